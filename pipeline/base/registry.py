"""A typed name -> object registry with good errors.

    DATASETS: Registry[DatasetSpec] = Registry("dataset")

    @DATASETS.register("wikitext2")
    def _wikitext2(...): ...

    DATASETS.get("wikitxt")  # RecipeError: Unknown dataset 'wikitxt'. Did you mean: wikitext2?
"""
from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Generic, TypeVar

from pipeline.base.errors import RecipeError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"duplicate {self.kind} name {name!r}")
            self._items[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise RecipeError(self.unknown_message(name)) from None

    def close_matches(self, name: str) -> list[str]:
        """Up to three registered names close to `name` (the "Did you mean" of an unknown one)."""
        return difflib.get_close_matches(name, list(self._items), n=3, cutoff=0.5)

    def unknown_message(self, name: str) -> str:
        close = self.close_matches(name)
        hint = f" Did you mean: {', '.join(close)}?" if close else f" Known: {', '.join(sorted(self._items))}."
        return f"Unknown {self.kind} {name!r}.{hint}"

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        return sorted(self._items)


def load_work(path: str) -> ModuleType:
    """The work module a plug-in declares by dotted path: a quantization method's (QuantMethod.work, reload_work:
    pipeline/quant/work/) or a serving engine's (Engine.work: pipeline/serve/work/). The one place a plug-in's heavy
    side is imported (tests/unit/test_import_graph.py checks each declared path resolves and respects the layers)."""
    # late: a work module imports torch, its engine or its server at its top; `compress check` imports every plug-in's
    # declarations and must load none of them (tests/unit/test_import_boundaries.py)
    return importlib.import_module(path)
