"""Are two runs of the same recipe the same? Every output file byte for byte, every report figure but timings.

    python -m benchmarks.byte_identity RUN_A RUN_B [--out FILE]

Made for a pure code move (issue #33): run one recipe at the commit before and at the commit after, each in its
own clone, then compare the two run folders:

    git worktree add /tmp/before <commit-before>; git worktree add /tmp/after <commit-after>
    (cd /tmp/before && .venv/bin/compress run recipes/default.toml --set draft.distill.steps=300 \
        --set draft.distill.time_budget_s=100000 --set run.output_dir='"/tmp/id-before"')      # same for /tmp/after
    python -m benchmarks.byte_identity /tmp/id-before/default /tmp/id-after/default

A time-budgeted draft is not reproducible by design (the step count depends on the machine's speed), hence the
fixed step count above, with a budget it never reaches (TOML has no null for --set). A worktree shares no .venv:
link the checkout's (`ln -s $PWD/.venv /tmp/before/.venv`) and run with PYTHONPATH=/tmp/before, or the editable
install imports the checkout's pipeline/. What is compared:
  - files: sha256 of every file under the run folder, except logs, locks, manifests (they hold timings and code
    hashes), report.json/report.md (compared as figures below) and plots (drawn from timings too);
  - figures: every number and string in report.json whose key does not name a duration, a rate, a memory reading
    or a start-up time (TIMING below); lists are compared element by element.
Exit 0 when both agree, 1 with each difference listed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

# the JSON --out writes (tests/benchmarks/test_bench_smoke.py)
OUTPUT_KEYS = ("a", "b", "files_compared", "files_differ", "only_in_a", "only_in_b", "figures_compared",
               "figures_differ")

SKIP_FILES = re.compile(r"(\.log$|\.lock$|(^|/)manifest\.json$|^report\.(json|md)$|^plots/|/\.tmp)")
# durations, throughputs, memory readings, speed-ups and anything derived from a clock, plus run ids/timestamps
TIMING = re.compile(r"(_s$|_ms$|^ms$|per_s|tok_s|tokens_per_s|requests_s|speedup|seconds|time|wall|rss|peak_memory|"
                    r"roofline|bandwidth|^ready|ttft|itl|latency|^started|^finished|^created|^run_id$|^id$|"
                    r"timestamp|^date$|elapsed|cost_per_iteration|break_even|^load$|predicted_speedup|"
                    r"best_possible|steps_per|tokens_seen_per|^host|^pid$|^port$|^path$|_dir$|^dir$|^output_dir$)")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def files(run: Path) -> dict[str, str]:
    out = {}
    for p in sorted(run.rglob("*")):
        rel = p.relative_to(run).as_posix()
        if p.is_file() and not SKIP_FILES.search(rel):
            out[rel] = sha256(p)
    return out


def figures(node, path: str = "") -> dict[str, object]:
    """Leaf values of report.json by path, timing keys left out."""
    out: dict[str, object] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            if not TIMING.search(str(k)):
                out.update(figures(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.update(figures(v, f"{path}[{i}]"))
    else:
        out[path] = node
    return out


def compare(a: Path, b: Path) -> dict:
    fa, fb = files(a), files(b)
    diff_files = sorted(k for k in fa.keys() & fb.keys() if fa[k] != fb[k])
    ra = figures(json.loads((a / "report.json").read_text()))
    rb = figures(json.loads((b / "report.json").read_text()))
    diff_fig = {k: [ra.get(k), rb.get(k)] for k in sorted(ra.keys() | rb.keys()) if ra.get(k) != rb.get(k)}
    return {"a": str(a), "b": str(b), "files_compared": len(fa.keys() & fb.keys()),
            "files_differ": diff_files, "only_in_a": sorted(fa.keys() - fb.keys()),
            "only_in_b": sorted(fb.keys() - fa.keys()), "figures_compared": len(ra.keys() & rb.keys()),
            "figures_differ": diff_fig}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    for run in (args.run_a, args.run_b):
        if not (run / "report.json").is_file():
            print(f"error: {run} is not a run folder (no report.json)", file=sys.stderr)
            return 2
    result = compare(args.run_a, args.run_b)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    same = not (result["files_differ"] or result["only_in_a"] or result["only_in_b"] or result["figures_differ"])
    print(f"{result['files_compared']} files, {result['figures_compared']} report figures compared: "
          f"{'identical' if same else 'DIFFERENT'}")
    for key in ("files_differ", "only_in_a", "only_in_b"):
        for name in result[key]:
            print(f"  {key}: {name}")
    for k, (va, vb) in result["figures_differ"].items():
        print(f"  figure {k}: {va!r} vs {vb!r}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
