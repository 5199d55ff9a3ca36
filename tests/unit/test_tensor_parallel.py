"""transformers tensor parallelism as a speed technique row (pipeline/eval/tensor_parallel.py), for real: two ranks
under torchrun with gloo on a tiny random Llama (4 heads, 2 KV heads), against the same measurement in one process.
Never a speed threshold; a rank that dies fails with one line naming it and leaves no process behind."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.eval.config import SpeedConfig
from pipeline.eval.parallel_check import technique_problems, tp_rank_bytes, usable_cores
from pipeline.eval.speed import measure_speed
from pipeline.eval.tensor_parallel import FAULT_ENV, RankFailed, died_when, failed_rank, tp_row

CFG = dict(prompt_len=12, new_tokens=6, batch_sizes=[1], repeats=2, warmup=1, roofline=False, tp_size=2)
needs_two_cores = pytest.mark.skipif(usable_cores() < 2, reason="two ranks need two cores")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    folder = tmp_path_factory.mktemp("tiny-tp")
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


def _alive(marker: str) -> list[str]:
    """Processes whose command line names `marker`."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            out.append(f"{proc.name}: {cmd}")
    return out


@needs_two_cores
def test_two_ranks_answer_as_one_process_and_hold_less_each(tiny_dir, tmp_path):
    row = tp_row(tiny_dir, SpeedConfig(**CFG), "cpu", tmp_path)
    assert row["backend"] == "gloo" and row["tp_size"] == 2 and row["device"] == "cpu"
    assert row["greedy_identical"] == row["prompts"] == 3
    assert row["max_abs_logit_diff"] <= row["equality_atol"] and "error" not in row
    assert len(row["peak_memory_per_rank_bytes"]) == 2 and all(b > 0 for b in row["peak_memory_per_rank_bytes"])
    assert row["decode_tokens_per_s"]["n"] == 2 and row["decode_tokens_per_s"]["median"] > 0
    assert row["one_process"]["threads"] == 2 and row["speed_ratio"] > 0 and row["memory_ratio"] > 0
    assert row["note"].startswith("TP=2 on ") and "greedy 3/3 identical" in row["note"]


@needs_two_cores
@pytest.mark.parametrize(("fault", "when"), [("1", "mid-measurement (the timed decode)"),
                                             ("1:load", "while loading the checkpoint")])
def test_a_rank_that_dies_fails_the_unit_naming_it_and_leaves_nothing(tiny_dir, tmp_path, monkeypatch, fault, when):
    monkeypatch.setenv(FAULT_ENV, fault)
    with pytest.raises(RankFailed) as e:
        measure_speed(tiny_dir, None, SpeedConfig(**CFG, techniques=["tensor_parallel"]), "cpu")
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"tensor_parallel: rank 1 of 2 died (exit -9) {when}: "), line
    assert _alive("tp-") == [] and _alive(str(tmp_path)) == []


def test_the_line_names_the_phase_the_rank_had_entered(tmp_path):
    assert died_when(tmp_path, "1") == "before loading (at start-up)"
    (tmp_path / "phase-rank1").write_text("forward")
    assert died_when(tmp_path, "1") == "in its first forward (the equality prompts)"
    assert died_when(tmp_path, "?").startswith("(rank unknown")


def test_failed_rank_reads_torchrun_root_cause():
    log = ("...\nRoot Cause (first observed failure):\n[0]:\n  time      : 2026-12-07_01:52:56\n  host      : h\n"
           "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 8770)\n")
    assert failed_rank(log) == ("1", "-9") and failed_rank("no summary") == ("?", "?")


def test_attention_rows_are_checked_against_sdpa_before_timing(tiny_dir):
    cfg = SpeedConfig(**{**CFG, "repeats": 1}, techniques=["eager"])
    row = measure_speed(tiny_dir, None, cfg, "cpu")["techniques"]["eager"]
    assert row["reference"] == "sdpa" and 0 <= row["max_abs_logit_diff"] <= cfg.equality_atol
    assert row["decode_tokens_per_s"]["median"] > 0 and "vs sdpa" in row["note"]


def test_an_attention_row_outside_the_tolerance_is_not_timed(tiny_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    cfg = SpeedConfig(**{**CFG, "repeats": 1, "equality_atol": 1e-30}, techniques=["eager"])
    row = measure_speed(model, None, cfg, "cpu")["techniques"]["eager"]
    if row["max_abs_logit_diff"] == 0:  # bit-identical kernels: nothing to refuse
        pytest.skip("eager and sdpa agree bit for bit here")
    assert "decode_tokens_per_s" not in row and row["error"].startswith("eager differs from sdpa: max |Δlogit|")


def test_memory_per_rank_is_predicted_below_one_process():
    smol = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
    speed = SpeedConfig(prompt_len=64, new_tokens=32).model_dump(mode="json")
    one, three = tp_rank_bytes(smol, 4, 1, speed), tp_rank_bytes(smol, 4, 3, speed)
    layers = 30 * (576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536) * 4
    kv_cache = 2 * 30 * 3 * 64 * (64 + 32) * 4  # float32, batch 1: split by KV heads too
    assert one - three == (layers + kv_cache) * 2 // 3  # the embeddings (tied head) and the runtime stay whole
    assert technique_problems(SpeedConfig(techniques=["tensor_parallel"], tp_size=3), smol, "cpu", cores=3) == []
