"""GPTQModel's loader patches transformers for the whole process, not for the model it loads: before it builds a
model it calls defuser.replace_fused_blocks(model_type), which replaces that architecture's fused classes in
transformers' modeling module (mixtral's MixtralSparseMoeBlock by one linear per expert; phi3's fused gate_up MLP
too) and transformers' checkpoint conversion mapping. Every later load of that architecture in the same process
then builds the defused modules: a compressed-tensors checkpoint of mixtral, loaded after a GPTQ one, left its 72
expert tensors unmatched (the architecture matrix's transformers serving, one process serving both). This scope
puts transformers back as it found it once GPTQModel's work is done; the models built inside keep their classes."""
from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

from defuser.model_registry import MODEL_CONFIG, PATCH  # GPTQModel's dependency: what its loader patches
from transformers import conversion_mapping, modeling_utils

MAPPING = "get_checkpoint_conversion_mapping"
ABSENT = object()


def replaced_classes(model_types: list[str]) -> list[tuple[str, str]]:
    """(module, class name) of every transformers class defuser replaces for these model types."""
    out = []
    for t in model_types:
        for orig, _ in (MODEL_CONFIG.get(t) or {}).get(PATCH.REPLACE_MODULE, []):
            module, _, name = orig.rpartition(".")
            out.append((module, name))
    return out


@contextmanager
def transformers_restored(config: dict) -> Iterator[None]:
    """Run GPTQModel inside: on exit, the classes defuser may have replaced for this config's model type (and its
    text_config's) and transformers' conversion-mapping functions are the ones found on entry."""
    types = [t for t in (config.get("model_type"), (config.get("text_config") or {}).get("model_type")) if t]
    saved = []
    for module, name in replaced_classes(types):
        try:
            mod = importlib.import_module(module)
        except ImportError:  # a class of another transformers version: defuser skips it too
            continue
        if hasattr(mod, name):
            saved.append((mod, name, getattr(mod, name)))
    for mod, name in ((conversion_mapping, MAPPING), (modeling_utils, MAPPING)):  # defuser sets both
        saved.append((mod, name, getattr(mod, name, ABSENT)))
    try:
        yield
    finally:
        for mod, name, value in saved:
            if value is ABSENT:
                if hasattr(mod, name):
                    delattr(mod, name)
            else:
                setattr(mod, name, value)
