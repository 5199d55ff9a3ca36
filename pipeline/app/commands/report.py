"""`compress report`: the renderers, on a finished run's folder."""
from __future__ import annotations

from pathlib import Path

import click

from pipeline.app.commands import EPILOG
from pipeline.results.render import render_report


@click.command(epilog=EPILOG)
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
def report(run_dir: str) -> None:
    """Re-render report.md, plots and model cards of RUN_DIR from its stage outputs (no recomputation)."""
    path = Path(run_dir)
    render_report(path)
    click.echo(f"wrote {path / 'report.md'}")
