"""`compress`: run, check, report, eval, bench, push, sweep, serve. Exit codes: pipeline/base/errors.py (EXIT_CODES).

The CLI repeats no recipe default. `check` imports neither torch nor transformers.

Each command is a module of its own under pipeline/app/commands/ that imports the machinery it runs at its top; the
group loads a command's module by name when that command runs (click's documented "lazily loading subcommands"
pattern), so `compress --help` loads only click and this module, `compress check` the recipe and the plan (no
torch), the other commands their own subsystem.
"""
from __future__ import annotations

import importlib
import os
import sys

import click

from pipeline.app.commands import EPILOG
from pipeline.base.cli_logging import setup_logging
from pipeline.base.errors import CompressError

# name -> ("module:command", the first paragraph of its help, which `compress --help` lists without importing it;
# tests/unit/test_import_graph.py checks each path resolves, stands in the layers and has this help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("pipeline.app.commands.measure:bench",
              "Speed and memory of any checkpoint folder ([validate.speed] defaults), outside a recipe."),
    "check": ("pipeline.app.commands.check:check", "Validate RECIPE and print the resolved plan; loads no weights."),
    "eval": ("pipeline.app.commands.measure:eval", "Perplexity of any checkpoint folder on DATASET, outside a recipe."),
    "push": ("pipeline.app.commands.push:push", "Publish the exports the finished run's report lists (re-checks the "
                                                "publish rule and file hashes first)."),
    "report": ("pipeline.app.commands.report:report", "Re-render report.md, plots and model cards of RUN_DIR from its "
                                                      "stage outputs (no recomputation)."),
    "run": ("pipeline.app.commands.run:run",
            "Run every stage of RECIPE; completed stages whose inputs did not change are skipped."),
    "serve": ("pipeline.app.commands.serve:serve", "Serve EXPORT_DIR over an OpenAI-compatible HTTP API "
                                                   "(/v1/completions, /v1/chat/completions, /v1/models, /health) with "
                                                   "continuous batching."),
    "sweep": ("pipeline.app.commands.sweep:sweep", "Run every recipe (or recipe x --set matrix) of the sweep SPEC, "
                                                   "each in its own run folder; exits with the worst run's code. "
                                                   "Every run is checked before the first starts."),
}


class LazyGroup(click.Group):
    """A click group whose commands are dotted paths, each imported when it is resolved (click's "Lazily Loading
    Subcommands"), and whose command listing takes each one's declared help instead of importing it (click's
    "Further Deferring Imports")."""

    def __init__(self, *args, lazy_commands: dict[str, tuple[str, str]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_commands])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_commands:
            return self.load(cmd_name)
        return super().get_command(ctx, cmd_name)

    def load(self, cmd_name: str) -> click.Command:
        """The command `cmd_name`, its module imported: the one place a command's machinery loads."""
        module, _, attr = self.lazy_commands[cmd_name][0].partition(":")
        # late: each command's module imports what it runs at its top (the recipe and plan, torch, the Hub client,
        # the server); `compress --help` lists every command and must load none of them
        command = getattr(importlib.import_module(module), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.lazy_commands[cmd_name][0]} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's command listing, each lazy command's short help made from its declared help, unimported."""
        names = self.list_commands(ctx)
        group_command = super().get_command  # bound here: a bare super() fails inside a comprehension (Python < 3.12)
        commands = {n: c for n in names if n not in self.lazy_commands and (c := group_command(ctx, n)) is not None}
        names = [n for n in names if n in self.lazy_commands or (n in commands and not commands[n].hidden)]
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = [(n, (click.Command(n, help=self.lazy_commands[n][1]) if n in self.lazy_commands else commands[n])
                 .get_short_help_str(limit)) for n in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, lazy_commands=COMMANDS, epilog=EPILOG)
@click.option("-v", "--verbose", is_flag=True, help="Show library logs and debug lines.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """Calibrate, quantize, distil a draft, validate, export and publish an LLM from one TOML recipe."""
    setup_logging(verbose)
    ctx.obj = {"verbose": verbose}


def _leave_now(code: int) -> None:
    """Exit after an interrupt without the interpreter's shutdown: a stage stopped mid-way can leave an engine's
    worker threads running (GPTQModel's pool), and their C++ destructors abort a normal shutdown (exit 134 instead of
    the documented code). The run's state is already saved and its lock released at this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except CompressError as e:
        click.echo(f"error: {e}", err=True)
        if e.exit_code in (130, 143):
            _leave_now(e.exit_code)
        sys.exit(e.exit_code)
    except OSError as e:  # outside any stage: e.g. the run folder's lock or report on a full disk
        click.echo(f"error: {e.strerror or e}: {e.filename or ''}", err=True)
        sys.exit(4)
    except KeyboardInterrupt:
        click.echo("interrupted; rerun the same command to resume", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
