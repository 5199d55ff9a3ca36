"""A tiny run folder shaped like the export stage's output, for the publish tests.

artifacts/<run>/report.json (a final report written through pipeline.results) + recipe.lock.toml (the same
run id) + export/<name>/{config.json, *.safetensors, tokenizer files, generation_config.json, README.md,
manifest.json} for two variants and a draft.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# name -> (kind, verifier, perplexity, max_shard_size, quantization_config)
EXPORTS = {
    "w8": ("variant", None, 10.10, None, None),
    "w4g64": ("variant", None, 10.60, "12KB",
              {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True}),
    "draft": ("draft", "w4g64", 31.00, None, None),
}
BASELINE_PPL = 10.0
RUN_ID = "20261130T000000-fixture"


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(folder: Path, kind: str, verifier: str | None) -> dict:
    """The manifest the runner writes for an export unit (pipeline/app/runner.py); also listed in the report."""
    from pipeline.app.runner import canonical_hash, hash_outputs

    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name != "manifest.json"}
    entry = {"kind": kind, "name": folder.name, "verifier": verifier, "folder": f"export/{folder.name}",
             "files": files}
    (folder / "metrics.json").write_text(json.dumps(entry))
    outputs = hash_outputs(folder)
    manifest = {"key": f"export/{folder.name}", "run_id": RUN_ID, "metrics": entry, "outputs": outputs,
                "outputs_hash": canonical_hash(outputs)}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    list_export(folder.parent.parent, manifest)
    return manifest


def list_export(run_dir: Path, manifest: dict) -> None:
    """Record an export manifest in the run's report, as the runner does after an export unit."""
    from pipeline.results import merge, schema

    if not (run_dir / "report.json").is_file():
        return
    report = schema.load(run_dir)
    merge.record(report, manifest["key"], {"time_s": 0.0, "peak_rss_bytes": 0, **manifest}, skipped=False)
    schema.save(report, run_dir)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def model_card(name: str, kind: str, verifier: str | None) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(base_model=BASE_MODEL, base_model_relation="quantized" if kind == "variant" else "finetune",
                         tags=["compress", kind, name], library_name="transformers", license="apache-2.0",
                         datasets=["wikitext"])
    target = f"\n\nDraft model for speculative decoding; its target is `{verifier}`." if verifier else ""
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n# {name}\n\nTiny test checkpoint.{target}\n"))


def build_run(root: Path, run: str = "tiny-run") -> Path:
    """Write the run folder under root/run; every gate passes."""
    run_dir = root / run
    tokenizer = tiny_tokenizer()
    for i, (name, (kind, verifier, _, shard, quant)) in enumerate(EXPORTS.items()):
        folder = run_dir / "export" / name
        kwargs = {"max_shard_size": shard} if shard else {}
        tiny_model(seed=i).save_pretrained(folder, **kwargs)
        tokenizer.save_pretrained(folder)
        if quant:
            config = json.loads((folder / "config.json").read_text())
            config["quantization_config"] = quant
            (folder / "config.json").write_text(json.dumps(config, indent=2))
        (folder / "README.md").write_text(model_card(name, kind, verifier))
    write_report(run_dir)
    for name, (kind, verifier, *_rest) in EXPORTS.items():
        write_manifest(run_dir / "export" / name, kind, verifier)
    return run_dir


def write_report(run_dir: Path) -> None:
    """A final report (status complete, gates evaluated, every gate passed) and the lock of the same run."""
    from pipeline.results import schema

    gates = [{"model": n, "gate": g, "metric": g, "value": v, "bound": b, "op": op, "passed": True, "severity": "fail"}
             for n in EXPORTS for g, v, b, op in (("max_ppl_ratio", 1.05, 1.10, "<="), ("min_top1", 0.95, 0.90, ">="))]
    report = schema.Report.model_validate({
        "run": {"id": RUN_ID, "name": run_dir.name, "recipe": "recipe.toml", "status": "complete", "exit_code": 0,
                "started": "2026-11-30T00:00:00+0000", "finished": "2026-11-30T00:01:00+0000", "device": "cpu",
                "seed": 0, "gates_evaluated": True},
        "model": {"name": BASE_MODEL.split("/")[-1], "source": f"hf:{BASE_MODEL}"},
        "baseline": {"perplexity": {"value": BASELINE_PPL}},
        "variants": {n: {"method": "gptq", "perplexity": {"value": e[2]}, "ppl_ratio": e[2] / BASELINE_PPL}
                     for n, e in EXPORTS.items() if e[0] == "variant"},
        "draft": {"name": "draft", "verifier": "w4g64"},
        "gates": gates,
    })
    run_dir.mkdir(parents=True, exist_ok=True)
    schema.save(report, run_dir)
    (run_dir / "recipe.lock.toml").write_text(f'[lock]\nrun_id = "{RUN_ID}"\n')


def set_gate(run_dir: Path, model: str, passed: bool, gate: str = "max_ppl_ratio") -> None:
    path = run_dir / "report.json"
    report = json.loads(path.read_text())
    for g in report["gates"]:
        if g["model"] == model and g["gate"] == gate:
            g["passed"] = passed
            g["value"] = 1.05 if passed else 1.31
    failed = any(not g["passed"] and g["severity"] == "fail" for g in report["gates"])
    report["run"]["status"], report["run"]["exit_code"] = ("gates_failed", 5) if failed else ("complete", 0)
    path.write_text(json.dumps(report, indent=2))
