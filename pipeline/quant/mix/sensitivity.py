"""Sensitivity of each allocation unit to each (bits, group_size) candidate, measured on the calibration rows (never
the evaluation text), two ways, each timed:

- kl:      mean per-token KL(base || model) of the next-token distributions on `probe_rows` calibration rows, with
           that unit alone quantized. The probe's weights are round-to-nearest with GPTQ's own min/max grid
           (`fake_quantize`), not GPTQ's: one forward pass per unit and candidate, no Hessian solve.
- kl-scaled: the kl above probed only at `probe_group_size` (one forward pass per unit and bits); a candidate of
           another group size g at the same bits b is KL(b, probe) x hessian(b, g) / hessian(b, probe): the unit's
           own ratio of the layer-wise error, which tracks the KL's ratio where the bits are equal (both are the
           same RTN noise, finer or coarser; measured on SmolLM2 in research/mix.md).
- hessian: sum over the unit's linears of ||(W - Q) X||^2 / tokens = tr(dW H dW^T), H = X^T X / tokens from the
           calibration activations (one forward pass with hooks over `hessian_rows` rows), Q the same weights as the
           probe's: the layer-wise objective GPTQ minimises.

The weights Q (`probe_weights`): 'rtn' rounds each weight to nearest on GPTQ's min/max grid (no solve, and no error
feedback: it overstates what GPTQ's solve leaves, by more at some settings than at others); 'gptq' runs GPTQModel's
own GPTQ solver on each linear alone, on that linear's calibration Hessian (fed as its symmetric square root, whose
X^T X is H), with the variant's damp, mse, symmetry and act-group settings (`Solver`): the weights the checkpoint
will hold, except for the error feedback from the layers before, which GPTQ's sequential pass adds.

The table is cached beside the quantize units (`cache_dir`) under a key made of everything it depends on: the base
model's files (their sha256 in the load stage's manifest, else the bytes), the calibration ids, the units, the
candidates, the probe rows and this file's version: a table from another model or calibration set is never read.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from gptqmodel.quantization.config import QuantizeConfig
from gptqmodel.quantization.gptq import GPTQ
from transformers import AutoModelForCausalLM

from pipeline.base.fileio import atomic_write_text
from pipeline.quant.mix.config import MixUnit

VERSION = 3  # 2: kl-scaled (the probed candidates are part of the key); 3: the probe's weights (rtn or gptq)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool = True) -> torch.Tensor:
    """w [out, in] rounded to the GPTQ grid (GPTQModel's Quantizer with mse off): per output row and group of
    `group_size` input columns, maxq = 2^bits - 1; symmetric: scale = 2 max|w| / maxq, zero = (maxq + 1) / 2;
    else scale = (max - min) / maxq, zero = round(-min / scale).
    Returns scale * (clamp(round(w / scale) + zero) - zero)."""
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


@dataclass(frozen=True)
class Solver:
    """How the probe's weights are made (see the module docstring): 'rtn', or 'gptq' with the variant's settings."""

    weights: str = "rtn"
    sym: bool = True
    damp_percent: float = 0.05
    mse: float = 0.0
    act_group_aware: bool = True  # for group sizes > 0 (GPTQModel refuses it at -1: off there, as in the checkpoint)
    desc_act: bool = False

    def key(self) -> list:
        return [self.weights, self.sym] + ([] if self.weights == "rtn" else
                                           [self.damp_percent, self.mse, self.act_group_aware, self.desc_act])


def gptq_solve(w: torch.Tensor, h_root: torch.Tensor, bits: int, group_size: int, solver: Solver) -> torch.Tensor:
    """w [out, in] quantized by GPTQModel's GPTQ on the Hessian h_root^T h_root (h_root: [in, in]); the dequantized
    weights, in w's dtype."""
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w.float().clone()
    cfg = QuantizeConfig(bits=bits, group_size=group_size, sym=solver.sym, desc_act=solver.desc_act,
                         act_group_aware=solver.act_group_aware and group_size > 0 and not solver.desc_act,
                         damp_percent=solver.damp_percent, mse=solver.mse)
    task = GPTQ(linear, cfg)
    task.quantizer.configure(perchannel=True)  # as GPTQModel's own GPTQ processor does
    task.fallback = None  # h_root stands for every calibration token: never the too-few-samples RTN fallback
    task.add_batch(h_root, None)
    return task.quantize()[0].to(w.dtype)


def hessian_root(h: torch.Tensor) -> torch.Tensor:
    """The symmetric square root of a positive semi-definite X^T X: R with R^T R = X^T X (negative rounding
    eigenvalues clamped to 0)."""
    e, v = torch.linalg.eigh(h.double())
    return ((v * e.clamp(min=0).sqrt()) @ v.T).float()


class Weights:
    """The quantized weights of a linear at a candidate, per `solver`; GPTQ's are solved once and kept for the
    candidates in `keep` (the KL probe's), so the Hessian table and the probe share them."""

    def __init__(self, solver: Solver, hess: dict[str, torch.Tensor], keep: set[tuple[int, int]]):
        self.solver, self.hess, self.keep = solver, hess, keep
        self.roots: dict[str, torch.Tensor] = {}
        self.kept: dict[tuple[str, int, int], torch.Tensor] = {}

    def __call__(self, name: str, w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
        if self.solver.weights == "rtn":
            return fake_quantize(w, bits, group_size, self.solver.sym)
        found = self.kept.get((name, bits, group_size))
        if found is not None:
            return found
        if name not in self.roots:
            self.roots[name] = hessian_root(self.hess[name])
        q = gptq_solve(w, self.roots[name], bits, group_size, self.solver)
        if (bits, group_size) in self.keep:
            self.kept[(name, bits, group_size)] = q
        return q

    def forget(self, u: MixUnit) -> None:
        """Drop what was kept and solved for unit u's linears (done with it: memory stays one unit's)."""
        for name, _, _ in u.modules:
            self.roots.pop(name, None)
            for key in [k for k in self.kept if k[0] == name]:
                del self.kept[key]


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
    """[layer][row] output of each decoder layer on each row of ids (unquantized model; the base model is run, not
    the vocabulary head, which no layer's output depends on)."""
    outs: list[list] = [[] for _ in layers]
    handles = [layer.register_forward_hook(lambda _m, _i, o, k=k: outs[k].append(o)) for k, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for row in ids:
                model.base_model(row[None])
    finally:
        for h in handles:
            h.remove()
    return outs


@contextmanager
def _replayed(layers, first: int, outputs: list[list]):
    """Decoder layers [0, first) replaced by one _Replay of `outputs` (set its .row before each row's forward);
    None when first is 0 (nothing to replay)."""
    if first == 0:
        yield None
        return
    saved = [layers[j] for j in range(first)]
    replay = _Replay(outputs[first - 1])
    for j in range(first):
        layers[j] = replay
    try:
        yield replay
    finally:
        for j, layer in enumerate(saved):
            layers[j] = layer


def _logits_from(model, layers, first: int, outputs: list[list], ids: torch.Tensor) -> torch.Tensor:
    """Logits with decoder layers [0, first) replayed from `outputs` (see _Replay)."""
    with _replayed(layers, first, outputs) as replay:
        if replay is None:
            return _logits(model, ids)
        rows = []
        with torch.no_grad():
            for r, row in enumerate(ids):
                replay.row = r
                rows.append(model(row[None]).logits[0].float())
        return torch.cat(rows)


class KLProbe:
    """The KL probe on `ids` (see the module docstring): the unquantized model's per-layer outputs and reference
    log-probabilities are computed once; row() measures one unit. The decoder layers before a unit's first linear are
    not recomputed (their outputs are replayed)."""

    def __init__(self, model, ids: torch.Tensor, layers_path: str, outputs: list[list] | None = None):
        """outputs: the decoder layers' outputs on ids when already computed (UnitHessians.on(ids)), else run."""
        self.model, self.ids, self.prefix = model, ids, layers_path + "."
        self.layers = model.get_submodule(layers_path)
        self.outputs = outputs if outputs is not None else _layer_outputs(self.layers, model, ids)
        self.ref = torch.log_softmax(_logits(model, ids), -1)

    def row(self, u: MixUnit, cands: list[tuple[int, int]],
            weights: Callable[[str, torch.Tensor, int, int], torch.Tensor]) -> list[float]:
        """Mean KL with unit u alone quantized, for each candidate; u's weights are restored after."""
        mods = [self.model.get_submodule(name) for name, _, _ in u.modules]
        first = min(int(name[len(self.prefix):].split(".", 1)[0]) for name, _, _ in u.modules)
        saved = [m.weight.data.clone() for m in mods]
        row = []
        try:
            for b, g in cands:
                for (name, _, _), m, w in zip(u.modules, mods, saved, strict=True):
                    m.weight.data.copy_(weights(name, w, b, g))
                row.append(mean_kl(self.ref, _logits_from(self.model, self.layers, first, self.outputs, self.ids)))
        finally:
            for m, w in zip(mods, saved, strict=True):
                m.weight.data.copy_(w)
        return row


def kl_table(model, ids: torch.Tensor, units: list[MixUnit], cands: list[tuple[int, int]],
             weights: Callable[[str, torch.Tensor, int, int], torch.Tensor], layers_path: str) -> list[list[float]]:
    """[unit][candidate] mean KL with that unit alone quantized (KLProbe, one unit after the other)."""
    probe = KLProbe(model, ids, layers_path)
    return [probe.row(u, cands, weights) for u in units]


def _add_xtx(hess: dict[str, torch.Tensor], name: str):
    """A forward hook adding the linear's input X^T X (float32) to hess[name]."""
    def add(_mod, inputs, _out):
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
        hess[name] = hess.get(name, 0) + x.T @ x
    return add


def input_hessians(model, ids: torch.Tensor, names: list[str]) -> tuple[dict[str, torch.Tensor], int]:
    """({linear: X^T X summed over the tokens of ids}, tokens): one forward pass with hooks. Every named linear's
    Hessian is held at once; the sensitivity table takes them a unit at a time instead (UnitHessians)."""
    hess: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(_add_xtx(hess, n)) for n in names]
    try:
        with torch.no_grad():
            for row in ids:
                model(row[None])
    finally:
        for h in handles:
            h.remove()
    return hess, int(ids.numel())


class _Stop(Exception):
    """Raised after the last decoder layer a unit's Hessians need: the layers after it are not run."""


class UnitHessians:
    """input_hessians for one unit's linears at a time, equal to its figures to the bit: the decoder layers' outputs
    on `ids` are kept once (rows x tokens x hidden a layer), and a unit's X^T X come from running only the unit's own
    layers on them (the layers before replayed, as the KL probe does; the ones after never run). Memory: those hidden
    states and one unit's Hessians, where every linear's at once is in_features^2 x 4 bytes each (Qwen2.5-1.5B: its 28
    down_proj Hessians alone are 9 GB in float32)."""

    def __init__(self, model, ids: torch.Tensor, layers_path: str):
        self.model, self.ids, self.prefix = model, ids, layers_path + "."
        self.layers = model.get_submodule(layers_path)
        self.outputs = _layer_outputs(self.layers, model, ids)
        self.tokens = int(ids.numel())

    def on(self, ids: torch.Tensor) -> list[list] | None:
        """The kept layer outputs for `ids` when they are the first rows of this object's ids (the KL probe's rows
        are: both take the calibration's first rows), else None: one forward pass and one copy for both."""
        n = len(ids)
        return [o[:n] for o in self.outputs] if n <= len(self.ids) and torch.equal(ids, self.ids[:n]) else None

    def of(self, u: MixUnit) -> dict[str, torch.Tensor]:
        """{linear: X^T X summed over the rows' tokens} for u's linears."""
        at = [int(name[len(self.prefix):].split(".", 1)[0]) for name, _, _ in u.modules]
        hess: dict[str, torch.Tensor] = {}

        def stop(_m, _i, _o):
            raise _Stop

        handles = [self.model.get_submodule(n).register_forward_hook(_add_xtx(hess, n)) for n, _, _ in u.modules]
        handles.append(self.layers[max(at)].register_forward_hook(stop))
        try:
            with _replayed(self.layers, min(at), self.outputs) as replay, torch.no_grad():
                for r, row in enumerate(self.ids):
                    if replay is not None:
                        replay.row = r
                    with suppress(_Stop):
                        self.model.base_model(row[None])
        finally:
            for h in handles:
                h.remove()
        return hess


def hessian_row(model, hess: dict[str, torch.Tensor], tokens: int, u: MixUnit, cands: list[tuple[int, int]],
                weights: Callable[[str, torch.Tensor, int, int], torch.Tensor]) -> list[float]:
    """Summed ||(W - Q) X||^2 / tokens over unit u's linears, for each candidate (see the module docstring)."""
    row = []
    for b, g in cands:
        total = 0.0
        for name, _, _ in u.modules:
            w = model.get_submodule(name).weight.data.float()
            dw = w - weights(name, w, b, g).float()
            total += float(((dw @ hess[name]) * dw).sum()) / tokens
        row.append(total)
    return row


def table_key(base_dir: Path, calib_ids: torch.Tensor, parts: list) -> str:
    """A sensitivity table's identity: the base model's files (their sha256 in the load stage's manifest, else the
    bytes), the calibration ids with their shape (64 x 256 and 32 x 512 are the same bytes, not the same rows), the
    versions of the libraries that compute it, and `parts` (what else the table depends on, JSON)."""
    h = hashlib.sha256()
    manifest = base_dir / "manifest.json"
    if manifest.is_file():
        h.update(json.dumps(json.loads(manifest.read_text()).get("outputs"), sort_keys=True).encode())
    else:
        for f in sorted(base_dir.glob("*.safetensors")):
            h.update(f.read_bytes())
    h.update(json.dumps(list(calib_ids.shape)).encode())
    h.update(calib_ids.to(torch.int64).contiguous().numpy().tobytes())
    h.update(json.dumps(_library_versions()).encode())
    h.update(json.dumps(parts).encode())
    return h.hexdigest()[:32]


def _library_versions() -> dict[str, str]:
    """The versions a table's figures depend on: the model code (transformers), the maths (torch), the quantizers."""
    out = {}
    for pkg in ("torch", "transformers", "gptqmodel", "gguf", "auto-round"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = ""
    return out


def cached_table(path: Path | None, key: str, log: Callable[[str], None], same: str) -> dict | None:
    """The table cached at `path` when it carries `key` (a table from another model or calibration set is never
    read), marked cached; else None."""
    if path is None or not path.is_file():
        return None
    found = json.loads(path.read_text())
    if found.get("key") != key:
        return None
    log(f"sensitivity: cached table {path.name} ({same})")
    return {**found, "cached": True}


def cache_key(base_dir: Path, calib_ids: torch.Tensor, units: list[MixUnit], cands: list[tuple[int, int]],
              rows: tuple[int, int], solver: Solver, probe_group_size: int | None = None) -> str:
    return table_key(base_dir, calib_ids, [VERSION, [(u.name, u.modules) for u in units], cands, rows, solver.key(),
                                           probe_group_size])


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
            probe_rows: int, hessian_rows: int, solver: Solver, layers_path: str, cache_dir: Path | None,
            log: Callable[[str], None], probe_group_size: int | None = None) -> dict:
    """{"kl": table, "hessian": table, "time_s": {...}, "key", "cached"}: measured, or read from cache_dir.
    probe_group_size: the kl-scaled estimator (KL probed at that group size only); None: every candidate probed."""
    if probe_group_size is not None and any((b, probe_group_size) not in cands for b, _ in cands):
        raise ValueError(f"kl-scaled: every candidate bits needs a candidate at group_size {probe_group_size}")
    key = cache_key(base_dir, calib_ids, units, cands, (probe_rows, hessian_rows), solver, probe_group_size)
    path = cache_dir / f"{key}.json" if cache_dir is not None else None
    cached = cached_table(path, key, log, "same model, calibration, candidates and probe weights")
    if cached is not None:
        return cached
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    probed = cands if probe_group_size is None else [c for c in cands if c[1] == probe_group_size]
    solving = "GPTQ solves" if solver.weights == "gptq" else "RTN"
    t0 = time.perf_counter()
    hessians = UnitHessians(model, calib_ids[:hessian_rows], layers_path)
    t1 = time.perf_counter()
    probe = KLProbe(model, calib_ids[:probe_rows], layers_path, hessians.on(calib_ids[:probe_rows]))
    hess: dict[str, torch.Tensor] = {}  # the current unit's (Weights reads them for GPTQ's solve)
    weights = Weights(solver, hess, set(probed))
    spent = {"hessian": t1 - t0, "kl": time.perf_counter() - t1}
    hessian: list[list[float]] = []
    kl: list[list[float]] = []
    for k, u in enumerate(units):  # unit by unit: its Hessians, and GPTQ's solves for the probe, held for it alone
        t = time.perf_counter()
        hess.clear()
        hess.update(hessians.of(u))
        hessian.append(hessian_row(model, hess, hessians.tokens, u, cands, weights))
        t1 = time.perf_counter()
        kl.append(probe.row(u, probed, weights))
        weights.forget(u)
        spent["hessian"] += t1 - t
        spent["kl"] += time.perf_counter() - t1
        if (k + 1) % 10 == 0 or k + 1 == len(units):
            log(f"sensitivity: {k + 1}/{len(units)} units ({solving}; {len(cands)} candidates' Hessian error, "
                f"KL probed at {len(probed)}) {spent['hessian'] + spent['kl']:.0f} s")
    del weights, probe, hessians, hess
    if probe_group_size is not None:
        kl = scale_by_hessian(kl, hessian, cands, probe_group_size)
    log(f"sensitivity: Hessian table in {spent['hessian']:.1f} s, KL table in {spent['kl']:.1f} s "
        f"({len(units) * len(probed) + 1} forward passes)")
    found = {"key": key, "units": [u.name for u in units], "candidates": cands, "kl": kl, "hessian": hessian,
             "probe": {"weights": "RTN on GPTQ's min/max grid" if solver.weights == "rtn" else
                       "GPTQModel's GPTQ solve of each linear alone on its calibration Hessian "
                       f"(damp {solver.damp_percent}, mse {solver.mse}, act_group_aware {solver.act_group_aware}, "
                       f"desc_act {solver.desc_act}, sym {solver.sym})",
                       "solver": asdict(solver), "kl_rows": probe_rows,
                       "hessian_rows": int(calib_ids[:hessian_rows].shape[0]), "seq_len": int(calib_ids.shape[1]),
                       "kl_probed": "every candidate" if probe_group_size is None else
                       f"group_size {probe_group_size} at each bits; other group sizes scaled by the Hessian error "
                       "ratio at the same bits"},
             "time_s": {k: round(v, 2) for k, v in spent.items()}}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(found))
    return {**found, "cached": False}
