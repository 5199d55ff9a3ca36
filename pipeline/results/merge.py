"""Every stage's contribution to the report, in one place: `record(report, key, manifest, skipped)` is
what the runner calls after a unit ran or was found up to date. The unit's key (parsed by
pipeline/base/stage_keys.py: a key outside its grammar is refused) says which section its metrics fill; nothing else
writes report sections."""
from __future__ import annotations

from typing import Any

from pipeline.base.stage_keys import UnitKey
from pipeline.eval.measures import MEASUREMENTS
from pipeline.results.metrics import Distill, Served, SpeculativeRow, Speed
from pipeline.results.schema import Calibration, DraftEntry, ExportEntry, ModelEntry, ModelInfo, Report, StageEntry

MODEL_KEYS = tuple(ModelInfo.model_fields)
CALIBRATION_KEYS = tuple(Calibration.model_fields)


def record_failure(report: Report, key: str, status: str, error: str) -> None:
    """A unit that raised ("failed", its error line) or did not run because an upstream one did ("blocked")."""
    report.stages[key] = StageEntry(status=status, time_s=0.0, peak_rss_bytes=0, dir="", error=error)


def record(report: Report, key: str, manifest: dict, skipped: bool) -> None:
    uk = UnitKey.parse(key)  # UnitKeyError before anything is written for a key outside the grammar
    report.stages[key] = StageEntry(status="skipped" if skipped else "done", time_s=manifest["time_s"],
                                    peak_rss_bytes=manifest["peak_rss_bytes"], dir=key)
    metrics = manifest.get("metrics") or {}
    if uk.stage == "load":
        report.model = ModelInfo(**{k: metrics.get(k) for k in MODEL_KEYS if metrics.get(k) is not None})
    elif uk.stage == "calibrate":
        report.calibration = Calibration(**{k: metrics.get(k) for k in CALIBRATION_KEYS})
    elif uk.stage == "draft":
        _draft(report, metrics)
    elif uk.measure == "speculative":
        _speculative(report, metrics)
    elif uk.name is not None:  # the grammar: every other key names its variant, model or export
        _named(report, uk, uk.name, manifest, metrics)


def _named(report: Report, uk: UnitKey, name: str, manifest: dict, metrics: dict) -> None:
    """quantize/<variant>, validate/<model>/quality|speed|serve/<engine>|<plug-in measurement> and export/<name>."""
    if uk.stage == "quantize":
        _quantized(report, name, metrics, (manifest.get("config") or {}).get("variant") or {})
    elif uk.measure == "quality":
        _quality(report, name, metrics)
    elif uk.measure == "speed":
        entry(report, name).speed = Speed.model_validate(metrics)
    elif uk.measure == "serve" and uk.engine is not None:  # the grammar: validate/<model>/serve/<engine>
        e = entry(report, name)
        e.served = {**(e.served or {}), uk.engine: Served.model_validate(metrics)}
    elif uk.measure is not None and uk.measure in MEASUREMENTS:  # a plug-in: its declaration says which fields
        MEASUREMENTS.get(uk.measure).merge(entry(report, name), metrics)
    elif uk.stage == "export":
        report.exports[name] = ExportEntry(**{k: metrics.get(k)
                                              for k in ("kind", "name", "verifier", "folder", "files")},
                                           outputs_hash=manifest.get("outputs_hash"), run_id=manifest.get("run_id"))


def entry(report: Report, name: str) -> ModelEntry:
    """The baseline's or a variant's entry, created empty when first written."""
    if name == "baseline":
        if report.baseline is None:
            report.baseline = ModelEntry()
        return report.baseline
    return report.variants.setdefault(name, ModelEntry())


def _quantized(report: Report, name: str, m: dict, params: dict) -> None:
    e = entry(report, name)
    e.method, e.params, e.checkpoint = params.get("method"), params, str(UnitKey("quantize", name))
    e.quantize_time_s, e.runtimes = m.get("time_s"), m.get("runtimes", [])
    e.quantize = {k: v for k, v in m.items() if k not in ("files", "runtimes")}


def _quality(report: Report, name: str, m: dict) -> None:
    e = entry(report, name)
    for k in ("perplexity", "footprint_bytes", "size_on_disk_bytes", "bits_per_weight", "smoke", "compute", "offload"):
        if k in m:
            setattr(e, k, m[k])
    ppl = m.get("perplexity") or {}
    e.kl, e.top1 = ppl.get("kl", e.kl), ppl.get("top1", e.top1)
    base = report.baseline.perplexity.value if report.baseline and report.baseline.perplexity else None
    if name != "baseline" and base and ppl.get("value"):
        e.ppl_ratio = ppl["value"] / base


def _draft(report: Report, m: dict) -> None:
    d = report.draft or DraftEntry()
    d.verifier, d.checkpoint, d.distill = m.get("verifier"), "draft", Distill.model_validate(m)
    d.layers = m.get("layers")
    d.num_layers = len(m.get("layers") or [])
    d.vocab_size = m.get("draft_vocab_size")
    d.source, d.dtype = m.get("source"), m.get("dtype", "float32")
    report.draft = d


def _speculative(report: Report, m: dict) -> None:
    d = report.draft or DraftEntry()
    d.speculative = {mode: SpeculativeRow.model_validate(row) for mode, row in speculative_modes(m).items()}
    d.speculative_detail = m
    report.draft = d


DRAFT_KINDS = ("distilled", "undistilled", "fp-distilled")  # keys of measure_speculative's result
FLAT_KEYS = ("alpha", "alpha_per_token", "tokens_per_target_forward", "speedup", "plain_tokens_per_s",
             "repetition_rate", "accepted_by_position", "drafted_by_position", "acceptance_by_position",
             "predicted_speedup", "greedy_mismatches")


def speculative_modes(m: dict) -> dict[str, dict[str, Any]]:
    """One flat row per (draft, temperature) — "greedy", "t0.7", "undistilled greedy", "fp-distilled t0.7"
    (the draft distilled against the full-precision model, same verifier) — for report and gates."""
    gamma = m.get("gamma")
    modes = {}
    for which in DRAFT_KINDS:
        section = m.get(which) or {}
        costs = section.get("costs") or {}
        for key, run in section.items():
            if not key.startswith("t=") or not isinstance(run, dict):
                continue
            t = float(key[2:])
            mode = "greedy" if t == 0 else f"t{t:g}"
            row = {k: run.get(k) for k in FLAT_KEYS if k in run}
            row.update(tokens_per_s=run.get("spec_tokens_per_s"), c_d=costs.get("c_d"),
                       c_v=(costs.get("c_v") or {}).get(str(gamma + 1)) if gamma else None,
                       break_even_alpha=costs.get("break_even_alpha_per_token"), gamma=gamma)
            if "hf_reference" in run:
                row["hf_assisted"] = run["hf_reference"]
            modes[mode if which == "distilled" else f"{which} {mode}"] = row
    return modes
