"""`compress check`: the recipe and the plan, torch-free."""
from __future__ import annotations

import time
from pathlib import Path

import click

from pipeline.app.commands import EPILOG, SET_HELP
from pipeline.eval.tasks_config import HUMANEVAL
from pipeline.plan import GiB
from pipeline.plan import check as check_plan
from pipeline.publish.config import summary
from pipeline.recipe import load_recipe
from pipeline.serve import engines
from pipeline.stages.kinds import Speed


@click.command(epilog=EPILOG)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def check(recipe: str, overrides: tuple[str, ...]) -> None:
    """Validate RECIPE and print the resolved plan; loads no weights."""
    t0 = time.perf_counter()
    r = load_recipe(recipe, list(overrides))
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
        click.echo(f"serve     {versions}" + "".join(engines.get(e).check_note(r.validate_.serve)
                                                   for e in sorted(served)))
        for name, by in plan.serve_engines.items():
            click.echo(f"            {name:<24}"
                       + ", ".join(e if why is None else f"{e} skipped" for e, why in by.items()))
    for w in plan.warnings:
        click.echo(f"warning   {w}")
