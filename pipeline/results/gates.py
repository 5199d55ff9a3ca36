"""Quality and speed gates over the typed report, and the one verdict on them.

Each configured gate gives one record per model it applies to (variants for quality, size and speed;
the draft, with its verifier, for the speculative gates). A metric the report lacks is a failed gate whose
reason says what is missing, never a crash. `severity` is "fail", or "warn" for gates listed in `warn_only`.

`blocks(gate)` is the only place that decides whether a gate failed: the run's exit code, the summary
line, report.md, the model cards and the publish rule all ask it (through `failed_gates`/`blocking_by_model`).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from pydantic import TypeAdapter, ValidationError

from pipeline.eval.config import GATE_SPECS, GatesConfig
from pipeline.quant.registry import METHODS
from pipeline.results.metrics import Level
from pipeline.results.schema import DraftEntry, Gate, ModelEntry, Report

Getter = Callable[[Report, ModelEntry, str], tuple[float | None, str]]
DraftGetter = Callable[[Report, DraftEntry, str], tuple[float | None, str]]


def blocks(g: Gate) -> bool:
    """THE gate verdict: a gate fails the run and keeps its model off the Hub when it did not pass and is not
    warn-only. Warn-only gates never block."""
    return not g.passed and g.severity != "warn"


def failed_gates(report: Report) -> list[Gate]:
    return [g for g in report.gates if blocks(g)]


def blocking_by_model(report: Report) -> dict[str, list[Gate]]:
    """{model: its blocking gates}, only models with at least one."""
    out: dict[str, list[Gate]] = {}
    for g in failed_gates(report):
        out.setdefault(g.model, []).append(g)
    return out


def gate_status(g: Gate) -> str:
    if g.passed:
        return "PASS"
    return "FAIL" if blocks(g) else "WARN"


def gates_summary(gates: list[Gate]) -> str:
    """"N passed, F failed, W warnings" (warn-only gates that did not pass are warnings, not failures)."""
    statuses = [gate_status(g) for g in gates]
    return f"{statuses.count('PASS')} passed, {statuses.count('FAIL')} failed, {statuses.count('WARN')} warnings"


# ---------------------------------------------------------------- reading metrics
def _ratio(num: float | None, den: float | None, what: str) -> tuple[float | None, str]:
    if num is None:
        return None, f"{what}: the model's value is missing"
    if den is None:
        return None, f"{what}: the baseline's value is missing"
    if not den:
        return None, f"{what}: the baseline's value is zero"
    return float(num) / float(den), ""


def _ppl_ratio(report: Report, e: ModelEntry, name: str) -> tuple[float | None, str]:
    if e.ppl_ratio is not None:
        return e.ppl_ratio, ""
    base = report.baseline.perplexity if report.baseline else None
    return _ratio(e.perplexity.value if e.perplexity else None, base.value if base else None,
                  f"variants.{name}.perplexity.value / baseline.perplexity.value")


def _plain(key: str) -> Getter:
    def get(report: Report, e: ModelEntry, name: str) -> tuple[float | None, str]:
        value = getattr(e, key)
        return (None, f"variants.{name}.{key} is not in the report") if value is None else (float(value), "")
    return get


def _footprint_ratio(report: Report, e: ModelEntry, name: str) -> tuple[float | None, str]:
    base = ((report.baseline.footprint_bytes if report.baseline else None)
            or (report.model.footprint_bytes if report.model else None))
    return _ratio(e.footprint_bytes, base, f"variants.{name}.footprint_bytes / baseline's")


def _decode_ratio(report: Report, e: ModelEntry, name: str) -> tuple[float | None, str]:
    base = report.baseline.speed if report.baseline else None
    for who, speed in ((name, e.speed), ("baseline", base)):
        if speed is not None and speed.skipped:
            return None, f"{who} was not timed: {speed.skipped}"
    return _ratio(e.speed.decode_tokens_per_s_b1 if e.speed else None, base.decode_tokens_per_s_b1 if base else None,
                  f"variants.{name}.speed.decode_tokens_per_s_b1 / baseline's (is speed timed for both?)")


def _smoke_ok(report: Report, e: ModelEntry, name: str) -> tuple[float | None, str]:
    """Share of the prompts the baseline answered well that this variant answers well too: a prompt the
    baseline itself fails (a base model looping on a chat prompt) is not held against the variant."""
    outputs = e.smoke.outputs if e.smoke else None
    if not outputs:
        return None, f"variants.{name}.smoke is not in the report (did the smoke test run?)"
    base_smoke = report.baseline.smoke if report.baseline else None
    base_ok = {o.prompt: o.ok for o in (base_smoke.outputs if base_smoke else None) or []}
    judged = [o for o in outputs if base_ok.get(o.prompt, True)]
    excused = len(outputs) - len(judged)
    note = f"{excused} prompt(s) the baseline also failed not counted" if excused else ""
    if not judged:
        return 1.0, "not judged: the baseline itself failed every smoke prompt"
    bad = [o for o in judged if not o.ok]
    reason = "; ".join(r for r in (f"{len(bad)} of {len(judged)} smoke prompts failed: {bad[0].problem}"
                                   if bad else "", note) if r)
    return (len(judged) - len(bad)) / len(judged), reason


def _served(e: ModelEntry | None) -> dict[str, list[Level]]:
    """The engines a model was load-tested in: {engine: its serve record's levels}."""
    return {k: v.levels for k, v in ((e.served if e else None) or {}).items() if v.levels}


def _serve_tok_s_ratio(report: Report, e: ModelEntry, name: str) -> tuple[float | None, str]:
    """The lowest, over the engines and concurrency levels both were load-tested in, of variant / baseline output
    tok/s (each engine against the baseline in the same engine)."""
    mine, base = _served(e), _served(report.baseline)
    if not mine:
        return None, f"variants.{name}.served is not in the report (is [validate.serve] enabled for it?)"
    if not base:
        return None, "baseline.served is not in the report (is [validate.serve] enabled for the baseline?)"
    ratios = []
    for engine, levels in mine.items():
        b = {lv.concurrency: lv.output_tok_s for lv in base[engine]} if engine in base else {}
        ratios += [(lv.output_tok_s / den, lv.concurrency, engine) for lv in levels
                   if lv.output_tok_s is not None and (den := b.get(lv.concurrency))]
    if not ratios:
        return None, "no engine and concurrency level load-tested for both the variant and the baseline"
    low, c, engine = min(ratios)
    return low, f"lowest at concurrency {c} ({engine})"


def _serve_error_rate(report: Report, e: ModelEntry, name: str) -> tuple[float | None, str]:
    """The highest, over the engines it was load-tested in, share of failed requests."""
    mine = _served(e)
    if not mine:
        return None, f"variants.{name}.served is not in the report (is [validate.serve] enabled for it?)"
    rates = []
    for engine, levels in mine.items():
        counts = [(lv.errors, lv.requests) for lv in levels if lv.errors is not None and lv.requests is not None]
        if len(counts) < len(levels):
            return None, f"variants.{name}.served.{engine}: a level's errors or requests is not in the report"
        total = sum(requests for _, requests in counts)
        rates.append(((sum(errors for errors, _ in counts) / total if total else 0.0), engine))
    rate, engine = max(rates)
    return rate, f"highest in {engine}" if len(rates) > 1 else ""


def _draft_metric(key: str, label: str) -> DraftGetter:
    def get(report: Report, draft: DraftEntry, mode: str) -> tuple[float | None, str]:
        row = (draft.speculative or {}).get(mode)
        value = row.given(key) if row is not None else None
        if value is None:
            return None, f"draft.speculative.{mode}.{key} ({label}) is not in the report"
        return float(value), ""
    return get


def _record(model: str, gate: str, value: float | None, bound: float, reason: str, warn: bool,
            verifier: str | None = None) -> Gate:
    metric, op = GATE_SPECS[gate].metric, GATE_SPECS[gate].op
    if value is not None and not math.isfinite(value):
        reason, passed, value = f"{metric} is not finite ({value})", False, None
    elif value is None:
        passed = False
    else:
        passed = value <= bound if op == "<=" else value >= bound
    return Gate(model=model, gate=gate, metric=metric, value=value, bound=bound, op=op, passed=passed,
                severity="warn" if warn else "fail", reason=reason, verifier=verifier)


def evaluate_gates(report: Report, cfg: GatesConfig) -> list[Gate]:
    """Every configured gate for every model it applies to, in report order (variants, then draft)."""
    out: list[Gate] = []
    random_init = bool(report.model and report.model.random_init)
    for name, e in report.variants.items():
        for gate, bound in cfg.bounds_for(name).items():
            spec = GATE_SPECS[gate]
            if spec.skip_random_init and (random_init or not bound):
                continue  # random weights produce noise by construction; 0 turns the gate off
            if spec.moe_only and not calibrates(e):
                continue  # expert coverage is about the calibration rows: a variant that reads none is not judged
            if spec.multi:  # several records (task_recovery: per task and/or the average), or a bound-aware one
                out += READERS[gate](report, e, name, bound, cfg)
                continue
            if spec.applies == "variant":
                value, reason = READERS[gate](report, e, name)
                out.append(_record(name, gate, value, bound, reason, gate in cfg.warn_only))
    draft = report.draft
    name = draft.name if draft else "draft"
    key = name if name in cfg.models else "draft"  # overrides under its name or "draft"
    for gate, bound in cfg.bounds_for(key).items():
        if GATE_SPECS[gate].applies != "draft":
            continue
        if draft is None:
            value, reason = None, "the report has no draft section (did the draft stage run?)"
        else:
            value, reason = READERS[gate](report, draft, cfg.speculative_mode)
        out.append(_record(name, gate, value, bound, reason, gate in cfg.warn_only, draft.verifier if draft else None))
    return out


def task_recovery_gates(e: ModelEntry, name: str, bound: float, cfg: GatesConfig) -> list[Gate]:
    """min_task_recovery: one record per task and/or the average ([validate.gates] task_recovery_scope), judging
    the point recovery or the lower end of its paired interval (task_recovery_bound). Recovery is measured above
    chance (pipeline/eval/recovery.py); a task whose baseline is not above chance is excluded from the gate, and
    the average's record (or, without one, the last record) names it and says why. Where [validate.tasks] engines
    scored the tasks through a server, that engine's recovery (its served items against the baseline's in-process
    ones) is judged too, its records' metric ending in "served: <engine>" (as max_ppl_ratio's served records)."""
    rec = e.task_recovery or {}
    if not rec.get("tasks"):
        out = [_record(name, "min_task_recovery", None, bound, f"variants.{name}.task_recovery is not in the report "
                       "(did [validate.tasks] run?)", "min_task_recovery" in cfg.warn_only)]
    else:
        out = _recovery_records(rec, name, bound, cfg)
    for engine, s in sorted((e.served or {}).items()):
        if s.task_recovery is not None:
            out += _recovery_records(s.task_recovery, name, bound, cfg, engine)
    return out


def _recovery_records(rec: dict, name: str, bound: float, cfg: GatesConfig, engine: str | None = None) -> list[Gate]:
    """min_task_recovery's records of one recovery (in process, or served by `engine`)."""
    warn = "min_task_recovery" in cfg.warn_only
    served = f", served: {engine}" if engine else ""
    by = f"served by {engine}: " if engine else ""
    tasks = rec.get("tasks") or {}
    excluded = {t: r["excluded"] for t, r in sorted(tasks.items()) if r.get("excluded")}
    note = "; excluded: " + "; ".join(f"{t}: {why}" for t, why in excluded.items()) if excluded else ""
    rows = []
    if cfg.task_recovery_scope in ("each", "both"):
        rows += [(t, r) for t, r in sorted(tasks.items()) if t not in excluded]
    if cfg.task_recovery_scope in ("average", "both") and rec.get("average"):
        rows.append(("average", rec["average"]))
    if not rows:
        return [_record(name, "min_task_recovery", None, bound, by + "no task to judge: every task's baseline is not "
                        "above chance" + note, warn).model_copy(update={"metric": f"task_recovery[none{served}]"})]
    out = []
    for i, (task, r) in enumerate(rows):
        value = r.get("low") if cfg.task_recovery_bound == "lower" else r.get("recovery")
        out.append(_record(name, "min_task_recovery", value, bound, by + _recovery_reason(task, r, value, cfg)
                           + (note if i == len(rows) - 1 else ""), warn)
                   .model_copy(update={"metric": f"task_recovery[{task}{served}]"}))
    return out


def _recovery_reason(task: str, r: dict, value: float | None, cfg: GatesConfig) -> str:
    low, high = r.get("low"), r.get("high")
    interval = f"[{low:.3f}, {high:.3f}]" if low is not None and high is not None else "[n/a]"
    reason = (f"{task}: recovery {fmt_value(r.get('recovery'))} {interval} on {r.get('n')} paired items "
              f"({cfg.task_recovery_bound} judged)")
    if r.get("chance") is not None:
        reason += f", above chance {r['chance']:.3f}"
    if value is None:
        reason += "; the baseline is not above chance, recovery undefined"
    return reason



def ppl_ratio_gates(report: Report, e: ModelEntry, name: str, bound: float, cfg: GatesConfig) -> list[Gate]:
    """max_ppl_ratio: the model as scored in process, then as each engine served it. A served perplexity (the
    quality windows through the server, pipeline/serve/served_nll.py) is divided by the baseline's in-process one on
    the same tokens: what the engine computes is what a user of that engine gets (vLLM's CPU W4A8 path quantizes
    activations to int8 and served a model above the bound while the in-process figure passed)."""
    warn = "max_ppl_ratio" in cfg.warn_only
    value, reason = _ppl_ratio(report, e, name)
    out = [_record(name, "max_ppl_ratio", value, bound, reason, warn)]
    base = report.baseline.perplexity.value if report.baseline and report.baseline.perplexity else None
    for engine, s in sorted((e.served or {}).items()):
        served = s.perplexity.value if s.perplexity is not None else None
        if served is None:
            continue
        ratio, why = _ratio(served, base, f"variants.{name}.served.{engine}.perplexity.value / baseline.perplexity")
        note = "; int8 activations (vLLM's CPU W4A8 path)" if getattr(s, "int8_activations", None) else ""
        out.append(_record(name, "max_ppl_ratio", ratio, bound, (why or f"served by {engine}") + note, warn)
                   .model_copy(update={"metric": f"ppl_ratio[served: {engine}]"}))
    return out



# a served record's metric: "ppl_ratio[served: vllm]", "task_recovery[average, served: transformers]"
SERVED_METRIC = re.compile(r"served: ([^\]]+)\]$")


def served_gate_failures(report: Report, name: str) -> dict[str, str]:
    """{engine: why} for the engines whose served figures fail a gate of this model ("ppl_ratio[served: vllm]" and
    the like): the card does not recommend them and `compress serve --engine auto` does not pick them."""
    out: dict[str, str] = {}
    for g in report.gates:
        m = SERVED_METRIC.search(g.metric)
        if g.model == name and blocks(g) and m:
            why = f"{g.metric} {fmt_value(g.value)} {'>' if g.op == '<=' else '<'} {g.bound:g}"
            out[m.group(1)] = f"{out[m.group(1)]}; {why}" if m.group(1) in out else why
    return out


def calibrates(e: ModelEntry) -> bool:
    """Whether a variant read the calibration rows, as its method answers for its recorded settings."""
    params = e.params or {}
    if params.get("method") not in METHODS:
        return True  # not a method this compress knows: judged, never skipped unseen
    method = METHODS.get(params["method"])
    try:
        return method.calibrates(TypeAdapter(method.variant).validate_python(params))
    except ValidationError:
        return method.needs_calibration


def expert_tokens_gate(report: Report, e: ModelEntry, name: str, bound: float, cfg: GatesConfig) -> list[Gate]:
    """min_expert_tokens: the fewest calibration tokens any expert of any MoE layer got (report.calibration's
    expert_coverage, through the baseline), naming each layer's experts below the bound; a variant calibrated with
    moe_all_experts gave every expert every calibration token it read."""
    warn = "min_expert_tokens" in cfg.warn_only
    cal = report.calibration
    cov = cal.expert_coverage if cal else None
    if cal is None or cov is None:
        return [_record(name, "min_expert_tokens", None, bound, "calibration.expert_coverage is not in the report (did "
                        "calibrate run on this Mixture-of-Experts model?)", warn)]
    params = e.params or {}
    rows = cal.num_samples or 0
    used = min(params.get("calibration_rows") or rows, rows)
    if params.get("moe_all_experts"):
        tokens = used * (cal.seq_len or 0)
        return [_record(name, "min_expert_tokens", float(tokens), bound,
                        f"moe_all_experts: every expert of the {len(cov.layers)} MoE layer(s) calibrated on all "
                        f"{tokens} calibration tokens (routed, the fewest would be {cov.least()})", warn)]
    starved = cov.starved(bound)
    reason = "; ".join(f"layer {layer}: expert{'s' if len(ex) > 1 else ''} {', '.join(map(str, ex))} got "
                       f"{', '.join(str(cov.counts[cov.layers.index(layer)][x]) for x in ex)} token(s)"
                       for layer, ex in starved)
    if used < rows:
        reason += (("; " if reason else "") + f"counted over all {rows} calibration rows; this variant reads the "
                   f"first {used} (calibration_rows), so its experts saw at most these counts")
    return [_record(name, "min_expert_tokens", float(cov.least()), bound, reason, warn)]



# Each gate's reader, one per row of pipeline/eval/config.py GATES (tests/unit/test_gates.py checks both lists agree):
# a variant gate's takes (report, entry, name) and gives (value, reason) (a Getter); a draft gate's takes (report,
# draft, speculative_mode) (a DraftGetter); a `multi` gate's takes (report, entry, name, bound, cfg) and gives its
# records. The gate's row says which of these its reader is (applies, multi).
READERS: Mapping[str, Callable[..., Any]] = MappingProxyType({
    "max_ppl_ratio": ppl_ratio_gates,
    "max_kl": _plain("kl"),
    "min_top1": _plain("top1"),
    "max_footprint_ratio": _footprint_ratio,
    "min_decode_speed_ratio": _decode_ratio,
    "min_smoke_ok": _smoke_ok,
    "min_acceptance": _draft_metric("alpha", "acceptance rate"),
    "min_spec_speedup": _draft_metric("speedup", "speculative speed-up"),
    "min_task_recovery": lambda report, e, name, bound, cfg: task_recovery_gates(e, name, bound, cfg),
    "min_serve_tok_s_ratio": _serve_tok_s_ratio,
    "max_serve_error_rate": _serve_error_rate,
    "min_expert_tokens": expert_tokens_gate,
})


# ---------------------------------------------------------------- console
def fmt_value(v: object) -> str:
    if v is None:
        return "missing"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def gates_table(gates: list[Gate]) -> str:
    """Plain-text table of all gates for the console (one line per gate, then a summary)."""
    if not gates:
        return "no gates configured"
    rows = [("model", "gate", "value", "bound", "result", "note")]
    for g in gates:
        model = g.model + (f" (verifier {g.verifier})" if g.verifier else "")
        rows.append((model, g.gate, fmt_value(g.value), f"{g.op} {fmt_value(g.bound)}", gate_status(g), g.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + ("  " + r[5] if r[5] else "")
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"{len(gates)} gates: {gates_summary(gates)}")
    return "\n".join(line.rstrip() for line in lines)
