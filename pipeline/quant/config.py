"""`[[quantize]]` variants: one pydantic model per method, a discriminated union on `method`.

Torch-free. These models check types and ranges only; what a method can actually do
(bits, group sizes, devices, the model's shapes) is declared in capabilities.py and checked
by `check_variant` before any weight is loaded. Defaults here are the recipe's defaults
(the best settings measured, see benchmarks/README_quant.md); nothing else repeats them.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from pipeline.quant.capabilities import METHODS
from pipeline.quant.caps_gguf import GGUF_TYPES
from pipeline.quant.caps_torchao import TORCHAO_SCHEMES

Dtype = Literal["float32", "bfloat16", "float16"]

SKIP_HELP = ("modules left unquantized, each a module name or a dotted suffix of one "
             "('lm_head', 'mlp.down_proj', 'model.layers.0.self_attn.q_proj')")


class _Variant(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="unique; the folder artifacts/<run>/quantize/<name>/")
    modules_to_skip: list[str] = Field(["lm_head"], description=SKIP_HELP)


class _Calibrated(BaseModel):
    """Shared by the methods that read the calibration rows."""

    calibration_rows: Optional[int] = Field(
        None, ge=1, description="use only the first N of the run's calibration rows (random windows, so a random "
                                "subset; at most calibration.num_samples); None = all. For a method whose time "
                                "grows with the calibration tokens, e.g. AWQ's scale search on a CPU")


class _GPTQFormat(_Variant):
    """Shared by the methods that write the GPTQ checkpoint format (qweight/qzeros/scales/g_idx)."""

    bits: int = Field(4, ge=1, le=16, description="2, 3, 4 or 8 (see capabilities)")
    group_size: int = Field(64, description="-1 = one scale per output channel; else columns per scale group")
    sym: bool = Field(True, description="symmetric (zero point fixed at the middle of the grid)")
    dtype: Optional[Dtype] = Field(None, description="dtype the model runs in while quantizing; "
                                                     "None = the loaded checkpoint's dtype")


class GPTQVariant(_Calibrated, _GPTQFormat):
    method: Literal["gptq"]
    desc_act: bool = Field(False, description="act-order: quantize columns by decreasing Hessian diagonal")
    act_group_aware: Optional[bool] = Field(
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


class RTNVariant(_GPTQFormat):
    """Round-to-nearest with min/max scales, no calibration: the baseline that shows what GPTQ buys."""

    method: Literal["rtn"]


class AWQVariant(_Calibrated, _Variant):
    """AWQ through GPTQModel: per-input-channel scales searched on the calibration activations, folded into the
    previous op, then round-to-nearest; GEMM checkpoint layout (limits in caps_awq)."""

    method: Literal["awq"]
    bits: int = Field(4, description="4 (the AWQ GEMM layout packs 4-bit values)")
    group_size: int = Field(64, description="-1 = one scale per output channel; else columns per scale group")
    zero_point: bool = Field(True, description="asymmetric grid with a zero point per group (AWQ's default)")
    dtype: Optional[Literal["bfloat16", "float16"]] = Field(
        None, description="dtype the model runs in while quantizing; None = the checkpoint's if 16-bit, else "
                          "bfloat16 (GPTQModel's AWQ modules take no float32)")


class AutoRoundVariant(_Calibrated, _GPTQFormat):
    """AutoRound through auto-round: per block, the rounding offsets and the min/max clipping are tuned by signed
    gradient descent to reproduce the block's full-precision outputs on the calibration text; GPTQ format."""

    method: Literal["autoround"]
    iters: int = Field(200, ge=0, description="tuning steps per decoder block (auto-round's default 200; 0 = its "
                                              "optimized RTN)")
    lr: Optional[float] = Field(None, gt=0, description="learning rate of the signed gradient steps; None = 1/iters")
    batch_size: int = Field(8, ge=1, description="calibration rows per tuning step (at most num_samples)")
    torch_compile: bool = Field(True, description="torch.compile auto-round's tuning step (its own option, on by "
                                                  "default on Linux): on a CPU it needs a C++ compiler (g++, or "
                                                  "$CXX); a SmolLM2 block of 200 one-row steps: 11.5 s against 32 s "
                                                  "eager on 2 cores. Compiled kernels round differently, so the "
                                                  "bytes differ from false")


class BnbInt8Variant(_Variant):
    method: Literal["bnb-int8"]
    threshold: float = Field(6.0, ge=0, description="LLM.int8() outlier threshold: activation columns above it "
                                                    "run in 16-bit")


class _Bnb4bit(_Variant):
    double_quant: bool = Field(True, description="quantize the per-block absmax scales too (~0.4 bit/weight saved)")
    compute_dtype: Dtype = Field("float32", description="dtype of the matmul after dequantization")
    quant_storage: Literal["uint8", "float16", "bfloat16", "float32"] = Field(
        "uint8", description="container dtype of the packed 4-bit weights (FSDP needs the model's dtype)")


class BnbNF4Variant(_Bnb4bit):
    method: Literal["bnb-nf4"]


class BnbFP4Variant(_Bnb4bit):
    method: Literal["bnb-fp4"]


class TorchAoVariant(_Variant):
    """PyTorch-native quantization through torchao (transformers' TorchAoConfig), no calibration; what each
    scheme takes and where it runs is in caps_torchao.TORCHAO_SCHEMES."""

    method: Literal["torchao"]
    scheme: Literal[tuple(TORCHAO_SCHEMES)] = Field(  # type: ignore[valid-type]
        description="int8-weight-only (int8 weights, 16/32-bit matmul), int8-dynamic (int8 weights and per-token "
                    "int8 activations, integer matmul) or int4-weight-only (CUDA only)")
    group_size: int = Field(-1, description="-1 = one scale per output channel (the int8 schemes); "
                                            "int4-weight-only takes 32, 64, 128 or 256")
    dtype: Optional[Dtype] = Field(None, description="dtype the model is loaded and run in; None = the loaded "
                                                     "checkpoint's (int4-weight-only needs bfloat16)")
    act_mapping: Literal["asymmetric", "symmetric"] = Field(
        "asymmetric", description="int8-dynamic only: each token's activation grid, with a zero point (asymmetric) "
                                  "or centred on 0; on SmolLM2 (recipes/methods.toml) asymmetric measured a perplexity "
                                  "ratio of 1.018 vs 1.039 symmetric")


class GGUFVariant(_Variant):
    """A GGUF file for llama.cpp, Ollama and LM Studio, converted from the baseline (pipeline/quant/gguf_export.py);
    what each type needs is in caps_gguf.gguf_problems."""

    method: Literal["gguf"]
    type: Literal[GGUF_TYPES] = Field(  # type: ignore[valid-type]
        "Q8_0", description="llama.cpp file type: Q8_0 (8-bit, blocks of 32) or F16, written here; K-quants "
                            "(Q4_K_M, ...) are made by llama.cpp's quantizer (extra gguf-kquants)")
    modules_to_skip: list[str] = Field([], description=SKIP_HELP + "; written in the checkpoint's float type "
                                       "('lm_head' of a tied model keeps the embedding unquantized)")
    allow_fallback: bool = Field(False, description="accept tensors whose rows do not fit the type's blocks in a "
                                                    "fallback type (F16 for Q8_0, llama.cpp's for K-quants); off: "
                                                    "compress check refuses such a model")


def _known_method(value: object) -> object:
    """Turn pydantic's tag error into the registry's 'Unknown quantization method ... Did you mean' line."""
    if isinstance(value, dict) and "method" in value and value["method"] not in METHODS:
        raise ValueError(METHODS.unknown_message(str(value["method"])))
    return value


QuantVariant = Annotated[
    Union[GPTQVariant, RTNVariant, AWQVariant, AutoRoundVariant, BnbInt8Variant, BnbNF4Variant, BnbFP4Variant,
          TorchAoVariant, GGUFVariant],
    Field(discriminator="method"),
    BeforeValidator(_known_method),
]
