"""Quality and speed gates over report.json (pure: dicts in, dicts out).

Each configured gate gives one record per model it applies to (variants for quality, size
and speed; the draft, with its verifier, for the speculative gates):
    {"model", "gate", "metric", "value", "bound", "op", "passed", "severity", "reason"}
A metric the report lacks is a failed gate whose reason says what is missing, never a crash.
`severity` is "fail", or "warn" for gates listed in `warn_only` (those never fail the run).
The runner exits with GateFailure's code (5) when `failed_gates()` is non-empty.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from pipeline.eval.config import GATE_METRICS, GatesConfig

Getter = Callable[[dict, dict, str], tuple[float | None, str]]


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def _ratio(num: Any, den: Any, what: str) -> tuple[float | None, str]:
    if num is None:
        return None, f"{what}: the model's value is missing"
    if den is None:
        return None, f"{what}: the baseline's value is missing"
    if not den:
        return None, f"{what}: the baseline's value is zero"
    return float(num) / float(den), ""


def _ppl_ratio(report: dict, entry: dict, name: str) -> tuple[float | None, str]:
    if entry.get("ppl_ratio") is not None:
        return float(entry["ppl_ratio"]), ""
    return _ratio(_dig(entry, "perplexity", "value"), _dig(report, "baseline", "perplexity", "value"),
                  f"variants.{name}.perplexity.value / baseline.perplexity.value")


def _plain(key: str) -> Getter:
    def get(report: dict, entry: dict, name: str) -> tuple[float | None, str]:
        value = entry.get(key)
        return (None, f"variants.{name}.{key} is not in the report") if value is None else (float(value), "")
    return get


def _footprint_ratio(report: dict, entry: dict, name: str) -> tuple[float | None, str]:
    base = _dig(report, "baseline", "footprint_bytes") or _dig(report, "model", "footprint_bytes")
    return _ratio(entry.get("footprint_bytes"), base, f"variants.{name}.footprint_bytes / baseline's")


def _decode_ratio(report: dict, entry: dict, name: str) -> tuple[float | None, str]:
    return _ratio(_dig(entry, "speed", "decode_tokens_per_s_b1"),
                  _dig(report, "baseline", "speed", "decode_tokens_per_s_b1"),
                  f"variants.{name}.speed.decode_tokens_per_s_b1 / baseline's (is speed timed for both?)")


def _speculative(key: str, label: str) -> Callable[[dict, str], Getter]:
    def make(mode: str) -> Getter:
        def get(report: dict, entry: dict, name: str) -> tuple[float | None, str]:
            value = _dig(entry, "speculative", mode, key)
            if value is None:
                return None, f"draft.speculative.{mode}.{key} ({label}) is not in the report"
            return float(value), ""
        return get
    return make


def _smoke_ok(report: dict, entry: dict, name: str) -> tuple[float | None, str]:
    outputs = _dig(entry, "smoke", "outputs")
    if not outputs:
        return None, f"variants.{name}.smoke is not in the report (did the smoke test run?)"
    bad = [o for o in outputs if not o.get("ok")]
    reason = f"{len(bad)} of {len(outputs)} smoke prompts failed: {bad[0].get('problem')}" if bad else ""
    return (len(outputs) - len(bad)) / len(outputs), reason


_VARIANT_GETTERS: dict[str, Getter] = {
    "ppl_ratio": _ppl_ratio,
    "kl": _plain("kl"),
    "top1": _plain("top1"),
    "footprint_ratio": _footprint_ratio,
    "decode_speed_ratio": _decode_ratio,
    "smoke_ok": _smoke_ok,
}
_DRAFT_GETTERS = {
    "acceptance": _speculative("alpha", "acceptance rate"),
    "spec_speedup": _speculative("speedup", "speculative speed-up"),
}


def _record(model: str, gate: str, value: float | None, bound: float, reason: str, warn: bool) -> dict:
    metric = GATE_METRICS[gate][0]
    op = "<=" if gate.startswith("max_") else ">="
    if value is not None and not math.isfinite(value):
        reason, passed = f"{metric} is not finite ({value})", False
        value = None
    elif value is None:
        passed = False
    else:
        passed = value <= bound if op == "<=" else value >= bound
    return {"model": model, "gate": gate, "metric": metric, "value": value, "bound": bound, "op": op,
            "passed": passed, "severity": "warn" if warn else "fail", "reason": reason}


def evaluate_gates(report: dict, cfg: GatesConfig) -> list[dict]:
    """Every configured gate for every model it applies to, in report order (variants, then draft)."""
    out = []
    random_init = bool(_dig(report, "model", "random_init"))
    for name, entry in (report.get("variants") or {}).items():
        for gate, bound in cfg.bounds_for(name).items():
            metric, applies = GATE_METRICS[gate]
            if metric == "smoke_ok" and (random_init or not bound):
                continue  # random weights produce noise by construction; 0 turns the gate off
            if applies == "variant":
                value, reason = _VARIANT_GETTERS[metric](report, entry or {}, name)
                out.append(_record(name, gate, value, bound, reason, gate in cfg.warn_only))
    draft = report.get("draft")
    draft_name = (draft or {}).get("name") or "draft"
    key = draft_name if draft_name in cfg.models else "draft"  # overrides under its name or "draft"
    draft_bounds = {g: b for g, b in cfg.bounds_for(key).items() if GATE_METRICS[g][1] == "draft"}
    for gate, bound in draft_bounds.items():
        if not draft:
            value, reason = None, "the report has no draft section (did the draft stage run?)"
            name = "draft"
        else:
            name = draft.get("name") or "draft"
            value, reason = _DRAFT_GETTERS[GATE_METRICS[gate][0]](cfg.speculative_mode)(report, draft, name)
        rec = _record(name, gate, value, bound, reason, gate in cfg.warn_only)
        rec["verifier"] = (draft or {}).get("verifier")
        out.append(rec)
    return out


def failed_gates(gates: list[dict]) -> list[dict]:
    """Gates that fail the run (failed, and not warn-only)."""
    return [g for g in gates if not g.get("passed") and g.get("severity") != "warn"]


def gate_status(g: dict) -> str:
    if g.get("passed"):
        return "PASS"
    return "WARN" if g.get("severity") == "warn" else "FAIL"


def fmt_value(v: Any) -> str:
    if v is None:
        return "missing"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def gates_table(gates: list[dict]) -> str:
    """Plain-text table of all gates for the console (one line per gate, then a summary)."""
    if not gates:
        return "no gates configured"
    rows = [("model", "gate", "value", "bound", "result", "note")]
    for g in gates:
        model = g.get("model", "?") + (f" (verifier {g['verifier']})" if g.get("verifier") else "")
        rows.append((model, str(g.get("gate")), fmt_value(g.get("value")),
                     f"{g.get('op', '')} {fmt_value(g.get('bound'))}", gate_status(g), g.get("reason") or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + ("  " + r[5] if r[5] else "") for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"{len(gates)} gates: {gates_summary(gates)}")
    return "\n".join(line.rstrip() for line in lines)


def gates_summary(gates: list[dict]) -> str:
    """"N passed, F failed, W warnings" (warn-only gates that did not pass are warnings, not failures)."""
    n_fail = len(failed_gates(gates))
    n_warn = sum(1 for g in gates if gate_status(g) == "WARN")
    return f"{len(gates) - n_fail - n_warn} passed, {n_fail} failed, {n_warn} warnings"
