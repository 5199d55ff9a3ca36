"""The shape of report.json (schema_version 2): typed sections, created, loaded and saved here only.

Later versions only add keys; a key never changes meaning without a new SCHEMA_VERSION. Measurement
payloads (a perplexity record, a smoke test, a speed run, a speculative row) are kept as the measuring
code wrote them; everything that structures the report, and everything a gate or the publish rule reads,
is a typed field.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.base.errors import CompressError
from pipeline.base.fileio import atomic_write_text
from pipeline.eval.measures import extend, sections
from pipeline.results.metrics import Distill, Offload, Perplexity, Served, Smoke, SpeculativeRow, Speed, TaskScore

SCHEMA_VERSION = 2  # 2: a model's `serve` (one engine) became `served` ({engine: ...})
REPORT = "report.json"

RunStatus = Literal["running", "complete", "gates_failed", "failed", "interrupted"]
FINAL = ("complete", "gates_failed")  # every stage finished and the gates were evaluated


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunInfo(_Section):
    id: str | None = None  # this invocation of `compress run`; also in recipe.lock.toml and every manifest it wrote
    name: str
    recipe: str
    status: RunStatus = "running"
    exit_code: int | None = None
    started: str
    finished: str | None = None
    device: str
    seed: int
    versions: dict[str, Any] = {}
    error: str | None = None
    gates_evaluated: bool = False
    memory_limit_bytes: int | None = None  # [run] max_memory_gb, when set
    predicted_peak_bytes: dict[str, int] = {}  # compress check's prediction per stage (pipeline/plan.py keys)
    offloaded: list[str] = []  # the stages planned to stream weights from disk


class ModelInfo(_Section):
    source: str | None = None
    name: str | None = None
    architecture: str | None = None
    parameters: int | None = None
    dtype: str | None = None
    footprint_bytes: int | None = None
    provenance: str | None = None
    random_init: bool = False
    license: str | None = None
    source_sha256: str | None = None
    config: dict[str, Any] = {}


class ExpertCoverage(_Section):
    """Calibration tokens routed to each expert of each Mixture-of-Experts layer (pipeline/quant/coverage.py), counted
    on the run's calibration rows through the baseline model, reading the expert indices each MoE block chose. A
    token counts once for each of its top_k experts: a layer's counts sum to tokens x top_k. GPTQ routes each token
    through the already-quantized attention of its layer and the quantized layers before it, so the counts its
    experts saw can differ from these by a few tokens (measured on a random qwen3_moe: 22 of 1,024 in layer 0)."""
    tokens: int  # calibration tokens run through the model (rows x seq_len)
    num_experts: int
    top_k: int
    layers: list[int]  # the decoder layer index of each MoE layer
    counts: list[list[int]]  # counts[j][e]: tokens routed to expert e of decoder layer layers[j]

    def least(self) -> int:
        """The fewest tokens any expert of any MoE layer got."""
        return min((min(row) for row in self.counts if row), default=0)

    def starved(self, bound: float) -> list[tuple[int, list[int]]]:
        """[(decoder layer, its experts that got fewer than `bound` tokens)] for every layer with any."""
        out = [(layer, [e for e, n in enumerate(row) if n < bound])
               for layer, row in zip(self.layers, self.counts, strict=True)]
        return [(layer, experts) for layer, experts in out if experts]


class Calibration(_Section):
    dataset: str | None = None
    documents_available: int | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    tokens: int | None = None
    sampling: str | None = None
    chat_template: bool | None = None
    expert_coverage: ExpertCoverage | None = None  # MoE models only: tokens per (MoE layer, expert)


class ModelEntry(_Section):
    """The baseline or one quantized variant: what made it (variants only) and what validate measured."""
    method: str | None = None
    params: dict[str, Any] | None = None
    checkpoint: str | None = None
    quantize_time_s: float | None = None
    quantize: dict[str, Any] | None = None
    runtimes: list[dict[str, Any]] = []
    perplexity: Perplexity | None = None
    ppl_ratio: float | None = None
    kl: float | None = None
    top1: float | None = None
    smoke: Smoke | None = None
    footprint_bytes: int | None = None
    size_on_disk_bytes: int | None = None
    bits_per_weight: float | None = None  # decoder-block linears as stored (scales, zeros; skipped ones at float size)
    compute: str | None = None  # the precision its quality was computed in (pipeline/model/compute.py describe)
    offload: Offload | None = None  # set when its perplexity read weights from disk (the memory limit)
    speed: Speed | None = None
    tasks: dict[str, TaskScore] | None = None  # [validate.tasks]: {task: {metric, score, stderr, n, split, ...}}
    task_recovery: dict[str, Any] | None = None  # variants: pipeline/eval/recovery.py recoveries() ({tasks, average})
    # validate/<model>/serve/<engine>: {engine: greedy equality and load-test levels, or why it was skipped}
    served: dict[str, Served] | None = None


if not TYPE_CHECKING:  # the fields of each plug-in measurement (pipeline/eval/measures/) it does not type above
    ModelEntry = extend(ModelEntry, sections())


class DraftEntry(_Section):
    name: str = "draft"
    verifier: str | None = None
    checkpoint: str | None = None
    distill: Distill | None = None
    layers: list[int] | None = None
    num_layers: int | None = None
    vocab_size: int | None = None
    source: str | None = None
    dtype: str | None = None
    speculative: dict[str, SpeculativeRow] | None = None  # one flat row per (draft, temperature)
    speculative_detail: dict[str, Any] | None = None
    speed: Speed | None = None


class Gate(_Section):
    model: str
    gate: str
    metric: str
    value: float | None
    bound: float
    op: Literal["<=", ">="]
    passed: bool
    severity: Literal["fail", "warn"]
    reason: str = ""
    verifier: str | None = None


class ExportEntry(_Section):
    kind: Literal["baseline", "variant", "draft"]
    name: str
    verifier: str | None = None
    folder: str
    files: dict[str, int]
    outputs_hash: str | None = None  # the export manifest's, as this run verified or wrote it
    run_id: str | None = None  # the run that wrote the folder (an unchanged folder is reused by later runs)


class PublishSection(_Section):
    status: Literal["dry-run", "pushed", "refused", "failed"]
    endpoint: str | None = None
    items: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    reason: str | None = None
    failed_gates: list[dict[str, Any]] = []
    run_id: str | None = None  # the run whose exports were planned or pushed


class StageEntry(_Section):
    # done / skipped (up to date); failed: the unit raised (error says why); blocked: an upstream unit failed, so
    # it did not run. A run with a failed unit goes on with the units that do not depend on it, then exits 4
    status: Literal["done", "skipped", "failed", "blocked"]
    time_s: float
    peak_rss_bytes: int
    dir: str
    error: str | None = None
    node: str | None = None  # executor = "ray": the node that ran the unit (id prefix and IP); None: this machine


class Report(_Section):
    schema_version: int = SCHEMA_VERSION
    run: RunInfo
    model: ModelInfo | None = None
    calibration: Calibration | None = None
    baseline: ModelEntry | None = None
    variants: dict[str, ModelEntry] = {}
    draft: DraftEntry | None = None
    gates: list[Gate] = []
    exports: dict[str, ExportEntry] = {}
    publish: PublishSection | None = None
    stages: dict[str, StageEntry] = {}

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def new_report(*, run_id: str, name: str, recipe: str, device: str, seed: int, versions: dict) -> Report:
    return Report(run=RunInfo(id=run_id, name=name, recipe=recipe, started=now(), device=device, seed=seed,
                              versions=versions))


def load(run_dir: Path) -> Report:
    """The run folder's report, validated; one clear line (ReportError) when it is not a readable report."""
    path = Path(run_dir) / REPORT
    if not path.is_file():
        raise ReportError(f"{path} not found: is {run_dir} a compress run folder?")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ReportError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        got = data.get("schema_version") if isinstance(data, dict) else None
        raise ReportError(f"{path}: schema_version {got!r}, this compress reads {SCHEMA_VERSION}")
    try:
        return Report.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ReportError(f"{path}: {where}: {first['msg']} ({e.error_count()} problem(s)); "
                          "rerun `compress run` to rewrite it") from None


def save(report: Report, run_dir: Path) -> None:
    atomic_write_text(Path(run_dir) / REPORT, json.dumps(report.to_dict(), indent=2, default=str))


class ReportError(CompressError):
    """report.json is missing or malformed: the folder given is not a run this compress can read."""

    exit_code = 2
