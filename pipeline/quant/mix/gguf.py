"""Mixed precision in a GGUF file (`[quantize.mix]` on a `method = "gguf"` variant): a llama.cpp type per allocation
unit, chosen from measured sensitivity within a budget of bits per weight, or of decode latency measured in
llama.cpp itself. Torch-free: the recipe table, what each candidate costs, and `compress check`'s rules; the work is
pipeline/quant/mix/gguf_plan.py.

The candidates are llama.cpp's block types that gguf's numpy quantizers write (byte-identical to llama.cpp's own
quantizer: tests/unit/quant/test_gguf_mix.py), one block of 32 values each:

    Q4_0  18 bytes (4.5 bits per weight)    Q4_1  20 (5.0)    Q5_0  22 (5.5)    Q5_1  24 (6.0)    Q8_0  34 (8.5)
    F16   2 bytes a value (16)

K-quants (super-blocks of 256) have no numpy quantizer and do not tile 576-wide rows; they are not candidates here.

A latency budget is in milliseconds per generated token at concurrency 1, in llama.cpp on this machine with the
threads it will be served with. Each candidate's cost is measured, not assumed: a file with every mixed linear at
that type is decoded in llama.cpp (llama-cpp-python), and a unit's latency cost at type t is its share of the
weights times the difference between t's file and the fastest candidate's. The allocation then spends
(budget - fastest file) on those differences; the serve stage measures the file it wrote.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.base.problem import Problem
from pipeline.quant.mix.config import MB, Granularity, MixUnit, budget_out_of_range, mix_units, nothing_to_mix
from pipeline.quant.shapes import Arch

# type -> (values per block, bytes per block)
GGUF_MIX_TYPES: dict[str, tuple[int, int]] = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
                                              "Q5_1": (32, 24), "Q8_0": (32, 34), "F16": (1, 2)}


class GGUFMixBudget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bits_per_weight: float | None = Field(None, gt=0, description="average bits per weight of the mixed decoder "
                                                                   "linears as stored (block scales included)")
    size_mb: float | None = Field(None, gt=0, description="the mixed decoder linears' bytes in the file, in MB")
    latency_ms_per_token: float | None = Field(
        None, gt=0, description="decode latency per generated token at concurrency 1, measured in `engine` on this "
                                "machine (the file's whole forward: embeddings, attention and head included)")
    latency_as: str | None = Field(
        None, description="a latency budget set by measurement: no slower than the file with every mixed linear at "
                          "this type (one of mix.types), measured in `engine` on this machine in the same rounds")

    @model_validator(mode="after")
    def _one(self):
        given = (self.bits_per_weight, self.size_mb, self.latency_ms_per_token, self.latency_as)
        if sum(x is not None for x in given) != 1:
            raise ValueError("give exactly one of bits_per_weight, size_mb, latency_ms_per_token or latency_as")
        return self

    def text(self) -> str:
        return ", ".join(f"{k} = {v}" for k, v in self.model_dump(exclude_none=True).items())


class GGUFMix(BaseModel):
    """`[quantize.mix]` on a gguf variant: a llama.cpp type per allocation unit (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    budget: GGUFMixBudget = Field(description="{ bits_per_weight = 6.0 }, { size_mb = 60 }, "
                                              "{ latency_ms_per_token = 15 } or { latency_as = 'Q5_0' } (the last "
                                              "two with engine = 'llama.cpp')")
    types: list[str] = Field(["Q4_0", "Q8_0"], min_length=1,
                             description=f"candidate llama.cpp types: {', '.join(GGUF_MIX_TYPES)}")
    engine: Literal["llama.cpp"] | None = Field(
        None, description="where a latency budget is measured: 'llama.cpp' (llama-cpp-python, the gguf-serve "
                          "extra); required with latency_ms_per_token")
    threads: int | None = Field(None, ge=1, description="threads of the latency measurement; None = what the "
                                                        "llama.cpp server uses by default (half the cores): serve it "
                                                        "with the same")
    latency_tokens: int = Field(48, ge=8, description="tokens generated per latency measurement")
    latency_repeats: int = Field(5, ge=1, description="rounds over the candidate files (interleaved); the median "
                                                      "round counts")
    granularity: Granularity = Field("module", description="allocation unit, as for GPTQ mixes ('module': every "
                                                           "linear; llama.cpp runs q/k/v and gate/up apart)")
    probe_rows: int = Field(3, ge=1, description="calibration rows the KL probe runs (one forward pass per unit and "
                                                 "type, from the unit's layer on)")

    @model_validator(mode="after")
    def _known(self):
        bad = [t for t in self.types if t not in GGUF_MIX_TYPES]
        if bad:
            raise ValueError(f"unknown types {bad}: candidates are {', '.join(GGUF_MIX_TYPES)}")
        if len(set(self.types)) != len(self.types):
            raise ValueError(f"types {self.types} name one type twice")
        if self.budget.latency_as is not None and self.budget.latency_as not in self.types:
            raise ValueError(f"budget latency_as = {self.budget.latency_as!r} is measured among the candidates: add "
                             f"it to types ({self.types})")
        return self

    @property
    def latency(self) -> bool:
        return self.budget.latency_ms_per_token is not None or self.budget.latency_as is not None


def type_bits(gguf_type: str) -> float:
    n, nbytes = GGUF_MIX_TYPES[gguf_type]
    return 8 * nbytes / n


def type_bytes(in_f: int, out_f: int, gguf_type: str) -> int:
    n, nbytes = GGUF_MIX_TYPES[gguf_type]
    return in_f * out_f // n * nbytes


def unit_bytes(unit: MixUnit, gguf_type: str) -> int:
    return sum(type_bytes(i, o, gguf_type) for _, i, o in unit.modules)


def budget_bytes(budget: GGUFMixBudget, units: list[MixUnit]) -> int | None:
    if budget.size_mb is not None:
        return int(budget.size_mb * MB)
    if budget.bits_per_weight is not None:
        return int(budget.bits_per_weight * sum(u.weights for u in units) / 8)
    return None


def check_gguf_mix(variant, arch: Arch, llama_cpp_installed: bool) -> list[Problem]:
    """What makes a gguf variant's [quantize.mix] impossible on this model ([] = fine)."""
    mix: GGUFMix = variant.mix
    problems = []
    if mix.latency and mix.engine is None:
        problems.append(Problem("mix.engine", "mix-latency-needs-engine",
                                "a latency budget is measured in the engine the file will be served in: set "
                                "engine = 'llama.cpp' in [quantize.mix]"))
    if (mix.latency or mix.engine) and not llama_cpp_installed:
        problems.append(Problem("mix.engine", "mix-engine-not-installed",
                                "the latency of each type is measured in llama.cpp (llama-cpp-python), which is not "
                                "installed: pip install -e '.[gguf-serve]' (it builds llama.cpp, ~8 minutes)"))
    if variant.type not in GGUF_MIX_TYPES:
        problems.append(Problem("type", "mix-gguf-base-type",
                                f"with [quantize.mix], type is the type of what is not mixed (the embedding): one "
                                f"of {', '.join(GGUF_MIX_TYPES)}, not {variant.type!r}"))
    if problems or not arch.shapes_known:
        return problems
    units = mix_units(arch, variant.modules_to_skip, mix.granularity)
    if not units:
        return [nothing_to_mix()]
    for t in mix.types:
        n = GGUF_MIX_TYPES[t][0]
        bad = sorted({f"{name.rsplit('.', 2)[-2]}.{name.rsplit('.', 1)[-1]} ({i})" for u in units
                      for name, i, _ in u.modules if i % n})
        if bad:
            problems.append(Problem("mix.types", "mix-type-does-not-tile",
                                    f"type {t} quantizes rows in blocks of {n} values; these rows are not a multiple "
                                    f"of {n}: {', '.join(bad)}: drop it from mix.types"))
    want = budget_bytes(mix.budget, units)
    if want is not None and not problems:
        lo = sum(min(unit_bytes(u, t) for t in mix.types) for u in units)
        hi = sum(max(unit_bytes(u, t) for t in mix.types) for u in units)
        if not lo <= want <= hi:
            problems.append(budget_out_of_range(mix.budget.text(), "types", lo, hi, units))
    return problems


def overrides(units: list[MixUnit], choice: list[str]) -> dict[str, str]:
    """{linear's full name: its GGUF type} for the writer (pipeline/quant/formats/gguf_export.py)."""
    return {name: t for u, t in zip(units, choice, strict=True) for name, _, _ in u.modules}
