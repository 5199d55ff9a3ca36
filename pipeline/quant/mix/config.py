"""Mixed precision to a budget (`[quantize.mix]` on a GPTQ variant): the recipe table, the allocation units (one
decoder layer's attention or MLP block, or one linear), what each candidate costs on disk, and the checks
`compress check` runs on them. Torch-free.

The cost of a module is counted as the GPTQ checkpoint stores it (GPTQModel's packing, int32 words):
    qweight  in * bits / 8 * out bytes      qzeros  groups * out * bits / 8 bytes
    scales   groups * out * 2 bytes (fp16)  g_idx   in * 4 bytes           groups = in / group_size (1 for -1)
so a budget in bits per weight means what pipeline/eval/bits.py measures on the written checkpoint (GPTQ w4g64 on
SmolLM2: 4.36, not 4.5 or 4.0). With format = "compressed-tensors" (the same integers, pack-quantized) a linear
stores no g_idx, and zero points only on an asymmetric grid:
    weight_packed  in * bits / 8 * out bytes   weight_scale  groups * out * 2   weight_shape  16 (two int64)
    weight_zero_point  groups * out * bits / 8 (asymmetric only)
(w4g64 symmetric: 4.25 bits per weight). Skipped modules (`modules_to_skip`) are outside the budget and outside the mix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.base.problem import Problem
from pipeline.quant.formats.ct import CT, CT_BITS
from pipeline.quant.shapes import Arch, is_skipped, module_kinds

Granularity = Literal["block", "fused", "module"]
# the linears an engine runs as one matmul (vLLM's packed_modules_mapping: qkv_proj, gate_up_proj), which must share
# a setting there; granularity 'fused' makes each such set one unit and every other linear its own
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}
MB = 10**6


class MixBudget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bits_per_weight: float | None = Field(
        None, gt=0, description="average bits per weight of the quantized decoder linears as stored (scales, zero "
                                "points and g_idx included: GPTQ w4g64 is 4.36 on SmolLM2)")
    size_mb: float | None = Field(
        None, gt=0, description="the quantized decoder linears' bytes on disk, in MB (10^6 bytes); embeddings, norms "
                                "and skipped modules are outside it")

    @model_validator(mode="after")
    def _one(self):
        if (self.bits_per_weight is None) == (self.size_mb is None):
            raise ValueError("give exactly one of bits_per_weight or size_mb")
        return self


class MixConfig(BaseModel):
    """`[quantize.mix]`: choose bits and group size per allocation unit so that the predicted quality cost (the
    measured sensitivity, summed) is smallest within the budget (an exact dynamic program,
    pipeline/quant/mix/alloc.py)."""

    model_config = ConfigDict(extra="forbid")

    budget: MixBudget = Field(description="the budget: { bits_per_weight = 4.0 } or { size_mb = 40 }")
    bits: list[int] = Field([2, 3, 4, 8], min_length=1, description="candidate bits")
    group_sizes: list[int] | None = Field(
        None, min_length=1, description="candidate group sizes; None = the variant's group_size only")
    granularity: Granularity = Field(
        "block", description="allocation unit: 'block' (one decoder layer's attention, or its MLP: two units a "
                             "layer), 'fused' (what engines run as one matmul shares a setting: q/k/v, gate/up; "
                             "o_proj and down_proj alone: four units a Llama layer, and what vLLM needs of a mix) "
                             "or 'module' (every linear; ~3.5x the sensitivity probe's forward passes)")
    estimator: Literal["kl", "kl-scaled", "hessian"] = Field(
        "kl", description="the sensitivity the allocation minimises: 'kl' (output KL on the calibration rows with "
                          "that unit alone quantized, RTN weights; one probe per unit and candidate), 'kl-scaled' "
                          "(that KL probed at each candidate bits with the variant's group_size only, the other "
                          "group sizes scaled by the unit's Hessian error ratio at the same bits: units x bits "
                          "probes instead of units x candidates) or 'hessian' (sum of ||(W-Q)X||^2 over the "
                          "unit's linears, X the calibration activations); KL and Hessian are both recorded")
    probe_rows: int = Field(8, ge=1, description="calibration rows the KL probe runs (each unit x candidate is one "
                                                  "forward pass over them, from the unit's layer on)")
    probe_weights: Literal["rtn", "gptq"] = Field(
        "rtn", description="the quantized weights the estimators measure: 'rtn' (round to nearest on GPTQ's min/max "
                           "grid: no solve) or 'gptq' (GPTQModel's GPTQ solve of each linear at each candidate on "
                           "that linear's calibration Hessian X^T X, with the variant's damp, mse and act-group "
                           "settings: what the checkpoint will hold, before the error feedback from earlier "
                           "layers; about 0.3 s a linear and candidate on CPU)")
    hessian_rows: int = Field(16, ge=1, description="calibration rows whose activations make the Hessian estimator's "
                                                    "X^T X (one forward pass)")

    def probe_group_size(self, variant_group_size: int) -> int | None:
        """The group size the KL probe runs at for 'kl-scaled' (the variant's, else the first candidate group size);
        None: every candidate is probed."""
        if self.estimator != "kl-scaled":
            return None
        gs = [g for _, g in self.candidates(variant_group_size)]
        return variant_group_size if variant_group_size in gs else gs[0]

    def candidates(self, variant_group_size: int) -> list[tuple[int, int]]:
        """(bits, group_size) pairs, in a fixed order."""
        gs = self.group_sizes or [variant_group_size]
        return [(b, g) for b in sorted(set(self.bits)) for g in sorted(set(gs), key=lambda g: (g == -1, g))]


@dataclass(frozen=True)
class MixUnit:
    """One allocation unit: a name ('layers.3.mlp'), and its linears (full name, in, out)."""

    name: str
    modules: tuple[tuple[str, int, int], ...]

    @property
    def weights(self) -> int:
        return sum(i * o for _, i, o in self.modules)

    def pattern(self, layers: str) -> str:
        """GPTQModel `dynamic` regex matching exactly this unit's linears (by name suffix after the layers path), and
        the fused linears whose every shard is in the unit, by the name vLLM gives them (its GPTQ loader looks the
        override up under 'layers.0.mlp.gate_up_proj', not the shards' names)."""
        tail = layers.rpartition(".")[2]
        suffixes = [n[len(layers) + 1:] for n, _, _ in self.modules]
        have = set(suffixes)
        for fused in dict.fromkeys(FUSED.values()):
            shards = [s for s, f in FUSED.items() if f == fused]
            for sfx in list(suffixes):
                head, _, leaf = sfx.rpartition(".")
                if leaf == shards[0] and all(f"{head}.{s}" in have for s in shards):
                    suffixes.append(f"{head}.{fused}")
        names = "|".join(re.escape(n) for n in suffixes)
        return rf"^(?:.*\.)?{re.escape(tail)}\.(?:{names})$"


def unit_kind(kind: str, granularity: Granularity) -> str:
    """The unit a linear ('self_attn.q_proj' within its layer) belongs to: 'self_attn', 'self_attn.qkv_proj' or
    itself."""
    if granularity == "module":
        return kind
    block, _, leaf = kind.rpartition(".")
    if granularity == "fused":
        return f"{block}.{FUSED.get(leaf, leaf)}" if block else FUSED.get(leaf, leaf)
    return kind.split(".", 1)[0]


def mix_units(arch: Arch, modules_to_skip: list[str], granularity: Granularity) -> list[MixUnit]:
    """The allocation units of a model's decoder linears (lm_head and skipped modules are not in the mix)."""
    prefix, tail = arch.layers + ".", arch.layers.rpartition(".")[2]
    groups: dict[str, list[tuple[str, int, int]]] = {}
    for full, kind in module_kinds(arch):
        if not full.startswith(prefix) or is_skipped(full, modules_to_skip):
            continue
        layer = full[len(prefix):].split(".", 1)[0]
        key = f"{tail}.{layer}.{unit_kind(kind, granularity)}"
        groups.setdefault(key, []).append((full, arch.linear_in_features[kind], arch.linear_out_features[kind]))
    return [MixUnit(k, tuple(v)) for k, v in groups.items()]


@dataclass(frozen=True)
class Layout:
    """How the checkpoint stores a quantized linear (the module docstring): its format, and for compressed-tensors
    whether zero points are stored (an asymmetric grid)."""

    format: str = "gptq"
    sym: bool = True

    @classmethod
    def of(cls, variant) -> Layout:
        return cls(getattr(variant, "format", "gptq"), bool(getattr(variant, "sym", True)))

    def module_bytes(self, in_f: int, out_f: int, bits: int, group_size: int) -> int:
        groups = in_f // group_size if group_size > 0 else 1
        values, scales = in_f * out_f * bits // 8, groups * out_f * 2
        if self.format == "compressed-tensors":
            return values + scales + 16 + (0 if self.sym else groups * out_f * bits // 8)
        return values + groups * out_f * bits // 8 + scales + in_f * 4


GPTQ_LAYOUT = Layout()


def module_bytes(in_f: int, out_f: int, bits: int, group_size: int) -> int:
    """Bytes of one linear in the GPTQ format (see the module docstring)."""
    return GPTQ_LAYOUT.module_bytes(in_f, out_f, bits, group_size)


def shape_problem(in_f: int, out_f: int, bits: int, group_size: int) -> str | None:
    """Why a linear of this shape cannot be stored at (bits, group_size) in the GPTQ format, or None."""
    if group_size > 0 and in_f % group_size:
        return f"group_size {group_size} does not divide its {in_f} in-features"
    if in_f * bits % 32:
        return (f"{bits}-bit qweight packs {32 // bits if 32 % bits == 0 else '32/3'} values per int32 word along its "
                f"{in_f} in-features")
    if out_f * bits % 32:
        return (f"{bits}-bit qzeros pack along its {out_f} out-features, which {bits} x {out_f} bits do not fill in "
                "int32 words")
    return None


def unit_cost(unit: MixUnit, bits: int, group_size: int, layout: Layout = GPTQ_LAYOUT) -> int:
    return sum(layout.module_bytes(i, o, bits, group_size) for _, i, o in unit.modules)


def budget_bytes(budget: MixBudget, units: list[MixUnit]) -> int:
    """The budget in bytes of the mixed linears."""
    if budget.size_mb is not None:
        return int(budget.size_mb * MB)
    assert budget.bits_per_weight is not None
    return int(budget.bits_per_weight * sum(u.weights for u in units) / 8)


def bits_per_weight(nbytes: int, units: list[MixUnit]) -> float:
    return 8 * nbytes / sum(u.weights for u in units)


def achievable(units: list[MixUnit], cands: list[tuple[int, int]], layout: Layout = GPTQ_LAYOUT
               ) -> tuple[int, int]:
    """(cheapest, dearest) total bytes over the units."""
    costs = [[unit_cost(u, b, g, layout) for b, g in cands] for u in units]
    return sum(min(c) for c in costs), sum(max(c) for c in costs)


def nothing_to_mix() -> Problem:
    return Problem("mix", "mix-nothing-to-mix",
                   "[quantize.mix]: no decoder linear is left to mix (every one is in modules_to_skip)")


def budget_out_of_range(budget: str, what: str, lo: int, hi: int, units: list[MixUnit]) -> Problem:
    """A bytes budget outside [lo, hi], the range the candidates can spend, stated in bits per weight and MB."""
    return Problem("mix.budget", "mix-budget-out-of-range",
                   f"mix budget {budget} is outside what the {what} can spend on this model's mixed linears: "
                   f"{bits_per_weight(lo, units):.3f} to {bits_per_weight(hi, units):.3f} bits per weight "
                   f"({lo / MB:.2f} to {hi / MB:.2f} MB)")


def check_mix(variant, arch: Arch, method_bits: tuple[int, ...], method_group_sizes: tuple[int, ...]) -> list[Problem]:
    """What makes a variant's [quantize.mix] impossible on this model ([] = fine): candidates the format does not take,
    candidates some linears' shapes cannot take (named), a budget outside the achievable range (stated)."""
    mix: MixConfig = variant.mix
    problems: list[Problem] = []
    fmt_name, fmt_bits = (("compressed-tensors pack-quantized", CT_BITS) if variant.format == CT
                          else ("GPTQ", method_bits))
    bad_bits = [b for b in mix.bits if b not in fmt_bits]
    if bad_bits:
        problems.append(Problem("mix.bits", "mix-bits-unsupported",
                                f"mix.bits {bad_bits} not supported (the {fmt_name} format takes "
                                f"{', '.join(map(str, fmt_bits))})"))
    cands = mix.candidates(variant.group_size)
    bad_g = sorted({g for _, g in cands if g not in method_group_sizes})
    if bad_g:
        problems.append(Problem("mix.group_sizes", "mix-group-size-unsupported",
                                f"mix.group_sizes {bad_g} not supported (supported: "
                                f"{', '.join(map(str, method_group_sizes))})"))
    if problems or not arch.shapes_known:
        return problems
    units = mix_units(arch, variant.modules_to_skip, mix.granularity)
    if not units:
        return [nothing_to_mix()]
    kinds: dict[str, tuple[int, int]] = {}
    for u in units:
        for full, i, o in u.modules:
            kinds.setdefault(full[len(arch.layers) + 1:].split(".", 1)[1], (i, o))
    for b, g in cands:
        why = {k: shape_problem(i, o, b, g) for k, (i, o) in kinds.items()}
        bad = {k: w for k, w in why.items() if w}
        if bad:
            problems.append(Problem("mix", "mix-candidate-does-not-fit",
                                    f"mix candidate {b}-bit group_size {g} cannot take "
                                    + "; ".join(f"{k} ({kinds[k][0]}x{kinds[k][1]}): {w}" for k, w in bad.items())
                                    + ": drop it from mix.bits / mix.group_sizes"))
    if problems:
        return problems
    lo, hi = achievable(units, cands, Layout.of(variant))
    want = budget_bytes(mix.budget, units)
    if not lo <= want <= hi:
        problems.append(budget_out_of_range(_budget_text(mix.budget), "candidates", lo, hi, units))
    return problems


def _budget_text(b: MixBudget) -> str:
    return f"bits_per_weight = {b.bits_per_weight}" if b.bits_per_weight is not None else f"size_mb = {b.size_mb}"


def dynamic_overrides(units: list[MixUnit], choice: list[tuple[int, int]], layers: str,
                      base: tuple[int, int]) -> dict[str, dict]:
    """GPTQModel's QuantizeConfig(dynamic=...) entries ("+:" positive match) for the units whose setting differs
    from the base config's (bits, group_size). A per-row scale (group_size -1) turns GPTQModel's act_group_aware off
    for that unit: it orders columns within groups and GPTQModel refuses it without groups."""
    out = {}
    for u, (b, g) in zip(units, choice, strict=True):
        if (b, g) != base:
            out[f"+:{u.pattern(layers)}"] = {"bits": b, "group_size": g,
                                             **({"act_group_aware": False} if g == -1 else {})}
    return out
