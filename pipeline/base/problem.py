"""One thing wrong with a recipe, as `compress check` finds it: where (`path`), which rule (`code`), and the line the
user reads (`message`).

Every check returns `list[Problem]` ([] = fine); `compress check` prints `str(problem)`, which is the message, and a
recipe with problems exits 2 (RecipeError, whose `.problems` keeps them). Tests assert `code` and `path`; the wording
of each message is tested once (tests/unit/test_problems.py).

- `path`: the recipe location, dotted TOML keys with list indices in brackets: "run.device", "quantize[1].group_size",
  "validate.gates.models.w9", "draft.verifier". A method's own check names fields of its variant ("group_size"); the
  plan puts them under the variant with `within("quantize[1]", "quantize.1 (w4): ")`.
- `code`: a stable kebab-case identifier of the rule ("group-size-does-not-tile"), unique across the package: one
  `Problem(...)` call site per code (tests/unit/test_problems.py collects them and checks).
- `note`: True for a remark that does not stop the run (`compress check` shows it among the warnings).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

CODE_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Problem:
    path: str
    code: str
    message: str
    note: bool = False

    def __str__(self) -> str:
        return self.message

    def within(self, path: str, label: str = "") -> Problem:
        """This problem seen from an enclosing table: `path` before its own ("quantize[1]" + "bits" ->
        "quantize[1].bits") and `label` before its message."""
        return replace(self, path=join_path(path, self.path), message=label + self.message)


def join_path(outer: str, inner: str) -> str:
    """"quantize[1]" + "bits" -> "quantize[1].bits"; an empty side is dropped; "[0]" joins without a dot."""
    if not outer or not inner:
        return outer or inner
    return outer + inner if inner.startswith("[") else f"{outer}.{inner}"


def messages(problems: list[Problem]) -> list[str]:
    """The lines the user reads, in order."""
    return [p.message for p in problems]
