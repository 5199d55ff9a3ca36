"""docs/architectures.md is rendered from docs/architectures.json (scripts/arch_matrix.py), and the JSON's verdicts
are still `compress check`'s: a cell recorded as refused is still refused (for the same reasons), and every other
cell still passes check. Torch-free and fast: check runs in process on one-variant recipes."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

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
        {"a": {"perplexity": {"value": 12.5}, "ppl_ratio": 1.01234, "kl": 0.000123456, "top1": 0.9,
               "quantize_time_s": 1.23},
         "c": {"perplexity": {"value": math.nan}, "ppl_ratio": math.nan}})
    a = am.cell_of_report(report, "a", "")
    assert a["status"] == am.GREEN and a["ppl_ratio"] == 1.0123 and a["kl"] == 0.000123
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
