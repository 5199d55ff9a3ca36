"""Production-size models inside a memory limit (issue: half precision end to end, one copy, disk offload):
float32 matmuls for 16-bit weights on CPUs without 16-bit units, random weights written tensor by tensor, the
baseline's perplexity offloaded to disk, GPTQ streamed layer by layer, and the plan that predicts and refuses."""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.model import compute
from pipeline.model.compute import Float32Matmuls, float32_matmuls, upcasts
from pipeline.base.errors import StageError
from pipeline.base.memory import PeakMemory
from tests.tiny_models import tiny_llama

log = logging.getLogger("test")
ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- float32 matmuls for 16-bit weights


def test_a_bfloat16_linear_is_computed_in_float32_and_returned_in_bfloat16():
    torch.manual_seed(0)
    x, w, b = (torch.randn(17, 64, dtype=torch.bfloat16), torch.randn(96, 64, dtype=torch.bfloat16),
               torch.randn(96, dtype=torch.bfloat16))
    with Float32Matmuls() as mode:
        y = F.linear(x, w, b)
        z = x @ w.t()
        kept = F.linear(x.float(), w.float())  # float32 operands pass through untouched
    assert y.dtype == torch.bfloat16 and z.dtype == torch.bfloat16 and kept.dtype == torch.float32
    assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16))
    assert torch.equal(z, (x.float() @ w.float().t()).to(torch.bfloat16))
    assert mode.calls == 2


def test_a_large_weight_is_upcast_in_blocks_with_the_same_result(monkeypatch):
    torch.manual_seed(0)
    x, w = torch.randn(2, 9, 32, dtype=torch.bfloat16), torch.randn(1000, 32, dtype=torch.bfloat16)
    with Float32Matmuls():
        whole = F.linear(x, w)
    monkeypatch.setattr(compute, "CHUNK_BYTES", 4 * 32 * 64)  # 64 rows at a time: 16 blocks
    with Float32Matmuls():
        blocks = F.linear(x, w)
    assert blocks.shape == (2, 9, 1000) and torch.equal(whole, blocks)


def test_linears_on_other_threads_are_upcast_too_and_torch_is_restored_after(monkeypatch):
    import threading

    monkeypatch.setattr("pipeline.model.dtypes.cpu_flags", lambda: {"avx2"})
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16)
    got, upcast_on = {}, []
    real = compute._linear
    monkeypatch.setattr(compute, "_linear", lambda *a: upcast_on.append(threading.current_thread().name) or real(*a))
    with float32_matmuls("bfloat16", "cpu"):
        t = threading.Thread(target=lambda: got.setdefault("y", layer(x)), name="engine-worker")
        t.start()
        t.join()
        one = layer(x[:1])  # one token (decoding): torch's own bfloat16 linear, no weight upcast
    assert upcast_on == ["engine-worker"] and torch.equal(got["y"], want)
    assert one.dtype == torch.bfloat16 and one.shape == (1, 32)
    assert F.linear is compute._LINEAR  # restored


def test_the_mode_is_on_only_for_16_bit_models_on_cpus_that_emulate_them(monkeypatch):
    monkeypatch.setattr("pipeline.model.dtypes.cpu_flags", lambda: {"avx2"})
    assert upcasts("bfloat16", "cpu") and upcasts(torch.float16, "cpu")
    assert not upcasts("float32", "cpu") and not upcasts("bfloat16", "cuda") and not upcasts(None, "cpu")
    with float32_matmuls("float32", "cpu") as mode:
        assert mode is None
    monkeypatch.setattr("pipeline.model.dtypes.cpu_flags", lambda: {"avx512_bf16"})
    assert not upcasts("bfloat16", "cpu")
    assert compute.describe("bfloat16", "cpu") == "bfloat16"


# ---------------------------------------------------------------- random weights, tensor by tensor


def _config(**over):
    from transformers import LlamaConfig

    fields = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True)
    return LlamaConfig(**{**fields, **over})


def test_random_weights_are_written_tensor_by_tensor_deterministically(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.model.materialize import random_to_safetensors

    cfg = _config()
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        random_to_safetensors(cfg, tmp_path / d, "bfloat16", seed=3)
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()
    (tmp_path / "c").mkdir()
    random_to_safetensors(cfg, tmp_path / "c", "bfloat16", seed=4)
    assert (tmp_path / "a/model.safetensors").read_bytes() != (tmp_path / "c/model.safetensors").read_bytes()
    sd = load_file(tmp_path / "a/model.safetensors")
    assert "lm_head.weight" not in sd and {t.dtype for t in sd.values()} == {torch.bfloat16}  # tied: written once
    assert torch.equal(sd["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    assert abs(sd["model.layers.0.mlp.up_proj.weight"].float().std().item() - cfg.initializer_range) < 2e-3
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert model.dtype == torch.bfloat16 and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_random_weights_never_hold_the_whole_model(tmp_path):
    from pipeline.base.env import release_freed_memory
    from pipeline.model.materialize import random_to_safetensors

    release_freed_memory()
    cfg = _config(num_hidden_layers=8, intermediate_size=4096, hidden_size=1024, vocab_size=8000)  # 0.54 GB float32
    with PeakMemory() as mem:
        random_to_safetensors(cfg, tmp_path, "float32", seed=0)
    size = (tmp_path / "model.safetensors").stat().st_size
    assert size > 500e6
    assert mem.above_start_bytes < 0.3 * size, (mem.above_start_bytes, size)  # the largest tensor is 33 MB


# ---------------------------------------------------------------- the baseline's perplexity, offloaded


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


def _evaluate(model_dir, out, limit):
    from pipeline.eval.quality import evaluate
    from pipeline.recipe import PerplexityConfig, SmokeConfig

    out.mkdir(parents=True)
    ppl = PerplexityConfig(dataset="wikitext2", seq_len=64, max_windows=2)
    return evaluate(model_dir, out, ppl, SmokeConfig(enabled=False), "cpu", None, "tiny", limit)


def test_a_baseline_over_the_limit_is_offloaded_with_identical_perplexity(tiny, tmp_path, monkeypatch):
    from pipeline.budget.formulas import window_bytes

    whole = _evaluate(tiny, tmp_path / "whole", None)
    config = json.loads((tiny / "config.json").read_text())
    weights = (tiny / "model.safetensors").stat().st_size
    monkeypatch.setattr("pipeline.budget.runtime.rss_bytes", lambda: 0)  # the decision, free of this process's noise
    limit = window_bytes(config, 64) + 3 * weights // 4  # room for 3/4 of the weights
    off = _evaluate(tiny, tmp_path / "off", limit)
    assert "offload" not in whole and off["offload"]["limit_bytes"] == limit
    assert 0 < off["offload"]["in_memory_bytes"] < weights
    assert off["perplexity"]["value"] == pytest.approx(whole["perplexity"]["value"], rel=1e-6)
    assert not (tmp_path / "off" / "offload").exists()  # the scratch folder is gone


def test_a_limit_below_two_layers_is_a_clear_error(tiny, tmp_path, monkeypatch):
    from pipeline.budget.formulas import window_bytes

    config = json.loads((tiny / "config.json").read_text())
    monkeypatch.setattr("pipeline.budget.runtime.rss_bytes", lambda: 0)
    with pytest.raises(StageError, match=r"max_memory_gb = .* GiB leaves .* offloading needs room for at least one layer"):
        _evaluate(tiny, tmp_path / "x", window_bytes(config, 64) + 1000)


# ---------------------------------------------------------------- GPTQ streamed layer by layer


def test_gptq_over_the_limit_streams_from_disk_and_writes_the_same_checkpoint(tiny, tmp_path):
    from safetensors.torch import load_file

    from pipeline.quant.api import quantize_variant
    from pipeline.recipe import Recipe

    variant = Recipe.model_validate({"run": {"name": "t"}, "model": {"source": "config:tiny-llama"}, "quantize": [
        {"name": "g", "method": "gptq", "bits": 4, "group_size": 32}]}).quantize[0]
    torch.manual_seed(0)
    calib = torch.randint(3, 500, (4, 32))
    whole = quantize_variant(tiny, variant, calib, tmp_path / "whole", log, 0, device="cpu")
    off = quantize_variant(tiny, variant, calib, tmp_path / "off", log, 0, device="cpu", memory_limit=1)
    assert not whole["offloaded"] and off["offloaded"]
    a, b = load_file(tmp_path / "whole/model.safetensors"), load_file(tmp_path / "off/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("config.json", "quantize_config.json"):  # no scratch path from the offload in the checkpoint
        text = (tmp_path / "off" / name).read_text()
        assert ".offload-" not in text and '"offload_to_disk": true' not in text
    assert not list((tmp_path / "off").glob(".offload-*"))


# ---------------------------------------------------------------- the plan


def _plan(text: str, tmp_path: Path):
    from pipeline.plan import check
    from pipeline.recipe import load_recipe

    p = tmp_path / "r.toml"
    p.write_text(text)
    return check(load_recipe(p))


LARGE = Path(__file__).resolve().parents[2] / "recipes" / "large.toml"


def test_the_large_recipe_is_planned_within_its_limit_with_offload(tmp_path):
    from pipeline.plan import GiB

    plan = _plan(LARGE.read_text().replace('name = "large"', f'name = "large"\noutput_dir = "{tmp_path}"'), tmp_path)
    assert plan.dtype == "bfloat16" and plan.memory_limit == int(2.75 * GiB)
    assert plan.offload == {"quantize/gptq-w4g128": True, "validate/baseline": True}
    assert set(plan.memory) == {"load", "quantize/gptq-w4g128", "quantize/bnb-int8", "validate/baseline",
                                "validate/gptq-w4g128", "validate/bnb-int8"}
    assert plan.peak_memory <= plan.memory_limit
    assert plan.memory["load"] < 1 * GiB  # written tensor by tensor, not the 3.2 GiB model


def test_a_limit_too_small_for_a_stage_that_cannot_offload_is_refused_with_the_need(tmp_path):
    from pipeline.base.errors import RecipeError

    text = LARGE.read_text().replace("max_memory_gb = 2.75", "max_memory_gb = 1.5").replace(
        'name = "large"', f'name = "large"\noutput_dir = "{tmp_path}"')
    with pytest.raises(RecipeError) as e:
        _plan(text, tmp_path)
    (p,) = e.value.problems
    assert (p.path, p.code) == ("run.max_memory_gb", "memory-over-limit") and "the 1.5 GiB" in p.message
    assert "quantize/bnb-int8 needs 2." in p.message and "validate/bnb-int8 needs 2." in p.message
    assert "validate/baseline" not in p.message  # offloaded: it fills the limit and no more


# ---------------------------------------------------------------- speed: never timed from disk


def test_a_model_whose_timing_would_not_fit_is_not_timed_and_the_plan_says_why(tmp_path):
    from pipeline.plan import GiB

    text = LARGE.read_text().replace('name = "large"', f'name = "large"\noutput_dir = "{tmp_path}"').replace(
        "[validate.speed]\nenabled = false", "[validate.speed]\nbatch_sizes = [1]\ntechniques = []")
    plan = _plan(text, tmp_path)
    # the bf16 baseline (3.2 GiB) cannot be timed in 2.75 GiB, nor the GPTQ checkpoint with the copy GPTQModel's
    # CPU kernel repacks (measured 2.68 GiB while validating it); the int8 checkpoint can
    assert set(plan.speed_skipped) == {"baseline", "gptq-w4g128"}
    assert "max_memory_gb" in plan.speed_skipped["baseline"]
    assert "validate/baseline/speed" not in plan.memory and "validate/gptq-w4g128/speed" not in plan.memory
    assert 2 * GiB < plan.memory["validate/bnb-int8/speed"] <= plan.memory_limit
    assert plan.peak_memory <= plan.memory_limit


def test_a_speed_gate_on_a_model_that_will_not_be_timed_is_refused(tmp_path):
    from pipeline.base.errors import RecipeError

    text = LARGE.read_text().replace('name = "large"', f'name = "large"\noutput_dir = "{tmp_path}"').replace(
        "[validate.speed]\nenabled = false", "[validate.speed]\nbatch_sizes = [1]\ntechniques = []").replace(
        "max_ppl_ratio = 1.05", "max_ppl_ratio = 1.05\nmin_decode_speed_ratio = 1.0")
    with pytest.raises(RecipeError) as e:
        _plan(text, tmp_path)
    found = [p for p in e.value.problems if p.code == "speed-gate-model-over-memory"]
    # the baseline and gptq-w4g128 are not timed: the gate on gptq-w4g128 needs both, the one on bnb-int8 the baseline
    assert [p.path for p in found] == ["validate.gates.min_decode_speed_ratio"] * 3
    assert [re.findall(r"'([^']+)'", p.message)[:2] for p in found] == [
        ["gptq-w4g128", "baseline"], ["gptq-w4g128", "gptq-w4g128"], ["bnb-int8", "baseline"]]
    assert re.search(r"needs about 4\.\d\d GiB", found[0].message)  # the baseline's need, from the plan


def test_speed_skip_reads_the_checkpoint_and_counts_the_cpu_repack(tiny, tmp_path):
    from pipeline.budget.formulas import GiB, speed_bytes
    from pipeline.eval.speed import speed_skip

    cfg = {"batch_sizes": [1, 8], "prompt_len": 16, "new_tokens": 8, "roofline": True, "bandwidth_mib": 256}
    assert speed_skip(tiny, cfg, None, "cpu") is None  # no limit
    assert speed_skip(tiny, cfg, 1, "cuda") is None  # GPU memory is not [run] max_memory_gb
    assert speed_skip(tiny, cfg, 8 * GiB, "cpu") is None
    out = speed_skip(tiny, cfg, 600 << 20, "cpu")  # 0.4 GiB runtime + 0.5 GiB of bandwidth buffers do not fit
    assert out["memory_limit_bytes"] == 600 << 20 and out["predicted_peak_bytes"] > 600 << 20
    assert out["skipped"].startswith("not timed: it needs about 0.9") and "not a speed figure" in out["skipped"]
    config = json.loads((tiny / "config.json").read_text())
    weights = (tiny / "model.safetensors").stat().st_size
    assert out["predicted_peak_bytes"] == speed_bytes(config, weights, cfg)
    # a GPTQ checkpoint's linears are repacked for GPTQModel's CPU kernel: counted twice
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    (gptq / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    (gptq / "model.safetensors").write_bytes(b"\0" * weights)
    assert speed_skip(gptq, cfg, 600 << 20, "cpu")["predicted_peak_bytes"] > out["predicted_peak_bytes"]


def test_trimming_mapped_pages_never_reverts_what_a_loader_changed_in_place(tiny, tmp_path, monkeypatch):
    """torch maps a checkpoint private and writable and GPTQModel rewrites its zero points in place while loading:
    dropping those pages would silently revert them to the file (a GPTQ checkpoint measured perplexity 3e9)."""
    import contextlib

    from pipeline.base import memory
    from pipeline.quant import checkpoint
    from pipeline.quant.api import quantize_variant
    from pipeline.recipe import Recipe

    variant = Recipe.model_validate({"run": {"name": "t"}, "model": {"source": "config:tiny-llama"}, "quantize": [
        {"name": "g", "method": "gptq", "bits": 4, "group_size": 32}]}).quantize[0]
    torch.manual_seed(0)
    quantize_variant(tiny, variant, torch.randint(3, 500, (4, 32)), tmp_path / "q", log, 0, device="cpu")
    ids = torch.randint(3, 500, (1, 24))

    class EveryStep(memory.MappedPagesTrimmed):  # trim after the loader's every step, not only every 0.1 s
        def __init__(self, folder):
            super().__init__(folder, interval_s=0.0005)

    monkeypatch.setattr(checkpoint, "MappedPagesTrimmed", EveryStep)
    with torch.no_grad():
        trimmed = checkpoint.load_checkpoint(tmp_path / "q")(ids).logits
        memory.drop_mapped_pages(tmp_path / "q")
        monkeypatch.setattr(checkpoint, "MappedPagesTrimmed", lambda folder: contextlib.nullcontext())
        plain = checkpoint.load_checkpoint(tmp_path / "q")(ids).logits
    assert torch.equal(trimmed, plain)


def test_settling_the_heap_collects_a_units_cycles_and_keeps_the_survivors_out_of_later_collections():
    """The run settles the heap between units (pipeline/base/memory.py settle_heap): cyclic garbage a unit left is
    collected first, never frozen; what survives is out of later collections, so PeakMemory's collection at the next
    unit's start walks only what that unit made. In a fresh interpreter: the freeze is the whole process's."""
    code = """
import gc, weakref
from pipeline.base.memory import PeakMemory, settle_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

left_by_a_unit = cycle()  # unreachable, collectable only by the cyclic collector
gc.disable()  # no automatic collection in between: only the calls below collect
settle_heap()
assert left_by_a_unit() is None, "a unit's cycle was frozen instead of collected"
frozen = gc.get_freeze_count()
assert frozen > 1000, frozen
made_in_the_next_unit = cycle()
PeakMemory().start().stop()
assert made_in_the_next_unit() is None, "PeakMemory's collection missed the new unit's cycle"
assert gc.get_freeze_count() == frozen  # PeakMemory itself freezes nothing (a unit's live objects stay collectable)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
