"""GGUF files for llama.cpp, Ollama and LM Studio, converted from the run's baseline: the types written here and by
llama.cpp's quantizer, the architectures converted, `compress check`'s rules and the runtimes; the work is
pipeline/quant/work/gguf.py. Two converters: for llama and qwen2, our port of llama.cpp's convert_hf_to_gguf.py
through its `gguf` package (pipeline/quant/formats/gguf_export.py: [quantize.mix], modules_to_skip, Q4_0..Q5_1 without
llama.cpp); for every other architecture, llama.cpp's own converter, pinned (pipeline/quant/formats/gguf_convert.py)."""
from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field

from pipeline.base.env import LLAMA_CPP_INSTALL, llama_cpp_installed
from pipeline.base.problem import Problem
from pipeline.quant.formats import gguf_convert
from pipeline.quant.method import QuantMethod
from pipeline.quant.mix.gguf import GGUFMix, check_gguf_mix
from pipeline.quant.shapes import Arch, is_skipped, quantized_linears
from pipeline.quant.variant import SKIP_HELP, VariantBase

# converted by our port (pipeline/quant/formats/gguf_export.py): config.json model_type -> whether llama.cpp permutes
# the Q/K rows (its LlamaModel does, Qwen2Model does not); the llama.cpp architecture has the same name. transformers'
# GGUF loader reads both back. Every other model_type goes through llama.cpp's own converter (gguf_convert).
GGUF_ARCHS = {"llama": True, "qwen2": False}
# transformers' GGUF loader rebuilds these model types as another one with the same weights and maths: model_type ->
# what it is read back as (llama.cpp writes Mistral as llama; without a sliding window the two are the same model)
READ_BACK_AS = {"mistral": "llama"}
# transformers 5.24's GGUF loader, measured on the matrix (docs/architectures.md): config fields it does not read from
# the file and builds at its config class's default (a model with another value comes back with other shapes), and
# architectures whose file it cannot read at all
GGUF_READ_DEFAULTS: dict[str, dict[str, int]] = {"qwen3": {"head_dim": 128},
                                                 "qwen3_moe": {"moe_intermediate_size": 768}}
GGUF_UNREADABLE = {"gpt_oss": "its GGUF config reader raises (TypeError: Object of type memmap is not JSON "
                              "serializable; measured)"}
# written here by gguf's numpy quantizer (byte-identical to llama.cpp's: tests/unit/quant/test_gguf_mix.py): type ->
# values per block
GGUF_WRITTEN_TYPES = {"F16": 1, "Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32}
# Made by llama.cpp's own quantizer (llama_model_quantize, the gguf-kquants extra), in super-blocks of QK_K.
GGUF_KQUANT_TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K")
GGUF_TYPES = (*GGUF_WRITTEN_TYPES, *GGUF_KQUANT_TYPES)
QK_K = 256
GGUF_KQUANTS_INSTALL = ("pip install -e '.[gguf-kquants]' (llama-cpp-python 0.3.36 has no wheel: it builds "
                        "llama.cpp from source, about 8 minutes on 2 cores)")
# llama.cpp's llama-quant.cpp: a tensor whose rows are not a multiple of QK_K is written in this type instead.
KQUANT_FALLBACK = "Q2_K/Q3_K -> IQ4_NL, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0"


def gguf_problems(variant, arch: Arch, device: str = "cpu") -> list[Problem]:
    """What makes a GGUF variant impossible for this model (checked by `compress check` on the recipe's source and
    again by the converter on the baseline checkpoint)."""
    mt = arch.model_type
    problems = _port_problems(variant, arch) if mt in GGUF_ARCHS else _converter_problems(variant, arch)
    kquant = variant.type in GGUF_KQUANT_TYPES
    if kquant and importlib.util.find_spec("llama_cpp") is None:
        problems.append(Problem("type", "gguf-kquants-not-installed",
                                f"type = {variant.type!r} is made by llama.cpp's quantizer (llama-cpp-python), which "
                                f"is not installed: {GGUF_KQUANTS_INSTALL}; or use type = 'Q8_0' (written without it)"))
    if kquant and variant.modules_to_skip:
        problems.append(Problem("modules_to_skip", "gguf-kquant-skip-list",
                                f"type = {variant.type!r}: llama.cpp's quantizer takes no per-module skip list here; "
                                f"leave modules_to_skip empty (it is {variant.modules_to_skip})"))
    if arch.shapes_known and not variant.allow_fallback:
        problems += _gguf_block_problems(variant, arch)
    return problems


def _port_problems(variant, arch: Arch) -> list[Problem]:
    """What our port (llama, qwen2) cannot convert."""
    mt = arch.model_type
    problems = []
    if arch.rope_type not in (None, "default"):
        problems.append(Problem("method", "gguf-rope-scaling",
                                f"rope_type {arch.rope_type!r}: RoPE scaling is not converted to GGUF here yet "
                                "(plain RoPE only)"))
    if mt == "llama" and (arch.attention_bias or arch.mlp_bias):
        problems.append(Problem("method", "gguf-llama-biases",
                                "attention_bias/mlp_bias = true: transformers' GGUF loader rebuilds a llama model "
                                "without biases, so the file could not be measured"))
    return problems


def _converter_problems(variant, arch: Arch) -> list[Problem]:
    """What llama.cpp's own converter (every model_type but the port's) cannot convert, or validate could not
    measure: the converter's classes and transformers' GGUF loader are read from their sources (gguf_convert)."""
    mt = arch.model_type
    root = gguf_convert.converter_dir()
    if root is None:
        return [Problem("method", "gguf-converter-not-set-up",
                        f"model_type {mt!r} is converted by {gguf_convert.CONVERTER}, which is not set up here: run "
                        f"{gguf_convert.SETUP_LINE}")]
    hf_arch = gguf_convert.hf_architecture(mt)
    if hf_arch is None or not gguf_convert.supported(root, hf_arch):
        why = (f"transformers has no causal-LM class for model_type {mt!r}, so no architecture to convert"
               if hf_arch is None else f"{gguf_convert.CONVERTER} has no class for {hf_arch} (model_type {mt!r})")
        return [Problem("method", "gguf-architecture-unsupported", why)]
    # a file llama.cpp itself cannot load is refused first; validate measures a file transformers' GGUF loader cannot
    # rebuild in llama.cpp itself, when it is installed
    problems = _llama_cpp_problems(arch) or (
        [] if llama_cpp_installed() else _transformers_cannot_rebuild(root, hf_arch, arch))
    if variant.type not in gguf_convert.OUTTYPES and variant.type not in GGUF_KQUANT_TYPES \
            and importlib.util.find_spec("llama_cpp") is None:
        problems.append(Problem("type", "gguf-type-needs-quantizer",
                                f"type = {variant.type!r} on {hf_arch}: {gguf_convert.CONVERTER} writes only "
                                f"{'/'.join(t for t in gguf_convert.OUTTYPES if t in GGUF_TYPES)} itself; "
                                f"{variant.type} is made from its F16 file by llama.cpp's quantizer: "
                                f"{GGUF_KQUANTS_INSTALL}"))
    if variant.modules_to_skip:
        problems.append(Problem("modules_to_skip", "gguf-converter-skip-list",
                                f"{gguf_convert.CONVERTER} takes no per-module skip list (model_type {mt!r}); leave "
                                f"modules_to_skip empty (it is {variant.modules_to_skip})"))
    if variant.mix is not None:
        problems.append(Problem("mix", "gguf-mix-port-only",
                                f"[quantize.mix] writes per-tensor types through our port, which converts model_type "
                                f"{' or '.join(GGUF_ARCHS)} only; {mt!r} goes through {gguf_convert.CONVERTER}"))
    return problems


# llama.cpp (llama-cpp-python 0.3.36) builds some architectures with shapes their transformers config may change:
# model_type -> (config field, the field it must equal, why), measured on the matrix's models
LLAMA_CPP_SAME = {"olmoe": ("num_key_value_heads", "num_attention_heads",
                            "llama.cpp's OLMoE normalises the keys over the whole attention width (blk.N.attn_k_norm "
                            "of hidden_size), so it does not load a model with grouped-query attention (measured: "
                            "check_tensor_dims refuses attn_k_norm)")}


def _llama_cpp_problems(arch: Arch) -> list[Problem]:
    """What makes the converted file one llama.cpp itself cannot load (LLAMA_CPP_SAME)."""
    config = arch.architecture.config if arch.architecture is not None else {}
    field, other, why = LLAMA_CPP_SAME.get(arch.model_type, (None, None, ""))
    if field is None or other is None or config.get(field) in (None, config.get(other)):
        return []
    return [Problem("method", "gguf-llama-cpp-cannot-load",
                    f"{arch.model_type} with {field} = {config[field]} and {other} = {config.get(other)}: {why}; "
                    "a model whose two are equal converts")]


def _loader_problems(arch: Arch) -> list[Problem]:
    """What transformers' GGUF loader (validate's way of scoring the file) would get wrong for this model."""
    config = arch.architecture.config if arch.architecture is not None else {}
    why = GGUF_UNREADABLE.get(arch.model_type)
    unread = {k: (config[k], v) for k, v in GGUF_READ_DEFAULTS.get(arch.model_type, {}).items()
              if k in config and config[k] != v}
    if unread:
        why = "it does not read " + ", ".join(f"{k} from the file (it builds {v}, this model has {have})"
                                              for k, (have, v) in unread.items())
    if why is None:
        return []
    return [Problem("method", "gguf-loader-unfaithful",
                    f"transformers' GGUF loader cannot score {arch.model_type} here: {why}; validate scores a GGUF "
                    "file through that loader unless llama-cpp-python is installed, and then in llama.cpp itself: "
                    f"{LLAMA_CPP_INSTALL}")]


def _transformers_cannot_rebuild(root, hf_arch: str, arch: Arch) -> list[Problem]:
    """Why transformers' GGUF loader could not rebuild this model from the converter's file ([] = it can): the one
    rule behind check's refusal without llama-cpp-python and measured_elsewhere with it."""
    return _read_back_problems(root, hf_arch, arch.model_type) or _loader_problems(arch)


def _read_back_problems(root, hf_arch: str, mt: str) -> list[Problem]:
    """validate measures a GGUF file the way a transformers user loads it (from_pretrained(gguf_file=...)): a file
    transformers cannot read, or reads back as another model, could not be scored."""
    gguf_arch = gguf_convert.llama_cpp_arch(root, hf_arch)
    if gguf_arch is None:  # set at run time by the converter class: the written file is checked (work/gguf.py)
        return []
    back = gguf_convert.transformers_model_type(gguf_arch)
    if back == READ_BACK_AS.get(mt, mt):
        return []
    reads = ("cannot read" if back is None else f"rebuilds as model_type {back!r}, not {mt!r} (weights it has no "
             "place for, such as experts, are dropped)")
    return [Problem("method", "gguf-not-measurable",
                    f"{gguf_convert.CONVERTER} writes {hf_arch} as GGUF architecture {gguf_arch!r}, which "
                    f"transformers' GGUF loader {reads}; validate scores a GGUF file through that loader unless "
                    f"llama-cpp-python is installed, and then in llama.cpp itself: {LLAMA_CPP_INSTALL}")]


def _gguf_rows(variant, arch: Arch) -> dict[str, int]:
    """Row length (in-features) of every tensor the type quantizes: the quantized linears and the embedding."""
    rows = {k: i for k, (i, _) in quantized_linears(arch, variant.modules_to_skip).items()}
    tied = arch.tie_word_embeddings
    if tied:  # one tensor, token_embd, serves as both: it is skipped with lm_head
        rows.pop("lm_head", None)
    if arch.hidden_size and not (tied and is_skipped("lm_head", variant.modules_to_skip)):
        rows["embed_tokens"] = arch.hidden_size
    return rows


def _gguf_block_problems(variant, arch: Arch) -> list[Problem]:
    kquant = variant.type in GGUF_KQUANT_TYPES
    block = QK_K if kquant else GGUF_WRITTEN_TYPES[variant.type]
    bad = {k: n for k, n in _gguf_rows(variant, arch).items() if n % block}
    if not bad:
        return []
    what = ", ".join(f"{k} ({n})" for k, n in bad.items())
    instead = (f"llama.cpp writes those tensors in a fallback type ({KQUANT_FALLBACK})" if kquant
               else "the converter writes those tensors in F16")
    return [Problem("type", "gguf-rows-do-not-tile",
                    f"type = {variant.type!r} quantizes rows in blocks of {block} values, and these rows are not a "
                    f"multiple of {block}: {what}. Use type = 'Q8_0' (blocks of 32), or set allow_fallback = true to "
                    f"accept that {instead}")]


def gguf_runtimes(variant, arch: Arch) -> list[dict]:
    t = variant.type if variant.mix is None else f"per tensor ({'/'.join(variant.mix.types)}; rest {variant.type})"
    bad = {} if not arch.shapes_known else {
        k: n for k, n in _gguf_rows(variant, arch).items()
        if n % (QK_K if variant.type in GGUF_KQUANT_TYPES else GGUF_WRITTEN_TYPES[variant.type])}
    mixed = f"; rows of {', '.join(bad)} do not fit its blocks: written in a fallback type" if bad else ""
    elsewhere = GGUFMethod().measured_elsewhere(variant, arch) if arch.model_type else None
    return [
        {"runtime": "llama.cpp", "kernel": f"{t} (CPU, CUDA, Metal, Vulkan)",
         "note": f"llama-cli / llama-server -m <file>.gguf{mixed}"},
        {"runtime": "Ollama", "kernel": f"llama.cpp {t}",
         "note": "ollama run hf.co/<repo>, or a Modelfile FROM ./<file>.gguf"},
        {"runtime": "LM Studio", "kernel": f"llama.cpp {t}", "note": "loads the .gguf as it is"},
        {"runtime": "transformers", "kernel": "none: dequantizes every tensor on load (float32)",
         "note": "from_pretrained(repo, gguf_file=...); measured here this way"} if elsewhere is None else
        {"runtime": "transformers", "kernel": "none", "note": f"its GGUF loader cannot rebuild {arch.model_type}: "
                                                             "measured here in llama.cpp (llama-cpp-python)"},
        {"runtime": "vLLM (CUDA)", "kernel": "GGUF (experimental)",
         "note": "single-file GGUF: vllm serve <file>.gguf --tokenizer <repo>"},
        {"runtime": "GPTQModel", "kernel": "none", "note": "GPTQModel does not load GGUF files"},
    ]


# bits per weight on disk of each file type, block scales included (the disk plan's estimate)
GGUF_BITS = {"F16": 16.0, "Q8_0": 8.5, "Q5_1": 6.0, "Q5_0": 5.5, "Q4_1": 5.0, "Q4_0": 4.5,
             "Q6_K": 6.6, "Q5_K_M": 5.7, "Q5_K_S": 5.5, "Q4_K_M": 4.9, "Q4_K_S": 4.6,
             "Q3_K_L": 4.3, "Q3_K_M": 3.9, "Q3_K_S": 3.5, "Q2_K": 3.4}


class GGUFVariant(VariantBase):
    """A GGUF file for llama.cpp, Ollama and LM Studio, converted from the baseline
    (pipeline/quant/formats/gguf_export.py); what each type needs is in gguf_problems."""

    method: Literal["gguf"]
    type: Literal[GGUF_TYPES] = Field(  # type: ignore[valid-type]
        "Q8_0", description="llama.cpp file type: Q8_0 (8-bit, blocks of 32), Q5_1, Q5_0, Q4_1, Q4_0 (blocks of 32) "
                            "or F16, written here; K-quants (Q4_K_M, ...) are made by llama.cpp's quantizer (extra "
                            "gguf-kquants). With [quantize.mix]: the type of what is not mixed (the embedding)")
    modules_to_skip: list[str] = Field([], description=SKIP_HELP + "; written in the checkpoint's float type "
                                       "('lm_head' of a tied model keeps the embedding unquantized)")
    allow_fallback: bool = Field(False, description="accept tensors whose rows do not fit the type's blocks in a "
                                                    "fallback type (F16 for Q8_0, llama.cpp's for K-quants); off: "
                                                    "compress check refuses such a model")
    mix: GGUFMix | None = Field(
        None, description="mixed precision to a budget: a llama.cpp type per decoder linear (or block) from measured "
                          "sensitivity, within bits per weight or a decode latency measured in llama.cpp "
                          "(pipeline/quant/mix/gguf.py)")


class GGUFMethod(QuantMethod):
    name = "gguf"
    variant = GGUFVariant
    engine = "gguf"
    engine_modules = ("pipeline.quant.formats.gguf_export", "pipeline.quant.formats.gguf_convert")
    checkpoint_format = "gguf"
    hub_library = "gguf"  # Hub GGUF conventions
    bits = (2, 3, 4, 5, 6, 8, 16)
    note = "a GGUF file for llama.cpp, Ollama and LM Studio, converted from the baseline"
    work = "pipeline.quant.work.gguf"


    def check_tokenizer(self, variant, arch: Arch, files: frozenset[str], tokenizer_class: str | None
                        ) -> list[Problem]:
        """llama.cpp's converter class for some architectures (gemma2, phi3) reads a SentencePiece tokenizer.model
        unconditionally (phi3's takes a GPT2Tokenizer instead): refused when the run's tokenizer has none."""
        root = gguf_convert.converter_dir()
        hf_arch = gguf_convert.hf_architecture(arch.model_type) if arch.model_type not in GGUF_ARCHS else None
        if root is None or hf_arch is None or "tokenizer.model" in files or tokenizer_class == "GPT2Tokenizer":
            return []
        if not gguf_convert.needs_sentencepiece(root, hf_arch):
            return []
        return [Problem("method", "gguf-needs-sentencepiece",
                        f"{gguf_convert.CONVERTER}'s class for {hf_arch} reads a SentencePiece tokenizer.model, and "
                        f"this run's tokenizer has none (it has {', '.join(sorted(files)) or 'no files'}): give the "
                        "model's own tokenizer ([model] tokenizer), or another method")]
    def measured_elsewhere(self, variant, arch: Arch) -> str | None:
        """With llama-cpp-python installed, a file transformers' GGUF loader cannot rebuild is measured in llama.cpp
        (pipeline/model/llamacpp_model.py); the converter's own check on the written file decides at run time."""
        root = gguf_convert.converter_dir()
        hf_arch = gguf_convert.hf_architecture(arch.model_type)
        if arch.model_type in GGUF_ARCHS or not llama_cpp_installed() or root is None or hf_arch is None:
            return None
        found = _transformers_cannot_rebuild(root, hf_arch, arch)
        return f"in llama.cpp: transformers' GGUF loader cannot rebuild {arch.model_type}" if found else None

    def calibrates(self, variant) -> bool:
        return variant.mix is not None  # the mix's sensitivity probe reads the calibration rows

    def check(self, variant, arch: Arch, device: str) -> list[Problem]:
        problems = gguf_problems(variant, arch, device)
        if variant.mix is not None:
            installed = importlib.util.find_spec("llama_cpp") is not None
            problems += [p.within("", "mix: ") for p in check_gguf_mix(variant, arch, installed)]
        return problems

    def runtimes(self, variant, arch: Arch) -> list[dict]:
        return gguf_runtimes(variant, arch)

    def bits_per_weight(self, variant) -> float:
        if variant.mix is not None:
            b = variant.mix.budget.bits_per_weight
            return b if b is not None else max(GGUF_BITS[t] for t in variant.mix.types)
        return GGUF_BITS.get(variant.type, 8.5)

    def mix_candidate(self, params: dict) -> str | None:  # a [quantize.mix] record's candidates are file types
        return None if params.get("modules_to_skip") else str(params.get("type"))

    def hub_tags(self, params: dict) -> list[str]:  # the Hub lists GGUF repos by the `gguf` tag and the file type
        return ["gguf", "llama.cpp", str(params.get("type") or "")] if params.get("type") else ["gguf", "llama.cpp"]

    def usage_section(self, repo: str, params: dict, quantize: dict, size) -> list[str]:
        """Its file, then llama.cpp, Ollama, LM Studio and transformers (the card adds the recorded runtimes)."""
        q = quantize
        name, gguf_type = q.get("gguf_file") or "<model>.gguf", q.get("type") or params.get("type") or "?"
        hub = repo if not repo.startswith((".", "/")) else "<namespace>/<repo>"
        local = f"{repo}/{name}" if repo.startswith((".", "/")) else name
        types = ", ".join(f"{k} × {v}" for k, v in (q.get("tensor_types") or {}).items()) or "–"
        return ["## Files", "", "| file | type | size | tensors |", "|---|---|---|---|",
                f"| `{name}` | {gguf_type} | {size(q.get('file_bytes'))} | {types} |", "",
                "The tokenizer is embedded in the file (tokens, merges, special tokens, chat template); the tokenizer "
                "files beside it are for transformers.", "", "## How to use", "",
                "[llama.cpp](https://github.com/ggml-org/llama.cpp):", "", "```sh",
                f'llama-cli -m {local} -p "The history of measurement"',
                f"llama-server -m {local}   # OpenAI-compatible server",
                f"llama-cli -hf {hub}   # or straight from the Hub", "```", "",
                f"[Ollama](https://ollama.com): `ollama run hf.co/{hub}`, or a Modelfile with `FROM ./{name}`. "
                "LM Studio loads the file as it is.", "",
                "transformers dequantizes every tensor on load (`pip install gguf`); figures in this card were "
                "measured this way, in float32:", "", "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
                f'model = AutoModelForCausalLM.from_pretrained("{repo}", gguf_file="{name}")', "```", ""]


METHODS = (GGUFMethod(),)
