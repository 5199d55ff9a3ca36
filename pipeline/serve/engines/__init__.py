"""The one list of serving engines and what the rest of the code asks of them. Torch-free.

    ENGINES.get("vlm")  # RecipeError: Unknown serving engine 'vlm'. Did you mean: vllm?

Each engine is a class in pipeline/serve/engines/<name>.py (interface: pipeline/serve/engines/base.py) declaring the
checkpoint formats it serves per device, the `compress serve` options it applies, whether it is installed and how
it serves. `compress serve`, `compress check`'s [validate.serve] rules and the serve unit all ask this module.
"""
from __future__ import annotations

import importlib

from pipeline.base.errors import RecipeError
from pipeline.base.registry import Registry
from pipeline.serve import measured
from pipeline.serve.engines.base import PARALLEL, UNQUANTIZED, Engine, ServeOptions, describe, device_kind

ENGINE_MODULES = ("transformers", "llamacpp", "vllm")
ENGINES: Registry[Engine] = Registry("serving engine")
_REGISTERED: list[str] = []
for _module in ENGINE_MODULES:
    for _engine in importlib.import_module(f"pipeline.serve.engines.{_module}").ENGINES:
        ENGINES.register(_engine.name)(_engine())
        _REGISTERED.append(_engine.name)
NAMES = tuple(ENGINES.names())
# the names in ENGINE_MODULES' order: the recipe's engine choices (pipeline/serve/config.py), as QuantVariant's
# union is built from the registered methods
REGISTERED = tuple(_REGISTERED)


def get(name: str) -> Engine:
    return ENGINES.get(name)


def find(name: str) -> Engine | None:
    """The engine of this name, or None for one this compress does not know (a report written by another)."""
    return ENGINES.get(name) if name in ENGINES else None


def label(name: str) -> str:
    """How report.md and the cards name an engine ("vLLM"); an unknown one by its name."""
    engine = find(name)
    return engine.display() if engine is not None else name


def splitting() -> tuple[str, ...]:
    """The engines that split one server's model over ranks: those that honour the PARALLEL options (vLLM's tensor
    and pipeline parallelism)."""
    return tuple(n for n in NAMES if all(o in ENGINES.get(n).honours for o in PARALLEL))


def reference() -> str:
    """The engine the others' served throughput is compared with (report.md's "x transformers" column)."""
    return next(n for n in REGISTERED if ENGINES.get(n).reference)


def checkpoint_format(fmt: str, quant_method: str | None) -> str:
    """A folder's checkpoint format as engines declare them: "gguf", "unquantized" or config.json's quant_method."""
    return "gguf" if fmt == "gguf" else (str(quant_method).lower() if quant_method else UNQUANTIZED)


def engines_for(fmt: str, device: str, model_class: str | None = None,
                needs: tuple[str, ...] = (), config: dict | None = None) -> dict[str, str | None]:
    """engine -> None if it can serve a checkpoint of this format (model class: config.json's `architectures`;
    needs: QuantMethod.serve_needs; config: the model's config.json, its shapes) on this device here, else why not
    (read by `compress serve` from the folder and by `compress check` from the recipe, before any folder exists)."""
    return {name: ENGINES.get(name).refuses(fmt, device) or ENGINES.get(name).refuses_needs(needs, device)
            or ENGINES.get(name).refuses_architecture(model_class)
            or (ENGINES.get(name).refuses_model(config, device, fmt, needs) if config else None) for name in NAMES}


def default_engine(fmt: str) -> str:
    """What "auto" means: llama.cpp for a .gguf file, transformers for a Hugging Face folder."""
    return "llama.cpp" if fmt == "gguf" else "transformers"


def declared(fmt: str, device: str) -> list[str]:
    """The engines that declare this format on this device, installed or not."""
    kind = device_kind(device)
    return [n for n in NAMES if fmt in ENGINES.get(n).formats.get(kind, ())]


def choose(fmt: str, where: str, engine: str, device: str) -> str:
    """The engine to use ("auto": transformers for HF folders, llama.cpp for GGUF), or RecipeError naming the engines
    that can serve it here."""
    why = engines_for(fmt, device)
    if engine == "auto":
        engine = default_engine(fmt)
    if engine not in why:
        raise RecipeError(f"--engine {engine}: unknown (choose from auto, {', '.join(NAMES)})")
    if why[engine] is not None:
        raise RecipeError(f"engine {engine} cannot serve {where} ({describe(fmt)}) here: {why[engine]}; {able(why)}")
    return engine


def able(why: dict[str, str | None]) -> str:
    ok = [e for e, w in why.items() if w is None]
    return f"engines that can: {', '.join(ok)}" if ok else "no engine can serve it here"


def auto(fmt: str, folder, opts: ServeOptions) -> tuple[str, str]:
    """What `--engine auto` serves a folder with, and the line that says why: the engine its run measured fastest
    on this kind of device among those that can serve it here and apply every option set (pipeline/serve/measured.py),
    else the format's default engine."""
    why = engines_for(fmt, opts.device)
    usable = [n for n in NAMES if why[n] is None and not ENGINES.get(n).unhonoured(opts)]
    # an engine whose serve would refuse to start here (exit 2) is passed over, and the line says so
    passed = {n: r for n in usable if (r := ENGINES.get(n).refuses_start(folder, opts))}
    usable = [n for n in usable if n not in passed]
    note = "".join(f"; {n} passed over: {r}" for n, r in passed.items())
    kind = device_kind(opts.device)
    found = measured.pick(measured.read(folder), kind, opts.slots, usable)
    if found:
        return found[0], found[1] + note
    name = default_engine(fmt)
    return name, (f"auto: {name}, the default for {describe(fmt)} (no error-free serving figures on {kind.upper()} "
                  f"for an engine usable here in the folder's {measured.SERVING_FILE})" + note)
