"""bitsandbytes int8 (LLM.int8(), Dettmers et al. 2022) and 4-bit (NF4/FP4) through transformers'
BitsAndBytesConfig: three methods of one class.

bnb quantizes while the weights load; save_pretrained serializes the packed weights and quant states to safetensors
so the checkpoint reloads from disk.

bitsandbytes 0.50 on CPUs with AVX512-BF16 repacks 4-bit weights for its CPU kernel on the first forward, and
save_pretrained after that repacking writes different (worse) weights than the freshly quantized ones. So we save
before any forward, and nothing here runs the model (the work: pipeline/quant/work/bnb.py).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.quant.method import LLAMA_CPP_ROW, QuantMemory, QuantMethod
from pipeline.quant.shapes import Arch
from pipeline.quant.variant import Dtype, VariantBase

ENGINE = "bitsandbytes"


class BnbInt8Variant(VariantBase):
    method: Literal["bnb-int8"]
    threshold: float = Field(6.0, ge=0, description="LLM.int8() outlier threshold: activation columns above it "
                                                    "run in 16-bit")


class _Bnb4bit(VariantBase):
    double_quant: bool = Field(True, description="quantize the per-block absmax scales too (~0.4 bit/weight saved)")
    compute_dtype: Dtype = Field("float32", description="dtype of the matmul after dequantization")
    quant_storage: Literal["uint8", "float16", "bfloat16", "float32"] = Field(
        "uint8", description="container dtype of the packed 4-bit weights (FSDP needs the model's dtype)")


class BnbNF4Variant(_Bnb4bit):
    method: Literal["bnb-nf4"]


class BnbFP4Variant(_Bnb4bit):
    method: Literal["bnb-fp4"]


# kind -> (variant model, bits, note, bits per weight on disk with scales: int8 8.0, nf4/fp4 4.5 (a 32-bit absmax
# per block of 64), the transformers kernel)
KINDS = {
    "int8": (BnbInt8Variant, 8, "LLM.int8() (Dettmers et al. 2022), quantized while loading", 8.0,
             "Linear8bitLt (LLM.int8)"),
    "nf4": (BnbNF4Variant, 4, "4-bit NormalFloat, blocks of 64 (QLoRA)", 4.5, "Linear4bit nf4"),
    "fp4": (BnbFP4Variant, 4, "4-bit float (e2m1), blocks of 64", 4.5, "Linear4bit fp4"),
}


class BnbMethod(QuantMethod):
    engine = ENGINE
    arch_limit_reasons = {"moe": "bitsandbytes 0.50 replaces nn.Linear modules only, so the routed experts would stay "
                                 "16-bit (measured on mixtral: int8 and nf4 both left experts.gate_up_proj in float)"}
    checkpoint_format = "bitsandbytes"
    memory = QuantMemory.WHILE_LOADING
    load_module = "bitsandbytes"
    work = "pipeline.quant.work.bnb"

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.name = f"bnb-{kind}"
        self.variant, bits, self.note, self._disk_bits, self._kernel = KINDS[kind]
        self.bits = (bits,)

    def runtimes(self, variant, arch: Arch) -> list[dict]:
        k = self._kernel
        return [
            {"runtime": "transformers (CPU)", "kernel": f"bitsandbytes {k}", "note": "measured here"},
            {"runtime": "transformers (CUDA)", "kernel": f"bitsandbytes {k}", "note": ""},
            {"runtime": "GPTQModel", "kernel": "none", "note": "GPTQModel does not load bitsandbytes checkpoints"},
            {"runtime": "vLLM (CUDA)", "kernel": "bitsandbytes", "note": "pre-quantized bnb checkpoints (int8, nf4, "
                                                                        "fp4); slower than GPTQ Marlin"},
            dict(LLAMA_CPP_ROW),
        ]

    def bits_per_weight(self, variant) -> float:
        return self._disk_bits

    def hub_tags(self, params: dict) -> list[str]:
        return ["bitsandbytes", "8-bit" if self.kind == "int8" else "4-bit", self.kind]

    def card_usage(self, repo: str, params: dict, quantize: dict) -> list[str]:
        return ["The checkpoint is pre-quantized with bitsandbytes (`quantization_config` in config.json): "
                "`pip install bitsandbytes` and load as above; no `BitsAndBytesConfig` is needed. "
                "LLM.int8() picks outlier columns per batch, so outputs can differ slightly with batch composition.",
                ""]


METHODS = (BnbMethod("int8"), BnbMethod("nf4"), BnbMethod("fp4"))
