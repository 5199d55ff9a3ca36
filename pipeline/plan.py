"""From a validated Recipe to a checked plan (no weights loaded, no torch imported) and its units."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import data
from pipeline.errors import RecipeError
from pipeline.dtypes import HALF_UNITS, cpu_flags, dtype_bytes, resolve_dtype
from pipeline.sources import ModelInfo, describe, link_problem, parse

from pipeline.footprint import GiB, RUNTIME_OVERHEAD, WORKER_OVERHEAD, quantize_bytes, speed_bytes, window_bytes
TRACKED_PACKAGES = ("torch", "transformers", "gptqmodel", "bitsandbytes", "optimum", "accelerate", "datasets",
                    "huggingface-hub", "safetensors", "gguf", "torchao", "pydantic", "numpy", "compress")


@dataclass
class Plan:
    model: ModelInfo
    stages: list[str]
    dtype: str = "float32"  # the baseline's precision: [model].dtype with "auto" resolved
    draft_model: ModelInfo | None = None  # [draft] init = "model": its source, described once by the checks
    variants: list[dict] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    memory_limit: int = 0
    offload: dict[str, bool] = field(default_factory=dict)  # stages that stream weights from disk to fit the limit
    speed_skipped: dict[str, str] = field(default_factory=dict)  # models not timed: over the limit (why)
    serve_skipped: dict[str, str] = field(default_factory=dict)  # [validate.serve] models not served here (why)
    disk: dict[str, int] = field(default_factory=dict)  # bytes each stage writes into the run folder (estimate)
    disk_free: int = 0  # free bytes on the run folder's filesystem
    disk_reused: int = 0  # bytes an earlier run already wrote into the run folder (a rerun reuses them)
    warnings: list[str] = field(default_factory=list)
    device: str = "cpu"  # what "auto" resolves to here
    gpu: object | None = None  # pipeline.gpu_probe.GpuInfo when an NVIDIA GPU is visible

    @property
    def peak_memory(self) -> int:
        return max(self.memory.values()) if self.memory else 0


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in TRACKED_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def machine_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def arch_dict(info: ModelInfo) -> dict:
    from pipeline.quant.shapes import linear_shapes_from_config

    return linear_shapes_from_config(info.config)


def check(recipe) -> Plan:
    """Every cross-stage rule, before any weight is loaded. Raises RecipeError listing all problems."""
    problems: list[str] = []
    try:
        source = parse(recipe.model.source, recipe.model.gguf_file)
        info = describe(source)
    except RecipeError as e:
        raise RecipeError(f"[model].source: {e}") from None
    except (OSError, ValueError) as e:
        raise RecipeError(f"[model].source {recipe.model.source!r} cannot be read: {e}") from None
    plan = Plan(info, stage_names(recipe))
    problems += _check_device(recipe, plan)
    plan.dtype = resolve_dtype(recipe.model.dtype, source.kind, info.dtype, plan.device)
    problems += _check_data(recipe)
    problems += _check_variants(recipe, info, plan)
    problems += _check_draft(recipe, info, plan)
    problems += _check_gates(recipe, random_init=source.random_init)
    problems += _check_tasks(recipe, plan)
    problems += _check_serve(recipe, plan)
    _estimate_memory(recipe, info, plan, source)
    problems += _untimed_gates(recipe, plan)
    if plan.peak_memory > plan.memory_limit:
        over = ", ".join(f"{k} needs {b / GiB:.2f} GiB" for k, b in plan.memory.items() if b > plan.memory_limit)
        where = "[run].max_memory_gb" if recipe.run.max_memory_gb else "this machine's memory"
        problems.append(f"estimated peak memory {plan.peak_memory / GiB:.2f} GiB exceeds the "
                        f"{plan.memory_limit / GiB:.3g} GiB available ({where}): {over}; "
                        "lower calibration.num_samples/seq_len, validate.perplexity.seq_len or draft.distill.batch_size,"
                        " or raise the limit (offloaded to disk where a stage can: GPTQ and RTN quantization, the "
                        "baseline's perplexity; quantized checkpoints, bitsandbytes, torchao, AWQ, AutoRound, GGUF and "
                        "the draft must fit)")
    problems += _estimate_disk(recipe, info, plan, source)
    problems += _check_executor(recipe)
    plan.warnings += _half_precision_on_cpu(recipe, plan)
    if problems:
        raise RecipeError("the recipe cannot run:\n" + "\n".join(f"  - {p}" for p in problems))
    return plan


def _check_executor(recipe) -> list[str]:
    """[run] executor = "ray" needs Ray installed (looked up, not imported: check stays fast)."""
    from importlib.util import find_spec

    if recipe.run.executor == "ray" and find_spec("ray") is None:
        return ["[run] executor = \"ray\" needs Ray, which is not installed: pip install -e '.[ray]'"]
    return []


def _untimed_gates(recipe, plan: Plan) -> list[str]:
    """A speed gate on a model that will not be timed (plan.speed_skipped) could only fail: refused here."""
    from pipeline.eval.config import GATE_SPECS

    gates = recipe.validate_.gates
    problems = []
    for v in recipe.quantize:
        for gate in (g for g in gates.bounds_for(v.name) if GATE_SPECS[g].needs_speed):
            for name in ("baseline", v.name):
                if name in plan.speed_skipped:
                    problems.append(f"[validate.gates].{gate} for {v.name!r} needs {name!r} timed, but "
                                    f"{name!r} will not be timed: it {plan.speed_skipped[name]}; raise max_memory_gb, "
                                    "lower [validate.speed] batch_sizes, or drop the gate")
    return problems


def stage_names(recipe) -> list[str]:
    names = ["load"]
    if any(_needs_calibration(q) for q in recipe.quantize) or recipe.draft is not None:
        names.append("calibrate")
    names += [f"quantize/{q.name}" for q in recipe.quantize]
    if recipe.draft is not None:
        names.append("draft")
    names += ["validate", "export"] + (["publish"] if recipe.publish is not None else [])
    return names


def _needs_calibration(variant) -> bool:
    from pipeline.quant.registry import needs_calibration

    return needs_calibration(variant)


def _check_data(recipe) -> list[str]:
    problems = []
    cal, ppl = recipe.calibration, recipe.validate_.perplexity
    for where, name, field_ in (("calibration.dataset", cal.dataset, cal.text_field),
                                ("validate.perplexity.dataset", ppl.dataset, ppl.text_field)):
        try:
            data.resolve(name, field_)
        except RecipeError as e:
            problems.append(f"{where}: {e}")
    prompts = recipe.draft.measure.prompts if recipe.draft is not None else None
    if prompts is not None:
        try:
            data.resolve(prompts)
        except RecipeError as e:
            problems.append(f"draft.measure.prompts: {e}")
        if prompts == cal.dataset and not cal.allow_overlap:
            problems.append(f"draft.measure.prompts and calibration.dataset are both {prompts!r}: the draft is "
                            "distilled on the calibration corpus, so acceptance would be measured on its training text")
    if cal.dataset == ppl.dataset and not cal.allow_overlap:
        problems.append(f"calibration.dataset and validate.perplexity.dataset are both {cal.dataset!r}: calibrating "
                        "or distilling on the evaluation text inflates every figure; use another corpus (c4) "
                        "or set calibration.allow_overlap = true to accept it")
    return problems


def _check_device(recipe, plan: Plan) -> list[str]:
    """Which device the run will use ("auto": CUDA when this environment's torch can use a GPU)."""
    from pipeline.gpu_probe import probe

    plan.gpu = probe() if recipe.run.device in ("auto", "cuda") else None
    usable = plan.gpu is not None and plan.gpu.torch_cuda
    plan.device = "cuda" if recipe.run.device == "cuda" or (recipe.run.device == "auto" and usable) else "cpu"
    if recipe.run.device == "cuda" and not usable:
        why = plan.gpu.note if plan.gpu else "no NVIDIA GPU found (nvidia-smi)"
        return [f"[run].device = 'cuda': {why}; use device = 'auto' or 'cpu'"]
    return []


def _check_variants(recipe, info: ModelInfo, plan: Plan) -> list[str]:
    if not recipe.quantize:
        return []
    from pipeline.quant.registry import check_variant, runtimes

    from pipeline.families import unknown_family

    arch = arch_dict(info)
    device = plan.device
    problems = []
    if not arch.get("shapes_known") and arch.get("model_type"):
        plan.warnings.append(unknown_family(arch["model_type"]))
    for i, v in enumerate(recipe.quantize):
        problems += [f"quantize.{i} ({v.name}): {p}" for p in check_variant(v, arch, device)]
        rows = getattr(v, "calibration_rows", None)
        if rows is not None and rows > recipe.calibration.num_samples:
            problems.append(f"quantize.{i} ({v.name}): calibration_rows = {rows} exceeds calibration.num_samples = "
                            f"{recipe.calibration.num_samples}: lower it or raise num_samples")
        plan.variants.append({"name": v.name, "method": v.method, "runtimes": runtimes(v, arch)})
    return problems


def _check_draft(recipe, info: ModelInfo, plan: Plan) -> list[str]:
    d = recipe.draft
    if d is None:
        return []
    problems = []
    names = {q.name for q in recipe.quantize}
    if d.verifier != "baseline" and d.verifier not in names:
        problems.append(f"draft.verifier = {d.verifier!r} is neither 'baseline' nor a [[quantize]] variant "
                        f"(variants: {sorted(names) or 'none'})")
    from pipeline.quant.registry import method_of

    gguf = {q.name for q in recipe.quantize if method_of(q).checkpoint_format == "gguf"}
    if d.verifier in gguf:
        problems.append(f"draft.verifier = {d.verifier!r} is a GGUF file (llama.cpp's format): the draft is distilled "
                        "and measured in transformers; name the baseline or a transformers variant (gptq, bnb, ...)")
    if d.measure.compare_fp_distilled and d.verifier == "baseline":
        problems.append("draft.measure.compare_fp_distilled = true needs a quantized draft.verifier: with verifier = "
                        "'baseline' the draft is already distilled against the full-precision model, so there is "
                        "nothing to compare; name a [[quantize]] variant as draft.verifier or set it to false")
    n_layers = info.config.get("num_hidden_layers")
    if d.layers and n_layers and any(not 0 <= i < n_layers for i in d.layers):
        problems.append(f"draft.layers {d.layers} must be indices in 0..{n_layers - 1} (the verifier has {n_layers} layers)")
    if d.num_layers and n_layers and d.num_layers >= n_layers:
        problems.append(f"draft.num_layers = {d.num_layers} must be below the verifier's {n_layers} layers")
    if d.vocab_size and info.config.get("vocab_size") and d.vocab_size > info.config["vocab_size"]:
        problems.append(f"draft.vocab_size = {d.vocab_size} exceeds the verifier's vocabulary ({info.config['vocab_size']})")
    if d.init == "model":
        problems += _check_draft_tokenizer(recipe, info, plan)
    return problems


def _check_draft_tokenizer(recipe, info: ModelInfo, plan: Plan) -> list[str]:
    d = recipe.draft
    if not d.source:
        return ["draft.init = 'model' needs draft.source (a model source with the verifier's tokenizer)"]
    try:
        dinfo = plan.draft_model = describe(parse(d.source))
    except RecipeError as e:
        return [f"draft.source: {e}"]
    diffs = [f"{k}: verifier {info.config.get(k)} vs draft {dinfo.config.get(k)}" for k in ("vocab_size",)
             if info.config.get(k) != dinfo.config.get(k)]
    for k in ("bos_token_id", "eos_token_id"):
        a, b = info.config.get(k), dinfo.config.get(k)
        if a is not None and b is not None and a != b:
            diffs.append(f"{k}: verifier {a} vs draft {b}")
    return [f"draft.source {d.source!r} has a different tokenizer than the verifier ({'; '.join(diffs)})"] if diffs else []


def _check_gates(recipe, random_init: bool) -> list[str]:
    """[validate.gates] and [validate.speed]: every model they name exists, every gate can be measured."""
    from pipeline.eval.config import gate_problems, speed_problems

    v = recipe.validate_  # the smoke gate does not apply to random weights
    variants, draft = [q.name for q in recipe.quantize], "draft" if recipe.draft else None
    return (gate_problems(v.gates, v.speed, variants, draft, smoke=v.smoke.enabled or random_init,
                          tasks=v.tasks)
            + speed_problems(v.speed, variants, draft))


def _check_tasks(recipe, plan: Plan) -> list[str]:
    """[validate.tasks] (pipeline/eval/tasks_config.py): problems are returned, notes become warnings."""
    from pipeline.eval.tasks_config import task_problems

    found = task_problems(recipe.validate_.tasks, [q.name for q in recipe.quantize])
    plan.warnings += [p.removeprefix("note: ") for p in found if p.startswith("note: ")]
    return [p for p in found if not p.startswith("note: ")]


def _check_serve(recipe, plan: Plan) -> list[str]:
    """[validate.serve]: an engine that can serve every served model here (pipeline/serve/config.py); a serve gate
    on a model that will not be served could only fail."""
    from pipeline.eval.config import GATE_SPECS
    from pipeline.serve.config import serve_plan

    cfg = recipe.validate_.serve
    if not cfg.enabled:
        return []
    models = [("baseline", None)] + [(q.name, q.method) for q in recipe.quantize]
    problems, plan.serve_skipped = serve_plan(cfg, models, cuda=plan.device == "cuda")
    plan.warnings += [f"validate/{n}/serve: skipped: {why}" for n, why in plan.serve_skipped.items()]
    gates = recipe.validate_.gates
    for v in recipe.quantize:
        for gate in (g for g in gates.bounds_for(v.name) if GATE_SPECS[g].metric.startswith("serve_")):
            problems += [f"[validate.gates].{gate} for {v.name!r} needs {n!r} served, but its serving is skipped: "
                         f"{plan.serve_skipped[n]}" for n in ("baseline", v.name) if n in plan.serve_skipped]
    return problems


def _estimate_memory(recipe, info: ModelInfo, plan: Plan, source) -> None:
    """Predicted peak RSS per stage (bytes, runtime included), keyed like the run's stages ("load",
    "quantize/<name>", "validate/<model>", "draft"), and which of them stream weights from disk (plan.offload).
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
    if source.kind in ("dir", "hf") and link_problem(source, plan.dtype) is None:
        plan.memory["load"] = WORKER_OVERHEAD
    elif source.kind in ("gguf", "pkg"):
        # transformers parses the GGUF's metadata (the tokenizer's tokens and merges: about 7 KB per vocabulary
        # entry, measured on SmolLM2 and Qwen2.5-1.5B), then the tensors are dequantized a block of rows at a time
        # (pipeline/materialize.py: a 4096-row block in float32 with gguf's intermediates, or a whole smaller one)
        plan.memory["load"] = WORKER_OVERHEAD + max(7 * 1024 * vocab, 16 * h * max(inter, h))
    elif source.kind == "config":  # initialised in its module, then copied out
        plan.memory["load"] = WORKER_OVERHEAD + 2 * dtype_bytes(plan.dtype) * largest
    else:
        plan.memory["load"] = RUNTIME_OVERHEAD + w + 4 * largest
    from pipeline.quant.registry import method_of

    cal_tokens = cal.num_samples * cal.seq_len
    embed = vocab * h * dtype_bytes(plan.dtype)
    for v in recipe.quantize:
        key = f"quantize/{v.name}"
        c = method_of(v)
        if c.memory == "layerwise":
            tokens = cal_tokens if c.needs_calibration else 0
            need = quantize_bytes(cfg, w, tokens, False, dtype_bytes(plan.dtype))
            if capped and c.offload and need > plan.memory_limit:
                plan.offload[key] = True
                need = quantize_bytes(cfg, w, tokens, True, dtype_bytes(plan.dtype))
        elif c.memory == "while_loading":  # quantized while loading, tensor by tensor
            need = RUNTIME_OVERHEAD + int((p - vocab * h) * variant_bits(v) / 8) + embed + 4 * h * max(inter, h)
        else:  # loaded whole, then quantized or searched
            need = RUNTIME_OVERHEAD + 2 * w + cal_tokens * h * 4 * 4
        plan.memory[key] = need
    win = window_bytes(cfg, ppl.seq_len)
    need = WORKER_OVERHEAD + w + win
    if capped and need > plan.memory_limit:  # accelerate keeps what fits and reads the rest at each forward
        plan.offload["validate/baseline"] = True
        need = max(plan.memory_limit, WORKER_OVERHEAD + win + w // max(cfg.get("num_hidden_layers") or 1, 1))
    plan.memory["validate/baseline"] = need
    resident = {"baseline": w}  # each model's weights in memory when it is measured
    for v in recipe.quantize:  # a quantized checkpoint is never offloaded (transformers refuses most of them)
        linears = int((p - vocab * h) * variant_bits(v) / 8)
        # GPTQModel repacks GPTQ-format weights for its CPU kernel at the first forward, while the pages it read
        # from the mapped checkpoint are still resident (measured on the 1.7B: 2.68 GiB against 1.74 predicted
        # without this copy)
        repacked = linears if plan.device == "cpu" and method_of(v).repacked_on_cpu else 0
        resident[v.name] = linears + repacked + embed
        plan.memory[f"validate/{v.name}"] = WORKER_OVERHEAD + resident[v.name] + win
    speed = recipe.validate_.speed
    for name, weights in resident.items() if speed.enabled else ():
        if speed.models != "all" and name not in speed.models:
            continue
        need = speed_bytes(cfg, weights, speed.for_model(name).model_dump(mode="json"))
        if capped and need > plan.memory_limit:  # timed from disk it would measure the disk: not timed
            plan.speed_skipped[name] = (f"needs about {need / GiB:.2f} GiB in memory, over [run] max_memory_gb; "
                                        "a decode rate read from disk offload is not a speed figure")
        else:
            plan.memory[f"validate/{name}/speed"] = need
    if recipe.draft is not None:
        dd = recipe.draft.distill
        if dd.steps == 0:  # verifier + the draft, and a copy of it when saved in another dtype
            draft_w = 4 * plan.draft_model.n_params if plan.draft_model else w  # layer drafts: at most the verifier
            plan.memory["draft"] = RUNTIME_OVERHEAD + w + 2 * draft_w
        else:
            # the verifier in its dtype; the draft (at most the verifier) and its gradients train in float32
            plan.memory["draft"] = RUNTIME_OVERHEAD + w + 2 * 4 * p + dd.batch_size * dd.seq_len * vocab * 4 * 6


def variant_bits(variant) -> float:
    """Bits per quantized weight on disk, scales and zero points included (an estimate for the disk plan): the
    method's own figure (QuantMethod.bits_per_weight)."""
    from pipeline.quant.registry import method_of

    return method_of(variant).bits_per_weight(variant)


def _estimate_disk(recipe, info: ModelInfo, plan: Plan, source) -> list[str]:
    """What the run folder will hold (bytes per stage) against the free space of its filesystem: refused when
    the disk lacks it. A rerun's completed stages are already on disk and count as available."""
    p = max(info.n_params, 1)
    h, vocab = info.config.get("hidden_size") or 0, info.config.get("vocab_size") or 0
    wbytes = dtype_bytes(plan.dtype)
    embed = min(vocab * h, p)  # kept in the checkpoint's dtype by every method here
    linked = source.kind in ("dir", "hf") and link_problem(source, plan.dtype) is None
    plan.disk["load"] = 0 if linked else wbytes * p
    variants = sum(int((p - embed) * variant_bits(v) / 8 + embed * wbytes) for v in recipe.quantize)
    if variants:
        plan.disk["quantize"] = variants
    if recipe.draft is not None:
        draft_p = plan.draft_model.n_params if plan.draft_model else p  # layer drafts: at most the verifier
        plan.disk["draft"] = 4 * draft_p * (1 if recipe.draft.distill.steps == 0 else 4)  # + optimizer checkpoint
    plan.disk["export"] = 0 if recipe.export.link == "hardlink" else variants + plan.disk.get("draft", 0)
    run_dir = Path(recipe.run.output_dir) / recipe.run.name
    plan.disk_reused = folder_size(run_dir)
    existing = next((d for d in [run_dir, *run_dir.absolute().parents] if d.exists()), Path("/"))
    plan.disk_free = shutil.disk_usage(existing).free
    need = sum(plan.disk.values()) - plan.disk_reused
    if need > plan.disk_free:
        return [f"the run folder {run_dir} needs about {need / GiB:.1f} GiB more on its disk "
                f"({', '.join(f'{k} {b / GiB:.1f}' for k, b in plan.disk.items() if b)} GiB), and {existing} has "
                f"{plan.disk_free / GiB:.1f} GiB free: free space, or set run.output_dir to a larger disk"]
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


HALF = ("bfloat16", "float16")


def _half_precision_on_cpu(recipe, plan: Plan) -> list[str]:
    """A note when models run in bfloat16/float16 on a CPU without units for it: torch emulates those matmuls
    (measured on a 2-core AVX2 machine: 1-6 GFLOPS against 38-53 in float32). Quantization and quality compute them
    in float32 from the 16-bit weights (pipeline/compute.py); the speed figures and the draft's distillation and
    acceptance measurement run as transformers runs them."""
    if plan.device != "cpu":
        return []
    uses: dict[str, list[str]] = {}
    if plan.dtype in HALF:
        uses.setdefault(plan.dtype, []).append("the baseline")
    from pipeline.quant.registry import method_of

    for v in recipe.quantize:
        dtype = getattr(v, "dtype", None) or ("bfloat16" if method_of(v).half_only and plan.dtype not in HALF else None)
        if dtype in HALF:
            uses.setdefault(dtype, []).append(v.name)
    flags = cpu_flags()
    out = []
    for dtype, who in uses.items():
        if not flags & set(HALF_UNITS[dtype]):
            out.append(f"{', '.join(who)} in {dtype} on a CPU without {' or '.join(HALF_UNITS[dtype])}: "
                       f"quantization and quality compute their matmuls in float32 from the {dtype} weights; speed, "
                       f"distillation and speculative decoding run with torch's emulated {dtype} matmuls, several "
                       f"times slower than float32 for long sequences ([model] dtype = 'float32' avoids it)")
    return out
