"""Speed and memory of one model, meant to run in a fresh worker process (`run_speed_subprocess`, which
runs pipeline/base/worker.py's "speed" task).

What is timed (every cell: `warmup` untimed runs, then `repeats` timed runs; median, min, max):
- prefill: one forward over a `prompt_len` prompt at batch 1 -> prompt tokens/s;
- time to first token and decode: one `model.generate` call (greedy, exactly `new_tokens`
  tokens). A logits processor stamps the clock after every forward: stamp 1 ends the
  prefill (TTFT from the call), stamps 1..N span N-1 decode forwards. Decode is timed at
  each batch size; batches > 1 are prompts of different lengths left-padded into one batch.
- technique rows at batch 1: KV cache vs none, static cache, torch.compile, attention kernels;
- peak memory above the baseline (post-import when this process loads the model), by pipeline/base/memory.py:
  CPU = RSS high-water mark (VmHWM, reset via /proc/self/clear_refs), CUDA = max_memory_allocated;
- roofline: weight bytes read per decoded token / time per token, over the copy bandwidth
  (STREAM convention: bytes read + bytes written) measured in the same process on the same device.
Clocks are read only after synchronizing the device.
"""
from __future__ import annotations

import importlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoTokenizer, CompileConfig
from transformers.utils import is_flash_attn_2_available

from pipeline.base.errors import StageError
from pipeline.base.fileio import atomic_write_json
from pipeline.base.memory import PeakMemory
from pipeline.base.worker import run_task  # a killed run kills its timing process too
from pipeline.budget.formulas import GiB, head_bytes, speed_bytes
from pipeline.eval.config import SpeedConfig
from pipeline.eval.measure import (  # noqa: F401
    StepClock,
    copy_bandwidth,
    make_batch,
    roofline_fraction,
    summarize,
    sync,
    time_generate,
    time_prefill,
    timed_runs,
    weight_bytes_per_token,
)
from pipeline.eval.tensor_parallel import RankFailed, tp_row
from pipeline.model.dtypes import config_dtype, dtype_bytes, dtype_name
from pipeline.quant.checkpoint import load_checkpoint
from pipeline.quant.registry import checkpoint_method

SPEED_SCHEMA = "speed/1"
# ---------------------------------------------------------------- cells
class Bench:
    """One model, its prompts (one left-padded batch per batch size) and the config: the cells of
    the speed stage. Public so that benchmarks time extra cells exactly as the stage does."""

    def __init__(self, model, tokenizer, cfg: SpeedConfig, device: str):
        self.model, self.cfg, self.device = model, cfg, device
        self.model_dir: Path | None = None  # the checkpoint folder, when timed from one (tensor_parallel loads it)
        vocab = model.config.get_text_config().vocab_size
        self.batches = {b: make_batch(tokenizer, vocab, cfg.prompt_len, b, device) for b in cfg.batch_sizes}
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        gen_cfg = getattr(model, "generation_config", None)
        self.pad_id = pad if pad is not None else (getattr(gen_cfg, "eos_token_id", None) or 0)
        if isinstance(self.pad_id, list):
            self.pad_id = self.pad_id[0]

    def warm_up(self) -> None:
        """One untimed prefill and generate per batch size, before any cell is timed: first calls
        pay for allocator growth, kernel selection and lazy initialisation."""
        if self.cfg.warmup:
            time_prefill(self.model, *self.batches[1], self.device)
            for b in self.cfg.batch_sizes:
                time_generate(self.model, *self.batches[b], 2, self.device, self.pad_id)

    def prefill(self) -> dict:
        ids, mask = self.batches[1]
        runs = timed_runs(lambda: time_prefill(self.model, ids, mask, self.device), self.cfg.warmup, self.cfg.repeats)
        return summarize([self.cfg.prompt_len / s for s in runs])

    def decode(self, batch: int, warmup: int | None = None, **gen_kwargs) -> dict:
        ids, mask = self.batches[batch]
        n = self.cfg.new_tokens
        runs = timed_runs(lambda: time_generate(self.model, ids, mask, n, self.device, self.pad_id, **gen_kwargs),
                          self.cfg.warmup if warmup is None else warmup, self.cfg.repeats)
        return {
            "batch": batch,
            "tokens_per_s": summarize([batch * (n - 1) / r["decode_s"] for r in runs]),
            "per_sequence_tokens_per_s": statistics.median((n - 1) / r["decode_s"] for r in runs),
            "ttft_s": summarize([r["ttft_s"] for r in runs]),
        }


def _technique(bench: Bench, name: str, kv: dict) -> dict:
    """One named technique row at batch 1 (or {"skipped": reason})."""
    cuda = torch.device(bench.device).type == "cuda"
    if name == "kv_cache":
        return {"decode_tokens_per_s": kv["tokens_per_s"], "note": "dynamic KV cache (the default)"}
    if name == "no_kv_cache":
        return {"decode_tokens_per_s": bench.decode(1, use_cache=False)["tokens_per_s"],
                "note": "every step re-runs the whole sequence"}
    if name == "static_cache":
        row = bench.decode(1, cache_implementation="static", disable_compile=True)
        return {"decode_tokens_per_s": row["tokens_per_s"], "note": "static cache, not compiled"}
    if name == "compile":
        return _compile_row(bench, cuda)
    if name == "tensor_parallel":
        if bench.model_dir is None:
            return {"skipped": "tensor_parallel loads a checkpoint folder in each rank: not timed from a model in "
                               "memory"}
        with tempfile.TemporaryDirectory(prefix="tp-") as tmp:
            return tp_row(bench.model_dir, bench.cfg, bench.device, Path(tmp))
    return _attention_row(bench, name, cuda)


def _compile_row(bench: Bench, cuda: bool) -> dict:
    quantizer = getattr(bench.model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return {"skipped": f"{type(quantizer).__name__} models do not support torch.compile in transformers"}
    cc = CompileConfig(mode="reduce-overhead" if cuda else "default")
    if not cuda:
        cc._compile_all_devices = True  # transformers compiles only on accelerators unless told
    t0 = time.perf_counter()
    bench.decode(1, warmup=0, cache_implementation="static", compile_config=cc)  # compiles
    compile_s = time.perf_counter() - t0
    row = bench.decode(1, warmup=max(1, bench.cfg.warmup), cache_implementation="static", compile_config=cc)
    return {"decode_tokens_per_s": row["tokens_per_s"], "compile_s": compile_s,
            "note": f"static cache + torch.compile (mode={cc.mode}); compile_s = first call"}


def _attention_row(bench: Bench, name: str, cuda: bool) -> dict:
    """One attention implementation, timed only after its output is checked against sdpa's on the batch-1 prompt
    (the last position's logits, within [validate.speed] equality_atol)."""
    model = bench.model
    if name == "flash_attention_2":
        if not cuda:
            return {"skipped": "flash_attention_2 needs CUDA"}
        if not is_flash_attn_2_available():
            return {"skipped": "flash_attn is not installed"}
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation("sdpa")
        reference = model.config._attn_implementation  # sdpa, or the model's own where it cannot switch
        expected = last_logits(model, *bench.batches[1])
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            return {"skipped": f"{type(model).__name__} cannot switch attention to {name}"}
        diff = float((last_logits(model, *bench.batches[1]) - expected).abs().max())
        atol = bench.cfg.equality_atol
        same = {"max_abs_logit_diff": diff, "equality_atol": atol, "reference": reference}
        if diff > atol:
            return {**same, "error": f"{name} differs from {reference}: max |Δlogit| {diff:.3g} over the tolerance "
                                     f"{atol:g} ([validate.speed] equality_atol); not timed"}
        return {"prefill_tokens_per_s": bench.prefill(), "decode_tokens_per_s": bench.decode(1)["tokens_per_s"],
                **same, "note": f"attn_implementation={name}; max |Δlogit| vs {reference} {diff:.2g} "
                                f"(tolerance {atol:g})"}
    finally:
        model.set_attn_implementation(before)


def last_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The last position's logits of one prompt, in float32."""
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).logits[0, -1].float()


def technique_rows(bench: Bench, kv: dict, bar=None) -> dict:
    """All requested technique rows; a row that raises records its error instead of ending the run."""
    rows = {}
    for name in bench.cfg.techniques:
        if bar is not None:
            bar.update()
        try:
            rows[name] = _technique(bench, name, kv)
        except RankFailed:
            raise  # a rank died: the unit fails, naming it
        except Exception as exc:  # noqa: BLE001 - one failed row must not hide the others
            rows[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
        row_speed = rows[name].get("decode_tokens_per_s")
        if row_speed:
            rows[name]["speedup_vs_kv_cache"] = row_speed["median"] / kv["tokens_per_s"]["median"]
    return rows


# ---------------------------------------------------------------- entry points
def _load_tokenizer(model_dir: Path):
    if any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return AutoTokenizer.from_pretrained(str(model_dir))
    return None


def measure_speed(model_or_dir, tokenizer, cfg: SpeedConfig, device: str, *, label: str | None = None) -> dict:
    """Time one model (a loaded model, or a checkpoint folder loaded here) -> the speed dict.

    Peak memory is measured from this call's entry: post-import when given a folder (the
    model's own load counts), call-entry when given a model already in memory. A progress bar
    (stderr) counts the cells: prefill, each decode batch, each technique row, the roofline."""
    memory = PeakMemory(device).start()
    cells = 2 + len(cfg.batch_sizes) + len(cfg.techniques) + int(cfg.roofline)
    bar = tqdm(total=cells, desc=f"speed {label or Path(str(model_or_dir)).name}", unit="cell", leave=False)
    load_s = None
    if isinstance(model_or_dir, (str, Path)):
        t0 = time.perf_counter()
        model = load_checkpoint(Path(model_or_dir), device)  # plain, GPTQ or bitsandbytes, as quality loads them
        load_s = time.perf_counter() - t0
        if tokenizer is None:
            tokenizer = _load_tokenizer(Path(model_or_dir))
    else:
        model = model_or_dir
    model.eval()
    bench = Bench(model, tokenizer, cfg, device)
    bench.model_dir = Path(model_or_dir) if load_s is not None else None
    bench.warm_up()
    bar.update()
    result: dict[str, Any] = _header(model, cfg, device, load_s)
    result["prefill_tokens_per_s"] = bench.prefill()
    bar.update()
    decode = {}
    for b in cfg.batch_sizes:
        decode[str(b)] = bench.decode(b)
        bar.update()
    kv = decode["1"]
    result["ttft_s"] = kv["ttft_s"]
    result["decode"] = decode
    result["decode_tokens_per_s_b1"] = kv["tokens_per_s"]["median"]
    result["max_batch"] = max(cfg.batch_sizes)
    result["decode_tokens_per_s_max_batch"] = decode[str(result["max_batch"])]["tokens_per_s"]["median"]
    result["techniques"] = technique_rows(bench, kv, bar)
    no_kv = result["techniques"].get("no_kv_cache", {}).get("decode_tokens_per_s")
    result["kv_cache_speedup"] = kv["tokens_per_s"]["median"] / no_kv["median"] if no_kv else None
    result["peak_memory_bytes"] = memory.stop().peak_above_base()
    result["peak_memory_kind"] = memory.kind
    result["peak_memory_basis"] = "post-import" if load_s is not None else "call-entry"
    result["weight_bytes_per_token"] = weight_bytes_per_token(model)
    if cfg.roofline:
        bw = copy_bandwidth(device, cfg.bandwidth_mib, cfg.repeats)
        result["copy_bandwidth_bytes_per_s"] = bw
        result["roofline_fraction"] = roofline_fraction(
            result["weight_bytes_per_token"], 1.0 / result["decode_tokens_per_s_b1"], bw)
        bar.update()
    else:
        result["copy_bandwidth_bytes_per_s"] = result["roofline_fraction"] = None
    bar.close()
    return result


def _header(model, cfg: SpeedConfig, device: str, load_s: float | None) -> dict:
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    return {
        "schema": SPEED_SCHEMA, "device": device, "device_name": name, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "dtype": dtype_name(next(model.parameters()).dtype),
        "quantization": (quant.get("quant_method") if isinstance(quant, dict)
                         else getattr(quant, "quant_method", None)),
        "prompt_len": cfg.prompt_len, "new_tokens": cfg.new_tokens, "repeats": cfg.repeats, "warmup": cfg.warmup,
        "attn_implementation": model.config._attn_implementation, "load_s": load_s,
        "footprint_bytes": int(model.get_memory_footprint()),
    }


def run_speed_subprocess(model_dir: str | Path, cfg: SpeedConfig, device: str, out_json: str | Path, *,
                         model_name: str | None = None, threads: int | None = None) -> dict:
    """Time a checkpoint folder in a fresh worker process (`run_task("speed", ...)`: its memory is its own);
    write the dict to `out_json` (the worker's log, speed.log, beside it) and return it.

    model_name ("baseline", a variant, the draft) applies `cfg.for_model` (technique rows only for
    `technique_models`); threads sets torch's CPU threads in the child (None: torch's default)."""
    if model_name is not None:
        cfg = cfg.for_model(model_name)
    if not Path(model_dir).is_dir():
        raise StageError(f"speed measurement: checkpoint folder {model_dir} does not exist")
    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    args = {"model_dir": str(model_dir), "cfg": cfg.model_dump(mode="json"), "device": device, "label": model_name}
    try:
        result = run_task("speed", args, out_json.parent, threads, cfg.timeout_s,
                          limit_setting="[validate.speed].timeout_s")
    except StageError as e:
        raise StageError(f"speed measurement of {model_dir}: {e}") from None
    atomic_write_json(out_json, result)
    return result


def speed_skip(model_dir: Path, speed: dict, limit: int | None, device: str) -> dict | None:
    """None when timing the checkpoint in model_dir fits `limit` (or there is no limit, or it runs on a GPU);
    else the speed result recorded instead of timing it: why, the predicted peak and the limit."""
    if limit is None or device != "cpu":
        return None
    config = json.loads((Path(model_dir) / "config.json").read_text())
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    method = checkpoint_method(config)
    if method is not None and method.repacked_on_cpu:  # the quantized linears twice (all but the embeddings and head)
        weights += max(weights - head_bytes(config, dtype_bytes(config_dtype(config, "bfloat16"))), 0)
    need = speed_bytes(config, weights, speed)
    if need <= limit:
        return None
    return {"skipped": f"not timed: it needs about {need / GiB:.2f} GiB in memory, over [run] max_memory_gb = "
                       f"{limit / GiB:.2f} GiB (a decode rate read from disk offload is not a speed figure)",
            "predicted_peak_bytes": need, "memory_limit_bytes": limit}


def measure_checkpoint(model_dir: Path, cfg: SpeedConfig, device: str, label: str | None = None) -> dict:
    """The worker's "speed" task: imports first, then the memory baseline, then load and time the folder."""
    _preimport(model_dir)  # before measure_speed takes the memory baseline
    tokenizer = _load_tokenizer(model_dir)  # prompts only: not counted in peak memory
    return measure_speed(model_dir, tokenizer, cfg, device, label=label)


def _preimport(model_dir: Path) -> None:
    """Import the model's code and its quantization library before the memory baseline: peak
    memory should count the model and its run, not imports."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # the loader will say what is wrong
    for arch in config.get("architectures") or []:
        getattr(transformers, arch, None)  # resolves the lazy module: imports modeling_<arch>
    transformers.GenerationMixin  # noqa: B018 - generation utilities
    method = checkpoint_method(config)  # the library transformers will call to load it
    if method is not None and method.load_module:
        importlib.import_module(method.load_module)


def worker_task(args: dict) -> dict:
    """The worker's "speed" task (pipeline/base/worker.py TASKS)."""
    return measure_checkpoint(Path(args["model_dir"]), SpeedConfig(**args["cfg"]), args["device"], args.get("label"))
