"""What `compress check` predicts before any weight is loaded: each stage's peak resident memory (and which stages
stream weights from disk to stay under [run] max_memory_gb), and what the run folder will hold on disk. Torch-free."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipeline.base.problem import Problem
from pipeline.budget.formulas import RUNTIME_OVERHEAD, WORKER_OVERHEAD, GiB, quantize_bytes, speed_bytes, window_bytes
from pipeline.eval.measures import all_measurements
from pipeline.model.architecture import architecture_of
from pipeline.model.dtypes import dtype_bytes
from pipeline.model.sources import link_problem
from pipeline.quant.method import QuantMemory
from pipeline.quant.registry import method_of, reload_of
from pipeline.stages.kinds import Calibrate, Draft, Export, Load, Quality, Quantize, Speed


def machine_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")



def estimate_memory(recipe, info, plan, source) -> None:
    """Predicted peak RSS per stage (bytes, runtime included), keyed by the stage classes (pipeline/stages/kinds.py:
    "load", "quantize/<name>", "validate/<model>" for a model's measurements, "validate/<model>/speed", "draft"; each
    unit's class says which of these figures it asks Ray for), and which of them stream weights from disk
    (plan.offload).
    A stage that can offload (GPTQ and RTN through GPTQModel, the plain baseline's perplexity through accelerate)
    does so when [run] max_memory_gb is set and the in-memory way would exceed it; the others must fit."""
    p = max(info.n_params, 1)
    cfg = info.config
    h = cfg.get("hidden_size") or 0
    vocab = cfg.get("vocab_size") or 0
    inter = cfg.get("intermediate_size") or 0
    w = dtype_bytes(plan.dtype) * p
    cal = recipe.calibration
    ppl = recipe.validate_.perplexity
    plan.memory_limit = recipe.run.memory_limit_bytes or machine_memory()
    capped = recipe.run.memory_limit_bytes is not None and plan.device == "cpu"
    # load: a checkpoint folder kept in its dtype is linked (headers read, no weights in memory); a GGUF is
    # dequantized and a config: model initialised tensor by tensor into safetensors (its largest tensor in float32
    # and converted; MoE GGUFs whose tensors transformers merges are loaded whole instead, not estimated here); a
    # folder converted to another dtype is loaded (one copy) and saved from memory
    largest = max(vocab * h, h * inter, 1)
    if source.checkpoint_folder and link_problem(source, plan.dtype) is None:
        plan.memory[Load.key()] = WORKER_OVERHEAD
    elif source.is_gguf:
        # transformers parses the GGUF's metadata (the tokenizer's tokens and merges: about 7 KB per vocabulary
        # entry, measured on SmolLM2 and Qwen2.5-1.5B), then the tensors are dequantized a block of rows at a time
        # (pipeline/model/materialize.py: a 4096-row block in float32 with gguf's intermediates, or a whole smaller one)
        plan.memory[Load.key()] = WORKER_OVERHEAD + max(7 * 1024 * vocab, 16 * h * max(inter, h))
    elif source.random_init:  # initialised in its module, then copied out
        plan.memory[Load.key()] = WORKER_OVERHEAD + 2 * dtype_bytes(plan.dtype) * largest
    else:
        plan.memory[Load.key()] = RUNTIME_OVERHEAD + w + 4 * largest
    cal_tokens = cal.num_samples * cal.seq_len
    if architecture_of(cfg).is_moe and Calibrate.key() in plan.stages:
        # calibrate counts each expert's tokens through the baseline (pipeline/quant/coverage.py): the model loaded
        # whole, one calibration row at a time through it (a perplexity window's activations and logits)
        plan.memory[Calibrate.key()] = RUNTIME_OVERHEAD + w + window_bytes(cfg, cal.seq_len)
    embed = vocab * h * dtype_bytes(plan.dtype)
    for v in recipe.quantize:
        key = Quantize.key(v.name)
        c = method_of(v)
        if c.memory is QuantMemory.LAYERWISE:
            tokens = cal_tokens if c.calibrates(v) else 0
            need = quantize_bytes(cfg, w, tokens, False, dtype_bytes(plan.dtype))
            if capped and c.offload and need > plan.memory_limit:
                plan.offload[key] = True
                need = quantize_bytes(cfg, w, tokens, True, dtype_bytes(plan.dtype))
        elif c.memory is QuantMemory.WHILE_LOADING:  # quantized while loading, tensor by tensor
            need = RUNTIME_OVERHEAD + int((p - vocab * h) * variant_bits(v) / 8) + embed + 4 * h * max(inter, h)
        else:  # loaded whole, then quantized or searched
            need = RUNTIME_OVERHEAD + 2 * w + cal_tokens * h * 4 * 4
        mix = getattr(v, "mix", None)
        if mix is not None:  # the sensitivity table is measured first, in the same process (unless cached)
            need = max(need, sensitivity_bytes(cfg, p, w, cal.seq_len, getattr(mix, "hessian_rows", mix.probe_rows),
                                               mix.probe_rows))
        plan.memory[key] = need
    win = window_bytes(cfg, ppl.seq_len)
    need = WORKER_OVERHEAD + w + win
    if capped and need > plan.memory_limit:  # accelerate keeps what fits and reads the rest at each forward
        plan.offload[Quality.plan_key("baseline")] = True
        need = max(plan.memory_limit, WORKER_OVERHEAD + win + w // max(cfg.get("num_hidden_layers") or 1, 1))
    plan.memory[Quality.plan_key("baseline")] = need
    resident = {"baseline": w}  # each model's weights in memory when it is measured
    for v in recipe.quantize:  # a quantized checkpoint is never offloaded (transformers refuses most of them)
        linears = int((p - vocab * h) * variant_bits(v) / 8)
        # GPTQModel repacks GPTQ-format weights for its CPU kernel at the first forward, while the pages it read
        # from the mapped checkpoint are still resident (measured on the 1.7B: 2.68 GiB against 1.74 predicted
        # without this copy)
        load = reload_of(v)
        repacked = linears if plan.device == "cpu" and load.repacked_on_cpu else 0
        if load.decompressed_on_load:  # compressed-tensors: decompressed to dense weights at the
            linears += dtype_bytes(plan.dtype) * (p - vocab * h)  # first forward, module by module (peak: both)
        resident[v.name] = linears + repacked + embed
        plan.memory[Quality.plan_key(v.name)] = WORKER_OVERHEAD + resident[v.name] + win
    speed = recipe.validate_.speed
    for name, weights in resident.items() if speed.enabled else ():
        if speed.models != "all" and name not in speed.models:
            continue
        need = speed_bytes(cfg, weights, speed.for_model(name).model_dump(mode="json"))
        if capped and need > plan.memory_limit:  # timed from disk it would measure the disk: not timed
            plan.speed_skipped[name] = (f"needs about {need / GiB:.2f} GiB in memory, over [run] max_memory_gb; "
                                        "a decode rate read from disk offload is not a speed figure")
        else:
            plan.memory[Speed.key(name)] = need
    for m in all_measurements():  # a plug-in's own figures; without one, its unit asks for its model's (above)
        plan.memory.update(m.memory(recipe, info, plan))
    if recipe.draft is not None:
        dd = recipe.draft.distill
        if dd.steps == 0:  # verifier + the draft, and a copy of it when saved in another dtype
            draft_w = 4 * plan.draft_model.n_params if plan.draft_model else w  # layer drafts: at most the verifier
            plan.memory[Draft.key()] = RUNTIME_OVERHEAD + w + 2 * draft_w
        else:
            # the verifier in its dtype; the draft (at most the verifier) and its gradients train in float32
            plan.memory[Draft.key()] = RUNTIME_OVERHEAD + w + 2 * 4 * p + dd.batch_size * dd.seq_len * vocab * 4 * 6


def sensitivity_bytes(config: dict, n_params: int, checkpoint_bytes: int, seq_len: int, hessian_rows: int,
                      probe_rows: int) -> int:
    """Peak of a [quantize.mix] sensitivity table (pipeline/quant/mix/sensitivity.py, gguf_plan.py), the larger of
    its two phases. Loading: the model converted to float32 beside the checkpoint's mapped pages. Measuring: the model
    in float32; every decoder layer's output on the Hessian and the probe rows (UnitHessians, KLProbe: counted apart,
    an upper bound, since the probe's rows are the first Hessian rows and share their outputs); one unit's
    Hessians in float32 (at most an MLP block's: two hidden x hidden and one intermediate x intermediate); the probe's
    reference log-probabilities and one forward's logits and log-softmax over the vocabulary. Measured on
    Qwen2.5-Coder-1.5B (bfloat16 checkpoint, 16 + 1 rows of 256): 10.51 GiB, at the load (research/mix.md)."""
    h = config.get("hidden_size") or 0
    inter = config.get("intermediate_size") or 4 * h
    vocab = config.get("vocab_size") or 0
    layers = max(config.get("num_hidden_layers") or 1, 1)
    kept = layers * (hessian_rows + probe_rows) * seq_len * h * 4
    unit = 4 * (2 * h * h + inter * inter)
    probe = 3 * probe_rows * seq_len * vocab * 4
    return RUNTIME_OVERHEAD + 4 * n_params + max(checkpoint_bytes, kept + unit + probe)


def variant_bits(variant) -> float:
    """Bits per quantized weight on disk, scales and zero points included (an estimate for the disk plan): the
    method's own figure (QuantMethod.bits_per_weight)."""
    return method_of(variant).bits_per_weight(variant)


def estimate_disk(recipe, info, plan, source) -> list[Problem]:
    """What the run folder will hold (bytes per stage) against the free space of its filesystem: refused when
    the disk lacks it. A rerun's completed stages are already on disk and count as available."""
    p = max(info.n_params, 1)
    h, vocab = info.config.get("hidden_size") or 0, info.config.get("vocab_size") or 0
    wbytes = dtype_bytes(plan.dtype)
    embed = min(vocab * h, p)  # kept in the checkpoint's dtype by every method here
    linked = source.checkpoint_folder and link_problem(source, plan.dtype) is None
    plan.disk[Load.stage] = 0 if linked else wbytes * p
    variants = sum(int((p - embed) * variant_bits(v) / 8 + embed * wbytes) for v in recipe.quantize)
    if variants:
        plan.disk[Quantize.stage] = variants
    if recipe.draft is not None:
        draft_p = plan.draft_model.n_params if plan.draft_model else p  # layer drafts: at most the verifier
        plan.disk[Draft.stage] = 4 * draft_p * (1 if recipe.draft.distill.steps == 0 else 4)  # + optimizer checkpoint
    plan.disk[Export.stage] = 0 if recipe.export.link == "hardlink" else variants + plan.disk.get(Draft.stage, 0)
    run_dir = Path(recipe.run.output_dir) / recipe.run.name
    plan.disk_reused = folder_size(run_dir)
    existing = next((d for d in [run_dir, *run_dir.absolute().parents] if d.exists()), Path("/"))
    plan.disk_free = shutil.disk_usage(existing).free
    need = sum(plan.disk.values()) - plan.disk_reused
    if need > plan.disk_free:
        return [Problem("run.output_dir", "disk-too-small",
                        f"the run folder {run_dir} needs about {need / GiB:.1f} GiB more on its disk "
                        f"({', '.join(f'{k} {b / GiB:.1f}' for k, b in plan.disk.items() if b)} GiB), and {existing} "
                        f"has {plan.disk_free / GiB:.1f} GiB free: free space, or set run.output_dir to a larger disk")]
    return []


def folder_size(folder: Path) -> int:
    """Bytes a folder occupies (0 when it does not exist); hard links to one file counted once."""
    seen, total = set(), 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total
