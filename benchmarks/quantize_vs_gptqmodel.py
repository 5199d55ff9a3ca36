"""Our GPTQ variant vs GPTQModel called directly vs transformers' GPTQConfig (optimum) path, and a settings search.

Same model, same calibration token ids, same quantization settings, same machine, one script:

  compare   ours / GPTQModel-direct alternating (ours first on even reps), --reps times; transformers'
            GPTQConfig path --hf-reps times; RTN at the same bits and group size; then perplexity of every
            checkpoint and of the baseline on fixed WikiText-2 test windows (GPTQ protocol, non-overlapping).
            Prints median and spread of wall times, their ratios, and the perplexity ratios.
  search    GPTQ settings (act-order, damping, MSE scale search, calibration count/length, chat template)
            scored by perplexity on held-out C4 documents (the corpus tail calibration never sees) --
            never on WikiText-2.
  figures   the recipe's variants (GPTQ w4g64 and w8, RTN w4g64, bnb int8/nf4) vs baseline on WikiText-2.

Every quantization and every evaluation runs in a fresh interpreter; wall times cover load + quantize +
save and exclude interpreter start, imports and GPTQModel's one-time C++ build (cached per machine).

  nice -n 5 python -m benchmarks.quantize_vs_gptqmodel compare --reps 3 --samples 32 --seq-len 256
  nice -n 5 python -m benchmarks.quantize_vs_gptqmodel search --samples 32 --seq-len 256
  nice -n 5 python -m benchmarks.quantize_vs_gptqmodel figures --samples 128 --seq-len 256
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# `compare`'s JSON (--out); `search` and `figures` write their own rows
OUTPUT_KEYS = ("settings", "seconds", "ppl", "identical_weights_ours_direct", "time_ratio_ours_direct",
               "per_rep_time_ratios", "ppl_ratio_ours_direct", "gptq_increase_over_rtn_increase", "command")

ROOT = Path(__file__).resolve().parent.parent

W4G64 = {"method": "gptq", "bits": 4, "group_size": 64}
AR50 = {"method": "autoround", "iters": 50, "batch_size": 4, "torch_compile": False}  # as rows 17-21 were measured
SEARCH = [  # (label, variant fields over W4G64 with GPTQModel's defaults (mse 0), calibration overrides)
    ("gptqmodel defaults (GAR, damp 0.05)", {}, {}),
    ("act-order (desc_act)", {"desc_act": True}, {}),
    ("damp 0.01", {"damp_percent": 0.01}, {}),
    ("damp 0.1", {"damp_percent": 0.1}, {}),
    ("mse 2.4 scale search", {"mse": 2.4}, {}),
    ("asymmetric (sym = false)", {"sym": False}, {}),
    ("2x calibration samples", {}, {"samples": 2}),
    ("2x calibration length", {}, {"seq_len": 2}),
    ("chat-templated calibration", {}, {"chat_template": True}),
    ("RTN (reference, no calibration)", {"method": "rtn"}, {}),
    ("mse 2.4 + asymmetric", {"mse": 2.4, "sym": False}, {}),
    ("RTN asymmetric (reference)", {"method": "rtn", "sym": False}, {}),
    ("mse 2.4 + GPTAQ (alpha 0.25)", {"mse": 2.4, "gptaq_alpha": 0.25}, {}),
    ("mse 2.4 + FOEM (beta 0.2)", {"mse": 2.4, "foem_beta": 0.2}, {}),
    ("mse 2.4 + GPTAQ 0.25 + FOEM 0.2", {"mse": 2.4, "gptaq_alpha": 0.25, "foem_beta": 0.2}, {}),
    ("GPTAQ (alpha 0.25), mse 0", {"gptaq_alpha": 0.25}, {}),
    ("mse 2.4 (reference, same run as the rows above)", {"mse": 2.4}, {}),
    # AutoRound on methods.toml's 64 x 256 calibration rows: at iters 50, batch 4, its auto learning rate
    # (1/iters = 0.02) against the 5e-3 of auto-round's own "light" recipe (iters 50)
    ("autoround iters 50, batch 4, lr auto (1/iters)", AR50, {}),
    ("autoround iters 50, batch 4, lr 5e-3 (auto-round's light recipe)", {**AR50, "lr": 5e-3}, {}),
    ("autoround iters 50, batch 4, lr auto, asymmetric (sym = false)", {**AR50, "sym": False}, {}),
    # the same tokens per block (iters x batch = 200 rows) spent on more, smaller steps
    ("autoround iters 100, batch 2, lr auto (1/iters)", {**AR50, "iters": 100, "batch_size": 2}, {}),
    ("autoround iters 200, batch 1, lr auto (1/iters)", {**AR50, "iters": 200, "batch_size": 1}, {}),
    # with auto-round's torch.compile on (a 200-step block 11.5 s against 32 s eager here; rounds differently)
    ("autoround iters 200, batch 1, lr auto, torch_compile (methods.toml)",
     {**AR50, "iters": 200, "batch_size": 1, "torch_compile": True}, {}),
    ("autoround iters 50, batch 4, lr auto, torch_compile", {**AR50, "torch_compile": True}, {}),
    ("autoround iters 100, batch 2, lr auto, torch_compile",
     {**AR50, "iters": 100, "batch_size": 2, "torch_compile": True}, {}),
]
FIGURES = {"gptq-w4g64": W4G64, "rtn-w4g64": {"method": "rtn", "bits": 4, "group_size": 64},
           "gptq-w8": {"method": "gptq", "bits": 8, "group_size": -1}, "bnb-int8": {"method": "bnb-int8"},
           "bnb-nf4": {"method": "bnb-nf4"}}


# ---------------------------------------------------------------- data (parent process)


def corpus(name: str) -> SimpleNamespace:
    return SimpleNamespace(dataset=name, text_field="text", held_out_docs=200)


def calibration_ids(tokenizer, n: int, seq_len: int, chat_template: bool, seed: int):
    from pipeline.data import calib

    docs = calib.training_documents(corpus("c4"))
    return calib.sample_token_windows(tokenizer, docs, n, seq_len, "random", seed, chat_template)


def wikitext_ids(tokenizer):
    import torch

    from pipeline import data

    text = data.eval_text(data.resolve("wikitext2"))
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def heldout_c4_ids(tokenizer):
    import torch

    from pipeline.data import calib

    ids: list[int] = []
    for doc in calib.held_out_documents(corpus("c4")):
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------- child processes


def child(args: list[str], timeout: float = 3600) -> Any:
    """Run this script's `_run`/`_ppl` in a fresh interpreter; its last stdout line is a JSON result."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.quantize_vs_gptqmodel", *args], capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{args[:2]} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_one(kind: str, model: str, ids_file: str, out: str, fields: dict, seed: int = 0) -> None:
    """One quantization, timed around load + quantize + save. kind: ours | direct | transformers. seed: the
    engine's (ours only; AutoRound draws its tuning batches with it)."""
    from pipeline.base.env import tame

    tame()
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    ids = load_file(ids_file)["input_ids"]
    if kind == "ours":
        from pydantic import TypeAdapter

        from pipeline.quant.api import quantize_variant
        from pipeline.quant.registry import QuantVariant

        v = TypeAdapter(QuantVariant).validate_python({"name": Path(out).name, **fields})
        m = quantize_variant(Path(model), v, ids, Path(out), logging.getLogger("bench"), seed=seed)
        seconds = m["time_s"]
    elif kind == "direct":
        seconds = direct_gptqmodel(model, ids, out, fields)
    elif kind == "transformers":
        seconds = transformers_gptq(model, ids, out, fields)
    else:
        raise SystemExit(f"unknown kind {kind}")
    print(json.dumps({"kind": kind, "seconds": seconds, "out": out, "weights_sha256": weights_sha256(Path(out))}))


def direct_gptqmodel(model: str, ids, out: str, fields: dict) -> float:
    """The plain GPTQModel API, its defaults except the settings under test (and fp32, like ours)."""
    import contextlib

    import torch
    from gptqmodel import GPTQConfig, GPTQModel

    cfg = GPTQConfig(bits=fields["bits"], group_size=fields["group_size"], **quality_settings(fields))
    rows = [{"input_ids": r.tolist(), "attention_mask": [1] * r.numel()} for r in ids]
    Path(out).mkdir(parents=True, exist_ok=True)
    with contextlib.chdir(out), torch._dynamo.config.patch(disable=True):  # its logs/ into out, not the cwd
        t0 = time.perf_counter()
        m = GPTQModel.load(model, cfg, device="cpu", dtype=torch.float32)
        m.quantize(rows, batch_size=1)
        m.save(out)
        return time.perf_counter() - t0


def quality_settings(fields: dict) -> dict:
    """Every quality-relevant GPTQ setting of our variant (recipe defaults filled in), to pass verbatim."""
    from pydantic import TypeAdapter

    from pipeline.quant.methods.gptq import act_group_aware
    from pipeline.quant.registry import QuantVariant

    v = TypeAdapter(QuantVariant).validate_python({"name": "x", **fields})
    return {"desc_act": v.desc_act, "act_group_aware": act_group_aware(v), "damp_percent": v.damp_percent,
            "sym": v.sym, "true_sequential": v.true_sequential, "mse": v.mse}


def transformers_gptq(model: str, ids, out: str, fields: dict) -> float:
    """transformers' GPTQConfig: optimum's GPTQ loop over gptqmodel's GPTQ class, same settings and ids."""
    import torch
    from transformers import AutoModelForCausalLM, GPTQConfig

    data = [{"input_ids": [r.tolist()], "attention_mask": [[1] * r.numel()]} for r in ids]  # optimum: [1, L] each
    q = quality_settings(fields)
    if q.pop("mse"):
        raise SystemExit("transformers' GPTQConfig has no MSE scale search: compare with mse = 0")
    cfg = GPTQConfig(bits=fields["bits"], group_size=fields["group_size"], dataset=data, model_seqlen=ids.shape[1], **q)
    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(model, quantization_config=cfg, dtype=torch.float32,
                                             device_map="cpu")
    m.save_pretrained(out)
    return time.perf_counter() - t0


def weights_sha256(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def ppl_of(model_dirs: list[str], ids_file: str, seq_len: int, windows: int) -> None:
    """The perplexity of each folder, loaded from disk one after another in this one interpreter (not timed: one
    process for all saves an interpreter and a GPTQModel import per model)."""
    from pipeline.base.env import tame

    tame()
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.eval.perplexity import gptq_windows, perplexity, windowed_nll

    ids = load_file(ids_file)["input_ids"]
    out = []
    for model_dir in model_dirs:
        torch.manual_seed(0)
        with torch._dynamo.config.patch(disable=True):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cpu").eval()
            t0 = time.perf_counter()
            nll, n = windowed_nll(model, ids, gptq_windows(len(ids), seq_len, windows))
        out.append({"model": model_dir, "ppl": perplexity(nll, n), "tokens": n, "seconds": time.perf_counter() - t0})
        del model
    print(json.dumps(out))


def perplexities(model_dirs: list[str], evals: str, a) -> list[dict]:
    """ppl_of in a fresh interpreter."""
    return child(["_ppl", evals, str(a.ppl_seq_len), str(a.ppl_windows), *model_dirs])


# ---------------------------------------------------------------- commands (parent process)


def save_ids(ids, path: Path) -> str:
    from safetensors.torch import save_file

    save_file({"input_ids": ids.contiguous()}, path)
    return str(path)


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": [round(x, 1) for x in xs]}


def compare(a) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    work = Path(a.work)
    calib = save_ids(calibration_ids(tok, a.samples, a.seq_len, False, 0), work / "calib.safetensors")
    evals = save_ids(wikitext_ids(tok), work / "wikitext2.safetensors")
    fields = {**W4G64, **json.loads(a.fields)}
    runs: dict[str, list[dict]] = {"ours": [], "direct": [], "transformers": []}
    for rep in range(a.reps):
        for kind in (("ours", "direct") if rep % 2 == 0 else ("direct", "ours")):
            r = child(["_run", kind, a.model, calib, str(work / f"{kind}-{rep}"), json.dumps(fields)])
            runs[kind].append(r)
            log(f"rep {rep} {kind}: {r['seconds']:.1f} s")
    for rep in range(a.hf_reps):
        r = child(["_run", "transformers", a.model, calib, str(work / f"transformers-{rep}"), json.dumps(fields)])
        runs["transformers"].append(r)
        log(f"transformers GPTQConfig: {r['seconds']:.1f} s")
    rtn_fields = {k: v for k, v in fields.items() if k in ("bits", "group_size", "sym")}
    rtn = child(["_run", "ours", a.model, calib, str(work / "rtn-w4g64"), json.dumps({"method": "rtn", **rtn_fields})])
    models = {"baseline": a.model, "ours": runs["ours"][0]["out"], "direct": runs["direct"][0]["out"],
              "rtn-w4g64": rtn["out"]}
    if runs["transformers"]:
        models["transformers"] = runs["transformers"][0]["out"]
    ppl = dict(zip(models, perplexities(list(models.values()), evals, a), strict=True))
    t = {k: spread([r["seconds"] for r in v]) for k, v in runs.items() if v}
    res = {"settings": {**fields, "samples": a.samples, "seq_len": a.seq_len, "reps": a.reps,
                        "ppl": f"WikiText-2 test, {a.ppl_windows} windows x {a.ppl_seq_len} tokens"},
           "seconds": t, "ppl": {k: v["ppl"] for k, v in ppl.items()},
           "identical_weights_ours_direct": len({r["weights_sha256"] for r in runs["ours"] + runs["direct"]}) == 1,
           "time_ratio_ours_direct": t["ours"]["median"] / t["direct"]["median"],
           "per_rep_time_ratios": [o["seconds"] / d["seconds"]
                                   for o, d in zip(runs["ours"], runs["direct"], strict=True)]}
    res["ppl_ratio_ours_direct"] = res["ppl"]["ours"] / res["ppl"]["direct"]
    if "transformers" in t:
        res["time_ratio_ours_transformers"] = t["ours"]["median"] / t["transformers"]["median"]
        res["ppl_ratio_ours_transformers"] = res["ppl"]["ours"] / res["ppl"]["transformers"]
    base = res["ppl"]["baseline"]
    res["gptq_increase_over_rtn_increase"] = (res["ppl"]["ours"] - base) / (res["ppl"]["rtn-w4g64"] - base)
    return res


def search(a) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    work = Path(a.work)
    evals = save_ids(heldout_c4_ids(tok), work / "heldout_c4.safetensors")
    base = perplexities([a.model], evals, a)[0]["ppl"]
    rows = []
    for i, (label, fields, cal) in enumerate(SEARCH):
        if a.only and str(i) not in a.only.split(","):
            continue
        n, L = a.samples * cal.get("samples", 1), a.seq_len * cal.get("seq_len", 1)
        ids = save_ids(calibration_ids(tok, n, L, cal.get("chat_template", False), 0), work / f"calib-{i}.safetensors")
        pinned = {"mse": 0.0} if fields.get("method", "gptq") == "gptq" else {}  # GPTQModel's own default
        folder = work / (f"search-{i}" if a.seed == 0 else f"search-{i}-seed{a.seed}")
        r = child(["_run", "ours", a.model, ids, str(folder), json.dumps({**W4G64, **pinned, **fields}), str(a.seed)])
        p = perplexities([r["out"]], evals, a)[0]["ppl"]
        rows.append({"label": label, "fields": fields, "calibration": [n, L, cal.get("chat_template", False)],
                     "seed": a.seed, "ppl": p, "increase_pct": 100 * (p / base - 1), "seconds": r["seconds"]})
        log(f"{label}: held-out C4 ppl {p:.3f} (+{rows[-1]['increase_pct']:.2f}%), {r['seconds']:.0f} s")
    return {"baseline_ppl": base, "eval": f"held-out C4 (last 200 docs), {a.ppl_windows} x {a.ppl_seq_len} tokens",
            "rows": rows}


def figures(a) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    work = Path(a.work)
    calib = save_ids(calibration_ids(tok, a.samples, a.seq_len, False, 0), work / "calib.safetensors")
    evals = save_ids(wikitext_ids(tok), work / "wikitext2.safetensors")
    out = {"baseline": perplexities([a.model], evals, a)[0]["ppl"]}
    for name, fields in FIGURES.items():
        if a.only and name not in a.only.split(","):
            continue
        r = child(["_run", "ours", a.model, calib, str(work / name), json.dumps(fields)])
        out[name] = perplexities([r["out"]], evals, a)[0]["ppl"]
        log(f"{name}: {out[name]:.3f} (baseline {out['baseline']:.3f}), quantized in {r['seconds']:.0f} s")
    return {"ppl": out, "eval": f"WikiText-2 test, {a.ppl_windows} x {a.ppl_seq_len}",
            "calibration": [a.samples, a.seq_len]}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_run":
        return run_one(*sys.argv[2:6], json.loads(sys.argv[6]), *map(int, sys.argv[7:8]))
    if len(sys.argv) > 1 and sys.argv[1] == "_ppl":
        return ppl_of(sys.argv[5:], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["compare", "search", "figures"])
    p.add_argument("--model", default="/tmp/smol", help="HF checkpoint folder (SmolLM2-135M-Instruct, fp32)")
    p.add_argument("--work", default="/tmp/quant_bench", help="scratch folder for checkpoints")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hf-reps", type=int, default=1)
    p.add_argument("--ppl-seq-len", type=int, default=512)
    p.add_argument("--ppl-windows", type=int, default=16)
    p.add_argument("--fields", default="{}", help="compare: variant fields over gptq w4g64, e.g. '{\"mse\": 0}'")
    p.add_argument("--only", default="", help="figures: comma-separated subset of " + ",".join(FIGURES)
                   + "; search: comma-separated row indices")
    p.add_argument("--seed", type=int, default=0, help="search: the quantizer's seed (the calibration rows stay "
                   "the same); another seed shows how much a row's figure moves by chance")
    p.add_argument("--out", default=None, help="write the results JSON here")
    a = p.parse_args()
    Path(a.work).mkdir(parents=True, exist_ok=True)
    res = {"compare": compare, "search": search, "figures": figures}[a.command](a)
    res["command"] = " ".join(["nice -n 5 python -m benchmarks.quantize_vs_gptqmodel", *sys.argv[1:]])
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
