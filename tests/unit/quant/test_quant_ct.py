"""format = "compressed-tensors" on the GPTQ-family and AWQ variants: the same integers, scales, zero points and group
size as the GPTQ or AWQ format (unpacked both ways, compared bit for bit), the folder reloads through transformers
(decompressed at the first forward), and `compress check` refuses what pack-quantized cannot hold."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter

from pipeline.base.env import tame
from pipeline.quant.formats.ct_export import INT, awq_integers, dequantized_weights
from pipeline.quant.registry import QuantVariant, check_variant, reload_of, runtimes, variant_format
from pipeline.quant.shapes import linear_shapes_from_config
from tests.problems import keys, only
from tests.tiny_models import tiny_llama

tame()
VOCAB = 512
CALIB = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(0))
PROBE = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
ROOT = Path(__file__).resolve().parents[3]
SMOL = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
CASES = {  # name: recipe fields (each quantized twice: its own format, "gptq" or "awq", and "compressed-tensors")
    "gptq-w4g32": {"method": "gptq", "bits": 4, "group_size": 32},
    "rtn-w4g32-asym": {"method": "rtn", "bits": 4, "group_size": 32, "sym": False},
    "rtn-w8-channel": {"method": "rtn", "bits": 8, "group_size": -1},
    "awq-w4g32": {"method": "awq", "group_size": 32},  # asymmetric (AWQ's zero points), bfloat16
}


def own_format(fields: dict) -> str:
    return "awq" if fields["method"] == "awq" else "gptq"


def symmetric(fields: dict) -> bool:
    return fields.get("sym", fields["method"] != "awq")


def variant(**kw):
    return TypeAdapter(QuantVariant).validate_python(kw)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    from pipeline.quant.api import quantize_variant

    root = tmp_path_factory.mktemp("ct")
    tiny = tiny_llama(root / "tiny", VOCAB)
    log = logging.getLogger("test")
    out = {}
    for name, fields in CASES.items():
        pair = []
        for fmt in (own_format(fields), "compressed-tensors"):
            v = variant(name=name, format=fmt, **fields)
            quantize_variant(tiny, v, CALIB, root / f"{name}-{fmt}", log, seed=0)
            pair.append(root / f"{name}-{fmt}")
        out[name] = tuple(pair)
    return out


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def gptq_weights(folder: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Dequantized weights of a GPTQ or AWQ folder from its qweight/qzeros/scales, in `dtype` (None: the scales')."""
    return dequantized_weights(folder, dtype)


def ct_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Dequantized weights of a compressed-tensors folder through compressed-tensors' own decompressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    state, out = _state(folder), {}
    for key in [k for k in state if k.endswith(".weight_packed")]:
        mod = key.removesuffix(".weight_packed")
        local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == mod}
        out[mod] = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_compressed_tensors_holds_the_gptq_weights_bit_for_bit(folders, name):
    gptq, ct = folders[name]
    fields = CASES[name]
    qc = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert (w["num_bits"], w["symmetric"], w["type"]) == (fields.get("bits", 4), symmetric(fields), "int")
    assert w["group_size"] == (None if fields["group_size"] == -1 else fields["group_size"])
    assert qc["ignore"] == ["lm_head"]
    assert not (ct / "quantize_config.json").exists() and not list(ct.glob(".ct-*"))
    a, b = gptq_weights(gptq), ct_weights(ct)
    assert a.keys() == b.keys() and len(a) == 2 * 7
    for mod in a:
        assert a[mod].dtype == b[mod].dtype and torch.equal(a[mod], b[mod]), mod
    plain_a = {k: v for k, v in _state(gptq).items() if k.rpartition(".")[0] not in a}
    plain_b = {k: v for k, v in _state(ct).items() if k.rpartition(".")[0] not in b}
    assert plain_a.keys() == plain_b.keys() and all(torch.equal(plain_a[k], plain_b[k]) for k in plain_a)


def test_awq_gemm_layout_unpacks_to_the_integers_gptqmodel_packed():
    """GPTQModel's own AWQ packer (values along the output features in AWQ's interleaved order) and our reader:
    the integers, zero points and scales come back in [out, in] / [out, groups] column order."""
    from gptqmodel.quantization.awq.utils.packing_utils import pack_awq

    gen = torch.Generator().manual_seed(2)
    in_f, out_f, g = 96, 40, 32
    q = torch.randint(0, 16, (in_f, out_f), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (in_f // g, out_f), generator=gen, dtype=torch.int32)
    scales = torch.rand(in_f // g, out_f, generator=gen).to(torch.bfloat16)
    qweight, qzeros = pack_awq(q, z, 4)
    assert qweight.shape == (in_f, out_f // 8) and qzeros.shape == (in_f // g, out_f // 8)
    got_q, got_z, got_s = awq_integers({"qweight": qweight, "qzeros": qzeros, "scales": scales}, 4, g)
    assert torch.equal(got_q, q.t().to(torch.int64)) and torch.equal(got_z, z.t().to(torch.int64))
    assert got_q.dtype == got_z.dtype == INT  # a quarter of int64's memory: the 1.5B conversion fits
    assert torch.equal(got_s, scales.t())
    with pytest.raises(ValueError, match="scale groups"):
        awq_integers({"qweight": qweight, "qzeros": qzeros, "scales": scales}, 4, 16)


RELOAD = r"""
import sys, json, torch
from pathlib import Path
from pipeline.base.env import tame; tame()
torch.set_num_threads(1)
from pipeline.quant.checkpoint import load_checkpoint
probe = torch.tensor(json.loads(sys.argv[1]))
m = load_checkpoint(Path(sys.argv[2]))
before = sorted({n.rpartition(".")[2] for n, _ in m.named_parameters() if "layers.0.self_attn.q_proj" in n})
with torch.no_grad():
    logits = m(probe).logits.float()
after = {n: str(p.dtype) for n, p in m.named_parameters() if "layers.0.self_attn.q_proj" in n}
torch.save(logits, sys.argv[3])
print(json.dumps({"before": before, "after": after}))
"""


@pytest.mark.parametrize("name", ["gptq-w4g32", "rtn-w4g32-asym", "awq-w4g32"])
def test_reloads_through_transformers_decompressed_and_matches_the_source_weights(folders, tmp_path, name):
    """Our stages' loader (pipeline/quant/checkpoint.py) on the folder: transformers' compressed-tensors quantizer
    keeps the packed tensors (an asymmetric grid's packed zero points too: compressed-tensors 0.20 needs help to place
    them, pipeline/quant/formats/ct.py) and decompresses them to dense weights at the first forward; the logits are
    those of the GPTQ or AWQ folder's weights dequantized exactly, beside its other tensors (AWQ folds its scales
    into the norms)."""
    from transformers import AutoModelForCausalLM

    src, ct = folders[name]
    dtype = torch.bfloat16 if CASES[name]["method"] == "awq" else torch.float32  # (AWQ runs in bfloat16)
    r = subprocess.run([sys.executable, "-c", RELOAD, json.dumps(PROBE.tolist()), str(ct), str(tmp_path / "l.pt")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    zp = [] if symmetric(CASES[name]) else ["weight_zero_point"]
    assert seen["before"] == ["weight_packed", "weight_scale", "weight_shape", *zp]
    after = seen["after"]  # decompressed: a dense weight in the model's dtype, the packed values gone
    assert after["model.layers.0.self_attn.q_proj.weight"] == str(dtype)
    assert "model.layers.0.self_attn.q_proj.weight_packed" not in after
    dense = AutoModelForCausalLM.from_pretrained(ct.parent / "tiny", dtype=dtype)
    weights = gptq_weights(src, dtype)  # the loader's scales are in the model's dtype
    plain = {k: v for k, v in _state(src).items() if k.rpartition(".")[0] not in weights}
    _, unexpected = dense.load_state_dict(plain, strict=False)
    assert not unexpected
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reload did: one summation order
    try:
        with torch.no_grad():
            for mod, w in weights.items():
                dense.get_submodule(mod).weight.copy_(w)
            want = dense(PROBE).logits.float()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.load(tmp_path / "l.pt"), want)


def test_without_the_fix_compressed_tensors_cannot_place_packed_zero_points(folders):
    """Why formats/ct.py's loader wraps an asymmetric folder (pipeline/quant/formats/ct_export.py
    packed_zero_points_on_meta): transformers + compressed-tensors 0.20 alone refuse the folder compressed-tensors
    itself wrote. When this starts passing the load, the wrapper can go."""
    from transformers import AutoModelForCausalLM

    _, ct = folders["awq-w4g32"]
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # its report names weight_zero_point
        AutoModelForCausalLM.from_pretrained(ct)


def test_recipe_default_format_is_unchanged():
    v = variant(name="w4", method="gptq")
    assert v.format == "gptq" and variant_format(v) == "gptq" and reload_of(v).load_module == "gptqmodel"
    ct = variant(name="w4", method="gptq", format="compressed-tensors")
    assert variant_format(ct) == "compressed-tensors" and reload_of(ct).load_module == "compressed_tensors"
    assert variant_format(variant(name="a", method="autoround", format="compressed-tensors")) == "compressed-tensors"


def test_check_refuses_act_order_other_bits_and_a_quantized_head():
    smol = linear_shapes_from_config(SMOL)
    ok = variant(name="ct", method="gptq", format="compressed-tensors")
    assert check_variant(ok, smol, "cpu") == []
    assert keys(check_variant(variant(name="ct", method="gptq", format="compressed-tensors", desc_act=True), smol,
                              "cpu")) == [("desc_act", "ct-desc-act")]
    assert check_variant(variant(name="g", method="gptq", desc_act=True), smol, "cpu") == []  # GPTQ format: fine
    assert keys(check_variant(variant(name="ct", method="rtn", format="compressed-tensors", bits=3), smol,
                              "cpu")) == [("bits", "ct-bits-unsupported")]
    assert keys(check_variant(variant(name="ct", method="gptq", format="compressed-tensors", modules_to_skip=[]),
                              smol, "cpu")) == [("modules_to_skip", "ct-lm-head-not-skipped")]


def test_check_names_the_layer_a_group_size_does_not_divide():
    smol = linear_shapes_from_config(SMOL)
    v = variant(name="ct", method="gptq", format="compressed-tensors", group_size=128)  # the W4A16 preset's 128
    p = only(check_variant(v, smol, "cpu"))
    assert (p.path, p.code) == ("group_size", "group-size-does-not-tile")
    assert "self_attn.q_proj" in p.message and "hidden size 576" in p.message and "64" in p.message


def test_compress_check_cli_refuses_desc_act(tmp_path):
    recipe = ROOT / "recipes" / "methods.toml"
    ct = 'quantize.0={name="ct", method="gptq", format="compressed-tensors", desc_act=true}'
    r = subprocess.run([str(Path(sys.executable).parent / "compress"), "check", str(recipe), "--set", ct,
                        "--set", "validate.gates.models={}"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "quantize.0 (ct): desc_act = true with format = 'compressed-tensors'" in r.stdout + r.stderr


def test_runtime_rows_name_the_compressed_tensors_kernels():
    smol = linear_shapes_from_config(SMOL)
    rows = {r["runtime"]: r for r in runtimes(variant(name="ct", method="gptq", format="compressed-tensors"), smol)}
    assert "decompress" in rows["transformers (CPU)"]["kernel"]
    assert "W4A16" in rows["vLLM (CPU)"]["kernel"] and "W4A16" in rows["vLLM (CUDA)"]["kernel"]
    assert "576" in rows["vLLM (CUDA)"]["note"]  # Marlin wants in-features divisible by 128


def test_awq_in_compressed_tensors_is_checked_planned_and_tagged_as_compressed_tensors():
    from pipeline.quant.registry import method_of

    smol = linear_shapes_from_config(SMOL)
    v = variant(name="awq-ct", method="awq", format="compressed-tensors")
    assert variant_format(v) == "compressed-tensors" and reload_of(v).load_module == "compressed_tensors"
    assert variant_format(variant(name="awq", method="awq")) == "awq"
    assert check_variant(v, smol, "cpu") == []
    assert keys(check_variant(variant(name="awq-ct", method="awq", format="compressed-tensors", modules_to_skip=[]),
                              smol, "cpu")) == [("modules_to_skip", "ct-lm-head-not-skipped")]
    m = method_of(v)
    assert m.bits_per_weight(v) == 4 + (16 + 4) / 64  # packed values, a 16-bit scale and a packed zero point
    rows = {r["runtime"]: r for r in runtimes(v, smol)}
    assert "W4A16" in rows["vLLM (CPU)"]["kernel"] and "W4A16" in rows["vLLM (CUDA)"]["kernel"]
    assert "GPTQ format" in rows["GPTQModel.load"]["note"]  # GPTQModel does not read compressed-tensors
    params = {"bits": 4, "format": "compressed-tensors"}
    assert m.hub_tags(params)[-1] == "compressed-tensors"
    assert "compressed-tensors" in m.card_usage("me/x", params, {})[0]


@pytest.mark.parametrize(("script", "said"), [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL: most likely the kernel's "
                                                                 "out-of-memory killer"),
    ("import sys; print('boom'); sys.exit(7)", "failed (exit code 7): boom"),
])
def test_a_conversion_that_dies_says_how_and_its_peak_memory(tmp_path, monkeypatch, caplog, script, said):
    """The conversion's own process, killed (the kernel's OOM killer sends SIGKILL: a 1.5B model's conversion was, at
    21.9 GB, before its integers were held in int16) or exiting non-zero: the error names the signal or the exit code
    and the output's last lines, and the log says the process's peak RSS, read from its own resource use."""
    from pipeline.quant.formats import ct_export

    stand_in = tmp_path / "python"
    stand_in.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"{script}\"\n")
    stand_in.chmod(0o755)
    monkeypatch.setattr(ct_export.sys, "executable", str(stand_in))
    (tmp_path / "gptq").mkdir()
    with caplog.at_level(logging.INFO, logger="compress"), pytest.raises(RuntimeError, match="conversion") as e:
        ct_export.convert_fresh(tmp_path / "gptq", tmp_path / "out")
    assert said in str(e.value)
    assert "compressed-tensors conversion of gptq: peak RSS" in caplog.text
    assert not list(tmp_path.glob(".ct-job-*")), "the conversion's scratch folder was left behind"


def test_an_interrupted_conversion_leaves_no_process_behind(tmp_path, monkeypatch):
    """Ctrl-C (or the runner's SIGTERM turned into an exception) while the parent waits: the conversion's process is
    killed and reaped, not left running."""
    import signal
    import threading

    from pipeline.quant.formats import ct_export

    pid_file = tmp_path / "pid"
    stand_in = tmp_path / "python"
    stand_in.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    stand_in.chmod(0o755)
    monkeypatch.setattr(ct_export.sys, "executable", str(stand_in))
    (tmp_path / "gptq").mkdir()

    def interrupt():
        while not pid_file.exists() or not pid_file.read_text().strip():
            threading.Event().wait(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        ct_export.convert_fresh(tmp_path / "gptq", tmp_path / "out")
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped: no such process (a zombie would still answer)
