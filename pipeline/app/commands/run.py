"""`compress run`: the run machinery (pipeline/app/execute.py), then the summary of the report it wrote."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from pipeline.app.commands import EPILOG, SET_HELP
from pipeline.app.execute import execute
from pipeline.base.errors import CompressError
from pipeline.plan import check as check_plan
from pipeline.recipe import load_recipe
from pipeline.results import schema
from pipeline.results.gates import gates_summary
from pipeline.results.query import planned


@click.command(epilog=EPILOG)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def run(recipe: str, overrides: tuple[str, ...]) -> None:
    """Run every stage of RECIPE; completed stages whose inputs did not change are skipped."""
    r = load_recipe(recipe, list(overrides))
    plan = check_plan(r)
    t0 = time.perf_counter()
    code = execute(r, Path(recipe), plan)
    _print_summary(Path(r.run.output_dir) / r.run.name, time.perf_counter() - t0)
    sys.exit(code)


def _print_summary(run_dir: Path, wall: float) -> None:
    try:
        report = schema.load(run_dir)
    except CompressError as e:
        click.echo(f"no summary: {e}", err=True)
        return
    width = max([34, *(len(k) + 2 for k in report.stages)])  # a long unit key never runs into its status
    click.echo(f"\n{'stage':<{width}}{'status':<10}{'time s':>9}{'peak MiB':>10}{'predicted':>11}", err=True)
    for key, s in report.stages.items():
        guess = planned(report.run.predicted_peak_bytes, key)
        click.echo(f"{key:<{width}}{s.status:<10}{s.time_s:>9.1f}{s.peak_rss_bytes / 2**20:>10.0f}"
                   f"{(f'{guess / 2**20:.0f}' if guess else '-'):>11}", err=True)
    rows = ([("baseline", report.baseline)] if report.baseline else []) + list(report.variants.items())
    click.echo(f"\n{'model':<20}{'ppl':>10}{'ratio':>8}{'KL':>9}{'top1':>7}{'disk MiB':>10}", err=True)
    for name, m in rows:
        ppl = m.perplexity.value if m.perplexity else None
        ratio = f"{m.ppl_ratio:.4f}" if m.ppl_ratio is not None else ("1.0000" if name == "baseline" and ppl else "-")
        kl = f"{m.kl:.4f}" if m.kl is not None else "-"
        top1 = f"{m.top1:.3f}" if m.top1 is not None else "-"
        disk = f"{m.size_on_disk_bytes / 2**20:.0f}" if m.size_on_disk_bytes else "-"
        click.echo(f"{name:<20}{(f'{ppl:.3f}' if ppl else '-'):>10}{ratio:>8}{kl:>9}{top1:>7}{disk:>10}", err=True)
    click.echo(f"\nstatus {report.run.status} in {wall:.0f} s; gates: {gates_summary(report.gates)}; "
               f"report {run_dir / 'report.md'}", err=True)
