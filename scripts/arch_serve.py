"""The architecture matrix's serving part (issue #41): each architecture's exports served by each engine compress
serves with, through the recipe's own [validate.serve] table, recorded in docs/architectures.json (each
architecture's "serve") and rendered as docs/architectures.md's Serving section by scripts/arch_matrix.py.

    python scripts/arch_matrix.py --serve                                  # every architecture, both engines
    python scripts/arch_matrix.py --serve --only llama --engines vllm --exports baseline,w8a8

Per (architecture, engine, export): `compress check` on a recipe holding that export's variant (none for the
baseline) and a [validate.serve] table serving it in that engine alone; a refusal is recorded with its codes and
message, and an export whose method check refuses for the architecture is "no export". The cells that pass go through
one `compress run` per architecture and engine (the quantizations and quality units are shared: one run folder per
architecture, resumed), serving each export in [validate.serve] `engine_models`; each cell is read from report.json:
served (its load test finished with 0 errors; the greedy outputs through the server against generate's: token for
token for transformers, recorded for vLLM, whose kernels differ), or failed at run (the serve unit's error line, or the
engine's own refusal at start-up, or the run's error when the export was never made).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("transformers", "vllm")
BASELINE = "baseline"
# the served exports: the unquantized baseline and one export of each checkpoint format the HF engines read
# (gptq: GPTQ format; awq; rtn-ct: compressed-tensors W4A16; bnb-int8: bitsandbytes; torchao; w8a8:
# compressed-tensors INT8 W8A8). GGUF is llama.cpp's: not served here
EXPORTS = (BASELINE, "gptq", "awq", "rtn-ct", "bnb-int8", "torchao", "w8a8")
DEFAULT_EXPORTS = (BASELINE, "gptq", "rtn-ct", "w8a8")  # what a plain --serve measures: cheap, every vLLM CPU format
# the recipe's [validate.serve] table, models/engines/engine_models set per run: small levels, few tokens, vLLM in
# eager mode (its compile step is ~60-90 s more per model on 2 cores), perplexity through vLLM's server
SERVE: dict[str, Any] = {"enabled": True, "concurrency": [1, 4], "requests_per_level": 4, "max_tokens": 8,
                         "prompt_words": 16, "equality_prompts": 2, "equality_tokens": 8, "max_model_len": 256,
                         "compile": False, "timeout_s": 300, "perplexity": True}
TIMEOUT_S = 1500
# the matrix's models with head size 32 (scripts/arch_configs.py SERVE_SHAPES): vLLM's CPU attention has no kernel for
# the matrix's 16, and `compress check` refuses vLLM for those (pipeline/serve/engines/vllm.py cpu_attention_missing)
MODELS = "tests/fixtures/arch/serve"
ATTEMPTS = 3
EDITED = "changed on disk during the run"  # pipeline/app: a unit whose code was edited mid-run records nothing

SERVED, REFUSED, FAILED, NO_EXPORT = "served", "refused", "failed", "no export"


def _script(name: str):
    """scripts/<name>.py as a module, once (scripts/ is not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _matrix():
    return _script("arch_matrix")


# ---------------------------------------------------------------- recipes and check


def recipe_data(arch: str, plan: dict[str, list[str]], output_dir: str | Path) -> dict[str, Any]:
    """The recipe serving these exports: plan = {engine: [exports]} (every export's variant, one serve table)."""
    exports = [x for x in EXPORTS if any(x in xs for xs in plan.values())]
    data = _matrix().recipe_data(arch, [x for x in exports if x != BASELINE], output_dir)
    data["model"]["source"] = f"config:{MODELS}/{arch}.json"
    data["validate"]["serve"] = {**SERVE, "models": exports, "engines": list(plan),
                                 "engine_models": {e: xs for e, xs in plan.items() if xs != exports}}
    return data


def recipe_toml(arch: str, plan: dict[str, list[str]], output_dir: str | Path) -> str:
    import tomli_w

    m = _matrix()
    head = (f"# The architecture matrix's serving run of {arch} ({m.COMMAND} --serve --only {arch}).\n"
            "# Run it from the repository root: its model source is a relative path.\n")
    return head + tomli_w.dumps(recipe_data(arch, plan, output_dir))


def check_cell(arch: str, engine: str, export: str) -> dict[str, Any]:
    """`compress check` on the recipe serving this export in this engine: {"passed": True}, {"passed": False,
    "codes", "reason"}, or {"no_export": the method's refusal} when check refuses the export's method itself."""
    m = _matrix()
    if export != BASELINE:
        method = m.check_cell(arch, export)
        if not method["passed"]:
            return {"passed": False, "no_export": True, "codes": method["codes"], "reason": method["reason"]}
    return m.check_recipe(recipe_data(arch, {engine: [export]}, m.SCRATCH), f"{arch}-{engine}-{export}")


def fresh_verdicts(arch: str, engines: list[str], exports: list[str]) -> dict[str, dict[str, dict]]:
    """check_cell for each (engine, export) in a new process: the code on disk now (see arch_matrix.fresh_verdicts)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "arch_matrix.py"), "--serve-verdicts", arch,
           "--engines", ",".join(engines), "--exports", ",".join(exports)]
    return json.loads(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout)


def verdicts(arch: str, engines: list[str], exports: list[str]) -> dict[str, dict[str, dict]]:
    return {e: {x: check_cell(arch, e, x) for x in exports} for e in engines}


# ---------------------------------------------------------------- runs


def measure(arch: str, engines: list[str], exports: list[str], scratch: Path, timeout_s: int) -> dict[str, dict]:
    """{engine: {"run": info, "cells": {export: cell}}}: check every cell, then one run per engine with the cells
    that passed (one run folder per architecture: the exports and their quality units are made once)."""
    m = _matrix()
    out: dict[str, dict] = {}
    for engine, by_export in fresh_verdicts(arch, engines, exports).items():
        cells: dict[str, dict] = {}
        for x, v in by_export.items():
            if v.get("no_export"):
                cells[x] = {"status": NO_EXPORT, "codes": v["codes"], "reason": v["reason"], "date": m._today()}
            elif not v["passed"]:
                cells[x] = {"status": REFUSED, "codes": v["codes"], "reason": v["reason"], "date": m._today()}
        passed = [x for x in exports if x not in cells]
        info: dict[str, Any] = {}
        for attempt in range(ATTEMPTS if passed else 0):
            # a unit that read code another checkout edited mid-run records nothing: the run resumes, it reruns
            info, ran = run(arch, engine, passed, scratch, timeout_s)
            cells.update({x: {**r, "date": info["date"]} for x, r in ran.items()})
            info["attempts"] = attempt + 1
            if not any(EDITED in r.get("error", "") for r in ran.values()):
                break
        for x, r in list(cells.items()):
            if EDITED in r.get("error", ""):  # still: the serve unit's own record, if an earlier attempt completed it,
                found = unit_record(scratch / "serve-runs" / arch, engine, x)  # else not measured (no cell)
                if found is None:
                    del cells[x]
                    info.setdefault("not_measured", []).append(x)
                else:
                    cells[x] = found
        out[engine] = {"run": info, "cells": cells}
    return out


def run(arch: str, engine: str, exports: list[str], scratch: Path, timeout_s: int) -> tuple[dict, dict]:
    """One `compress run` serving these exports in this engine. Returns (run info, {export: cell})."""
    m = _matrix()
    folder = scratch / "serve" / arch
    folder.mkdir(parents=True, exist_ok=True)
    recipe = folder / f"{engine}.toml"
    recipe.write_text(recipe_toml(arch, {engine: exports}, scratch / "serve-runs"))
    log = folder / f"{engine}.log"
    exe = Path(sys.executable).with_name("compress")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "pipeline.app.cli"]
    commit, t0 = m.tree_state(), time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen([*cmd, "run", str(recipe)], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    report_path = scratch / "serve-runs" / arch / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    info = {"exit_code": rc, "wall_s": round(time.monotonic() - t0, 1), "date": m._today(), "commit": commit,
            "exports": exports, "command": f"{m.COMMAND} --serve --only {arch} --engines {engine} --exports "
                                          f"{','.join(exports)}"}
    run_error = ("" if rc == 0 else f"the run timed out after {timeout_s} s (killed)" if rc is None
                 else f"the run ended with exit {rc}: " + str(((report or {}).get("run") or {}).get("error")))
    return info, {x: cell_of_report(report, engine, x, run_error) for x in exports}


def cell_of_report(report: dict | None, engine: str, export: str, run_error: str) -> dict[str, Any]:
    """One (engine, export) cell from report.json: served, or failed with the line that says why."""
    from pipeline.stages.kinds import Quality, Quantize, Serve

    report = report or {}
    entry = (report.get("baseline") if export == BASELINE else (report.get("variants") or {}).get(export)) or {}
    rec = (entry.get("served") or {}).get(engine) or {}
    stages = report.get("stages") or {}
    path = ([] if export == BASELINE else [Quantize.key(export)]) + [Quality.key(export), Serve.key(export, engine)]
    failed = next((k for k in path if (stages.get(k) or {}).get("status") == "failed"), None)
    if failed is not None:
        return {"status": FAILED, "error": f"{failed}: {_first_line(stages[failed].get('error') or '')}"}
    if rec.get("refused"):
        return {"status": FAILED, "error": f"{engine} refused it at start-up: {rec['refused']}"}
    if rec.get("skipped"):
        return {"status": FAILED, "error": f"skipped at run: {rec['skipped']}"}
    levels = rec.get("levels")
    if not levels:
        return {"status": FAILED, "error": run_error or "no serve record in report.json and no failed unit"}
    return served_cell(rec)


def unit_record(run_dir: Path, engine: str, export: str) -> dict[str, Any] | None:
    """The cell from the serve unit's own metrics.json, written when an earlier attempt completed it (a later
    attempt's rerun of it, stopped by an edit to the code it imports, left report.json without it); None if none."""
    from pipeline.stages.kinds import Serve

    path = run_dir / Serve.key(export, engine) / "metrics.json"
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    if rec.get("refused"):
        return {"status": FAILED, "error": f"{engine} refused it at start-up: {rec['refused']}", "record": str(path)}
    if not rec.get("levels"):
        return None
    m = _matrix()
    return {**served_cell(rec), "record": "the serve unit's metrics.json from an earlier attempt of the run (the last "
                                          "attempt's rerun of it was stopped by an edit to pipeline/)",
            "date": m._today()}


def served_cell(rec: dict) -> dict[str, Any]:
    """A finished serve record: served when every request of every level completed without error and, for an exact
    engine (the same kernels as generate), every greedy output equals generate's."""
    levels = rec.get("levels") or []
    requests = sum(int(lv.get("requests") or 0) for lv in levels)
    errors = sum(int(lv.get("errors") or 0) for lv in levels)
    completed = sum(int(lv.get("completed") or 0) for lv in levels)
    eq = rec.get("equality") or {}
    exact = eq.get("exact", True)
    ppl = rec.get("perplexity") or {}
    out: dict[str, Any] = {
        "requests": requests, "errors": errors, "levels": [lv.get("concurrency") for lv in levels],
        "greedy": f"{eq.get('identical')}/{eq.get('prompts')}", "exact": exact, "ready_s": rec.get("ready_s"),
        "output_tok_s": [_r(lv.get("output_tok_s"), 1) for lv in levels],
        "versions": rec.get("versions") or {}, **({"kernels": rec["kernels"]} if rec.get("kernels") else {}),
        **({"served_dtype": rec["served_dtype"]} if rec.get("served_dtype") else {}),
        **({"served_ppl_ratio": _r(ppl.get("ratio"), 4)} if ppl.get("ratio") is not None else {})}
    if errors or completed < requests:
        return {"status": FAILED, "error": f"{errors} of {requests} requests failed ({completed} completed)", **out}
    if exact and eq.get("prompts") and eq.get("identical") != eq.get("prompts"):
        return {"status": FAILED, "error": f"greedy output through the server differs from generate's on "
                                           f"{eq['prompts'] - eq['identical']} of {eq['prompts']} prompts", **out}
    return {"status": SERVED, **out}


def _r(x: Any, digits: int) -> Any:
    return round(x, digits) if isinstance(x, (int, float)) else x


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def machine(engine: str) -> dict[str, Any]:
    """What an engine's check verdicts depend on beyond the code: vLLM's CPU build refuses weight-only formats and an
    FP8 KV cache on an AVX2-only CPU, and every model when it is not installed."""
    if engine != "vllm":
        return {}
    from pipeline.serve.engines import vllm

    dist = vllm.distribution(vllm.python())
    return {"cpu": "avx2-only" if vllm.avx2_only() else "avx512-or-other", "vllm": " ".join(dist) if dist else None}


def merge(data: dict, arch: str, measured: dict[str, dict], here: dict[str, dict] | None = None) -> dict:
    """These engines' cells (and runs) into architecture `arch`'s serve record; other cells are kept. `here`:
    {engine: machine(engine)} where they were checked (default: this machine)."""
    data["serve_settings"] = SERVE
    entry = data.setdefault("architectures", {}).setdefault(arch, {"cells": {}})
    serve = entry.setdefault("serve", {})
    for engine, got in measured.items():
        rec = serve.setdefault(engine, {"cells": {}})
        if got["run"]:
            rec["run"] = got["run"]
        rec["cells"].update(got["cells"])
        facts = here[engine] if here is not None and engine in here else machine(engine)
        if facts:
            rec["machine"] = facts
    return data


def verdict_differs(recorded: dict, now: dict) -> str | None:
    """Why check's verdict `now` on a cell differs from the `recorded` cell, or None."""
    status = recorded["status"]
    if status in (REFUSED, NO_EXPORT):
        if now["passed"] or bool(now.get("no_export")) != (status == NO_EXPORT) or now["codes"] != recorded["codes"]:
            return (f"recorded {status} {recorded['codes']}, check now "
                    + ("passes" if now["passed"] else f"refuses {now['codes']}: {now['reason']}"))
        return None
    if not now["passed"]:
        return f"recorded {status} (passed check), check now refuses {now['codes']}: {now['reason']}"
    return None


# ---------------------------------------------------------------- the document

STATUS_TEXT = {SERVED: "served", REFUSED: "refused at check", FAILED: "FAILS at run", NO_EXPORT: "no export"}


def counts(data: dict) -> dict[str, dict[str, int]]:
    out = {e: {s: 0 for s in STATUS_TEXT} for e in ENGINES}
    for entry in data.get("architectures", {}).values():
        for engine, rec in (entry.get("serve") or {}).items():
            for cell in rec["cells"].values():
                out.setdefault(engine, {s: 0 for s in STATUS_TEXT})[cell["status"]] += 1
    return out


def cell_text(cell: dict | None, width: int = 90) -> str:
    m = _matrix()
    if cell is None:
        return "not measured"
    status = cell["status"]
    if status == SERVED:
        return f"ok {cell.get('greedy')}"
    if status in (REFUSED, NO_EXPORT):
        return f"{'refused' if status == REFUSED else 'no export'}: " + ", ".join(cell.get("codes") or [])
    return "FAILS: " + m._short(re.sub(r"(?<!\S)/\S+/(?=[^/\s]+: )", "", m._core(cell.get("error", ""))), width)


def render(data: dict) -> list[str]:
    """docs/architectures.md's Serving section (lines), from the JSON alone."""
    m = _matrix()
    archs = [a for a in m.all_architectures() if (data.get("architectures", {}).get(a) or {}).get("serve")]
    if not archs:
        return []
    n = counts(data)
    totals = "; ".join(f"{e}: {c[SERVED]} served, {c[REFUSED]} refused at check, {c[FAILED]} failing at run, "
                       f"{c[NO_EXPORT]} without an export (method refused at check)" for e, c in n.items())
    lines = [
        "", "## Serving", "",
        "Each architecture's exports served by each engine compress serves with (`compress serve`, as validate runs it "
        "from the recipe's `[validate.serve]` table): transformers (compress's own server) and vLLM (its CPU build, "
        "`.venv-vllm`). One export per checkpoint format: the unquantized baseline, `gptq` (GPTQ format), `awq`, "
        "`rtn-ct` (compressed-tensors W4A16), `bnb-int8` (bitsandbytes), `torchao`, `w8a8` (compressed-tensors "
        "INT8 W8A8); their `[[quantize]]` tables are the Methods above. Per cell, `compress check` on the recipe "
        "serving that export in that engine alone; those it passes go through one `compress run` per architecture and "
        "engine. The models are the matrix's with 2 attention heads of 32 instead of 4 of 16 "
        f"(`{MODELS}/`, written by `scripts/arch_configs.py`): vLLM's CPU attention has no kernel for head size 16, "
        "and `compress check` refuses vLLM for the matrix's own models, saying so.",
        "",
        "A cell is **ok i/n** when the load test finished with 0 errors and i of n greedy outputs through the server "
        "equal transformers `generate`'s on the same checkpoint (token for token; transformers must match all of "
        "them, vLLM's kernels and precision differ, so its count is recorded: on a random model's near-uniform "
        "logits a tie breaks either way); **refused: `code`** when check refused it (reason below); **no export** "
        "when check refuses the method itself for the architecture (the table above); **FAILS** with the error "
        "line when it failed at run.",
        "",
        f"Totals: {totals}.",
        "",
        f"`[validate.serve]` settings: `{json.dumps(data.get('serve_settings', {}), sort_keys=True)}` (models, "
        "engines and engine_models per run). Measure again: "
        f"`{m.COMMAND} --serve --only <types> --engines <engines> --exports <exports>`.",
    ]
    for engine in ENGINES:
        exports = [x for x in EXPORTS if any(x in ((data["architectures"][a].get("serve") or {}).get(engine) or {})
                                             .get("cells", {}) for a in archs)]
        if not exports:
            continue
        lines += ["", f"### {'vLLM' if engine == 'vllm' else engine}", "",
                  "| architecture | " + " | ".join(exports) + " |", "|---|" + "---|" * len(exports)]
        for a in archs:
            cells = ((data["architectures"][a]["serve"].get(engine)) or {}).get("cells", {})
            moe = " (MoE)" if data["architectures"][a].get("moe") else ""
            lines.append(f"| {a}{moe} | " + " | ".join(m._md(cell_text(cells.get(x))) for x in exports) + " |")
    lines += ["", "### Serving details"]
    for a in archs:
        lines += _details(a, data["architectures"][a]["serve"])
    return lines


def _details(arch: str, serve: dict) -> list[str]:
    m = _matrix()
    lines = ["", f"#### {arch}", ""]
    for engine in ENGINES:
        rec = serve.get(engine)
        if not rec:
            continue
        run_info = rec.get("run")
        if run_info:
            rc = ("stopped by hand (the time box)" if run_info.get("wall_s") is None else "timed out"
                  if run_info.get("exit_code") is None else f"exit {run_info['exit_code']}")
            lines += [f"{engine}: last run {run_info.get('date')} (code: {run_info.get('commit')}), exports "
                      f"{', '.join(run_info.get('exports', []))}; {rc}"
                      + (f" after {run_info['wall_s']} s" if run_info.get("wall_s") is not None else "")
                      + f". Reproduce: `{run_info.get('command')}`."
                      + (f" Not measured: {', '.join(run_info['not_measured'])} (each attempt's unit was stopped by "
                         "an edit to pipeline/ from another checkout)." if run_info.get("not_measured") else ""), ""]
        for x in EXPORTS:
            cell = rec["cells"].get(x)
            if cell is not None:
                lines.append(f"- {engine} `{x}`: " + m._md(_detail(cell)) + f" ({cell.get('date')})")
        lines.append("")
    return lines[:-1]


def _detail(cell: dict) -> str:
    status = cell["status"]
    if status in (REFUSED, NO_EXPORT):
        return f"{STATUS_TEXT[status]} ({', '.join(cell.get('codes') or [])}): {cell.get('reason')}"
    figures = ""
    if cell.get("levels"):
        versions = ", ".join(f"{k} {v}" for k, v in sorted((cell.get("versions") or {}).items()))
        figures = (f"levels {cell['levels']}, {cell.get('requests')} requests, {cell.get('errors')} errors, output "
                   f"tok/s {cell.get('output_tok_s')}, greedy equal to generate {cell.get('greedy')}, ready in "
                   f"{cell.get('ready_s')} s"
                   + (f", served perplexity / in-process {cell['served_ppl_ratio']}" if "served_ppl_ratio" in cell
                      else "")
                   + (f", dtype {cell['served_dtype']}" if cell.get("served_dtype") else "")
                   + (f", kernels {', '.join(cell['kernels'])}" if cell.get("kernels") else "")
                   + (f"; {versions}" if versions else ""))
    if cell.get("record"):
        figures += f" (from {cell['record']})"
    if status == SERVED:
        return f"served: {figures}"
    return f"FAILS at run: {cell.get('error')}" + (f" ({figures})" if figures else "")
