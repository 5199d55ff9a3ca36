"""`compress sweep`: the sweep runner (pipeline/app/sweep.py)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from pipeline.app.commands import EPILOG, SET_HELP
from pipeline.app.sweep import run_sweep, summary_table


@click.command(epilog=EPILOG)
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP + " Applies to every run.")
def sweep(spec: str, overrides: tuple[str, ...]) -> None:
    """Run every recipe (or recipe x --set matrix) of the sweep SPEC, each in its own run folder; exits with the
    worst run's code. Every run is checked before the first starts."""
    t0 = time.perf_counter()
    rows, code = run_sweep(Path(spec), list(overrides))
    click.echo(summary_table(rows))
    click.echo(f"sweep: {len(rows)} run(s) in {time.perf_counter() - t0:.0f} s; exit {code} (the worst run's)")
    sys.exit(code)
