"""Speed measurement on a tiny random Llama: the dict's shape and sanity, never thresholds on speed."""
import json
import math
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from pipeline.base.errors import StageError
from pipeline.eval.config import SpeedConfig, speed_problems
from pipeline.eval.speed import (PeakMemory, StepClock, make_batch, measure_speed, roofline_fraction,
                                 run_speed_subprocess, summarize, weight_bytes_per_token)


def tiny_llama(tie=True, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tie, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    return LlamaForCausalLM(cfg).eval()


CFG = dict(prompt_len=12, new_tokens=5, batch_sizes=[1, 3], repeats=2, warmup=1, bandwidth_mib=16)


def _finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_stats(st):
    assert set(st) == {"median", "min", "max", "n"}
    assert st["min"] <= st["median"] <= st["max"] and _finite_positive(st["min"])


@pytest.fixture(scope="module")
def result():
    cfg = SpeedConfig(**CFG, techniques=["kv_cache", "no_kv_cache", "static_cache", "eager", "sdpa",
                                         "flash_attention_2"])
    return measure_speed(tiny_llama(), None, cfg, "cpu")


def test_speed_dict_has_every_key_with_positive_finite_numbers(result):
    for key in ("prefill_tokens_per_s", "ttft_s"):
        _check_stats(result[key])
    assert set(result["decode"]) == {"1", "3"}
    for batch, cell in result["decode"].items():
        assert cell["batch"] == int(batch)
        _check_stats(cell["tokens_per_s"])
        assert cell["tokens_per_s"]["n"] == 2
    for key in ("decode_tokens_per_s_b1", "decode_tokens_per_s_max_batch", "footprint_bytes",
                "weight_bytes_per_token", "copy_bandwidth_bytes_per_s", "kv_cache_speedup"):
        assert _finite_positive(result[key]), key
    # call-entry basis in a warm test process: a tiny model's tensors may all fit in heap pages freed by earlier
    # tests, so 0 above the base is a true reading here (the fresh-process test below asserts a positive peak)
    assert isinstance(result["peak_memory_bytes"], int) and result["peak_memory_bytes"] >= 0
    assert result["max_batch"] == 3 and result["prompt_len"] == 12 and result["new_tokens"] == 5
    assert result["peak_memory_kind"] in ("rss_hwm", "rss_sampled") and result["peak_memory_basis"] == "call-entry"
    assert 0 < result["roofline_fraction"] <= 1.5
    json.dumps(result)  # JSON-serialisable as it is


def test_technique_rows(result):
    rows = result["techniques"]
    assert list(rows) == ["kv_cache", "no_kv_cache", "static_cache", "eager", "sdpa", "flash_attention_2"]
    assert rows["kv_cache"]["decode_tokens_per_s"] == result["decode"]["1"]["tokens_per_s"]
    no_kv = rows["no_kv_cache"]["decode_tokens_per_s"]["median"]
    assert result["kv_cache_speedup"] == pytest.approx(result["decode_tokens_per_s_b1"] / no_kv)
    for name in ("static_cache", "eager", "sdpa"):
        assert "error" not in rows[name], rows[name]
        _check_stats(rows[name]["decode_tokens_per_s"])
        assert _finite_positive(rows[name]["speedup_vs_kv_cache"])
    _check_stats(rows["eager"]["prefill_tokens_per_s"])
    assert rows["flash_attention_2"] == {"skipped": "flash_attention_2 needs CUDA"}


def test_attention_implementation_is_restored_after_the_rows():
    model = tiny_llama()
    before = model.config._attn_implementation
    measure_speed(model, None, SpeedConfig(**{**CFG, "repeats": 1, "warmup": 0, "roofline": False},
                                           techniques=["eager"]), "cpu")
    assert model.config._attn_implementation == before


def test_no_roofline_and_no_techniques():
    cfg = SpeedConfig(**{**CFG, "batch_sizes": [1], "repeats": 1, "warmup": 0, "roofline": False}, techniques=[])
    r = measure_speed(tiny_llama(), None, cfg, "cpu")
    assert r["roofline_fraction"] is None and r["copy_bandwidth_bytes_per_s"] is None
    assert r["techniques"] == {} and r["kv_cache_speedup"] is None
    assert r["decode_tokens_per_s_max_batch"] == r["decode_tokens_per_s_b1"]


def test_batch_is_left_padded_with_different_lengths():
    ids, mask = make_batch(None, 100, prompt_len=10, batch=3, device="cpu")
    assert ids.shape == mask.shape == (3, 10)
    lengths = mask.sum(1).tolist()
    assert lengths[0] == 10 and lengths == sorted(lengths, reverse=True) and len(set(lengths)) == 3
    for row, n in zip(mask, lengths):
        assert row[-n:].all() and not row[:-n].any()  # padding on the left only
    assert torch.equal(ids[1, -lengths[1]:], ids[0, :lengths[1]])  # each prompt is the same text, cut shorter


def test_step_clock_stamps_once_per_generated_token():
    from transformers import LogitsProcessorList

    model = tiny_llama()
    clock = StepClock("cpu")
    ids, mask = make_batch(None, 128, 8, 1, "cpu")
    model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, min_new_tokens=6,
                   pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    assert len(clock.stamps) == 6 and clock.stamps == sorted(clock.stamps)


def test_weight_bytes_count_tied_lm_head_once_and_skip_untied_embedding_table():
    tied, untied = tiny_llama(tie=True), tiny_llama(tie=False)
    emb = 128 * 32 * 4
    total = sum(p.nbytes for p in untied.parameters()) + sum(b.nbytes for b in untied.buffers())
    assert weight_bytes_per_token(untied) == total - emb  # lm_head read, input table not
    total_tied = sum(p.nbytes for p in tied.parameters()) + sum(b.nbytes for b in tied.buffers())
    assert weight_bytes_per_token(tied) == total_tied  # parameters() already de-duplicates the tied weight
    assert weight_bytes_per_token(tied) == weight_bytes_per_token(untied)


def _touch_fresh_pages(n: int) -> None:
    """Map n bytes of new anonymous memory, write every page, hold it 100 ms (long enough for the sampling fallback),
    unmap. Not a torch tensor: an allocator may hand back already-resident memory freed by earlier tests, which
    (rightly) raises no RSS at all; that is what CI saw."""
    import mmap

    block = mmap.mmap(-1, n)
    for off in range(0, n, mmap.PAGESIZE):
        block[off] = 1
    time.sleep(0.1)
    block.close()


def test_peak_memory_sees_a_transient_allocation():
    mem = PeakMemory("cpu").start()
    _touch_fresh_pages(64 * 2**20)
    assert mem.peak_above_base() >= 60 * 2**20, mem.kind


def test_peak_memory_sampling_fallback_sees_a_held_allocation(monkeypatch):
    real_write = Path.write_text

    def refuse_clear_refs(self, *a, **k):
        if str(self) == "/proc/self/clear_refs":
            raise PermissionError("clear_refs refused")
        return real_write(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", refuse_clear_refs)
    mem = PeakMemory("cpu").start()
    assert mem.kind == "rss_sampled"
    _touch_fresh_pages(64 * 2**20)
    assert mem.peak_above_base() >= 60 * 2**20


def test_pure_helpers():
    assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    with pytest.raises(ValueError):
        summarize([])
    assert roofline_fraction(1000, 0.5, 4000.0) == pytest.approx(0.5)
    assert roofline_fraction(1000, 0.5, None) is None


def test_config_validation_and_per_model_rows():
    with pytest.raises(ValidationError, match="must include 1"):
        SpeedConfig(batch_sizes=[4, 8])
    with pytest.raises(ValidationError):
        SpeedConfig(techniques=["kv_cache", "warp_drive"])
    with pytest.raises(ValidationError, match="extra"):
        SpeedConfig(prompt_length=3)
    cfg = SpeedConfig(batch_sizes=[8, 1], techniques=["no_kv_cache"], technique_models=["baseline"])
    assert cfg.batch_sizes == [1, 8]
    assert cfg.for_model("baseline").techniques == ["no_kv_cache"] and cfg.for_model("w4").techniques == []
    assert cfg.times("w4") and not SpeedConfig(models=["baseline"]).times("w4")
    (p,) = speed_problems(SpeedConfig(models=["w9"]), ["w4"], None)
    assert (p.path, p.code) == ("validate.speed.models", "speed-model-unknown")
    assert "'w9'" in p.message and "['baseline', 'w4']" in p.message  # the unknown name and the known ones


def test_subprocess_times_a_checkpoint_folder_in_a_fresh_process(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "ckpt")
    cfg = SpeedConfig(**{**CFG, "batch_sizes": [1, 2], "repeats": 1}, techniques=["no_kv_cache"])
    r = run_speed_subprocess(tmp_path / "ckpt", cfg, "cpu", tmp_path / "out" / "speed.json", threads=1)
    assert json.loads((tmp_path / "out" / "speed.json").read_text()) == r
    assert r["peak_memory_basis"] == "post-import" and r["threads"] == 1 and _finite_positive(r["load_s"])
    assert _finite_positive(r["peak_memory_bytes"]) and _finite_positive(r["kv_cache_speedup"])


def test_subprocess_failure_is_a_stage_error_with_the_cause(tmp_path):
    with pytest.raises(StageError, match="does not exist"):
        run_speed_subprocess(tmp_path / "missing", SpeedConfig(**CFG), "cpu", tmp_path / "speed.json")
    (tmp_path / "empty").mkdir()  # no config.json: the child fails, its stderr tail is in the message
    with pytest.raises(StageError, match=r"(?s)speed measurement of .* failed \(exit code 1\):.*config"):
        run_speed_subprocess(tmp_path / "empty", SpeedConfig(**CFG), "cpu", tmp_path / "speed.json")


def test_subprocess_over_its_time_limit_is_killed_with_a_clear_error(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "ckpt")
    cfg = SpeedConfig(**{**CFG, "timeout_s": 0.5})  # the child cannot even import torch in that time
    with pytest.raises(StageError, match=r"exceeded 0 s|exceeded 1 s|\(\[validate.speed\].timeout_s\)"):
        run_speed_subprocess(tmp_path / "ckpt", cfg, "cpu", tmp_path / "speed.json")
    assert not (tmp_path / "speed.json").exists()


def test_cuda_code_paths_by_construction(monkeypatch):
    """No GPU here: fake the torch.cuda calls and check what PeakMemory and sync do with them."""
    calls = []
    stats = {"allocated": 100, "max": 100}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", str(device))))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: (calls.append(("reset", str(device))), stats.update(max=stats["allocated"])))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats["max"])
    mem = PeakMemory("cuda:0").start()
    assert mem.kind == "cuda_max_allocated"
    assert ("sync", "cuda:0") in calls and ("reset", "cuda:0") in calls
    stats["max"] = 5000  # something allocated 4900 bytes more at its peak
    calls.clear()
    assert mem.peak_above_base() == 4900
    assert calls == [("sync", "cuda:0")], "synchronize before reading the peak"
    clock = StepClock("cuda")
    clock(None, torch.zeros(1))
    assert calls[-1] == ("sync", "cuda") and len(clock.stamps) == 1


@pytest.mark.gpu
def test_measure_speed_on_cuda():
    model = tiny_llama().to("cuda")
    r = measure_speed(model, None, SpeedConfig(**CFG, techniques=["no_kv_cache", "static_cache",
                                                                   "flash_attention_2"]), "cuda")
    assert r["peak_memory_kind"] == "cuda_max_allocated" and r["peak_memory_bytes"] > 0
    assert 0 < r["roofline_fraction"] <= 1.5 and _finite_positive(r["kv_cache_speedup"])


def test_eval_and_bench_refuse_bad_threads_and_unwritable_out(tmp_path):
    from click.testing import CliRunner

    from pipeline.app.cli import cli

    tiny_llama().save_pretrained(tmp_path / "ckpt")
    runner = CliRunner()
    r = runner.invoke(cli, ["eval", str(tmp_path / "ckpt"), "--threads", "0"])
    assert r.exit_code == 2 and "0 is not in the range x>=1" in r.output
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the output folder should be
    r = runner.invoke(cli, ["bench", str(tmp_path / "ckpt"), "--out", str(blocker / "speed.json")])
    assert r.exit_code != 0 and "cannot create its folder" in str(r.output) + str(r.exception)
    r = runner.invoke(cli, ["eval", str(tmp_path / "ckpt"), "--out", str(blocker / "q")])
    assert r.exit_code != 0 and "cannot create it" in str(r.output) + str(r.exception)


def test_nested_meters_each_keep_their_peak():
    """An inner meter resets the process's high-water mark; the outer one still sees the peak from before it."""
    outer = PeakMemory("cpu").start()
    _touch_fresh_pages(64 * 2**20)  # the outer block's peak, freed before the inner meter starts
    with PeakMemory("cpu") as inner:
        _touch_fresh_pages(8 * 2**20)
    assert outer.stop().peak_above_base() >= 60 * 2**20, outer.kind
    assert inner.above_start_bytes < 60 * 2**20 or inner.kind == "rss_sampled"
