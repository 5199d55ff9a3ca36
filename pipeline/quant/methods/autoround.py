"""AutoRound (Cheng et al. 2023) through auto-round, exported in the GPTQ format (auto-round's `auto_gptq` export).

auto-round tunes, decoder block by decoder block, each weight's rounding offset (in [-0.5, 0.5]) and each group's
min/max clipping by signed gradient descent so that the quantized block reproduces the full-precision block's
outputs on the calibration text (the shared calibration ids, as they are: no dataset of its own). The export is
a GPTQ checkpoint (qweight/qzeros/scales/g_idx, `quant_method: gptq`), so transformers, GPTQModel and vLLM load it
with their GPTQ kernels, with the same kernel rules. auto-round writes into a subfolder it names itself; it runs in
a scratch folder inside out_dir and save() moves the checkpoint up (the work: pipeline/quant/work/autoround.py).
"""
from __future__ import annotations

import os
import shutil
from typing import Literal

from pydantic import Field

from pipeline.base.problem import Problem
from pipeline.quant.formats.gptq import GPTQFormatMethod, lm_head_rule
from pipeline.quant.method import QuantMethod, missing_package
from pipeline.quant.mix.config import MixConfig, check_mix
from pipeline.quant.shapes import Arch
from pipeline.quant.variant import Calibrated, GPTQFormat

ENGINE = "auto_round"
AUTOROUND_PIN = "auto-round==0.16.1"


class AutoRoundVariant(Calibrated, GPTQFormat):
    """AutoRound through auto-round: per block, the rounding offsets and the min/max clipping are tuned by signed
    gradient descent to reproduce the block's full-precision outputs on the calibration text; GPTQ format."""

    method: Literal["autoround"]
    iters: int = Field(200, ge=0, description="tuning steps per decoder block (auto-round's default 200; 0 = its "
                                              "optimized RTN)")
    lr: float | None = Field(None, gt=0, description="learning rate of the signed gradient steps; None = 1/iters")
    batch_size: int = Field(8, ge=1, description="calibration rows per tuning step (at most num_samples)")
    torch_compile: bool = Field(True, description="torch.compile auto-round's tuning step (its own option, on by "
                                                  "default on Linux): on a CPU it needs a C++ compiler (g++, or "
                                                  "$CXX); a SmolLM2 block of 200 one-row steps: 11.5 s against 32 s "
                                                  "eager on 2 cores. Compiled kernels round differently, so the "
                                                  "bytes differ from false")
    mix: MixConfig | None = Field(
        None, description="mixed precision to a budget, as for GPTQ (pipeline/quant/mix/config.py): bits and group "
                          "size per decoder block (or linear) from measured sensitivity (probe_weights 'rtn'), passed "
                          "to auto-round as its layer_config; the checkpoint carries them as GPTQModel `dynamic` "
                          "overrides (auto-round's own export)")


class AutoRoundMethod(GPTQFormatMethod, QuantMethod):
    name = "autoround"
    variant = AutoRoundVariant
    engine = ENGINE
    hub_tag_names = ("autoround", "gptq")  # a GPTQ-format checkpoint: found under both tags
    made = " (tuned by auto-round, exported in the GPTQ format)"
    made_by = " (tuned by auto-round)"
    dtypes = ("float32", "bfloat16", "float16")
    needs_calibration = True
    note = ("AutoRound (Cheng et al. 2023): rounding and min/max tuned by signed gradient descent per block, "
            "through auto-round; GPTQ checkpoint format")
    work = "pipeline.quant.work.autoround"
    model_type_limits = {
        "mixtral": "auto-round writes Mixtral's experts as block_sparse_moe.experts.<e>.gate_proj/up_proj/down_proj, "
                   "names neither transformers (block_sparse_moe.experts.<e>.w1/w3/w2) nor GPTQModel "
                   "(mlp.experts.<e>.gate_proj/...) loads (measured: 'Missing required quantized weights'); GPTQ and "
                   "RTN take it",
        "gpt_oss": "auto-round writes gpt_oss's experts de-interleaved (gate_proj = the fused gate_up_proj's even "
                   "columns, the gate the model computes), while GPTQModel, which reloads GPTQ-format MoE checkpoints, "
                   "reads a per-expert gate_proj/up_proj as the fused parameter's two halves (its defuser's split): "
                   "the reloaded model is not the tuned one (measured: top-1 agreement with the baseline 0.03, "
                   "against 0.75 for GPTQ); GPTQ and RTN take it",
    }

    def bits_per_weight(self, variant) -> float:
        budget = variant.mix.budget.bits_per_weight if variant.mix is not None else None
        return budget if budget is not None else super().bits_per_weight(variant)

    def check(self, variant, arch: Arch, device: str) -> list[Problem]:
        problems = missing_package(AUTOROUND_PIN, "auto_round", "autoround") + lm_head_rule(variant, "AutoRound")
        problems += super().check(variant, arch, device)  # the checkpoint format's rules (formats/gptq.py)
        if variant.bits == 8 and not variant.sym:
            problems.append(Problem("sym", "autoround-asymmetric-8-bit",
                                    "bits = 8 with sym = false: auto-round refuses to export asymmetric 8-bit in the "
                                    "GPTQ format; set sym = true"))
        if variant.mix is not None:
            problems += [p.within("", "mix: ") for p in check_mix(variant, arch, self.bits, self.group_sizes)]
            if variant.mix.probe_weights != "rtn":
                problems.append(Problem("mix.probe_weights", "autoround-mix-probe",
                                        "probe_weights = 'gptq' solves GPTQ's rounding, which AutoRound does not "
                                        "write: set probe_weights = 'rtn' (the grid AutoRound's tuning starts from)"))
        if variant.torch_compile and device == "cpu" and cpp_compiler() is None:
            problems.append(Problem("torch_compile", "autoround-no-cpp-compiler",
                                    "torch_compile = true: torch.compile on a CPU builds C++ kernels, and no C++ "
                                    f"compiler was found ({os.environ.get('CXX') or 'g++'} not on PATH): install one "
                                    "(apt install g++) or set torch_compile = false (about 2.8x slower on a CPU)"))
        return problems


def cpp_compiler() -> str | None:
    """The compiler torch inductor would call on a CPU ($CXX, else g++), or None if it is not on PATH."""
    return shutil.which(os.environ.get("CXX") or "g++")


METHODS = (AutoRoundMethod(),)
