"""validate: measure every model in a fresh process — quality (perplexity, KL, top-1, smoke test),
speed, the serving engines, the speculative pair and every plug-in measurement (pipeline/eval/measures/: each
declares its own units). Gates are applied by the runner after all units (pipeline/plan.py)."""
from __future__ import annotations

import functools
import json
import logging

from safetensors.torch import load_file
from tqdm import tqdm

from pipeline import data
from pipeline.base.fileio import atomic_write_json
from pipeline.base.unit import Unit, UnitContext
from pipeline.base.worker import run_task
from pipeline.eval.jobs import run_quality
from pipeline.eval.measures import BASELINE, all_measurements
from pipeline.eval.measures.tasks import TASKS, task_identity
from pipeline.eval.perplexity import make_windows
from pipeline.eval.quality import EVAL_IDS
from pipeline.eval.speed import run_speed_subprocess, speed_skip
from pipeline.eval.tasks import score_served
from pipeline.eval.tasks_config import task_jobs
from pipeline.model.llamacpp_model import scored_in_llama_cpp
from pipeline.quant.registry import model_code, variant_format
from pipeline.serve import engines
from pipeline.serve.config import engine_plan, model_format
from pipeline.serve.folder import inspect
from pipeline.serve.loadtest import corpus_prompts
from pipeline.serve.measure import Refused, measure
from pipeline.serve.served_nll import served_vs_in_process
from pipeline.stages.draft import verifier_code, verifier_key
from pipeline.stages.kinds import Draft, Load, Quality, Quantize, Serve, Speculative, Speed

# the entry module; what it imports (the worker, the eval and speculative code it runs, the measurements'
# declarations) is found by pipeline/base/codehash.py (pipeline/eval/measures/base.py CODE: the same)
CODE = ("stages/validate.py",)
log = logging.getLogger("compress")


def units(recipe) -> list[Unit]:
    v = recipe.validate_
    models = [("baseline", Load.key())] + [(q.name, Quantize.key(q.name)) for q in recipe.quantize]
    ppl = v.perplexity
    eval_data = data.identity(data.resolve(ppl.dataset, ppl.text_field))  # the evaluation text, by content

    formats = {q.name: variant_format(q) for q in recipe.quantize}
    out = []
    for name, src in models:
        code = CODE + model_code(recipe, name)  # a variant's checkpoint is loaded by its method's reload hook
        deps = [src] if name == "baseline" else [src, Quality.key("baseline")]
        cfg = {"perplexity": ppl.model_dump(), "smoke": v.smoke.model_dump(), "device": recipe.run.device,
               "data": eval_data}
        out.append(Unit(Quality.key(name), cfg, functools.partial(quality, recipe=recipe, name=name, src=src),
                        deps=deps, code=code))
        if v.speed.enabled and (v.speed.models == "all" or name in v.speed.models):
            speed_cfg = {"speed": v.speed.model_dump(), "device": recipe.run.device,
                         "max_memory_gb": recipe.run.max_memory_gb}  # over it, the model is not timed
            out.append(Unit(Speed.key(name), speed_cfg,
                            functools.partial(speed, recipe=recipe, name=name, src=src), deps=[src], code=code))
        out += serve_units(recipe, name, src, formats.get(name), eval_data, code)
    # a unit runs after those before it in this list: a serve unit that scores the tasks reads the baseline's
    # in-process task items, so it follows the measurements' units
    measured = [u for m in all_measurements() for u in m.units(recipe, models)]
    baselines = {m.unit_key(BASELINE) for m in all_measurements()}
    after = [u for u in out if baselines & set(u.deps)]
    out = [u for u in out if not baselines & set(u.deps)] + measured + after
    if recipe.draft is not None:
        out.append(speculative_unit(recipe))
    return out


def serve_units(recipe, name: str, src: str, fmt: str | None, eval_data, code: tuple) -> list[Unit]:
    """validate/<model>/serve/<engine>, one per engine [validate.serve] engines asks for this model's format
    (pipeline/serve/config.py engine_plan). Each identity holds its engine's installed version: a rerun after
    installing (or upgrading) an engine serves the model in it again, and only there."""
    cfg, tasks = recipe.validate_.serve, recipe.validate_.tasks
    if not cfg.serves(name):
        return []
    fmt = fmt or model_format(None)
    device = engines.device_kind(recipe.run.device)  # "auto": planned for the CPU
    plan, _ = engine_plan(cfg, fmt, device, name)
    out = []
    for engine, skipped in plan.items():
        config = {"serve": cfg.model_dump(exclude={"engines", "engine_models", "engine_options"}), "engine": engine,
                  "engine_version": engines.get(engine).version(), "device": recipe.run.device, "data": eval_data}
        if engine in cfg.engine_options:  # its own choices only: another engine's never reruns this unit
            config["engine_options"] = cfg.engine_options[engine].model_dump()
        deps = [src, Quality.key(name)] + ([Quality.key("baseline")] if name != "baseline" else [])
        if tasks.served_by(name, engine):  # [validate.tasks] engines: the tasks scored through this server too
            config["tasks"] = task_identity(tasks, task_jobs(tasks))
            deps += [TASKS.unit_key(BASELINE)] if name != "baseline" else []  # recovery: its in-process items
        out.append(Unit(Serve.key(name, engine), config,
                        functools.partial(serve, recipe=recipe, name=name, src=src, engine=engine, skipped=skipped),
                        deps=deps, code=code))
    return out


def speculative_unit(recipe) -> Unit:
    """Acceptance and speed-up of the draft: every [draft] field (gamma and [draft.measure] are read here, and
    only here) and the held-out prompts by content."""
    cfg, ppl = recipe.draft, recipe.validate_.perplexity
    if cfg.measure.prompts is not None:
        prompts = {"dataset": cfg.measure.prompts, "data": data.identity(data.resolve(cfg.measure.prompts))}
    else:  # paragraphs of the evaluation corpus
        prompts = {"dataset": ppl.dataset, "text_field": ppl.text_field,
                   "data": data.identity(data.resolve(ppl.dataset, ppl.text_field))}
    config = {"draft": cfg.model_dump(mode="json"), "prompts": prompts, "device": recipe.run.device}
    return Unit(Speculative.key(), config, lambda ctx: speculative(ctx, recipe),
                deps=[Draft.key(), verifier_key(recipe)], code=CODE + verifier_code(recipe))


def quality(ctx: UnitContext, recipe, name: str, src: str) -> dict:
    v = recipe.validate_
    ref = None if name == "baseline" else ctx.dep(Quality.key("baseline"))
    return run_quality(ctx.dep(src), ctx.out, v.perplexity, v.smoke, ctx.device, recipe.run.threads, reference=ref,
                       label=name, memory_limit=recipe.run.memory_limit_bytes)


def speed(ctx: UnitContext, recipe, name: str, src: str) -> dict:
    """Time one model in a fresh process; under [run] max_memory_gb, a model whose timing would not fit is not
    timed and the reason is recorded instead (speed_skip)."""
    cfg = recipe.validate_.speed.for_model(name)
    in_llama_cpp = scored_in_llama_cpp(ctx.dep(src))
    skipped = ({"skipped": f"not timed in transformers, which cannot rebuild this GGUF file ({in_llama_cpp}); "
                           "llama.cpp's server times it where [validate.serve] serves it"} if in_llama_cpp is not None
               else speed_skip(ctx.dep(src), cfg.model_dump(mode="json"), recipe.run.memory_limit_bytes, ctx.device))
    if skipped is not None:
        log.warning("speed of %s: %s", name, skipped["skipped"])
        atomic_write_json(ctx.out / "speed.json", skipped)
        return skipped
    return run_speed_subprocess(ctx.dep(src), recipe.validate_.speed, ctx.device, ctx.out / "speed.json",
                                model_name=name, threads=recipe.run.threads)


def speculative(ctx: UnitContext, recipe) -> dict:
    cfg, draft = recipe.draft, ctx.dep(Draft.key())
    args = {"verifier": str(ctx.dep(verifier_key(recipe))), "draft": str(draft),
            "prompts": held_out_prompts(cfg.measure.num_prompts, recipe.validate_.perplexity, cfg.measure.prompts),
            "draft_cfg": cfg.model_dump(mode="json"), "seed": ctx.seed, "device": ctx.device,
            "undistilled": str(draft / "undistilled") if (draft / "undistilled").is_dir() else None,
            "fp_distilled": str(draft / "fp-distilled") if (draft / "fp-distilled").is_dir() else None}
    return run_task("speculative", args, ctx.out, recipe.run.threads)


def held_out_prompts(n: int, ppl_cfg, dataset: str | None = None) -> list[str]:
    """Prompts for measuring acceptance, never trained on: `n` documents spread through `dataset` (each one
    prompt), or by default paragraphs of the evaluation corpus."""
    if dataset is not None:
        docs = data.documents(data.resolve(dataset))
        if len(docs) < n:
            raise ValueError(f"prompt set {dataset!r} has {len(docs)} prompts; [draft.measure] num_prompts "
                             f"asks for {n}")
        return [docs[i * len(docs) // n] for i in range(n)]
    rows = data.documents(data.resolve(ppl_cfg.dataset, ppl_cfg.text_field))
    paragraphs = [r.strip() for r in rows if len(r) > 300 and not r.strip().startswith("=")]
    if len(paragraphs) < n:
        raise ValueError(f"the evaluation corpus has only {len(paragraphs)} usable prompts; {n} requested")
    step = len(paragraphs) // n
    return [paragraphs[i * step][:600] for i in range(n)]


def serve(ctx: UnitContext, recipe, name: str, src: str, engine: str, skipped: str | None) -> dict:
    """`compress serve --engine <engine>` on the model's checkpoint: greedy output against generate's, then the load
    test. An engine not installed here records why it was not served instead."""
    cfg, ppl = recipe.validate_.serve, recipe.validate_.perplexity
    folder = inspect(ctx.dep(src))
    if skipped:
        log.warning("serve %s in %s: skipped: %s", name, engine, skipped)
        return {"engine": engine, "skipped": skipped}
    engines.choose(folder.checkpoint_format, str(folder.path), engine, ctx.device)
    prompts = corpus_prompts(max(64, 2 * max(cfg.concurrency)), cfg.prompt_words, ppl.dataset)
    score, unscored = None, None
    if engines.get(engine).prompt_logprobs and cfg.perplexity:  # scored from its prompt log-probabilities
        context = folder.context  # max_position_embeddings (pipeline/serve/folder.py)
        if context is not None and ppl.seq_len + 1 > context:  # a window and the one token vLLM must generate
            unscored = (f"a perplexity window of {ppl.seq_len} tokens and one generated token exceed the model's "
                        f"context of {context} (max_position_embeddings)")
            log.warning("serve %s: perplexity through the server not scored: %s", name, unscored)
        else:
            score = functools.partial(served_perplexity, ctx=ctx, name=name, ppl_cfg=ppl, timeout_s=cfg.timeout_s)
            longest = max(cfg.max_model_len, ppl.seq_len + 8)
            cfg = cfg.model_copy(update={"max_model_len": longest if context is None else min(longest, context)})
    scored_tasks = None
    if recipe.validate_.tasks.served_by(name, engine):
        # lm-eval's clients x their batches of prompts within what the server admits at once (measure() starts it
        # with slots and queue of max(concurrency) each; a batch above that is HTTP 400, a crowd 503)
        room, concurrent = 2 * max(cfg.concurrency), min(4, max(cfg.concurrency))
        scored_tasks = functools.partial(served_tasks, ctx=ctx, recipe=recipe, name=name, folder=folder.path,
                                         max_length=cfg.max_model_len, concurrent=concurrent,
                                         batch=max(1, min(recipe.validate_.tasks.batch_size, room // concurrent)))
    try:
        result = measure(folder.path, cfg, prompts, ctx.out, recipe.run.threads, ctx.device, engine=engine,
                         score=score, score_tasks=scored_tasks)
    except Refused as e:
        if engine == engines.default_engine(folder.format):
            raise  # the engine the model is meant to be served by: the unit fails
        log.warning("serve %s: %s refused it: %s", name, engine, e)
        return {"engine": engine, "refused": e.line, "versions": engines.get(engine).version()}
    if unscored is not None:
        result["perplexity"] = {"skipped": unscored}
    eq = result["equality"]
    if eq.get("exact", True) and eq["prompts"] and eq["identical"] < eq["prompts"]:
        log.warning("serve %s: greedy output through the server differs from generate's on %d of %d prompts",
                    name, eq["prompts"] - eq["identical"], eq["prompts"])
    elif eq["prompts"] and eq["identical"] < eq["prompts"]:
        log.info("serve %s (%s): greedy output equals transformers' generate on %d of %d prompts "
                 "(different kernels: not expected to be identical)", name, engine, eq["identical"], eq["prompts"])
    return result


SERVED_PPL_WARN = 0.01  # served / in-process perplexity further than this from 1: a warning (measured: 0.998-1.001)


def served_perplexity(url: str, model: str, ctx: UnitContext, name: str, ppl_cfg, timeout_s: float) -> dict:
    """The quality stage's windows scored through the server at url (pipeline/serve/served_nll.py): the baseline's
    evaluation ids, the same windows; beside the model's in-process perplexity (validate/<model>/quality)."""
    ids = load_file(ctx.dep(Quality.key("baseline")) / EVAL_IDS)["input_ids"].tolist()
    mine = json.loads((ctx.dep(Quality.key(name)) / "metrics.json").read_text())["perplexity"]
    windows = make_windows(len(ids), ppl_cfg.seq_len, ppl_cfg.stride, ppl_cfg.max_windows)
    with tqdm(total=len(windows), desc=f"served perplexity {name}", unit="win", leave=False) as bar:
        got = served_vs_in_process(url, model, ids, windows, mine, name, timeout_s, bar.update)
    (log.warning if abs(got["ratio"] - 1) > SERVED_PPL_WARN else log.info)(
        "serve %s: perplexity through the server %.4f, in process %.4f (x%.4f, %d windows)", name, got["value"],
        got["in_process"], got["ratio"], len(windows))
    return got


def served_tasks(url: str, model: str, ctx: UnitContext, recipe, name: str, folder, max_length: int,
                 concurrent: int, batch: int) -> dict:
    """[validate.tasks] engines: the run's tasks scored through the server at url (pipeline/eval/tasks.py
    score_served) on the in-process unit's items; a variant's recovery against the baseline's in-process items."""
    cfg = recipe.validate_.tasks
    ref = None if name == "baseline" else str(ctx.dep(TASKS.unit_key(BASELINE)))
    return score_served(url, model, folder, task_jobs(cfg), {"limit": cfg.limit, "seed": cfg.seed,
                                                             "num_fewshot": cfg.num_fewshot,
                                                             "batch_size": batch},
                        ctx.out / "tasks", ref, cfg.bootstrap, max_length, concurrent)
