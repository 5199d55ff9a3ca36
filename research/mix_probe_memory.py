"""The [quantize.mix] sensitivity table's memory and its first units, on a finished run's model and calibration rows:
the table's first N rows measured again with the code as it is now (pipeline/quant/mix/sensitivity.py: one unit's
Hessians at a time) and compared with the table the run recorded in mix.json (KL and Hessian rows, exactly), with
the process's peak resident memory (VmHWM) beside what the plan predicts (pipeline/estimate.sensitivity_bytes).

    PYTHONPATH=$PWD python -m research.mix_probe_memory artifacts/mixed-qwen mixed-4.17 --units 8 \
        --out benchmarks/results/mixed-qwen/probe_memory.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("variant")
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.estimate import sensitivity_bytes
    from pipeline.model.dtypes import config_dtype, dtype_bytes
    from pipeline.plan import GiB
    from pipeline.quant.mix.config import mix_units
    from pipeline.quant.mix.sensitivity import KLProbe, Solver, UnitHessians, Weights, hessian_row
    from pipeline.quant.shapes import linear_shapes_from_config

    base = args.run / "load"
    record = json.loads((args.run / "quantize" / args.variant / "mix.json").read_text())
    table = record["sensitivity"]  # the table the run measured (and cached)
    probe = table["probe"]
    config = json.loads((base / "config.json").read_text())
    calib = load_file(args.run / "calibrate" / "calibration.safetensors")["input_ids"]
    units = [u for u in mix_units(linear_shapes_from_config(config), ["lm_head"], record["granularity"])
             if u.name in table["units"]]
    assert [u.name for u in units] == table["units"], "the run's units"
    cands = [tuple(c) for c in record["candidates"]]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    t1 = time.perf_counter()
    hessians = UnitHessians(model, calib[: probe["hessian_rows"]], "model.layers")
    t2 = time.perf_counter()
    kl_probe = KLProbe(model, calib[: probe["kl_rows"]], "model.layers", hessians.on(calib[: probe["kl_rows"]]))
    hess: dict = {}
    weights = Weights(Solver(**probe["solver"]), hess, set(cands))
    t3 = time.perf_counter()
    rows = []
    for k, u in enumerate(units[: args.units]):
        s = time.perf_counter()
        hess.clear()
        hess.update(hessians.of(u))
        h = hessian_row(model, hess, hessians.tokens, u, cands, weights)
        m = time.perf_counter()
        kl = kl_probe.row(u, cands, weights)
        weights.forget(u)
        rows.append({"unit": u.name, "hessian_equal": h == table["hessian"][k], "kl_equal": kl == table["kl"][k],
                     "hessian_s": round(m - s, 2), "kl_s": round(time.perf_counter() - m, 2)})
        print(rows[-1], flush=True)
    checkpoint = dtype_bytes(config_dtype(config)) * n_params  # the load folder's weights, as the plan counts them
    predicted = sensitivity_bytes(config, n_params, checkpoint, int(calib.shape[1]), probe["hessian_rows"],
                                  probe["kl_rows"])
    out = {"run": str(args.run), "variant": args.variant, "table_key": table["key"], "units_checked": rows,
           "all_equal": all(r["hessian_equal"] and r["kl_equal"] for r in rows),
           "load_s": round(t1 - t0, 1), "layer_outputs_s": round(t2 - t1, 1), "probe_reference_s": round(t3 - t2, 1),
           "peak_rss_bytes": vm_hwm(), "predicted_bytes": predicted,
           "peak_gib": round(vm_hwm() / GiB, 2), "predicted_gib": round(predicted / GiB, 2)}
    print(json.dumps({k: v for k, v in out.items() if k != "units_checked"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
