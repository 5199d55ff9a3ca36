"""GPTQ (Frantar et al. 2022) through GPTQModel: the recipe variant and what it takes; the work is
pipeline/quant/work/gptq.py (GPTQModel's driver, shared with RTN and AWQ, is pipeline/quant/gptqmodel_driver.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.base.problem import Problem
from pipeline.quant.formats.gptq import GPTQFormatMethod, GPTQModelDriven
from pipeline.quant.method import QuantMemory, QuantMethod
from pipeline.quant.mix.config import MixConfig, check_mix
from pipeline.quant.mix.runtimes import mix_runtimes
from pipeline.quant.shapes import Arch
from pipeline.quant.variant import Calibrated, GPTQFormat


class GPTQVariant(Calibrated, GPTQFormat):
    method: Literal["gptq"]
    desc_act: bool = Field(False, description="act-order: quantize columns by decreasing Hessian diagonal")
    act_group_aware: bool | None = Field(
        None, description="GPTQModel's group-aware reordering (GAR): act-order inside each group, g_idx stays "
                          "monotone (fast kernels). None = on where it applies (group_size > 0, desc_act off)")
    damp_percent: float = Field(0.05, gt=0, lt=1, description="Hessian dampening, fraction of its mean diagonal")
    true_sequential: bool = Field(True, description="quantize attention then MLP inside a layer, each on the "
                                                    "inputs produced by the already-quantized modules")
    mse: float = Field(2.4, ge=0, description="scale search: shrink each group's min/max range to minimise the "
                                              "|error|^mse of its weights (GPTQ paper's norm 2.4); 0 = plain "
                                              "min/max (GPTQModel's default). ~2x quantization time")
    gptaq_alpha: float = Field(0.0, ge=0, le=1, description="GPTAQ: also fit each layer to the full-precision "
                                                           "model's inputs (asymmetric calibration), weight of that "
                                                           "correction term (GPTAQ's recommended 0.25); 0 = off")
    foem_beta: float = Field(0.0, ge=0, le=1, description="FOEM: first-order error compensation on top of GPTQ "
                                                         "(or GPTAQ when gptaq_alpha > 0), 0.1-0.25 typical; 0 = off")
    mix: MixConfig | None = Field(
        None, description="mixed precision to a budget: bits and group size chosen per decoder block (or linear) from "
                          "measured sensitivity; bits/group_size above are then GPTQModel's base config only "
                          "(pipeline/quant/mix/config.py)")


class GPTQMethod(GPTQModelDriven, GPTQFormatMethod, QuantMethod):
    name = "gptq"
    variant = GPTQVariant
    hub_tag_names = ("gptq",)
    needs_calibration = True
    note = "GPTQ (Frantar et al. 2022) through GPTQModel"
    offload = True
    memory = QuantMemory.LAYERWISE
    work = "pipeline.quant.work.gptq"

    def check(self, variant, arch: Arch, device: str) -> list[Problem]:
        problems = super().check(variant, arch, device)  # the checkpoint format's rules (formats/gptq.py)
        if variant.act_group_aware:
            if variant.desc_act:
                problems.append(Problem("act_group_aware", "act-group-aware-with-desc-act",
                                        "desc_act = true and act_group_aware = true exclude each other: drop "
                                        "act_group_aware"))
            if variant.group_size <= 0:
                problems.append(Problem("act_group_aware", "act-group-aware-needs-groups",
                                        f"act_group_aware reorders columns inside groups: it needs group_size > 0, "
                                        f"not {variant.group_size}; drop act_group_aware"))
        if variant.mix is not None:
            problems += [p.within("", "mix: ") for p in check_mix(variant, arch, self.bits, self.group_sizes)]
        return problems

    def runtimes(self, variant, arch: Arch) -> list[dict]:
        return super().runtimes(variant, arch) if variant.mix is None else mix_runtimes(variant)

    def bits_per_weight(self, variant) -> float:
        budget = variant.mix.budget.bits_per_weight if variant.mix is not None else None
        return budget if budget is not None else super().bits_per_weight(variant)


def act_group_aware(variant) -> bool:
    """The recipe's None: on where it applies (GPTQModel's default, except that it fails on group_size -1)."""
    if variant.act_group_aware is not None:
        return variant.act_group_aware
    return variant.group_size > 0 and not variant.desc_act


METHODS = (GPTQMethod(),)
