"""What `--engine auto` is judged from: the serving figures a run measured for an export, kept beside its weights.

The export stage writes `serving.json` into each export folder the run served (one entry per engine: its version,
device, whether vLLM compiled, and each load level's output tok/s and errors, read from the report's `served`
records). `compress serve FOLDER --engine auto` then picks, among the engines that can serve the folder here, apply
every option the user set and were measured on this kind of device with no error, the one with the highest output
tok/s at the measured concurrency nearest `--slots` (the largest level not above it, else the smallest). Without
figures for this device, auto is the format's default engine (transformers, llama.cpp for a .gguf file), and the
line it prints says so. Torch-free.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.base.errors import RecipeError
from pipeline.base.fileio import atomic_write_text

SERVING_FILE = "serving.json"
SCHEMA = 1


def serving_record(served: dict | None, failed: dict[str, str] | None = None) -> dict | None:
    """The compact, publishable form of a model's `served` report entry: only engines that served it (not the
    skipped or refused ones), their versions, device and per-level throughput, and `gate_failed` (why) for an engine
    whose served figures failed one of the run's gates (pipeline/results/gates.py served_gate_failures): `pick`
    never chooses it. None when nothing was served."""
    engines = {}
    for engine, s in (served or {}).items():
        if not isinstance(s, dict) or not s.get("levels"):
            continue
        eq = s.get("equality") or {}
        engines[engine] = {
            "versions": s.get("versions", {}), "device": s.get("device", "cpu"), "compiled": s.get("compiled"),
            "int8_activations": s.get("int8_activations"),
            "greedy_equal_generate": f"{eq.get('identical', 0)}/{eq.get('prompts', 0)}",
            "levels": [{"concurrency": lv["concurrency"], "output_tok_s": lv["output_tok_s"],
                        "errors": lv["errors"], "requests": lv["requests"]} for lv in s["levels"]],
            **({"gate_failed": (failed or {})[engine]} if engine in (failed or {}) else {})}
    return {"schema": SCHEMA, "measured_by": "compress [validate.serve]", "engines": engines} if engines else None


def write(folder: Path, served: dict | None, failed: dict[str, str] | None = None) -> bool:
    record = serving_record(served, failed)
    if record is None:
        return False
    atomic_write_text(folder / SERVING_FILE, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return True


def read(folder: Path) -> dict:
    """{engine: entry} from the folder's serving.json; {} when absent. A file that is not ours is an error, not a
    silent fallback."""
    path = Path(folder) / SERVING_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA or not isinstance(data.get("engines"), dict):
            raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA}")
        return data["engines"]
    except (ValueError, AttributeError) as e:
        raise RecipeError(f"{path}: not a compress serving record ({e}); remove it or pass --engine") from None


def _level(levels: list[dict], slots: int) -> int:
    measured = sorted({lv["concurrency"] for lv in levels})
    fit = [c for c in measured if c <= slots]
    return fit[-1] if fit else measured[0]


def pick(figures: dict, kind: str, slots: int, usable: list[str]) -> tuple[str, str] | None:
    """(engine, why) for the fastest usable engine measured on `kind` ("cpu"/"cuda") with no error, or None."""
    rows = []
    for engine in usable:
        entry = figures.get(engine)
        if not entry or entry.get("device", "cpu").split(":")[0] != kind or not entry.get("levels"):
            continue
        if any(lv["errors"] for lv in entry["levels"]) or entry.get("gate_failed"):
            continue  # errors under load, or what it served failed the run's gates
        level = _level(entry["levels"], slots)
        rate = next(lv["output_tok_s"] for lv in entry["levels"] if lv["concurrency"] == level)
        rows.append((rate, engine, level))
    if not rows:
        return None
    rows.sort(reverse=True)
    rate, engine, level = rows[0]
    others = ", ".join(f"{e} {r:.1f} at {c}" for r, e, c in rows[1:])
    return engine, (f"auto: {engine}, measured fastest for this export on {kind.upper()}: {rate:.1f} output tok/s at "
                    f"concurrency {level}" + (f" (against {others})" if others else "")
                    + f"; {SERVING_FILE}, --slots {slots}")
