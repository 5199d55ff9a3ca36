"""`compress`: run, check, report, eval, bench, push. Exit codes: pipeline/base/errors.py (EXIT_CODES).

The CLI repeats no recipe default. `check` imports neither torch nor transformers.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import click
from click.core import ParameterSource

from pipeline.base.cli_logging import setup_logging
from pipeline.base.errors import EXIT_CODES, CompressError, RecipeError
from pipeline.serve import engines
from pipeline.serve.engines import NAMES as ENGINE_NAMES
from pipeline.serve.engines.base import OPTIONS, ServeOptions
from pipeline.stages.kinds import Speed

# Each command imports the machinery it runs in its body: `compress --help` loads only click and the modules above,
# `compress check` the recipe and the plan (no torch), the other commands their own subsystem.

EPILOG = "Exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items())
SET_HELP = "Override a recipe field, e.g. --set quantize.0.bits=3 (repeatable; type-checked)."


@click.group(epilog=EPILOG)
@click.option("-v", "--verbose", is_flag=True, help="Show library logs and debug lines.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """Calibrate, quantize, distil a draft, validate, export and publish an LLM from one TOML recipe."""
    setup_logging(verbose)
    ctx.obj = {"verbose": verbose}


def _load(recipe: str, overrides: tuple[str, ...]):
    from pipeline.recipe import load_recipe  # late: the recipe schema (every method's declarations), not for --help

    return load_recipe(recipe, list(overrides))


@cli.command(epilog=EPILOG)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def check(recipe: str, overrides: tuple[str, ...]) -> None:
    """Validate RECIPE and print the resolved plan; loads no weights."""
    # late: the plan and the configs it checks (torch-free), not for --help
    from pipeline.eval.tasks_config import HUMANEVAL
    from pipeline.plan import GiB, check as check_plan
    from pipeline.publish.config import summary

    t0 = time.perf_counter()
    r = _load(recipe, overrides)
    plan = check_plan(r)
    m = plan.model
    click.echo(f"recipe {recipe}: valid ({time.perf_counter() - t0:.2f} s)")
    click.echo(f"model     {r.model.source}: {m.name}, {m.architecture}, {m.n_params / 1e6:.1f} M parameters, "
               f"{m.config.get('num_hidden_layers')} layers, hidden {m.config.get('hidden_size')}, "
               f"vocab {m.config.get('vocab_size')}")
    click.echo(f"          {m.provenance}; baseline in {plan.dtype} ([model] dtype = {r.model.dtype})")
    click.echo(f"run dir   {Path(r.run.output_dir) / r.run.name}   device {r.run.device}   seed {r.run.seed}")
    gpu = plan.gpu
    click.echo(f"device    {plan.device}" + (f" ({gpu.name}, {gpu.memory_bytes / GiB:.0f} GiB)" if gpu else "")
               + (f"; {gpu.note}" if gpu and gpu.note else ""))
    click.echo("stages    " + " -> ".join(plan.stages))
    for v in plan.variants:
        click.echo(f"variant   {v['name']} ({v['method']})")
        for rt in v["runtimes"]:
            note = f" — {rt['note']}" if rt.get("note") else ""
            click.echo(f"            {rt['runtime']}: {rt['kernel']}{note}")
    click.echo(f"memory    estimated peak {plan.peak_memory / GiB:.2f} GiB of {plan.memory_limit / GiB:.2f} GiB "
               f"({'[run] max_memory_gb' if r.run.max_memory_gb else 'this machine'}), per stage:")
    for k, b in plan.memory.items():
        how = "offloaded to disk (streams weights)" if plan.offload.get(k) else "in memory"
        click.echo(f"            {k:<32}{b / GiB:>7.2f} GiB  {how}")
    for name, why in plan.speed_skipped.items():
        click.echo(f"            {Speed.key(name):<32}{'':>11}  not timed: {why}")
    disk = ", ".join(f"{k} {b / GiB:.2f} GiB" for k, b in plan.disk.items() if b) or "no large files"
    reused = f", {plan.disk_reused / GiB:.2f} GiB already there" if plan.disk_reused else ""
    click.echo(f"disk      about {sum(plan.disk.values()) / GiB:.2f} GiB in the run folder ({disk}{reused}); "
               f"{plan.disk_free / GiB:.1f} GiB free")
    if r.publish is not None:
        click.echo(f"publish   {summary(r.publish)}")
    tasks = r.validate_.tasks
    if tasks.enabled and tasks.tasks:
        scored = [t for t in tasks.tasks if t != HUMANEVAL]
        sample = f"seed {tasks.seed}" if tasks.seed is not None else "the first items"
        parts = [f"{', '.join(scored)} (lm-eval, {tasks.scorer} scorer; {tasks.limit or 'all'} items each, "
                 f"{sample}, {tasks.num_fewshot}-shot)"] if scored else []
        if HUMANEVAL in tasks.tasks:
            parts.append(f"humaneval (greedy pass@1 on the first {tasks.limit or 164} problems; runs generated code "
                         "in a sandbox, execute_code = true)")
        click.echo(f"tasks     {'; '.join(parts)} on {tasks.models if tasks.models != 'all' else 'every model'}")
    if plan.serve_engines:
        served = {e for by in plan.serve_engines.values() for e, why in by.items() if why is None}
        versions = "; ".join(f"{e}: " + (", ".join(f"{k} {v}" for k, v in engines.get(e).version().items()) or "?")
                             for e in sorted(served))
        click.echo(f"serve     {versions}" + (" (vLLM compiles: ~60-90 s more start-up per model)"
                                              if "vllm" in served and r.validate_.serve.compile else ""))
        for name, by in plan.serve_engines.items():
            click.echo(f"            {name:<24}" + ", ".join(e if why is None else f"{e} skipped" for e, why in by.items()))
    for w in plan.warnings:
        click.echo(f"warning   {w}")


@cli.command(epilog=EPILOG)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def run(recipe: str, overrides: tuple[str, ...]) -> None:
    """Run every stage of RECIPE; completed stages whose inputs did not change are skipped."""
    # late: the run machinery, loaded by `compress run` only
    from pipeline.app.execute import execute
    from pipeline.plan import check as check_plan

    r = _load(recipe, overrides)
    plan = check_plan(r)
    t0 = time.perf_counter()
    code = execute(r, Path(recipe), plan)
    _print_summary(Path(r.run.output_dir) / r.run.name, time.perf_counter() - t0)
    sys.exit(code)


def _print_summary(run_dir: Path, wall: float) -> None:
    # late: the report's code, loaded by `compress run` only
    from pipeline.results import schema
    from pipeline.results.gates import gates_summary
    from pipeline.results.render import planned

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
    for name, e in rows:
        ppl = e.perplexity.value if e.perplexity else None
        ratio = f"{e.ppl_ratio:.4f}" if e.ppl_ratio is not None else ("1.0000" if name == "baseline" and ppl else "-")
        kl = f"{e.kl:.4f}" if e.kl is not None else "-"
        top1 = f"{e.top1:.3f}" if e.top1 is not None else "-"
        disk = f"{e.size_on_disk_bytes / 2**20:.0f}" if e.size_on_disk_bytes else "-"
        click.echo(f"{name:<20}{(f'{ppl:.3f}' if ppl else '-'):>10}{ratio:>8}{kl:>9}{top1:>7}{disk:>10}", err=True)
    click.echo(f"\nstatus {report.run.status} in {wall:.0f} s; gates: {gates_summary(report.gates)}; "
               f"report {run_dir / 'report.md'}", err=True)


@cli.command(epilog=EPILOG)
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
def report(run_dir: str) -> None:
    """Re-render report.md, plots and model cards of RUN_DIR from its stage outputs (no recomputation)."""
    from pipeline.results.render import render_report  # late: the renderers, loaded by `compress report` only

    path = Path(run_dir)
    render_report(path)
    click.echo(f"wrote {path / 'report.md'}")


@cli.command(epilog=EPILOG)
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
    # late: the measuring code and its configs, loaded by `compress eval` only
    from pipeline.eval.jobs import run_quality
    from pipeline.recipe import PerplexityConfig, SmokeConfig

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


@cli.command(epilog=EPILOG)
@click.argument("checkpoint", type=click.Path(file_okay=False, exists=True))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a [validate.speed] field, e.g. --set batch_sizes=[1,4].")
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", default=None, type=click.IntRange(min=1), help="torch threads (default: all cores).")
@click.option("--out", "out_json", default=None, type=click.Path(dir_okay=False),
              help="Also write the result to this JSON file.")
def bench(checkpoint: str, overrides: tuple[str, ...], device: str, threads: int | None, out_json: str | None) -> None:
    """Speed and memory of any checkpoint folder ([validate.speed] defaults), outside a recipe."""
    # late: the timing code (it imports torch) and its config, loaded by `compress bench` only
    from pipeline.eval.config import SpeedConfig
    from pipeline.eval.speed import run_speed_subprocess
    from pipeline.recipe import apply_override

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


@cli.command(epilog=EPILOG)
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False), default=None,
              help="A recipe whose [publish] table says where to push (default: the one in the run's lock). "
                   "Only its [publish] table is used: what is pushed is what the run's report lists.")
@click.option("--dry-run/--no-dry-run", default=None, help="Print which files would go where; touch nothing "
              "(default: the [publish] table's dry_run).")
@click.option("--partial/--no-partial", default=None, help="Push the exports whose gates passed even if others "
              "failed (default: the [publish] table's partial).")
def push(run_dir: str, recipe_path: str | None, dry_run: bool | None, partial: bool | None) -> None:
    """Publish the exports the finished run's report lists (re-checks the publish rule and file hashes first)."""
    # late: the Hub client and the run folder's lock, loaded by `compress push` only
    from pipeline.app.runner import RunLock
    from pipeline.publish.hub import publish_run

    path = Path(run_dir)
    cfg = _publish_config(path, recipe_path)
    cfg = cfg.model_copy(update={k: v for k, v in (("dry_run", dry_run), ("partial", partial)) if v is not None})
    with RunLock(path):  # exit 3 while a run (or another push) holds the folder
        try:
            section = publish_run(path, cfg, logging.getLogger("compress"))
        except CompressError as e:
            _record_publish(path, getattr(e, "section", None) or _failed_section(e))
            raise
        _record_publish(path, section)
    click.echo(json.dumps(section.model_dump(mode="json"), indent=2, default=str))


def _publish_config(run_dir: Path, recipe_path: str | None):
    from pipeline.recipe import load_recipe, validate  # late: the recipe schema, loaded by `compress push` only

    if recipe_path:
        r = load_recipe(recipe_path)
    else:
        lock = run_dir / "recipe.lock.toml"
        if not lock.is_file():
            raise RecipeError(f"{run_dir} has no recipe.lock.toml: is it a compress run folder?")
        r = validate(tomllib.loads(lock.read_text())["recipe"], lock)
    if r.publish is None:
        raise RecipeError("the recipe has no [publish] table: nothing says where to push")
    return r.publish


def _failed_section(e: CompressError):
    from pipeline.results.schema import PublishSection  # late: the report schema, loaded by `compress push` only

    return PublishSection(status="failed", reason=str(e))


def _record_publish(run_dir: Path, section) -> None:
    """`compress push` writes its outcome into the run's report (publish.items[] for a push)."""
    from pipeline.results import schema  # late: the report schema, loaded by `compress push` only

    try:
        report = schema.load(run_dir)
    except CompressError:
        return  # no readable report: the refusal itself already says so
    report.publish = section
    schema.save(report, run_dir)


@cli.command(epilog=EPILOG)
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP + " Applies to every run.")
def sweep(spec: str, overrides: tuple[str, ...]) -> None:
    """Run every recipe (or recipe x --set matrix) of the sweep SPEC, each in its own run folder; exits with the
    worst run's code. Every run is checked before the first starts."""
    from pipeline.app.sweep import run_sweep, summary_table  # late: the run machinery, loaded by `compress sweep` only

    t0 = time.perf_counter()
    rows, code = run_sweep(Path(spec), list(overrides))
    click.echo(summary_table(rows))
    click.echo(f"sweep: {len(rows)} run(s) in {time.perf_counter() - t0:.0f} s; exit {code} (the worst run's)")
    sys.exit(code)


def _leave_now(code: int) -> None:
    """Exit after an interrupt without the interpreter's shutdown: a stage stopped mid-way can leave an engine's
    worker threads running (GPTQModel's pool), and their C++ destructors abort a normal shutdown (exit 134 instead of
    the documented code). The run's state is already saved and its lock released at this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@cli.command(epilog=EPILOG)
@click.argument("export_dir", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Bind address; anything but loopback needs an API key.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--engine", default="auto", show_default=True, type=click.Choice(["auto", *ENGINE_NAMES]),
              help="auto: the engine the export's run measured fastest here (its serving.json, at the level "
                   "nearest --slots), else transformers for Hugging Face folders, llama.cpp for a .gguf file; vllm: "
                   "vLLM's server "
                   "from its own environment (scripts/setup.sh), supervised by this process.")
@click.option("--api-key", default=None, help="Key requests must send as 'Authorization: Bearer KEY' "
              "(or set COMPRESS_API_KEY, which keeps it out of the process list).")
@click.option("--slots", default=16, show_default=True, type=click.IntRange(min=1),
              help="Requests generated at once (continuous batching; vLLM's --max-num-seqs).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests waiting for a slot; more get 503 (not vllm: refused when given).")
@click.option("--queue-timeout-s", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Longest wait for a slot before 503 with Retry-After (not vllm).")
@click.option("--max-tokens-limit", default=2048, show_default=True, type=click.IntRange(min=1),
              help="Largest max_tokens a request may ask for (not vllm).")
@click.option("--max-model-len", default=2048, show_default=True, type=click.IntRange(min=2),
              help="Longest prompt + output served (capped at the model's context); sizes the KV cache.")
@click.option("--drain-s", default=10.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM, how long in-flight requests may take to finish.")
@click.option("--start-timeout-s", default=600.0, show_default=True, type=click.FloatRange(min=1),
              help="vllm: longest its start-up may take before exit 4 (it compiles on its first start).")
@click.option("--enforce-eager", is_flag=True, help="vllm: skip its torch.compile step (faster start, slower serving).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", default=None, type=click.IntRange(min=1), help="torch threads (default: all cores).")
@click.pass_context
def serve(ctx: click.Context, export_dir: str, host: str, port: int, engine: str, api_key: str | None, slots: int,
          max_queue: int, queue_timeout_s: float, max_tokens_limit: int, max_model_len: int, drain_s: float,
          start_timeout_s: float, enforce_eager: bool, device: str, threads: int | None) -> None:
    """Serve EXPORT_DIR over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health) with continuous batching."""
    from pipeline.serve.server import serve as run_server  # late: the server, loaded by `compress serve` only

    explicit = frozenset(o for o in OPTIONS if ctx.get_parameter_source(o) is not ParameterSource.DEFAULT)
    opts = ServeOptions(host=host, port=port, key=api_key, slots=slots, max_queue=max_queue,
                        queue_timeout_s=queue_timeout_s, max_tokens_limit=max_tokens_limit,
                        max_model_len=max_model_len, drain_s=drain_s, device=device, threads=threads,
                        start_timeout_s=start_timeout_s, enforce_eager=enforce_eager, explicit=explicit)
    sys.exit(run_server(export_dir, engine, opts))


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
