"""The one list of quantization methods and export formats, and what the rest of the code asks of them. Torch-free.

    METHODS.get("gtpq")  # RecipeError: Unknown quantization method 'gtpq'. Did you mean: gptq?

Each method is a class in pipeline/quant/methods/<name>.py (interface: pipeline/quant/method.py); adding one is
that file, its test file, and its module in METHOD_MODULES. The recipe's `[[quantize]]` union (`QuantVariant`) is
built from the registered methods' variant models. `check_variant` applies what every method declares (devices,
dtypes, bits, group sizes, the model's shapes, modules_to_skip), then the method's own rules.
"""
from __future__ import annotations

import importlib
import re
from typing import Annotated, Union

from pydantic import BeforeValidator, Field

from pipeline.base.problem import Problem
from pipeline.base.registry import Registry
from pipeline.quant.arch_support import arch_problems
from pipeline.quant.formats.ct import LOAD as CT_LOAD
from pipeline.quant.method import CheckpointLoad, QuantMethod
from pipeline.quant.shapes import Arch, module_names, quantized_linears, skip_pattern

# the method files, in the order their variants appear in the recipe's union. Imported by name: a unit's code
# identity names only the method file of the variant it concerns (pipeline/base/codehash.py PLUGINS)
METHOD_MODULES = ("gptq", "rtn", "awq", "autoround", "bnb", "torchao", "gguf", "w8a8")
PACKAGE = "pipeline.quant.methods"

# export formats no method writes by default (a variant's `format` field asks for them): their reload facts
EXPORT_FORMATS = (CT_LOAD,)

METHODS: Registry[QuantMethod] = Registry("quantization method")
_VARIANTS: list[type] = []
for _module in METHOD_MODULES:
    for _method in importlib.import_module(f"{PACKAGE}.{_module}").METHODS:
        METHODS.register(_method.name)(_method)
        _VARIANTS.append(_method.variant)


def method_of(variant) -> QuantMethod:
    return METHODS.get(variant.method)


def by_format(checkpoint_format: str | None):
    """A method that writes checkpoints of this format (config.json's quant_method), for its reload hook and load
    facts (the methods of one format share them), or the export format's own (compressed-tensors: the format's,
    whichever method wrote it); None for an unquantized or unknown checkpoint."""
    fmt = next((f for f in EXPORT_FORMATS if f.checkpoint_format == checkpoint_format), None)
    if fmt is not None:
        return fmt
    for name in METHODS:
        if METHODS.get(name).checkpoint_format == checkpoint_format:
            return METHODS.get(name)
    return None


def variant_format(variant) -> str:
    """The checkpoint format a variant's folder will have ("gptq", "compressed-tensors", "gguf", ...)."""
    return method_of(variant).format_of(variant)


def serve_needs(variant) -> tuple[str, ...]:
    """What serving a variant's checkpoint needs of an engine beyond its format (QuantMethod.serve_needs)."""
    return method_of(variant).serve_needs(variant)


def reload_of(variant) -> CheckpointLoad:
    """The reload facts of a variant's checkpoint (repacked_on_cpu, load_module, ...): its method's or its format's."""
    return method_of(variant).reload_of(variant)


def checkpoint_method(config: dict) -> QuantMethod | None:
    """The method whose checkpoint format a config.json declares (quantization_config.quant_method), or None."""
    return by_format(str((config.get("quantization_config") or {}).get("quant_method") or "").lower() or None)


def method_code(variant) -> tuple[str, ...]:
    """The method file a unit that quantizes, measures or exports `variant` adds to its code (() for none)."""
    return () if variant is None else (method_of(variant).file,)


def model_code(recipe, name: str) -> tuple[str, ...]:
    """method_code of the recipe's model `name`: a variant's method file; () for the baseline or a draft."""
    return method_code(next((q for q in recipe.quantize if q.name == name), None))


def _known_method(value: object) -> object:
    """Turn pydantic's tag error into the registry's 'Unknown quantization method ... Did you mean' line."""
    if isinstance(value, dict) and "method" in value and value["method"] not in METHODS:
        raise ValueError(METHODS.unknown_message(str(value["method"])))
    return value


# a union of the variants registered above: built at run time, so no static type (mypy's valid-type). Its `|` form
# does not exist for a tuple (ruff's UP007 fix would leave the bare tuple, not a union)
QuantVariant = Annotated[  # type: ignore[valid-type]
    Union[tuple(_VARIANTS)],  # noqa: UP007 - a union of a run-time tuple
    Field(discriminator="method"),
    BeforeValidator(_known_method),
]


def needs_calibration(variant) -> bool:
    return method_of(variant).calibrates(variant)


# ---------------------------------------------------------------- checks


def check_variant(variant, arch: Arch, device: str) -> list[Problem]:
    """Problems that make this variant impossible on this model and device ([] = fine); paths are the variant's
    fields (the plan puts them under quantize[i])."""
    c = method_of(variant)
    problems = []
    if device not in c.devices:
        problems.append(Problem("method", "method-device-unsupported",
                                f"{c.name} cannot run on device {device!r} (it runs on: {', '.join(c.devices)})"))
    for field in ("dtype", "compute_dtype"):
        value = getattr(variant, field, None)
        if value is not None and value not in c.dtypes:
            problems.append(Problem(field, "dtype-unsupported", f"{field} = {value!r} is not supported by {c.name} "
                                                                f"(supported: {', '.join(c.dtypes)})"))
    bits = getattr(variant, "bits", None)
    if bits is not None and bits not in c.bits:
        problems.append(Problem("bits", "bits-unsupported", f"bits = {bits} is not supported by {c.name} "
                                                            f"(supported: {', '.join(map(str, c.bits))})"))
    problems += arch_problems(c, variant, arch)
    problems += c.check(variant, arch, device)
    if arch.shapes_known:
        problems += _check_skips(variant, arch)
        problems += _check_group_size(variant, arch, c)
    elif getattr(variant, "group_size", None) is not None and variant.group_size not in c.group_sizes:
        problems.append(_unsupported_group_size(variant.group_size, c))
    return problems


def _unsupported_group_size(g: int, c: QuantMethod, suggest: str | None = None) -> Problem:
    """A group size the method does not take (with the sizes that fit this model, when its shapes are known)."""
    return Problem("group_size", "group-size-unsupported",
                   f"group_size = {g} is not supported by {c.name} (supported: {', '.join(map(str, c.group_sizes))})"
                   + (f"; for this model use {suggest}" if suggest is not None else ""))


def _check_skips(variant, arch: Arch) -> list[Problem]:
    names = module_names(arch)
    bad = [e for e in variant.modules_to_skip if not any(re.match(skip_pattern(e), n) for n in names)]
    if not bad:
        return []
    kinds = ", ".join(arch.linear_in_features)
    return [Problem("modules_to_skip", "modules-to-skip-match-nothing",
                    f"modules_to_skip entries {bad} match no linear layer of this {arch.model_type} model "
                    f"(linear names end in: {kinds})")]


def _check_group_size(variant, arch: Arch, c: QuantMethod) -> list[Problem]:
    g = getattr(variant, "group_size", None)
    if g is None:
        return []
    linears = quantized_linears(arch, variant.modules_to_skip)
    ins = sorted({i for i, _ in linears.values()})
    ok = [s for s in c.group_sizes if s != -1 and all(i % s == 0 for i in ins)]
    suggest = " or ".join(map(str, sorted(ok, reverse=True)[:2])) or "-1"
    if g not in c.group_sizes:
        return [_unsupported_group_size(g, c, suggest)]
    if g == -1:
        return []
    bad = {k: i for k, (i, _) in linears.items() if i % g}
    if not bad:
        return []
    sizes = sorted(set(bad.values()))
    what = "; ".join(f"{i} ({', '.join(k for k, v in bad.items() if v == i)})" for i in sizes)
    hidden = arch.hidden_size
    first = f"hidden size {hidden}" if hidden in sizes else f"in-features {sizes[0]}"
    why = f"{first} is not a multiple of {g}"
    return [Problem("group_size", "group-size-does-not-tile",
                    f"group_size = {g} does not divide the in-features of every quantized linear: {what}; the {why}. "
                    f"Use group_size = {suggest} (or -1 for per-channel)")]


def runtimes(variant, arch: Arch) -> list[dict]:
    """Which runtimes can serve this checkpoint, with which kernel: [{"runtime", "kernel", "note"}]."""
    return method_of(variant).runtimes(variant, arch)
