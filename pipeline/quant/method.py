"""The one interface every quantization method and export format implements, shaped like transformers'
`HfQuantizer`: a class per method in pipeline/quant/methods/<name>.py, registered in pipeline/quant/registry.py.

A method declares, as class attributes, what it accepts (bits, group sizes, dtypes, devices, calibration) and how
it holds the model while quantizing (the memory plan), and implements: `check` (its own rules beyond those
declarations), `runtimes` (the kernel table the cards print), `bits_per_weight` (on disk), `hub_tags` and
`card_usage` (the Hub card), `before_load`/`after_load` (the reload hook: how its checkpoint is loaded back;
`format_of`/`reload_of` when a variant may ask for another export format, e.g. compressed-tensors),
and `session`/`quantize`/`save` (the work). A method file holds the declarations only, all torch-free, so
`compress check` imports every method without torch; the work lives in a module of its own,
pipeline/quant/work/<name>.py, which imports torch and the method's engine at its top and defines
`quantize(base_dir, variant, calib_ids, console, device, offload=None)`, `save(model, base_dir, out_dir, variant)`
and, when the method needs one, `session(out_dir)`. The method names it by dotted path (`work =
"pipeline.quant.work.rtn"`; `reload_work` for a reload hook's torch side), and `load_work`
(pipeline/base/registry.py) is the one place such a module is imported (tests/unit/test_import_graph.py checks
that every named path resolves and respects the layers; pipeline/base/codehash.py follows the name, so a unit's
identity covers its method's work).

A method file imports no other method's file (a test checks it): a unit's identity names the method file of the
variant it concerns (pipeline/base/codehash.py), so what two methods share lives in a module of its own
(pipeline/quant/formats/gptq.py, variant.py, shapes.py, common.py, ...).
"""
from __future__ import annotations

import contextlib
import importlib.util
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import IO, Any, ClassVar, Protocol

from pipeline.base.problem import Problem
from pipeline.base.registry import load_work
from pipeline.model.dtypes import DTYPE_NAMES
from pipeline.quant.shapes import Arch

LLAMA_CPP_ROW = {"runtime": "llama.cpp", "kernel": "none", "note": "reads GGUF only: add a method = \"gguf\" variant"}



class QuantMemory(Enum):
    """How quantizing holds the model, for the memory plan (pipeline/estimate.py)."""

    LAYERWISE = "layerwise"  # GPTQModel's layer-by-layer loop
    WHILE_LOADING = "while_loading"  # quantized tensor by tensor as transformers loads it
    WHOLE = "whole"  # loaded whole, then quantized or searched


class CheckpointLoad(Protocol):
    """The reload facts of a variant's checkpoint (QuantMethod.reload_of): its method's, or its export format's
    (pipeline/quant/formats/ct.py CompressedTensorsLoad). The memory plan (pipeline/estimate.py) reads these two."""

    @property
    def repacked_on_cpu(self) -> bool:  # its CPU kernel repacks the quantized linears at the first forward
        ...

    @property
    def decompressed_on_load(self) -> bool:  # decompressed to dense weights at the first forward (both held)
        ...


class QuantMethod:
    # name, variant, bits and note are instance attributes: one class may serve several methods (BnbMethod sets
    # them per kind); every other declaration is the class's
    name: str
    variant: type  # the recipe's [[quantize]] model (pydantic) for this method
    engine: ClassVar[str]  # the library that does the work (its module name), recorded in the manifest
    engine_modules: ClassVar[tuple[str, ...]] = ()  # our modules that drive it, imported before it (api.py)
    checkpoint_format: ClassVar[str]  # config.json's quantization_config.quant_method, or "gguf"
    bits: tuple[int, ...]
    group_sizes: ClassVar[tuple[int, ...]] = ()  # () = the method has no group size
    dtypes: ClassVar[tuple[str, ...]] = DTYPE_NAMES
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    needs_calibration: ClassVar[bool] = False  # every variant reads the calibration rows (else see calibrates)
    note: str = ""
    offload: ClassVar[bool] = False  # quantize(..., offload=folder) streams the model from disk layer by layer
    memory: ClassVar[QuantMemory] = QuantMemory.WHOLE  # how quantizing holds the model, for the memory plan
    half_only: ClassVar[bool] = False  # computes in 16 bits only: a float32 baseline is quantized in bfloat16
    repacked_on_cpu: ClassVar[bool] = False  # its CPU kernel repacks the quantized linears at the first forward
    decompressed_on_load: ClassVar[bool] = False  # its checkpoint is decompressed to dense weights at the first forward
    load_module: ClassVar[str | None] = None  # the library transformers calls to load the checkpoint (imported first)
    hub_library: ClassVar[str | None] = None  # the card's library_name when it is not transformers
    # what it needs of an architecture (pipeline/quant/arch_support.py, applied by compress check): "gptqmodel" (a
    # GPTQModel definition for the model_type), "architecture" (ours: pipeline/model/architecture.py) or
    # "transformers" (any model transformers builds)
    needs_definition: ClassVar[str] = "transformers"
    # architecture trait (arch_support.TRAITS) -> why this method cannot take a model that has it (measured)
    arch_limit_reasons: ClassVar[dict[str, str]] = {}
    # model_type -> why this method cannot take it, where no trait says it (a library failure measured on that type)
    model_type_limits: ClassVar[dict[str, str]] = {}
    work: ClassVar[str]  # the dotted path of the module that does the work (session/quantize/save): load_work()
    reload_work: ClassVar[str | None] = None  # the module a reload hook calls for its torch side, if any

    @property
    def file(self) -> str:
        """This method's file as a path under pipeline/ ("quant/methods/gptq.py"): what a unit that quantizes,
        measures or exports one of its variants adds to its code identity (pipeline/base/codehash.py)."""
        return "quant/methods/" + type(self).__module__.rpartition(".")[2] + ".py"

    # ------------------------------------------------------------ declarations (torch-free)

    def format_of(self, variant) -> str:
        """The checkpoint format this variant's checkpoint will have (methods that write one format: theirs)."""
        return self.checkpoint_format

    def reload_of(self, variant) -> CheckpointLoad:
        """What holds the reload facts (before_load/after_load, load_module, repacked_on_cpu) of this variant's
        checkpoint: the method itself, or its export format's (pipeline/quant/formats/ct.py)."""
        return self

    def serve_needs(self, variant) -> tuple[str, ...]:
        """What serving this variant's checkpoint needs of an engine beyond reading its format (an engine may refuse
        it where check can tell: "wna16" a weight-only integer kernel, "fp8_kv" an FP8 KV cache)."""
        return ()

    def measured_elsewhere(self, variant, arch: Arch) -> str | None:
        """Why validate measures this variant's checkpoint outside transformers (a GGUF file in llama.cpp), or None.
        Such a model's quality is measured there; what only transformers measures ([validate.tasks]) is refused."""
        return None

    def calibrates(self, variant) -> bool:
        """Whether this variant reads the calibration rows (a method may need them for some variants only)."""
        return self.needs_calibration

    def check(self, variant, arch: Arch, device: str) -> list[Problem]:
        """This method's own rules beyond the declared bits/group sizes/dtypes/devices ([] = fine), each a Problem
        whose path names a field of the variant ("group_size"; "" = the variant as a whole)."""
        return []

    def arch_limits(self, variant) -> dict[str, str]:
        """The architecture traits this variant cannot take, with why (a variant's format may add its own)."""
        return self.arch_limit_reasons

    def check_tokenizer(self, variant, arch: Arch, files: frozenset[str], tokenizer_class: str | None
                        ) -> list[Problem]:
        """Rules on the tokenizer the run saves beside the baseline (its file names, tokenizer_config.json's
        tokenizer_class) ([] = fine)."""
        return []

    def check_calibration(self, variant, rows: int, seq_len: int) -> list[Problem]:
        """Rules on the calibration set this variant reads (rows x seq_len tokens) ([] = fine)."""
        return []

    def runtimes(self, variant, arch: Arch) -> list[dict]:
        """Which runtimes can serve the checkpoint, with which kernel: [{"runtime", "kernel", "note"}]."""
        raise NotImplementedError

    def bits_per_weight(self, variant) -> float:
        """Bits per quantized weight on disk, scales included (the disk plan's estimate)."""
        return 16.0

    def mix_candidate(self, params: dict) -> str | None:
        """The candidate of a [quantize.mix] record (its `predicted_uniform` key) that a uniform variant of this
        method with these recorded params is, for report.md's predicted-against-measured KL; None when it is not
        comparable (it keeps more than lm_head unquantized)."""
        if params.get("modules_to_skip", ["lm_head"]) != ["lm_head"]:
            return None
        return f"w{params.get('bits')}g{params.get('group_size')}"

    def hub_tags(self, params: dict) -> list[str]:
        """Hub tags from the variant's recorded params."""
        return [self.name]

    def card_usage(self, repo: str, params: dict, quantize: dict) -> list[str]:
        """What the card's "How to use" section adds after the transformers snippet (quantize: the variant's
        recorded manifest)."""
        return []

    def usage_section(self, repo: str, params: dict, quantize: dict, size) -> list[str] | None:
        """The card's whole "How to use" section for a format transformers is not the way to run (size: the card's
        byte formatter, so no method imports the report code); None: the transformers snippet, then card_usage."""
        return None

    # ------------------------------------------------------------ reload hook

    def before_load(self) -> None:
        """Called before transformers loads one of this method's checkpoints."""

    def after_load(self, model) -> None:
        """Called on the model transformers loaded from one of this method's checkpoints."""

    def load_own(self, folder: Path, config: dict, device: str) -> Any:
        """The model, for a checkpoint of this method that transformers cannot load (e.g. per-module bits); None:
        transformers loads it (between before_load and after_load)."""
        return None

    # ------------------------------------------------------------ the work (in the module `work` names)

    def load_work(self) -> ModuleType:
        """This method's work module (pipeline/quant/work/<name>.py), imported on first use."""
        return load_work(self.work)

    def session(self, out_dir: Path) -> contextlib.AbstractContextManager:
        """A context around quantize() and save() (working folder, library settings): the work module's
        `session(out_dir)`, or none."""
        work = self.load_work()
        return work.session(out_dir) if hasattr(work, "session") else contextlib.nullcontext()

    def quantize(self, base_dir: Path, variant, calib_ids, console: IO[str], device: str,
                 offload: Path | None = None) -> Any:
        """The quantized model in memory (calib_ids: [n, seq_len] ids when needs_calibration, else None)."""
        return self.load_work().quantize(base_dir, variant, calib_ids, console, device, offload=offload)

    def save(self, model, base_dir: Path, out_dir: Path, variant) -> dict:
        """Write the checkpoint into out_dir; return the manifest details (engine, engine_version, engine_config,
        dtype, ...)."""
        return self.load_work().save(model, base_dir, out_dir, variant)


def missing_package(package: str, module: str, method: str) -> list[Problem]:
    """One problem naming the package a method needs when its module cannot be found ([] when it can)."""
    if importlib.util.find_spec(module) is not None:
        return []
    return [Problem("method", "method-package-missing",
                    f"method {method!r} needs the {package} package, which is not installed: pip install {package} "
                    f"(a dependency of compress: pip install -e .)")]


def grouped_bits(variant) -> float:
    """Bits per quantized weight on disk of a grouped integer format: a 16-bit scale and a packed zero per group."""
    g = getattr(variant, "group_size", -1)
    return variant.bits + (32 / g if g and g > 0 else 0.0)


def bits_tags(params: dict, *tags: str) -> list[str]:
    """Hub tags of a method whose variants have `bits`: the method's tags, then "<bits>-bit"."""
    bits = params.get("bits")
    return [*tags, f"{bits}-bit"] if bits else list(tags)

