"""The mixed-precision section of report.md (pipeline/results/mix_render.py): allocation table, budget and spent,
predicted vs measured KL with its correlation."""
from __future__ import annotations

import pytest

from pipeline.results.mix_render import allocation_table, mix_section, pearson, predicted_kl
from pipeline.results.render import render_markdown
from pipeline.results.schema import ModelEntry, new_report


def mix_record(predicted: float, alloc: dict) -> dict:
    return {"granularity": "block", "estimator": "kl", "candidates": [[3, 64], [4, 64]],
            "budget": {"bytes": 4_000_000, "bits_per_weight": 4.0}, "spent": {"bytes": 3_990_000, "bits_per_weight": 3.99},
            "allocation": alloc, "predicted": {"kl": predicted, "hessian": 1.0},
            "predicted_uniform": {"w3g64": {"kl": 0.9, "hessian": 2.0}, "w4g64": {"kl": 0.2, "hessian": 1.0}},
            "solver": {"kind": "dynamic program (multiple-choice knapsack)", "resolution_bytes": 8, "exact": True},
            "sensitivity_time_s": {"kl": 12.5, "hessian": 3.0}, "sensitivity_cached": False, "probe": {"kl_rows": 1}}


@pytest.fixture
def report():
    r = new_report(run_id="r", name="n", recipe="x.toml", device="cpu", seed=0, versions={})
    alloc = {"layers.0.self_attn": {"bits": 4, "group_size": 64}, "layers.0.mlp": {"bits": 3, "group_size": 64},
             "layers.1.self_attn": {"bits": 8, "group_size": 64}, "layers.1.mlp": {"bits": 3, "group_size": 64}}
    r.variants = {
        "w4": ModelEntry(method="gptq", params={"bits": 4, "group_size": 64, "modules_to_skip": ["lm_head"]}, kl=0.25),
        "w3": ModelEntry(method="gptq", params={"bits": 3, "group_size": 64, "modules_to_skip": ["lm_head"]}, kl=0.8),
        "mixed": ModelEntry(method="gptq", params={"bits": 4, "group_size": 64}, kl=0.5, bits_per_weight=3.99,
                            quantize={"mix": mix_record(0.45, alloc)}),
        "nf4": ModelEntry(method="bnb-nf4", params={}, kl=0.3),
    }
    return r


def test_predicted_and_measured_kl_pair_the_mixed_and_the_uniform_candidates(report):
    assert predicted_kl(report) == [("w4", 0.2, 0.25), ("w3", 0.9, 0.8), ("mixed", 0.45, 0.5)]
    import numpy as np

    assert pearson([0.2, 0.9, 0.45], [0.25, 0.8, 0.5]) == pytest.approx(np.corrcoef([0.2, 0.9, 0.45], [0.25, 0.8, 0.5])[0, 1])
    assert pearson([1, 2], [1, 2]) is None


def test_the_allocation_table_has_a_row_per_layer_and_a_column_per_block(report):
    rows = allocation_table(report.variants["mixed"].quantize["mix"])
    assert rows[0] == "| layer | self_attn | mlp |"
    assert rows[2:] == ["| 0 | w4g64 | w3g64 |", "| 1 | w8g64 | w3g64 |"]


def test_report_md_shows_the_section(report):
    text = "\n".join(mix_section(report))
    assert "## Mixed precision" in text and "### mixed" in text
    assert "spent 3.99" in text and "Pearson correlation of predicted and measured KL over these 3 models: 0.994" in text
    assert "KL probe 12.5 s" in text
    assert "## Mixed precision" in render_markdown(report, [])
    report.variants.pop("mixed")
    assert mix_section(report) == []


def test_the_mix_plots_draw_the_allocation_and_quality_per_bit_only_for_a_mixed_run(report, tmp_path):
    from pipeline.results.plots import MIX_ALLOCATION_PLOT, MIX_PARETO_PLOT, mix_allocation_plot, write_plots

    for name, bpw, ratio in (("w4", 4.36, 1.33), ("w3", 3.36, 3.5), ("mixed", 3.99, 1.6)):
        report.variants[name].bits_per_weight, report.variants[name].ppl_ratio = bpw, ratio
    written = write_plots(report, tmp_path)
    assert {MIX_PARETO_PLOT, MIX_ALLOCATION_PLOT} <= set(written)
    assert (tmp_path / MIX_ALLOCATION_PLOT).read_bytes()[:4] == b"\x89PNG"
    ax = mix_allocation_plot(report).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["self_attn", "mlp"]
    assert ax.images[0].get_array().tolist() == [[4, 3], [8, 3]]  # bits per layer (rows) and block (columns)
    del report.variants["mixed"]
    assert not {MIX_PARETO_PLOT, MIX_ALLOCATION_PLOT} & set(write_plots(report, tmp_path))  # no mix: none drawn
    assert not (tmp_path / MIX_PARETO_PLOT).exists()  # and the stale ones are gone
