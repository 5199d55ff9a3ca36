"""transformers tensor parallelism on a real checkpoint: the speed stage's tensor_parallel row (pipeline/eval/
tensor_parallel.py tp_row: TP ranks under torchrun with gloo, against the same measurement in one process), at
each size asked, with `compress check`'s verdict on that size and its predicted memory per rank beside the
measured one.

    .venv/bin/python -m benchmarks.tensor_parallel --model-dir FOLDER --tp 2 3 [--out benchmarks/results/tp]

A size `compress check` refuses (heads not divisible: transformers then fails in its first forward; more ranks than
cores: they time the scheduler) is reported with the refusal; `--force` measures it anyway (--tp 3 on 2 cores:
memory per rank and equality are still real figures, the speed is not).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.base.errors import StageError
from pipeline.budget.formulas import GiB
from pipeline.eval.config import SpeedConfig
from pipeline.eval.parallel_check import technique_problems, tp_rank_bytes, usable_cores
from pipeline.eval.tensor_parallel import tp_row
from pipeline.model.dtypes import config_dtype, dtype_bytes

OUTPUT_KEYS = ("model_dir", "cores", "sizes")  # sizes: {tp: {check, predicted_rank_bytes, row | error}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[2])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--force", action="store_true", help="measure sizes compress check refuses")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tensor_parallel"))
    a = ap.parse_args()
    config = json.loads((a.model_dir / "config.json").read_text())
    out = {}
    for tp in a.tp:
        cfg = SpeedConfig(prompt_len=a.prompt_len, new_tokens=a.new_tokens, repeats=a.repeats,
                          warmup=a.warmup, batch_sizes=[1], roofline=False, techniques=["tensor_parallel"], tp_size=tp)
        refused = [p.message for p in technique_problems(cfg, config, "cpu")]
        predicted = tp_rank_bytes(config, dtype_bytes(config_dtype(config)), tp, cfg.model_dump(mode="json"))
        entry: dict = {"check": refused or "ok", "predicted_rank_bytes": predicted}
        if refused and not a.force:
            print(f"TP={tp}: refused by compress check: {'; '.join(refused)}")
        else:
            try:
                entry["row"] = tp_row(a.model_dir, cfg, "cpu", a.out / f"tp{tp}")
                print(f"TP={tp}: {entry['row']['note']}; predicted {predicted / GiB:.3f} GiB per rank, measured "
                      f"{max(entry['row']['peak_memory_per_rank_bytes']) / GiB:.3f} GiB"
                      + (f"; ERROR {entry['row']['error']}" if "error" in entry["row"] else ""))
            except StageError as e:
                entry["error"] = str(e)
                print(f"TP={tp}: failed: {e}")
        out[str(tp)] = entry
    a.out.mkdir(parents=True, exist_ok=True)
    result = {"model_dir": str(a.model_dir), "cores": usable_cores(), "sizes": out}
    (a.out / "tensor_parallel.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
