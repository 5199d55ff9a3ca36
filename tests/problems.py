"""Asserting what `compress check` refuses by rule and place, not by wording: a check returns Problem(path, code,
message) (pipeline/base/problem.py); tests compare (path, code) pairs, and each message's wording is asserted once,
in tests/unit/test_problems.py."""
from __future__ import annotations

import pytest

from pipeline.base.errors import RecipeError
from pipeline.base.problem import Problem


def refused(recipe) -> list[Problem]:
    """The problems `check(recipe)` refuses the recipe with (the test fails when the recipe passes)."""
    from pipeline.plan import check

    with pytest.raises(RecipeError) as e:
        check(recipe)
    assert e.value.problems, str(e.value)
    return e.value.problems


def keys(problems: list[Problem]) -> list[tuple[str, str]]:
    """(path, code) of each problem, in order."""
    return [(p.path, p.code) for p in problems]


def codes(problems: list[Problem]) -> list[str]:
    return [p.code for p in problems]


def only(problems: list[Problem]) -> Problem:
    """The one problem of a list that should hold exactly one."""
    assert len(problems) == 1, [str(p) for p in problems]
    return problems[0]
