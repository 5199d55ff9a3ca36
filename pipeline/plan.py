"""From a validated Recipe to a checked plan (no weights loaded, no torch imported) and its units."""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import platform
from dataclasses import dataclass, field

from pipeline import data
from pipeline.base.errors import RecipeError
from pipeline.base.gpu_probe import GpuInfo, probe
from pipeline.base.problem import Problem
from pipeline.budget.formulas import GiB
from pipeline.estimate import estimate_disk, estimate_memory
from pipeline.eval.config import GATE_SPECS, gate_path, gate_problems, moe_gate_problems, speed_problems
from pipeline.eval.measures import all_measurements
from pipeline.eval.parallel_check import bound_cores, serve_parallel_problems, technique_problems, tp_rank_bytes
from pipeline.eval.tasks_config import served_task_problems
from pipeline.model.architecture import missing, model_class, transformers_model_types
from pipeline.model.dtypes import HALF_UNITS, cpu_flags, dtype_bytes, resolve_dtype
from pipeline.model.sources import ModelInfo, describe, parse
from pipeline.quant.registry import check_variant, method_of, needs_calibration, runtimes, serve_needs, variant_format
from pipeline.quant.shapes import Arch, linear_shapes_from_config
from pipeline.serve import engines
from pipeline.serve.config import serve_plan
from pipeline.stages.kinds import Calibrate, Draft, Export, Load, Quality, Quantize, Serve, Speed

TRACKED_PACKAGES = ("torch", "transformers", "gptqmodel", "bitsandbytes", "optimum", "accelerate", "datasets",
                    "huggingface-hub", "safetensors", "gguf", "torchao", "pydantic", "numpy", "compress",
                    "compressed-tensors", "lm-eval", "tokenizers")


@dataclass
class Plan:
    model: ModelInfo
    stages: list[str]
    dtype: str = "float32"  # the baseline's precision: [model].dtype with "auto" resolved
    draft_model: ModelInfo | None = None  # [draft] init = "model": its source, described once by the checks
    variants: list[dict] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    memory_limit: int = 0
    offload: dict[str, bool] = field(default_factory=dict)  # stages that stream weights from disk to fit the limit
    speed_skipped: dict[str, str] = field(default_factory=dict)  # models not timed: over the limit (why)
    # [validate.serve]: {model: {engine: None (served) or why that engine is skipped}}
    serve_engines: dict[str, dict[str, str | None]] = field(default_factory=dict)
    serve_skipped: dict[str, str] = field(default_factory=dict)  # models no engine serves here (why)
    disk: dict[str, int] = field(default_factory=dict)  # bytes each stage writes into the run folder (estimate)
    disk_free: int = 0  # free bytes on the run folder's filesystem
    disk_reused: int = 0  # bytes an earlier run already wrote into the run folder (a rerun reuses them)
    warnings: list[str] = field(default_factory=list)
    device: str = "cpu"  # what "auto" resolves to here
    gpu: GpuInfo | None = None  # when an NVIDIA GPU is visible

    @property
    def peak_memory(self) -> int:
        return max(self.memory.values()) if self.memory else 0


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in TRACKED_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    for name in engines.NAMES:  # each serving engine's own (vLLM: the environment it runs from, .venv-vllm)
        for pkg, v in engines.get(name).version().items():
            out.setdefault(pkg, v)
    return out


def identity_versions(vers: dict[str, str]) -> dict[str, str]:
    """The versions every unit's identity hashes: `vers` without those of the engines that run from an environment
    of their own (Engine.own_environment: vLLM's .venv-vllm). Their serve units hash the engine's version in their
    config; counting it in every unit made a run started before .venv-vllm was built recompute its load,
    quantization and measurements once it was (CI's ci-real run beside vLLM's set-up: every unit ran twice)."""
    own = {pkg for name in engines.NAMES if engines.get(name).own_environment for pkg in engines.get(name).version()}
    return {k: v for k, v in vers.items() if k not in own}


def arch_of(info: ModelInfo) -> Arch:
    return linear_shapes_from_config(info.config)


def check(recipe) -> Plan:
    """Every cross-stage rule, before any weight is loaded. Raises RecipeError listing all problems (its
    `.problems`: one Problem each, pipeline/base/problem.py)."""
    problems: list[Problem] = []
    try:
        source = parse(recipe.model.source, recipe.model.gguf_file)
        info = describe(source)
    except RecipeError as e:
        raise _source_error(Problem("model.source", "model-source-invalid", f"[model].source: {e}")) from None
    except (OSError, ValueError) as e:
        raise _source_error(Problem("model.source", "model-source-unreadable",
                                    f"[model].source {recipe.model.source!r} cannot be read: {e}")) from None
    plan = Plan(info, stage_names(recipe))
    problems += _check_device(recipe, plan)
    plan.dtype = resolve_dtype(recipe.model.dtype, source.source_kind, info.dtype, plan.device)
    problems += _check_data(recipe)
    problems += _check_model_type(recipe, info)
    problems += _check_quantized_source(recipe, info)
    problems += _check_variants(recipe, info, plan)
    problems += _check_draft(recipe, info, plan)
    problems += _check_gates(recipe, random_init=source.random_init)
    problems += _check_moe_calibration(recipe, info)
    problems += _check_measurements(recipe, plan)
    problems += _check_serve(recipe, plan)
    problems += served_task_problems(recipe.validate_.tasks, recipe.validate_.serve, plan.serve_engines,
                                     {n: engines.get(n).scores_tasks for n in engines.NAMES})
    problems += serve_parallel_problems(recipe.validate_.serve, info.config, plan.device, plan.serve_engines,
                                        engines.splitting(), bound_cores(recipe.run.threads), _group_sizes(recipe))
    estimate_memory(recipe, info, plan, source)
    problems += _check_techniques(recipe, info, plan)
    problems += _untimed_gates(recipe, plan)
    if plan.peak_memory > plan.memory_limit:
        over = ", ".join(f"{k} needs {b / GiB:.2f} GiB" for k, b in plan.memory.items() if b > plan.memory_limit)
        where = "[run].max_memory_gb" if recipe.run.max_memory_gb else "this machine's memory"
        problems.append(Problem("run.max_memory_gb", "memory-over-limit",
                                f"estimated peak memory {plan.peak_memory / GiB:.2f} GiB exceeds the "
                                f"{plan.memory_limit / GiB:.3g} GiB available ({where}): {over}; lower "
                                "calibration.num_samples/seq_len, validate.perplexity.seq_len or "
                                "draft.distill.batch_size, or raise the limit (offloaded to disk where a stage can: "
                                "GPTQ and RTN quantization, the baseline's perplexity; quantized checkpoints, "
                                "bitsandbytes, torchao, AWQ, AutoRound, GGUF and the draft must fit)"))
    problems += estimate_disk(recipe, info, plan, source)
    problems += _check_executor(recipe)
    plan.warnings += _half_precision_on_cpu(recipe, plan)
    if problems:
        raise RecipeError("the recipe cannot run:\n" + "\n".join(f"  - {p}" for p in problems), problems=problems)
    return plan


def _check_techniques(recipe, info: ModelInfo, plan: Plan) -> list[Problem]:
    """[validate.speed] technique rows this model and device cannot run; the tensor_parallel ranks' memory: each
    rank's own line (per rank), and all of them added to the speed unit that starts them (one machine holds all)."""
    speed = recipe.validate_.speed
    if not speed.enabled or not speed.techniques:
        return []
    if "tensor_parallel" in speed.techniques:
        rank = tp_rank_bytes(info.config, dtype_bytes(plan.dtype), speed.tp_size, speed.model_dump(mode="json"))
        for name in ["baseline", *(v.name for v in recipe.quantize)]:
            key = Speed.key(name)
            if key in plan.memory and speed.for_model(name).techniques:
                plan.memory[key] += speed.tp_size * rank
                plan.memory[f"{key} tensor_parallel, per rank (x{speed.tp_size})"] = rank
    return technique_problems(speed, info.config, plan.device)


def _check_model_type(recipe, info) -> list[Problem]:
    """A model transformers can build: its model_type known to this transformers, or its own code allowed."""
    config = info.config or {}
    mt = str(config.get("model_type") or "")
    if config.get("auto_map") and not recipe.model.trust_remote_code:
        return [Problem("model.trust_remote_code", "remote-code-not-trusted",
                        f"[model].source {recipe.model.source!r} ships its own model code (config.json auto_map: "
                        f"{', '.join(sorted(config['auto_map']))}), which runs only with [model] trust_remote_code = "
                        "true: read that code first, then set it")]
    if mt and not config.get("auto_map") and mt not in transformers_model_types():
        return [Problem("model.source", "model-type-unknown",
                        f"model_type {mt!r} is not known to transformers {_version('transformers')} (its "
                        "models/auto mappings): upgrade transformers, or give a checkpoint with its own code "
                        "(auto_map) and [model] trust_remote_code = true")]
    return []


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _check_quantized_source(recipe, info) -> list[Problem]:
    """A source that is already quantized is evaluated as written; quantizing it again is refused."""
    qc = (info.config or {}).get("quantization_config")
    if not qc or not recipe.quantize:
        return []
    return [Problem("quantize", "source-already-quantized",
                    f"[model].source is already quantized ({qc.get('quant_method', 'unknown method')}): [[quantize]] "
                    "variants start from full-precision weights; give the unquantized model as the source, or drop "
                    "[[quantize]] to evaluate this checkpoint as it is written")]


def _source_error(problem: Problem) -> RecipeError:
    """[model].source cannot be described: nothing else can be checked, so the error is that one line."""
    return RecipeError(problem.message, problems=[problem])


def _check_executor(recipe) -> list[Problem]:
    """[run] executor = "ray" needs Ray installed (looked up, not imported: check stays fast)."""
    if recipe.run.executor == "ray" and importlib.util.find_spec("ray") is None:
        return [Problem("run.executor", "ray-not-installed",
                        "[run] executor = \"ray\" needs Ray, which is not installed: pip install -e '.[ray]'")]
    return []


def _untimed_gates(recipe, plan: Plan) -> list[Problem]:
    """A speed gate on a model that will not be timed (plan.speed_skipped) could only fail: refused here."""
    gates = recipe.validate_.gates
    problems = []
    for v in recipe.quantize:
        for gate in (g for g in gates.bounds_for(v.name) if GATE_SPECS[g].needs_speed):
            for name in ("baseline", v.name):
                if name in plan.speed_skipped:
                    problems.append(Problem(gate_path(gates, v.name, gate), "speed-gate-model-over-memory",
                                            f"[validate.gates].{gate} for {v.name!r} needs {name!r} timed, but "
                                            f"{name!r} will not be timed: it {plan.speed_skipped[name]}; raise "
                                            "max_memory_gb, lower [validate.speed] batch_sizes, or drop the gate"))
    return problems


def stage_names(recipe) -> list[str]:
    """The run's stages in order, as `compress check` lists them: the keys of load, calibrate, each quantize
    variant and the draft, then the validate and export stages (many units each) and publish."""
    names = [Load.key()]
    if any(_needs_calibration(q) for q in recipe.quantize) or recipe.draft is not None:
        names.append(Calibrate.key())
    names += [Quantize.key(q.name) for q in recipe.quantize]
    if recipe.draft is not None:
        names.append(Draft.key())
    names += [Quality.stage, Export.stage] + (["publish"] if recipe.publish is not None else [])
    return names


def _needs_calibration(variant) -> bool:
    return needs_calibration(variant)


def _check_data(recipe) -> list[Problem]:
    cal, ppl = recipe.calibration, recipe.validate_.perplexity
    problems = _check_dataset("calibration.dataset", cal.dataset, cal.text_field)
    problems += _check_dataset("validate.perplexity.dataset", ppl.dataset, ppl.text_field)
    prompts = recipe.draft.measure.prompts if recipe.draft is not None else None
    if prompts is not None:
        problems += _check_dataset("draft.measure.prompts", prompts)
        if prompts == cal.dataset and not cal.allow_overlap:
            problems.append(Problem("draft.measure.prompts", "prompts-are-calibration-text",
                                    f"draft.measure.prompts and calibration.dataset are both {prompts!r}: the draft "
                                    "is distilled on the calibration corpus, so acceptance would be measured on its "
                                    "training text"))
    if cal.dataset == ppl.dataset and not cal.allow_overlap:
        problems.append(Problem("calibration.dataset", "calibration-is-evaluation-text",
                                f"calibration.dataset and validate.perplexity.dataset are both {cal.dataset!r}: "
                                "calibrating or distilling on the evaluation text inflates every figure; use another "
                                "corpus (c4) or set calibration.allow_overlap = true to accept it"))
    return problems


def _check_dataset(where: str, name: str, text_field: str = "text") -> list[Problem]:
    try:
        data.resolve(name, text_field)
    except RecipeError as e:
        return [Problem(where, "dataset-unresolved", f"{where}: {e}")]
    return []


def _check_device(recipe, plan: Plan) -> list[Problem]:
    """Which device the run will use ("auto": CUDA when this environment's torch can use a GPU)."""
    plan.gpu = probe() if recipe.run.device in ("auto", "cuda") else None
    usable = plan.gpu is not None and plan.gpu.torch_cuda
    plan.device = "cuda" if recipe.run.device == "cuda" or (recipe.run.device == "auto" and usable) else "cpu"
    if recipe.run.device == "cuda" and not usable:
        why = plan.gpu.note if plan.gpu else "no NVIDIA GPU found (nvidia-smi)"
        return [Problem("run.device", "cuda-unavailable",
                        f"[run].device = 'cuda': {why}; use device = 'auto' or 'cpu'")]
    return []


def _check_variants(recipe, info: ModelInfo, plan: Plan) -> list[Problem]:
    if not recipe.quantize:
        return []

    arch = arch_of(info)
    device = plan.device
    problems = []
    line = missing(arch.architecture) if arch.architecture is not None and arch.model_type else None
    if line is not None:
        plan.warnings.append(line)
    tokenizer = tokenizer_facts(recipe)
    for i, v in enumerate(recipe.quantize):
        found = check_variant(v, arch, device)
        if tokenizer is not None:
            found += method_of(v).check_tokenizer(v, arch, *tokenizer)
        rows = getattr(v, "calibration_rows", None)
        if rows is not None and rows > recipe.calibration.num_samples:
            found.append(Problem("calibration_rows", "calibration-rows-over-samples",
                                 f"calibration_rows = {rows} exceeds calibration.num_samples = "
                                 f"{recipe.calibration.num_samples}: lower it or raise num_samples"))
        if needs_calibration(v):
            n = min(rows or recipe.calibration.num_samples, recipe.calibration.num_samples)
            found += method_of(v).check_calibration(v, n, recipe.calibration.seq_len)
        problems += [p.within(f"quantize[{i}]", f"quantize.{i} ({v.name}): ") for p in found]
        plan.variants.append({"name": v.name, "method": v.method, "runtimes": runtimes(v, arch)})
    return problems


def tokenizer_facts(recipe) -> tuple[frozenset[str], str | None] | None:
    """(file names, tokenizer_config.json's tokenizer_class) of the tokenizer the load stage will save beside the
    baseline: a GGUF's is rebuilt by transformers as tokenizer.json (no SentencePiece model); a folder's are its own.
    None when it cannot be told without loading it."""
    try:
        src = parse(recipe.model.source, recipe.model.gguf_file)
        spec = recipe.model.tokenizer or src.default_tokenizer
        tok = parse(spec) if spec else src
    except (RecipeError, OSError, ValueError):
        return None
    if tok.is_gguf:
        return frozenset({"tokenizer.json", "tokenizer_config.json"}), None
    folder, _ = tok.source_kind.tokenizer_files(tok, recipe.model.trust_remote_code)
    if not folder.is_dir():
        return None
    cls = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        cls = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    return frozenset(p.name for p in folder.iterdir()), cls


def _check_draft(recipe, info: ModelInfo, plan: Plan) -> list[Problem]:
    d = recipe.draft
    if d is None:
        return []
    problems = []
    names = {q.name for q in recipe.quantize}
    if d.verifier != "baseline" and d.verifier not in names:
        problems.append(Problem("draft.verifier", "draft-verifier-unknown",
                                f"draft.verifier = {d.verifier!r} is neither 'baseline' nor a [[quantize]] variant "
                                f"(variants: {sorted(names) or 'none'})"))

    gguf = {q.name for q in recipe.quantize if method_of(q).checkpoint_format == "gguf"}
    if d.verifier in gguf:
        problems.append(Problem("draft.verifier", "draft-verifier-gguf",
                                f"draft.verifier = {d.verifier!r} is a GGUF file (llama.cpp's format): the draft is "
                                "distilled and measured in transformers; name the baseline or a transformers variant "
                                "(gptq, bnb, ...)"))
    if d.measure.compare_fp_distilled and d.verifier == "baseline":
        problems.append(Problem("draft.measure.compare_fp_distilled", "fp-distilled-needs-quantized-verifier",
                                "draft.measure.compare_fp_distilled = true needs a quantized draft.verifier: with "
                                "verifier = 'baseline' the draft is already distilled against the full-precision "
                                "model, so there is nothing to compare; name a [[quantize]] variant as "
                                "draft.verifier or set it to false"))
    n_layers = info.config.get("num_hidden_layers")
    if d.layers and n_layers and any(not 0 <= i < n_layers for i in d.layers):
        problems.append(Problem("draft.layers", "draft-layers-out-of-range",
                                f"draft.layers {d.layers} must be indices in 0..{n_layers - 1} (the verifier has "
                                f"{n_layers} layers)"))
    if d.num_layers and n_layers and d.num_layers >= n_layers:
        problems.append(Problem("draft.num_layers", "draft-num-layers-too-many",
                                f"draft.num_layers = {d.num_layers} must be below the verifier's {n_layers} layers"))
    if d.vocab_size and info.config.get("vocab_size") and d.vocab_size > info.config["vocab_size"]:
        problems.append(Problem("draft.vocab_size", "draft-vocab-too-large",
                                f"draft.vocab_size = {d.vocab_size} exceeds the verifier's vocabulary "
                                f"({info.config['vocab_size']})"))
    if d.init == "model":
        problems += _check_draft_tokenizer(recipe, info, plan)
    return problems


def _check_draft_tokenizer(recipe, info: ModelInfo, plan: Plan) -> list[Problem]:
    d = recipe.draft
    if not d.source:
        return [Problem("draft.source", "draft-source-missing",
                        "draft.init = 'model' needs draft.source (a model source with the verifier's tokenizer)")]
    try:
        dinfo = plan.draft_model = describe(parse(d.source))
    except RecipeError as e:
        return [Problem("draft.source", "draft-source-invalid", f"draft.source: {e}")]
    diffs = [f"{k}: verifier {info.config.get(k)} vs draft {dinfo.config.get(k)}" for k in ("vocab_size",)
             if info.config.get(k) != dinfo.config.get(k)]
    for k in ("bos_token_id", "eos_token_id"):
        a, b = info.config.get(k), dinfo.config.get(k)
        if a is not None and b is not None and a != b:
            diffs.append(f"{k}: verifier {a} vs draft {b}")
    return [Problem("draft.source", "draft-tokenizer-differs",
                    f"draft.source {d.source!r} has a different tokenizer than the verifier ({'; '.join(diffs)})")
            ] if diffs else []


def _check_gates(recipe, random_init: bool) -> list[Problem]:
    """[validate.gates] and [validate.speed]: every model they name exists, every gate can be measured."""
    v = recipe.validate_  # the smoke gate does not apply to random weights
    variants, draft = [q.name for q in recipe.quantize], "draft" if recipe.draft else None
    return (gate_problems(v.gates, v.speed, variants, draft, smoke=v.smoke.enabled or random_init,
                          tasks=v.tasks)
            + speed_problems(v.speed, variants, draft))


def _check_moe_calibration(recipe, info: ModelInfo) -> list[Problem]:
    """Expert coverage (pipeline/quant/coverage.py): min_expert_tokens and moe_all_experts need a Mixture-of-Experts
    model; moe_all_experts is GPTQModel's MoE routing, so only the methods it runs (gptq, awq) take it."""
    a = arch_of(info).architecture
    moe, mt = bool(a is not None and a.is_moe), str(info.config.get("model_type") or "?")
    problems = moe_gate_problems(recipe.validate_.gates, [q.name for q in recipe.quantize], mt, moe)
    for i, v in enumerate(recipe.quantize):
        if not getattr(v, "moe_all_experts", False):
            continue
        engine = getattr(method_of(v), "engine", None)
        if not moe:
            why = f"model_type {mt!r} is not a Mixture-of-Experts model (no experts to route)"
        elif engine != "gptqmodel":
            why = (f"method {v.method!r} ({engine}) has no all-expert calibration option; it is GPTQModel's MoE "
                   "routing (ExpertsRoutingOverride), taken by gptq and awq")
        else:
            continue
        problems.append(Problem(f"quantize[{i}].moe_all_experts", "moe-all-experts-unsupported",
                                f"quantize.{i} ({v.name}): moe_all_experts = true: {why}; drop it"))
    return problems


def _check_measurements(recipe, plan: Plan) -> list[Problem]:
    """Each plug-in measurement's rules for its table (pipeline/eval/measures/: [validate.tasks], ...): problems
    are returned, notes become warnings."""
    arch = arch_of(plan.model)
    found = [p for m in all_measurements() for p in m.check(recipe, arch)]
    plan.warnings += [p.message for p in found if p.note]
    return [p for p in found if not p.note]


def _group_sizes(recipe) -> dict[str, tuple[int, ...]]:
    """{variant: the group sizes its checkpoint may hold}: its group_size, or every one its mix may choose."""
    out = {}
    for v in recipe.quantize:
        g = getattr(v, "group_size", None)
        if not isinstance(g, int):
            continue
        mix = getattr(v, "mix", None)
        out[v.name] = tuple(gs for _, gs in mix.candidates(g)) if mix is not None else (g,)
    return out


def _check_serve(recipe, plan: Plan) -> list[Problem]:
    """[validate.serve]: an engine that can serve every served model here (pipeline/serve/config.py); a serve gate
    on a model that will not be served could only fail."""
    cfg = recipe.validate_.serve
    if not cfg.enabled:
        return []
    models: list[tuple[str, str | None] | tuple[str, str | None, str | None]] = [("baseline", None)]
    models += [(q.name, q.method, variant_format(q)) for q in recipe.quantize]
    problems, plan.serve_engines = serve_plan(cfg, models, plan.device, model_class(plan.model.config or {}),
                                              {q.name: serve_needs(q) for q in recipe.quantize},
                                              plan.model.config or None)
    plan.warnings += [f"{Serve.key(n, e)}: skipped: {why}" for n, by in plan.serve_engines.items()
                      for e, why in by.items() if why is not None]
    plan.serve_skipped = {n: "; ".join(f"{e}: {w}" for e, w in by.items()) for n, by in plan.serve_engines.items()
                          if by and all(w is not None for w in by.values())}
    gates = recipe.validate_.gates
    for v in recipe.quantize:
        for gate in (g for g in gates.bounds_for(v.name) if GATE_SPECS[g].needs_serve):
            needs = ("baseline", v.name) if GATE_SPECS[gate].serve_baseline else (v.name,)
            problems += [Problem(gate_path(gates, v.name, gate), "serve-gate-model-not-served",
                                 f"[validate.gates].{gate} for {v.name!r} needs {n!r} served, but its serving is "
                                 f"skipped: {plan.serve_skipped[n]}") for n in needs if n in plan.serve_skipped]
            problems += [Problem(gate_path(gates, v.name, gate), "serve-gate-model-not-listed",
                                 f"[validate.gates].{gate} for {v.name!r} needs {n!r} served, but [validate.serve] "
                                 f"models does not list it: add it there, or set the gate for the served models "
                                 f"only ([validate.gates.models.<name>])") for n in needs
                         if n not in plan.serve_engines and n not in plan.serve_skipped]
    return problems


HALF = ("bfloat16", "float16")


def _half_precision_on_cpu(recipe, plan: Plan) -> list[str]:
    """A note when models run in bfloat16/float16 on a CPU without units for it: torch emulates those matmuls
    (measured on a 2-core AVX2 machine: 1-6 GFLOPS against 38-53 in float32). Quantization and quality compute them
    in float32 from the 16-bit weights (pipeline/model/compute.py); the speed figures and the draft's distillation and
    acceptance measurement run as transformers runs them."""
    if plan.device != "cpu":
        return []
    uses: dict[str, list[str]] = {}
    if plan.dtype in HALF:
        uses.setdefault(plan.dtype, []).append("the baseline")

    for v in recipe.quantize:
        dtype = getattr(v, "dtype", None) or ("bfloat16" if method_of(v).half_only and plan.dtype not in HALF else None)
        if dtype in HALF:
            uses.setdefault(dtype, []).append(v.name)
    flags = cpu_flags()
    out = []
    for dtype, who in uses.items():
        if not flags & set(HALF_UNITS[dtype]):
            out.append(f"{', '.join(who)} in {dtype} on a CPU without {' or '.join(HALF_UNITS[dtype])}: "
                       f"quantization and quality compute their matmuls in float32 from the {dtype} weights; speed, "
                       f"distillation and speculative decoding run with torch's emulated {dtype} matmuls, several "
                       f"times slower than float32 for long sequences ([model] dtype = 'float32' avoids it)")
    return out
