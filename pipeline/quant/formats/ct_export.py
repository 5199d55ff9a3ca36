"""A GPTQ- or AWQ-format checkpoint rewritten as a compressed-tensors `pack-quantized` checkpoint (W4A16 / W8A16):
the same integers, scales and group size, not a re-quantization.

The GPTQ folder's qweight/qzeros/scales/g_idx are unpacked here (`gptq_integers`), an AWQ GEMM folder's
qweight/qzeros/scales with GPTQModel's own AWQ unpacker (`awq_integers`: values packed along the output features,
interleaved in AWQ's order, zero points stored as they are); the compressed-tensors side is
written by compressed-tensors itself: a `QuantizationConfig` of one `QuantizationScheme` (int weights, group or
channel strategy, symmetric when the GPTQ zero points all sit at the middle of the grid) is applied to the model,
each quantized linear gets the GPTQ scales as its `weight_scale` (their dtype kept: float16 from GPTQModel) and the
exactly dequantized weight (q - z) * s in float32, and `ModelCompressor.compress_model` quantizes and packs it. In
float32 that product and the quotient compressed-tensors takes are exact (an 11-bit float16 or 8-bit bfloat16 scale
times an integer of at most 9 bits),
so its rounding returns the GPTQ integers; `convert` unpacks what it wrote and refuses to finish if any integer,
scale or zero point differs.

compressed-tensors' signed grid is the GPTQ grid shifted by 2**(bits-1): q_ct = q - 2**(bits-1), and for an
asymmetric grid zp_ct = z - 2**(bits-1); (q_ct - zp_ct) * s = (q - z) * s. pack-quantized stores no g_idx, so an
act-order checkpoint (g_idx not column // group_size) is refused.

A mixed-precision GPTQ checkpoint ([quantize.mix]: GPTQModel's per-module `dynamic` overrides) becomes one config
group per (bits, group size), each targeting its linears by name; which setting a linear has is read with GPTQModel's
own `dynamic_get`, the rule its loader follows.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PACK_ZP_STRATS, PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
)
from gptqmodel.quantization.awq.utils.packing_utils import reverse_awq_order, unpack_awq
from gptqmodel.quantization.config import dynamic_get
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    apply_renamings,
    revert_weight_conversion,
)

from pipeline.base.errors import StageError
from pipeline.base.memory import MappedPagesTrimmed

log = logging.getLogger("compress")
CT_FORMAT = "pack-quantized"
GPTQ_FILES = ("quantize_config.json",)  # the GPTQ folder's own metadata, not carried over
# the dtype the unpacked integers are held in: every grid here is at most 8 bits, so its values, zero points and
# their differences fit, at a quarter of int64's memory (a 1.5B model's int64 integers alone took 10.5 GB)
INT = torch.int16


def unpack_rows(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """GPTQ's int32 words -> one int64 per value, low bits first, along `dim` (0: qweight's rows, 1: qzeros'
    columns)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:
        vals = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
        return vals.reshape(-1, packed.shape[1])
    vals = (words.unsqueeze(2) >> shifts.view(1, 1, -1)) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], -1)


def gptq_integers(t: dict[str, torch.Tensor], bits: int, group_size: int, v1: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One GPTQ linear's (q [out, in], z [out, groups], scales [out, groups]) in GPTQ's unsigned grid.
    v1: the classic GPTQ checkpoint stores each zero point minus one (GPTQModel's checkpoint_format "gptq")."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit GPTQ packing straddles int32 words: only 2, 4 and 8 bits convert")
    q = unpack_rows(t["qweight"], bits, 0).t().contiguous()  # [out, in]
    out_f, in_f = q.shape
    z = unpack_rows(t["qzeros"], bits, 1)[:, :out_f].t().contiguous() + (1 if v1 else 0)  # [out, groups]
    groups = t["scales"].shape[0]
    g = in_f if group_size == -1 else group_size
    expect = torch.arange(in_f, dtype=torch.int64) // g
    if "g_idx" in t and not torch.equal(t["g_idx"].to(torch.int64), expect):
        raise ValueError("g_idx is not column // group_size (an act-order checkpoint): compressed-tensors' "
                         "pack-quantized format stores no g_idx")
    if groups != in_f // g:
        raise ValueError(f"{groups} scale groups for {in_f} in-features and group_size {group_size}")
    if int(z.min()) < 0 or int(z.max()) >= 1 << bits:
        raise ValueError(f"zero points outside the {bits}-bit grid ({int(z.min())}..{int(z.max())})")
    return q.to(INT), z.to(INT), t["scales"].t().contiguous()


def awq_integers(t: dict[str, torch.Tensor], bits: int, group_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AWQ GEMM linear's (q [out, in], z [out, groups], scales [out, groups]): qweight [in, out * bits / 32] and
    qzeros [groups, out * bits / 32] unpacked and put back in column order by GPTQModel's AWQ helpers."""
    if bits != 4:
        raise ValueError(f"{bits}-bit AWQ: the GEMM layout converted here is 4-bit")
    in_f, out_f = t["qweight"].shape[0], t["scales"].shape[1]
    iw, iz = unpack_awq(t["qweight"], t["qzeros"], bits, out_f)
    iw, iz = reverse_awq_order(iw, iz, bits)
    g = in_f if group_size == -1 else group_size
    if t["scales"].shape[0] != in_f // g or iz.shape[0] != in_f // g:
        raise ValueError(f"{t['scales'].shape[0]} scale groups for {in_f} in-features and group_size {group_size}")
    q, z = iw.to(INT).t().contiguous(), iz.to(INT).t().contiguous()
    return q, z, t["scales"].t().contiguous()


def dequantized(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q - z) * s per group, computed in `dtype` (compressed-tensors' decompressor computes in the scale's dtype)."""
    g = q.shape[1] // scales.shape[1]
    zz, ss = z.repeat_interleave(g, 1), scales.to(dtype).repeat_interleave(g, 1)
    return (q - zz).to(dtype) * ss


Setting = tuple[int, int]  # (bits, group_size; -1 = one scale per row)


def weight_args(bits: int, group_size: int, sym: bool) -> QuantizationArgs:
    """compressed-tensors' int weights only (A16), group or channel strategy, static."""
    return QuantizationArgs(num_bits=bits, type="int", symmetric=sym, dynamic=False,
                            strategy="channel" if group_size == -1 else "group",
                            group_size=None if group_size == -1 else group_size)


def scheme(bits: int, group_size: int, sym: bool, ignore: list[str]):
    """compressed-tensors' own config for a uniform checkpoint: every Linear not ignored at (bits, group_size)."""
    return QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"],
                                                                           weights=weight_args(bits, group_size, sym))},
                              ignore=ignore, format=CT_FORMAT, quantization_status="initialized")


def mixed_scheme(settings: dict[str, Setting], sym: bool, ignore: list[str]):
    """One config group per setting, targeting its linears by their full names (no two groups match one linear);
    groups ordered by bits, then group size."""
    by: dict[Setting, list[str]] = {}
    for name, setting in settings.items():
        by.setdefault(setting, []).append(name)
    groups = {f"group_{i}": QuantizationScheme(targets=sorted(by[st]), weights=weight_args(*st, sym))
              for i, st in enumerate(sorted(by))}
    return QuantizationConfig(config_groups=groups, ignore=ignore, format=CT_FORMAT,
                              quantization_status="initialized")


def linear_settings(qc: dict, names: list[str]) -> dict[str, Setting]:
    """Each quantized linear's (bits, group_size): the config's, or its `dynamic` override as GPTQModel resolves it."""
    base = (int(qc["bits"]), int(qc["group_size"]))
    dynamic = qc.get("dynamic") or None
    if dynamic is None:
        return dict.fromkeys(names, base)
    out = {}
    for name in names:
        over = dynamic_get(dynamic, name)
        if over is False:
            raise ValueError(f"{name} has quantized tensors but the checkpoint's `dynamic` excludes it")
        over = over or {}
        out[name] = (int(over.get("bits", base[0])), int(over.get("group_size", base[1])))
    return out


def _packed_linears(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        mod, _, leaf = k.rpartition(".")
        if leaf in PACKED:
            out.setdefault(mod, {})[leaf] = v
    return out


PACKED = ("qweight", "qzeros", "scales", "g_idx")  # a GPTQ/AWQ linear's packed tensors (its bias is carried over)


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    return state


Ints = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (q [out, in], z [out, groups], scales [out, groups]); INT


def read_integers(folder: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, Setting], dict[str, Ints]]:
    """A GPTQ or AWQ folder's quantization_config, its tensors, and each quantized linear's setting and integers
    (in the unsigned grid, zero points as stored by AWQ / restored from GPTQ's v1 offset)."""
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    fmt = qc.get("quant_method")  # the checkpoint's format
    if fmt not in ("gptq", "awq"):
        raise ValueError(f"{folder} is not a GPTQ or AWQ checkpoint (quant_method {fmt!r})")
    if qc.get("desc_act"):
        raise ValueError("desc_act = true: compressed-tensors' pack-quantized format stores no g_idx (act-order)")
    if fmt == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {qc.get('version')!r}: only the GEMM layout converts")
    v1 = qc.get("checkpoint_format", "gptq") == "gptq"
    state = _read_state(folder)
    linears = _packed_linears(state)
    settings = linear_settings(qc, sorted(linears))
    ints = {name: (gptq_integers(t, *settings[name], v1) if fmt == "gptq" else awq_integers(t, *settings[name]))
            for name, t in linears.items()}
    return qc, state, settings, ints


def dequantized_weights(folder: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Each quantized linear of a GPTQ or AWQ folder as (q - z) * s in `dtype` (None: its scales' dtype)."""
    _, _, _, ints = read_integers(folder)
    return {name: dequantized(q, z, s, dtype or s.dtype) for name, (q, z, s) in ints.items()}


# GPTQModel quantizes some of transformers' fused linears as their parts (phi3's mlp.gate_up_proj as gate_proj and
# up_proj); the parts' rows, stacked in this order, are the fused linear's (each row has its own scales and zeros)
FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "qkv_proj": ("q_proj", "k_proj", "v_proj")}
EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<leaf>gate_proj|up_proj|down_proj)$")


def meta_model(cfg):
    """transformers' model of `cfg` on the meta device: its module tree, dtypes and checkpoint names, no weights."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=cfg.dtype if isinstance(cfg.dtype, torch.dtype)
                                                else torch.bfloat16)


def checkpoint_names(model) -> set[str]:
    """The tensor names transformers' save_pretrained writes for `model` (tied duplicates dropped, its conversion
    mapping reverted: mixtral's experts as block_sparse_moe.experts.<e>.w1 ..., gpt_oss's fused)."""
    seen, own = set(), {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in seen:
            seen.add(id(v))
            own[k] = v
    return set(revert_weight_conversion(model, own))


def _conversions(model) -> tuple[dict[str, str], list]:
    """transformers' conversion mapping for `model`: the per-expert names it merges into fused experts (GPTQModel's
    gate_proj/up_proj/down_proj -> the checkpoint's leaf, e.g. mixtral's w1/w3/w2; empty when the model's
    checkpoints hold its experts fused) and the renamings it applies, reversed (model names -> checkpoint names)."""
    convs = get_model_conversion_mapping(model, add_legacy=False)
    leaves: dict[str, str] = {}
    for c in convs:
        if not isinstance(c, WeightConverter) or len(c._original_target_patterns) != 1:
            continue
        target = c._original_target_patterns[0]
        found = [re.search(r"experts\.\*\.([A-Za-z0-9_]+)\.weight$", s) for s in c._original_source_patterns]
        if not all(found):
            continue
        names = [f.group(1) for f in found if f]
        if target.endswith("experts.gate_up_proj") and len(names) == 2:
            leaves.update(gate_proj=names[0], up_proj=names[1])
        elif target.endswith("experts.down_proj") and len(names) == 1:
            leaves["down_proj"] = names[0]
    renamings = [c.reverse_transform() for c in convs[::-1] if isinstance(c, WeightRenaming)]
    return leaves, renamings


def place_linears(model, ints: dict[str, Ints], settings: dict[str, Setting], state: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, Ints], dict[str, Setting], dict[str, torch.Tensor], dict[str, str]]:
    """GPTQModel's quantized linears (its module tree: fused linears split, experts one module each) placed where
    transformers' checkpoints hold them, in the model's names: split parts stacked back into the fused linear,
    each expert under the name transformers' conversion mapping reads. Returns the placed integers, settings,
    the linears' biases, and where each GPTQModel linear went."""
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    fused_experts = {n for n, m in model.named_modules() if n.endswith(".experts")
                     and not isinstance(m, torch.nn.ModuleList) and any(True for _ in m.parameters(recurse=False))}
    leaves, _ = _conversions(model)
    mt = model.config.model_type
    groups: dict[str, list[str]] = {}
    for name in ints:
        parent, _, leaf = name.rpartition(".")
        fused = next((f for f, parts in FUSED_PARTS.items() if leaf in parts and f"{parent}.{f}" in linears), None)
        m = EXPERT.match(name)
        if name in linears:
            groups[name] = [name]
        elif fused is not None:
            groups.setdefault(f"{parent}.{fused}", []).append(name)
        elif m and m["experts"] in fused_experts:
            if m["leaf"] not in leaves:
                raise ValueError(f"{name}: transformers {transformers.__version__} holds {mt}'s experts as fused 3D "
                                 "parameters and reads no per-expert names for them, so a per-expert "
                                 "compressed-tensors checkpoint cannot load (pipeline/quant/formats/ct.py)")
            groups[f"{m['experts']}.{m['e']}.{leaves[m['leaf']]}"] = [name]
        else:
            raise ValueError(f"{name}: quantized by GPTQModel but transformers' {mt} model has no place for it")
    placed, placed_settings, biases, where = {}, {}, {}, {}
    for target, names in groups.items():
        if len(names) > 1:
            order = FUSED_PARTS[target.rpartition(".")[2]]
            names = sorted(names, key=lambda n: order.index(n.rpartition(".")[2]))
            if len(names) != len(order) or len({settings[n] for n in names}) != 1:
                raise ValueError(f"{target}: its parts {names} are not all quantized alike, so they cannot be "
                                 "stacked into one compressed-tensors linear")
        # one part: its own tensors (a copy of every linear's integers doubled the conversion's memory)
        if len(names) == 1:
            placed[target] = ints[names[0]]
        else:
            q, z, sc = (torch.cat([ints[n][i] for n in names]) for i in range(3))
            placed[target] = (q, z, sc)
        placed_settings[target] = settings[names[0]]
        has_bias = [f"{n}.bias" in state for n in names]
        if any(has_bias):
            if not all(has_bias):
                raise ValueError(f"{target}: some of its parts {names} have a bias, some not")
            biases[f"{target}.bias"] = torch.cat([state[f"{n}.bias"] for n in names])
        where.update(dict.fromkeys(names, target))
    return placed, placed_settings, biases, where


def compress_linear(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, setting: Setting, sym: bool
                    ) -> dict[str, torch.Tensor]:
    """One linear's pack-quantized tensors, written by compressed-tensors itself from the exactly dequantized
    float32 weight, the GPTQ scales (their dtype kept) and, when asymmetric, the zero points."""
    bits = setting[0]
    mid = 1 << (bits - 1)
    local = {"weight": dequantized(q, z, s, torch.float32), "weight_scale": s.clone()}
    if not sym:
        local["weight_zero_point"] = (z - mid).to(torch.int8)
    return PackedQuantizationCompressor.compress(local, QuantizationScheme(targets=["Linear"],
                                                                           weights=weight_args(*setting, sym)))


def convert(gptq_dir: Path, out_dir: Path) -> dict:
    """Write the compressed-tensors checkpoint of the GPTQ or AWQ folder gptq_dir into out_dir (weights and
    config.json; the caller copies the tokenizer and finishes the config). Returns config.json's
    quantization_config. Every tensor lands under the name transformers' save_pretrained gives it (checked against
    the model's own list: none missing, none extra), every expert's linears quantized."""
    qc, state, settings, ints = read_integers(gptq_dir)
    sym = all(bool((z == 1 << (settings[n][0] - 1)).all()) for n, (_, z, _) in ints.items())
    if qc.get("sym", not qc.get("zero_point", False)) and not sym:  # (AWQ's config says zero_point)
        raise ValueError("sym = true but some zero points are not the grid's middle")
    cfg = AutoConfig.from_pretrained(gptq_dir)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = meta_model(cfg)
    placed, placed_settings, biases, where = place_linears(model, ints, settings, state)
    if qc.get("dynamic") and any(EXPERT.match(n) and n != where[n] for n in ints):
        raise ValueError("a [quantize.mix] checkpoint with fused experts: transformers decompresses every expert "
                         "with one config group's scheme, so experts cannot have their own (bits, group size)")
    own = dict(model.state_dict(keep_vars=True))
    tied = set(own) - {k for k, _ in model.named_parameters()} - {k for k, _ in model.named_buffers()}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():  # the plain tensors, in the model's dtype for each (as its from_config made them)
        mod, _, leaf = k.rpartition(".")
        if (mod in ints and leaf in PACKED) or (mod in where and leaf == "bias") or k in tied:
            continue
        out[k] = v.to(own[k].dtype) if k in own and v.is_floating_point() else v
    for k, v in biases.items():
        out[k] = v.to(own[k].dtype) if k in own else v.to(model.dtype)
    for name, (q, z, s) in placed.items():
        out.update({f"{name}.{k}": v for k, v in compress_linear(q, z, s, placed_settings[name], sym).items()})
    _, renamings = _conversions(model)
    out = {apply_renamings(k, renamings): v for k, v in out.items()}
    _check_names(out, checkpoint_names(model), {apply_renamings(n, renamings) for n in placed}, model)

    quantized = set(placed)
    ignore = sorted({apply_renamings(n, renamings) for n, m in model.named_modules()
                     if n not in quantized and holds_matrix(m)})
    qcfg = (mixed_scheme({apply_renamings(n, renamings): st for n, st in placed_settings.items()}, sym, ignore)
            if qc.get("dynamic") else scheme(*next(iter(placed_settings.values())), sym, ignore))
    qcfg.quantization_status = QuantizationStatus.COMPRESSED
    out_dir.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(out, out_dir, max_shard_size="50GB", metadata={"format": "pt"})  # save_pretrained's
    cfg.save_pretrained(out_dir)
    ModelCompressor(quantization_config=qcfg).update_config(str(out_dir))
    _verify(out_dir, {apply_renamings(n, renamings): v for n, v in placed.items()},
            {apply_renamings(n, renamings): b for n, (b, _) in placed_settings.items()}, sym)
    return json.loads((out_dir / "config.json").read_text())["quantization_config"]


def holds_matrix(m: torch.nn.Module) -> bool:
    """A module a loader may take for a linear layer: an nn.Linear, or one holding a 2-D `weight` of its own (a
    transformers 5 MoE router, e.g. Qwen3MoeTopKRouter). Those left 16-bit go in the config's `ignore`: vLLM builds
    qwen3_moe's router as a linear with the checkpoint's quantization scheme unless it is ignored, and then looks for
    packed tensors the checkpoint does not hold (llm-compressor's MoE recipes ignore "re:.*mlp.gate$" for this)."""
    if isinstance(m, torch.nn.Linear):
        return True
    w = m._parameters.get("weight")
    return not isinstance(m, torch.nn.Embedding) and w is not None and w.dim() == 2


def _check_names(out: dict[str, torch.Tensor], expected: set[str], quantized: set[str], model) -> None:
    """The checkpoint holds what transformers' own save would, under the same names, each quantized linear as its
    packed tensors: no tensor missing, none the model has no place for, every expert linear quantized."""
    have = {k.removesuffix("_packed") if k.endswith(".weight_packed") else k for k in out
            if not k.endswith((".weight_scale", ".weight_shape", ".weight_zero_point"))}
    missing, extra = sorted(expected - have), sorted(have - expected)
    if missing or extra:
        mt = model.config.model_type
        raise ValueError(f"the compressed-tensors checkpoint of {mt} does not have transformers' layout: missing "
                         f"{missing[:4]} ({len(missing)}), not in the model {extra[:4]} ({len(extra)})")
    dense_experts = sorted(k for k in out if ".experts." in k and k.endswith(".weight")
                           and k.removesuffix(".weight") not in quantized)
    if dense_experts:
        raise ValueError(f"expert weights left in 16 bits: {dense_experts[:4]} ({len(dense_experts)})")


def _verify(out_dir: Path, ints: dict, bits_of: dict[str, int], sym: bool) -> None:
    """Unpack what compressed-tensors wrote (its own unpacker) and compare with the GPTQ integers, scales and zeros."""
    state = _read_state(out_dir)
    for name, (q, z, s) in ints.items():
        bits = bits_of[name]
        mid = 1 << (bits - 1)
        got = unpack_from_int32(state[f"{name}.weight_packed"], bits, tuple(q.shape)).to(INT)
        ok = torch.equal(got, q - mid) and torch.equal(state[f"{name}.weight_scale"], s)
        if ok and not sym:
            zp = unpack_from_int32(state[f"{name}.weight_zero_point"], bits, tuple(z.shape), packed_dim=0)
            ok = torch.equal(zp.to(INT), z - mid)
        if not ok:
            raise RuntimeError(f"{name}: the compressed-tensors checkpoint does not hold the GPTQ integers/scales")


REFUSED_EXIT = 3  # convert_fresh's child: the converter refused the checkpoint (its ValueError, written to RESULT)


def convert_fresh(gptq_dir: Path, out_dir: Path) -> dict:
    """`convert` in a fresh interpreter (`python -m pipeline.quant.formats.ct_export GPTQ_DIR OUT_DIR RESULT`):
    GPTQModel's quantize replaces some of transformers' MoE classes and its conversion mapping in the process that ran
    it (defuser.replace_fused_blocks, e.g. mixtral's sparse block by one nn.Linear per expert), and the checkpoint
    must be laid out for transformers' own classes. Not through pipeline/base/worker.py: its task table names the
    measuring modules, which would become part of every quantize unit's code identity."""
    logs = Path(tempfile.mkdtemp(prefix=".ct-job-", dir=out_dir.parent))
    result = logs / "result.json"
    root = str(Path(__file__).resolve().parents[3])  # the repository root
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        with (logs / "output.log").open("w+") as out:
            child = subprocess.Popen([sys.executable, "-m", "pipeline.quant.formats.ct_export",
                                      str(gptq_dir.resolve()), str(out_dir.resolve()), str(result)],
                                     env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                _, status, usage = os.wait4(child.pid, 0)  # its own resource use: the conversion's peak memory
            except BaseException:  # interrupted (Ctrl-C, the runner's SIGTERM): the conversion does not outlive us
                child.kill()
                child.wait()
                raise
            child.returncode = rc = os.waitstatus_to_exitcode(status)
            out.seek(0)
            text = out.read()
        peak = usage.ru_maxrss * 1024  # KiB on Linux
        log.info("compressed-tensors conversion of %s: peak RSS %.2f GiB (its own process, beside this one)",
                 gptq_dir.name, peak / 2**30)
        if rc == REFUSED_EXIT and result.is_file():  # the converter's ValueError: a layout it refuses
            raise StageError(f"the compressed-tensors conversion refused {gptq_dir.name}: "
                             f"{json.loads(result.read_text())['refused']}")
        if rc < 0:
            why = ("SIGKILL: most likely the kernel's out-of-memory killer (dmesg says)" if -rc == signal.SIGKILL
                   else signal.Signals(-rc).name)
            raise RuntimeError(f"the compressed-tensors conversion of {gptq_dir.name} was killed by {why}, at "
                               f"{peak / 2**30:.2f} GiB of peak RSS")
        if rc != 0:
            tail = "\n".join(text.strip().splitlines()[-3:])
            raise RuntimeError(f"the compressed-tensors conversion failed (exit code {rc}): {tail}")
        return json.loads(result.read_text())
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def convert_folder(gptq_dir: Path, out_dir: Path) -> dict:
    """A complete compressed-tensors folder beside a GPTQ one (tokenizer and generation config copied; the GPTQ
    folder's config.json with quantization_config replaced). For converting an existing export."""
    out_dir.mkdir(parents=True, exist_ok=True)
    qc = convert_fresh(gptq_dir, out_dir)
    cfg = json.loads((gptq_dir / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in gptq_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", *GPTQ_FILES) \
                and (f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template",
                                        "vocab", "merges", "added_tokens"))):
            shutil.copyfile(f, out_dir / f.name)
    return qc


def rewrite_in_place(folder: Path) -> dict:
    """The GPTQ checkpoint a method just saved in `folder`, rewritten there as compressed-tensors (its GPTQ
    safetensors and quantize_config.json removed; config.json left for the caller's finish_checkpoint). Returns the
    new quantization_config."""
    scratch = Path(tempfile.mkdtemp(prefix=".ct-", dir=folder))
    try:
        qc = convert_fresh(folder, scratch)
        for f in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json"),
                  *(folder / n for n in GPTQ_FILES)]:
            if f.is_file():
                f.unlink()
        for f in scratch.iterdir():
            if f.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.move(str(f), folder / f.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return qc


@contextmanager
def packed_zero_points_on_meta() -> Iterator[None]:
    """compressed-tensors 0.20 compresses transformers' meta-device model (before the weights load) without packing
    an asymmetric grid's zero points: the place made for weight_zero_point is [out, groups] while the checkpoint
    (written by the same library) holds it packed, [ceil(out * bits / 32), groups], and the load stops with a
    size mismatch. Within this block the meta branch gives the packed shape, as the real branch does; the
    decompression at the first forward unpacks it (its own code). Weight-only asymmetric checkpoints only
    (pipeline/quant/formats/ct.py asks)."""
    plain = PackedQuantizationCompressor.__dict__["compress"]

    def compress(cls, state_dict, scheme):
        out = plain.__func__(cls, state_dict, scheme)
        zp, w = state_dict.get("weight_zero_point"), scheme.weights
        if zp is not None and zp.device.type == "meta" and not w.symmetric and w.strategy in PACK_ZP_STRATS:
            rows = math.ceil(zp.shape[0] * w.num_bits / 32)
            out["weight_zero_point"] = torch.empty((rows, *zp.shape[1:]), dtype=torch.int32, device="meta")
        return out

    PackedQuantizationCompressor.compress = classmethod(compress)
    try:
        yield
    finally:
        PackedQuantizationCompressor.compress = plain


def load_own(folder: Path, device: str):
    """A compressed-tensors folder with packed zero points, loaded the way transformers loads any (decompressed at
    the first forward), the zero points placed (pipeline/quant/formats/ct.py CompressedTensorsLoad)."""
    with MappedPagesTrimmed(folder), packed_zero_points_on_meta():
        return AutoModelForCausalLM.from_pretrained(folder, device_map=device)


if __name__ == "__main__":  # convert_fresh's child: GPTQ_DIR OUT_DIR RESULT_JSON
    try:
        qc = convert(Path(sys.argv[1]), Path(sys.argv[2]))
    except ValueError as e:  # a layout this converter refuses, by name: the parent raises it as a StageError
        Path(sys.argv[3]).write_text(json.dumps({"refused": str(e)}))
        sys.exit(REFUSED_EXIT)
    Path(sys.argv[3]).write_text(json.dumps(qc))
