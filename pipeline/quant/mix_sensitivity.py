"""Sensitivity of each allocation unit to each (bits, group_size) candidate, measured on the calibration rows (never
the evaluation text), two ways, each timed:

- kl:      mean per-token KL(base || model) of the next-token distributions on `probe_rows` calibration rows, with
           that unit alone quantized. The probe's weights are round-to-nearest with GPTQ's own min/max grid
           (`fake_quantize`), not GPTQ's: one forward pass per unit and candidate, no Hessian solve.
- kl-scaled: the kl above probed only at `probe_group_size` (one forward pass per unit and bits); a candidate of
           another group size g at the same bits b is KL(b, probe) x hessian(b, g) / hessian(b, probe): the unit's
           own ratio of the layer-wise error, which tracks the KL's ratio where the bits are equal (both are the
           same RTN noise, finer or coarser; measured on SmolLM2 in benchmarks/README_mix.md).
- hessian: sum over the unit's linears of ||(W - Q) X||^2 / tokens = tr(dW H dW^T), H = X^T X / tokens from the
           calibration activations (one forward pass with hooks over `hessian_rows` rows), Q the same RTN weights:
           the layer-wise objective GPTQ minimises, before its error feedback.

The table is cached beside the quantize units (`cache_dir`) under a key made of everything it depends on: the base
model's files (their sha256 in the load stage's manifest, else the bytes), the calibration ids, the units, the
candidates, the probe rows and this file's version: a table from another model or calibration set is never read.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pipeline.base.fileio import atomic_write_text
from pipeline.quant.mix import MixUnit

VERSION = 2  # 2: kl-scaled (the probed candidates are part of the key)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool = True) -> torch.Tensor:
    """w [out, in] rounded to the GPTQ grid (GPTQModel's Quantizer with mse off): per output row and group of
    `group_size` input columns, maxq = 2^bits - 1; symmetric: scale = 2 max|w| / maxq, zero = (maxq + 1) / 2;
    else scale = (max - min) / maxq, zero = round(-min / scale). Returns
    scale * (clamp(round(w / scale) + zero) - zero)."""
    out_f, in_f = w.shape
    g = in_f if group_size <= 0 else group_size
    x = w.float().reshape(out_f, in_f // g, g)
    maxq = 2**bits - 1
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    scale = (hi - lo) / maxq
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-lo / scale)
    q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
    return (scale * (q - zero)).reshape(out_f, in_f).to(w.dtype)


def mean_kl(ref_logp: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over tokens of KL(ref || model), both [tokens, vocab] (ref as log-probabilities)."""
    logp = torch.log_softmax(logits.float(), -1)
    return float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(row[None]).logits[0].float() for row in ids])


class _Replay(torch.nn.Module):
    """Stands in for the decoder layers before the probed unit: returns, row by row, what the last of them output
    in the unquantized model (their weights are untouched, so it is the same tensor): the probe skips their work."""

    def __init__(self, outputs: list):
        super().__init__()
        self.outputs, self.row = outputs, 0

    def forward(self, hidden_states, *args, **kwargs):
        return self.outputs[self.row]


def _layer_outputs(layers, model, ids: torch.Tensor) -> list[list]:
    """[layer][row] output of each decoder layer on each row of ids (unquantized model)."""
    outs: list[list] = [[] for _ in layers]
    handles = [layer.register_forward_hook(lambda _m, _i, o, k=k: outs[k].append(o)) for k, layer in enumerate(layers)]
    try:
        _logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return outs


def _logits_from(model, layers, first: int, outputs: list[list], ids: torch.Tensor) -> torch.Tensor:
    """Logits with decoder layers [0, first) replayed from `outputs` (see _Replay)."""
    if first == 0:
        return _logits(model, ids)
    saved = [layers[j] for j in range(first)]
    replay = _Replay(outputs[first - 1])
    for j in range(first):
        layers[j] = replay
    try:
        rows = []
        with torch.no_grad():
            for r, row in enumerate(ids):
                replay.row = r
                rows.append(model(row[None]).logits[0].float())
        return torch.cat(rows)
    finally:
        for j, layer in enumerate(saved):
            layers[j] = layer


def kl_table(model, ids: torch.Tensor, units: list[MixUnit], cands: list[tuple[int, int]], sym: bool, layers_path: str,
             progress: Callable[[int, int], None] | None = None) -> list[list[float]]:
    """[unit][candidate] mean KL with that unit alone quantized (see the module docstring). The decoder layers before
    a unit's first linear are not recomputed (their outputs are replayed)."""
    layers = model.get_submodule(layers_path)
    outputs = _layer_outputs(layers, model, ids)
    ref = torch.log_softmax(_logits(model, ids), -1)
    prefix = layers_path + "."
    table = []
    for k, u in enumerate(units):
        mods = [model.get_submodule(name) for name, _, _ in u.modules]
        first = min(int(name[len(prefix):].split(".", 1)[0]) for name, _, _ in u.modules)
        saved = [m.weight.data.clone() for m in mods]
        row = []
        for b, g in cands:
            for m, w in zip(mods, saved, strict=True):
                m.weight.data.copy_(fake_quantize(w, b, g, sym))
            row.append(mean_kl(ref, _logits_from(model, layers, first, outputs, ids)))
        for m, w in zip(mods, saved, strict=True):
            m.weight.data.copy_(w)
        table.append(row)
        if progress is not None:
            progress(k + 1, len(units))
    return table


def hessian_table(model, ids: torch.Tensor, units: list[MixUnit], cands: list[tuple[int, int]],
                  sym: bool) -> list[list[float]]:
    """[unit][candidate] summed ||(W - Q) X||^2 / tokens over the unit's linears (see the module docstring)."""
    names = [name for u in units for name, _, _ in u.modules]
    hess: dict[str, torch.Tensor] = {}
    count = {"tokens": 0}

    def hook(name):
        def add(_mod, inputs, _out):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            hess[name] = hess.get(name, 0) + x.T @ x
        return add

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            for row in ids:
                model(row[None])
                count["tokens"] += row.numel()
    finally:
        for h in handles:
            h.remove()
    table = []
    for u in units:
        row = []
        for b, g in cands:
            total = 0.0
            for name, _, _ in u.modules:
                w = model.get_submodule(name).weight.data.float()
                dw = w - fake_quantize(w, b, g, sym).float()
                total += float(((dw @ hess[name]) * dw).sum()) / count["tokens"]
            row.append(total)
        table.append(row)
    return table


def cache_key(base_dir: Path, calib_ids: torch.Tensor, units: list[MixUnit], cands: list[tuple[int, int]],
              rows: tuple[int, int], sym: bool, probe_group_size: int | None = None) -> str:
    h = hashlib.sha256()
    manifest = base_dir / "manifest.json"
    if manifest.is_file():
        h.update(json.dumps(json.loads(manifest.read_text()).get("outputs"), sort_keys=True).encode())
    else:
        for f in sorted(base_dir.glob("*.safetensors")):
            h.update(f.read_bytes())
    h.update(calib_ids.to(torch.int64).contiguous().numpy().tobytes())
    h.update(json.dumps([VERSION, [(u.name, u.modules) for u in units], cands, rows, sym, probe_group_size]).encode())
    return h.hexdigest()[:32]


def scale_by_hessian(probed: list[list[float]], hess: list[list[float]], cands: list[tuple[int, int]],
                     probe_group_size: int) -> list[list[float]]:
    """The kl-scaled table (see the module docstring): probed[u] has one entry per candidate at probe_group_size,
    in cands' order; every other candidate's KL is scaled from the probed one at its bits."""
    probe_cands = [c for c in cands if c[1] == probe_group_size]
    out = []
    for kl_u, h_u in zip(probed, hess, strict=True):
        row = []
        for j, (b, g) in enumerate(cands):
            r = probe_cands.index((b, probe_group_size))
            ref = h_u[cands.index((b, probe_group_size))]
            row.append(kl_u[r] if g == probe_group_size or ref <= 0 else kl_u[r] * h_u[j] / ref)
        out.append(row)
    return out


def measure(base_dir: Path, calib_ids: torch.Tensor, units: list[MixUnit], cands: list[tuple[int, int]],
            probe_rows: int, hessian_rows: int, sym: bool, layers_path: str, cache_dir: Path | None,
            log: Callable[[str], None], probe_group_size: int | None = None) -> dict:
    """{"kl": table, "hessian": table, "time_s": {...}, "key", "cached"}: measured, or read from cache_dir.
    probe_group_size: the kl-scaled estimator (KL probed at that group size only); None: every candidate probed."""
    if probe_group_size is not None and any((b, probe_group_size) not in cands for b, _ in cands):
        raise ValueError(f"kl-scaled: every candidate bits needs a candidate at group_size {probe_group_size}")
    key = cache_key(base_dir, calib_ids, units, cands, (probe_rows, hessian_rows), sym, probe_group_size)
    path = cache_dir / f"{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        found = json.loads(path.read_text())
        if found.get("key") == key:
            log(f"sensitivity: cached table {path.name} (same model, calibration and candidates)")
            return {**found, "cached": True}
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    hess = hessian_table(model, calib_ids[:hessian_rows], units, cands, sym)
    t1 = time.perf_counter()
    log(f"sensitivity: hessian table ({len(units)} units x {len(cands)} candidates) in {t1 - t0:.1f} s")
    probed = cands if probe_group_size is None else [c for c in cands if c[1] == probe_group_size]
    kl = kl_table(model, calib_ids[:probe_rows], units, probed, sym, layers_path,
                  lambda k, n: log(f"sensitivity: KL probe {k}/{n} units") if k % 10 == 0 or k == n else None)
    if probe_group_size is not None:
        kl = scale_by_hessian(kl, hess, cands, probe_group_size)
    t2 = time.perf_counter()
    log(f"sensitivity: KL table in {t2 - t1:.1f} s ({len(units) * len(probed) + 1} forward passes)")
    found = {"key": key, "units": [u.name for u in units], "candidates": cands, "kl": kl, "hessian": hess,
             "probe": {"weights": "RTN on GPTQ's min/max grid", "kl_rows": probe_rows,
                       "hessian_rows": int(calib_ids[:hessian_rows].shape[0]), "seq_len": int(calib_ids.shape[1]),
                       "kl_probed": "every candidate" if probe_group_size is None else
                       f"group_size {probe_group_size} at each bits; other group sizes scaled by the Hessian error "
                       "ratio at the same bits"},
             "time_s": {"hessian": round(t1 - t0, 2), "kl": round(t2 - t1, 2)}}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(found))
    return {**found, "cached": False}
