"""The allocation of a gguf variant's [quantize.mix] (pipeline/quant/mix/gguf.py): sensitivity per unit and llama.cpp
type, each candidate's cost (bytes, or decode latency measured in llama.cpp), the exact allocation, and the
{linear: type} map the writer takes.

Sensitivity: the output KL on the calibration rows with one unit alone at a type (the KL probe of
pipeline/quant/mix/sensitivity.py), the unit's weights rounded by gguf's numpy quantizer and read back, which is what
the file will hold (Q/K rows are permuted for llama.cpp, but its blocks run along the in-features, so the rounding is
the same), and the Hessian-weighted error ||(W - Q) X||^2 beside it. Cached beside the quantize units like the GPTQ
mix's table, under a key of the model's files, the calibration ids, the units, the types and the gguf version.

Latency: one file per candidate type with every mixed linear at it (the rest as the variant's type), each loaded in
llama.cpp with the threads it will be served with, and `latency_tokens` greedy tokens streamed from a fixed prompt;
the time between the first and the last token over the tokens between is that file's milliseconds per token. The
files are decoded in turn, `latency_repeats` rounds, and each file's median round counts (other work on the machine
moves every file's figure alike within a round). Unit u at type t costs weights(u) / weights(all mixed) x
(ms(t) - ms(fastest)); a budget B leaves B - ms(fastest) to spend on those differences.
"""
from __future__ import annotations

import gc
import importlib.metadata
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from pipeline.base.env import llama_cpp_threads
from pipeline.base.errors import StageError
from pipeline.base.fileio import atomic_write_text
from pipeline.quant.formats.gguf_export import convert, llama_cpp_module, write_file
from pipeline.quant.methods.gguf import GGUF_ARCHS
from pipeline.quant.mix.alloc import allocate
from pipeline.quant.mix.config import MixUnit, mix_units
from pipeline.quant.mix.gguf import GGUFMix, budget_bytes, overrides, type_bits, unit_bytes
from pipeline.quant.mix.plan import sensitivity_cache_dir
from pipeline.quant.mix.sensitivity import KLProbe, UnitHessians, cached_table, hessian_row, table_key
from pipeline.quant.shapes import linear_shapes_from_config

VERSION = 1
CELLS = 100_000  # latency costs are integers for the allocation: the types' measured range in this many cells
PROMPT = "The history of the city begins with a small settlement on the river, where"


def gguf_version() -> str:
    return importlib.metadata.version("gguf")


def gguf_round(w: torch.Tensor, gguf_type: str) -> torch.Tensor:
    """w [out, in] quantized to `gguf_type` by gguf's numpy quantizer and read back (float32)."""
    qtype = getattr(gguf.GGMLQuantizationType, gguf_type)
    data = w.detach().float().numpy()
    back = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
    return torch.from_numpy(np.ascontiguousarray(back.reshape(data.shape), dtype=np.float32))


def sensitivity(base_dir: Path, calib_ids: torch.Tensor, units: list[MixUnit], types: list[str], probe_rows: int,
                layers_path: str, cache_dir: Path | None, log: Callable[[str], None]) -> dict:
    """{"kl": [unit][type], "hessian": [unit][type], "time_s", "key", "cached"}."""
    key = table_key(base_dir, calib_ids, ["gguf", VERSION, gguf_version(), [(u.name, u.modules) for u in units],
                                          types, probe_rows])
    path = cache_dir / f"gguf-{key}.json" if cache_dir is not None else None
    cached = cached_table(path, key, log, "same model, calibration and types")
    if cached is not None:
        return cached
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    hessians = UnitHessians(model, calib_ids[:probe_rows], layers_path)
    probe = KLProbe(model, calib_ids[:probe_rows], layers_path, hessians.on(calib_ids[:probe_rows]))
    spent = {"hessian": 0.0, "kl": time.perf_counter() - t0}
    cands = [(j, 0) for j in range(len(types))]  # the probe's candidates are indices into types

    rounded: dict[tuple[str, int], torch.Tensor] = {}  # one unit's roundings, for both estimators

    def weights(name: str, w: torch.Tensor, j: int, _unused: int) -> torch.Tensor:
        if (name, j) not in rounded:
            rounded[(name, j)] = gguf_round(w, types[j])
        return rounded[(name, j)]

    kl, hessian = [], []
    for k, u in enumerate(units):
        t = time.perf_counter()
        hessian.append(hessian_row(model, hessians.of(u), hessians.tokens, u, cands, weights))
        t1 = time.perf_counter()
        kl.append(probe.row(u, cands, weights))
        rounded.clear()
        spent["hessian"] += t1 - t
        spent["kl"] += time.perf_counter() - t1
        if (k + 1) % 10 == 0 or k + 1 == len(units):
            log(f"sensitivity: {k + 1}/{len(units)} units ({len(types)} types) {spent['hessian'] + spent['kl']:.0f} s")
    found = {"key": key, "units": [u.name for u in units], "candidates": types, "kl": kl, "hessian": hessian,
             "probe": {"weights": "gguf's numpy quantizer (llama.cpp's rounding), read back", "kl_rows": probe_rows,
                       "seq_len": int(calib_ids.shape[1])},
             "time_s": {k: round(v, 2) for k, v in spent.items()}}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(found))
    return {**found, "cached": False}


def decode_ms(llm, tokens: int) -> float:
    """Milliseconds per generated token after the first, greedy, streamed (what a client sees between tokens)."""
    stamps = []
    for _ in llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0, stream=True, seed=0):
        stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"llama.cpp streamed {len(stamps)} token(s) of the {tokens} asked")
    return 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def type_latencies(base_dir: Path, variant, config: dict, units: list[MixUnit], mix: GGUFMix,
                   log: Callable[[str], None]) -> dict:
    """{"ms": {type: median ms per token}, "rounds": [[...]], "threads", "tokens"} of one file per candidate type
    (every mixed linear at that type), decoded in llama.cpp (see the module docstring)."""
    llama_cpp = llama_cpp_module("a latency budget")

    threads = llama_cpp_threads(mix.threads)
    with tempfile.TemporaryDirectory(prefix=".latency-") as tmp:
        files = {}
        for t in mix.types:
            conv = convert(base_dir, variant, config, False, GGUF_ARCHS[config["model_type"]], io.StringIO(),
                           overrides(units, [t] * len(units)))
            files[t] = Path(tmp) / f"{t}.gguf"
            write_file(conv.writer, files[t])
            del conv
        llms = {t: llama_cpp.Llama(str(f), n_threads=threads, n_threads_batch=threads, n_ctx=256, seed=0,
                                   verbose=False) for t, f in files.items()}
        try:
            for llm in llms.values():  # warm: the first decode pays page faults and repacking
                decode_ms(llm, 8)
            rounds = []
            for r in range(mix.latency_repeats):
                rounds.append({t: round(decode_ms(llm, mix.latency_tokens), 3) for t, llm in llms.items()})
                log(f"latency round {r + 1}/{mix.latency_repeats} (llama.cpp, {threads} threads): "
                    + ", ".join(f"{t} {ms:.2f} ms/token" for t, ms in rounds[-1].items()))
        finally:
            for llm in llms.values():
                llm.close()
            llms.clear()
            gc.collect()
    return {"ms": {t: round(statistics.median(r[t] for r in rounds), 3) for t in mix.types}, "rounds": rounds,
            "threads": threads, "tokens": mix.latency_tokens,
            "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"}


def plan(base_dir: Path, variant, calib_ids: torch.Tensor, console: IO[str]) -> dict:
    """The allocation record (mix.json) of a gguf variant with [quantize.mix]; record["types"] is the writer's map."""
    mix: GGUFMix = variant.mix
    config = json.loads((base_dir / "config.json").read_text())
    arch = linear_shapes_from_config(config)
    if not arch.shapes_known:
        raise StageError(f"[quantize.mix] needs the model's linear shapes; {arch.model_type!r} is not a known family")
    units = mix_units(arch, variant.modules_to_skip, mix.granularity)

    def say(line: str) -> None:
        console.write(f"{variant.name}: {line}\n")
        console.flush()

    sens = sensitivity(base_dir, calib_ids, units, mix.types, mix.probe_rows, arch.layers, sensitivity_cache_dir(), say)
    weights = sum(u.weights for u in units)
    size = [[unit_bytes(u, t) for t in mix.types] for u in units]
    latency, budget_ms, fastest, cell = None, None, 0.0, 0.0
    if mix.latency:
        latency = type_latencies(base_dir, variant, config, units, mix, say)
        ms = latency["ms"]
        fastest = min(ms.values())
        slowest = max(ms.values())
        cell = max(slowest - fastest, 1e-9) / CELLS  # ms per token a DP cell stands for
        # floored: the uniform files' own sums stay within their own figures (a budget equal to one is met by it)
        cost = [[int(u.weights / weights * (ms[t] - fastest) / cell) for t in mix.types] for u in units]
        budget_ms = ms[mix.budget.latency_as] if mix.budget.latency_as else mix.budget.latency_ms_per_token
        assert budget_ms is not None
        budget = int((budget_ms - fastest) / cell + 1e-6)
        if not fastest <= budget_ms <= slowest:
            raise StageError(f"quantize {variant.name}: mix budget {budget_ms} ms per token is "
                             f"outside what the types measure in llama.cpp here: {fastest:.2f} (all "
                             f"{min(ms, key=lambda k: ms[k])}) to {slowest:.2f} ms per token "
                             f"({', '.join(f'{t} {v:.2f}' for t, v in ms.items())})")
    else:
        cost = size
        found = budget_bytes(mix.budget, units)
        assert found is not None
        budget = found
    try:
        a = allocate(cost, sens["kl"], budget)
    except ValueError as e:
        raise StageError(f"quantize {variant.name}: mix allocation: {e}") from e
    choice = [mix.types[j] for j in a.choice]
    spent_bytes = sum(size[u][j] for u, j in enumerate(a.choice))
    spent = {"bytes": spent_bytes, "bits_per_weight": round(8 * spent_bytes / weights, 4)}
    if latency is not None:
        spent["latency_ms_per_token"] = round(fastest + a.cost * cell, 3)
    say(f"allocation: {spent['bits_per_weight']:.3f} bits per weight"
        + (f", predicted {spent['latency_ms_per_token']:.2f} ms per token of {budget_ms:.2f} budgeted"
           if latency is not None else
           f" of {8 * budget / weights:.3f} budgeted"))
    return {
        "kind": "gguf", "granularity": mix.granularity, "estimator": "kl", "candidates": mix.types,
        "budget": {**mix.budget.model_dump(exclude_none=True),
                   **({"bytes": budget, "bits_per_weight": round(8 * budget / weights, 4)} if latency is None
                      else {"engine": mix.engine, "latency_ms_per_token": budget_ms})},
        "spent": spent,
        "latency": latency,
        "allocation": {u.name: {"type": t, "bits": type_bits(t)} for u, t in zip(units, choice, strict=True)},
        "predicted": {k: sum(sens[k][u][j] for u, j in enumerate(a.choice)) for k in ("kl", "hessian")},
        "predicted_uniform": {t: {k: sum(row[j] for row in sens[k]) for k in ("kl", "hessian")}
                              for j, t in enumerate(mix.types)},
        "solver": {"kind": "dynamic program (multiple-choice knapsack)", "resolution_bytes": a.resolution_bytes,
                   "exact": a.exact,
                   "cost": f"latency cells of {cell:.3g} ms per token" if latency is not None else "bytes"},
        "sensitivity": {k: sens[k] for k in ("key", "units", "kl", "hessian", "probe", "time_s", "cached")},
        "types": overrides(units, choice),
    }


def summary(record: dict) -> dict:
    """What the report keeps of a record (the tables and the writer's map stay in mix.json)."""
    sens = record["sensitivity"]
    return {**{k: v for k, v in record.items() if k not in ("sensitivity", "types")},
            "sensitivity_time_s": sens["time_s"], "sensitivity_cached": sens["cached"], "probe": sens["probe"]}
