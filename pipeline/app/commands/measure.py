"""`compress eval` and `compress bench`: quality and speed of any checkpoint folder, outside a recipe."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import click

from pipeline.app.commands import EPILOG
from pipeline.base.errors import RecipeError
from pipeline.eval.config import SpeedConfig
from pipeline.eval.jobs import run_quality
from pipeline.eval.speed import run_speed_subprocess
from pipeline.recipe import PerplexityConfig, SmokeConfig, apply_override


@click.command(epilog=EPILOG)
@click.argument("checkpoint", type=click.Path(file_okay=False, exists=True))
@click.option("--dataset", default="wikitext2", show_default=True)
@click.option("--seq-len", default=2048, show_default=True, type=int)
@click.option("--stride", default=None, type=int, help="Sliding-window stride (default: non-overlapping windows).")
@click.option("--max-windows", default=None, type=int, help="Evaluate only the first N windows (default: all).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", default=None, type=click.IntRange(min=1), help="torch threads (default: all cores).")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Keep the result (quality.json) and the evaluation log in this folder.")
def eval(checkpoint: str, dataset: str, seq_len: int, stride: int | None, max_windows: int | None, device: str,  # noqa: A001
         threads: int | None, out_dir: str | None) -> None:
    """Perplexity of any checkpoint folder on DATASET, outside a recipe."""
    cfg = PerplexityConfig(dataset=dataset, seq_len=seq_len, stride=stride, max_windows=max_windows)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(out_dir) if out_dir else Path(tmp)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecipeError(f"--out {out_dir}: cannot create it ({e.strerror})") from None
        t0 = time.perf_counter()
        result = run_quality(checkpoint, out, cfg, SmokeConfig(enabled=False), device, threads)
        result["wall_time_s"] = round(time.perf_counter() - t0, 1)
        if out_dir:
            (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
    click.echo(json.dumps(result, indent=2))


@click.command(epilog=EPILOG)
@click.argument("checkpoint", type=click.Path(file_okay=False, exists=True))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a [validate.speed] field, e.g. --set batch_sizes=[1,4].")
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", default=None, type=click.IntRange(min=1), help="torch threads (default: all cores).")
@click.option("--out", "out_json", default=None, type=click.Path(dir_okay=False),
              help="Also write the result to this JSON file.")
def bench(checkpoint: str, overrides: tuple[str, ...], device: str, threads: int | None, out_json: str | None) -> None:
    """Speed and memory of any checkpoint folder ([validate.speed] defaults), outside a recipe."""
    raw: dict = {}
    for item in overrides:
        apply_override(raw, item)
    try:
        cfg = SpeedConfig(**raw)
    except Exception as e:
        raise RecipeError(f"--set: {e}") from None
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(out_json) if out_json else Path(tmp) / "speed.json"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecipeError(f"--out {out_json}: cannot create its folder ({e.strerror})") from None
        result = run_speed_subprocess(Path(checkpoint), cfg, device, target, threads=threads)
    click.echo(json.dumps(result, indent=2))
