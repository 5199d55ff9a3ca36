"""Errors a user can act on, each with its documented exit code.

The CLI turns a CompressError into one clear line on stderr and its exit code;
anything else is a bug and exits 1 with a traceback.
"""
from __future__ import annotations

import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.base.problem import Problem


class CompressError(Exception):
    """Base of every user-facing error. `exit_code` is what `compress` exits with."""

    exit_code = 1


class RecipeError(CompressError):
    """Malformed recipe, unknown key, impossible setting, bad CLI input. `problems`: what `compress check` found,
    one Problem each (pipeline/base/problem.py), when the error lists them."""

    exit_code = 2

    def __init__(self, *args: object, problems: list[Problem] | tuple[Problem, ...] = ()) -> None:
        super().__init__(*args)
        self.problems = list(problems)


class LockedError(CompressError):
    """Another run holds the run folder's lock."""

    exit_code = 3


class StageError(CompressError):
    """A stage failed on valid input (missing model file, unwritable output, ...)."""

    exit_code = 4


class GateFailure(CompressError):
    """The run finished but one or more quality/speed gates failed."""

    exit_code = 5


class PublishError(CompressError):
    """Pushing to the Hub failed or was refused."""

    exit_code = 6


class Interrupted(CompressError):
    """SIGINT (Ctrl-C, exit 130) or SIGTERM (exit 143) stopped the run; rerunning the command resumes it."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}; rerun the same command to resume")
        self.exit_code = 128 + int(signum)


EXIT_CODES = {
    0: "success",
    1: "internal error (a bug: please report it with the traceback)",
    2: "bad recipe or command-line input",
    3: "the run folder is locked by another running `compress` process",
    4: "a stage failed (missing file, unwritable output, library failure)",
    5: "the run finished but at least one gate failed (see report.md)",
    6: "publishing to the Hub failed or was refused",
    130: "interrupted by Ctrl-C (SIGINT); rerun to resume",
    143: "stopped by SIGTERM (e.g. a CI timeout); rerun to resume",
}
