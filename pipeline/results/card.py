"""Model cards (README.md) for export folders, in the Hub's conventions.

YAML metadata through huggingface_hub's ModelCardData (base_model, base_model_relation="quantized"
for variants, library_name, tags, datasets, license, a model-index with the perplexity), then:
provenance of the baseline, this run's results, how to load it, and the recipe excerpt + lock.
The text depends only on report sections that are final once validate has run and on the parts of
recipe.lock.toml that describe how the weights were made (never on run status, times, the run
folder's path or the [publish] table), so re-rendering or re-running an unchanged recipe
reproduces the same bytes, and re-publishing it makes no new Hub commit.
"""
from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import tomli_w
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from pipeline.base.fileio import atomic_write_text
from pipeline.base.public import local_name, public, public_text, public_tree
from pipeline.model.sources import packaged_upstream
from pipeline.quant.registry import METHODS
from pipeline.results.coverage_render import coverage_line
from pipeline.results.format import num, size, speculative_label
from pipeline.results.gates import blocks, gate_status, served_gate_failures
from pipeline.results.metrics import Perplexity, Served
from pipeline.results.mix_render import mix_lines, mix_of
from pipeline.results.query import is_distilled, shown_params
from pipeline.results.schema import DraftEntry, ModelEntry, ModelInfo, Report
from pipeline.results.tasks_render import task_eval_results
from pipeline.serve import engines

# names of our datasets -> Hub dataset ids (metadata only lists ids the Hub can resolve)
HUB_DATASETS = {"wikitext2": "Salesforce/wikitext", "wikitext-2": "Salesforce/wikitext",
                "wikitext-2-raw": "Salesforce/wikitext", "c4": "allenai/c4"}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id(source: Any) -> str | None:
    """A Hub repo id from a model source ("hf:owner/name", "owner/name"), or None for local/other sources."""
    if not isinstance(source, str):
        return None
    s = source.removeprefix("hf:").split("@")[0]
    if _REPO_ID.match(s) and not Path(s).exists() and not s.startswith((".", "/")):
        return s
    return None


def _method(entry) -> Any:
    """The declared capabilities of the method that made a report entry (None: not a quantized variant)."""
    method = getattr(entry, "method", None) if isinstance(entry, ModelEntry) else None
    return METHODS.get(method) if method and method in METHODS.names() else None


def _variant_tags(entry: ModelEntry) -> list[str]:
    c = _method(entry)
    if c is None:
        return [entry.method] if entry.method else []
    return c.hub_tags(entry.params or {})


def _baseline_ppl(report: Report) -> Perplexity:
    """The baseline's perplexity record (empty when not measured): its protocol and dataset describe every row."""
    return (report.baseline.perplexity if report.baseline else None) or Perplexity()


def _datasets(report: Report, entry: ModelEntry | DraftEntry) -> list[str]:
    params, distill = getattr(entry, "params", None), getattr(entry, "distill", None)
    names = [_baseline_ppl(report).dataset, report.calibration.dataset if report.calibration else None,
             params.get("dataset") if isinstance(params, dict) else None, distill.dataset if distill else None]
    ids = {HUB_DATASETS.get(str(n).lower()) for n in names if n}
    return sorted(i for i in ids if i)


def card_data(report: Report, entry: dict) -> ModelCardData:
    kind, name = entry["kind"], entry["name"]
    model = report.model or ModelInfo()

    base = hub_id(model.source) or packaged_upstream(model.source) or hub_id(model.name)
    data = entry_data(report, entry)
    tags = ["compress"]
    extra: dict[str, Any] = {}
    if kind == "variant":
        tags += ["quantized", *_variant_tags(_variant(report, name))]
        if base:
            extra["base_model_relation"] = "quantized"
    elif kind == "draft":
        tags += ["speculative-decoding", "draft-model", "assistant-model"]
        if is_distilled(data):
            tags.append("distillation")
    if model.random_init:
        tags.append("random-weights")
    measured = getattr(data, "perplexity", None) or Perplexity()
    ppl = measured.value
    results = None
    if isinstance(ppl, (int, float)):
        ds = public(_baseline_ppl(report).dataset or "unknown")
        results = [EvalResult(task_type="text-generation", dataset_type=HUB_DATASETS.get(str(ds).lower(), str(ds)),
                              dataset_name=str(ds), metric_type="perplexity", metric_value=round(float(ppl), 4),
                              metric_name=f"perplexity ({measured.protocol or 'unknown protocol'})")]

    results = ((results or []) + task_eval_results(data)) or None  # [validate.tasks], one per task
    own = getattr(_method(data), "hub_library", None)  # a library other than transformers reads its files (GGUF)
    if own:  # Hub conventions for another library's files: who quantized it
        extra["quantized_by"] = "compress"
    library = own or "transformers"
    return ModelCardData(base_model=base, library_name=library, pipeline_tag="text-generation",
                         license=model.license or None, tags=tags, datasets=_datasets(report, data) or None,
                         model_name=name, eval_results=results, **extra)


def entry_data(report: Report, entry: dict) -> ModelEntry | DraftEntry:
    """The report section an export entry describes (empty when the report lacks it)."""
    if entry["kind"] == "variant":
        return _variant(report, entry["name"])
    if entry["kind"] == "draft":
        return _draft(report)
    return report.baseline or ModelEntry()


def _variant(report: Report, name: str) -> ModelEntry:
    return report.variants.get(name) or ModelEntry()


def _draft(report: Report) -> DraftEntry:
    return report.draft or DraftEntry()


# ---------------------------------------------------------------- the base model, as a published file names it
def _source_ref(model: ModelInfo) -> str:
    """How the card names the source model: its source as written, or for a local file or folder its
    metadata name and file name (a path of this machine never goes into a published card)."""
    name = local_name(model.source)
    if name is None:
        return f"`{model.source or '?'}`"
    return f"`{model.name or '?'}` from the local file `{name}`"


def _source_line(model: ModelInfo) -> str:
    name = local_name(model.source)
    if name is None:
        return f"- source: `{model.source or '?'}`"
    sha = f" (sha256 `{model.source_sha256}`)" if model.source_sha256 else ""
    return f"- source: local file `{name}`{sha}; model `{model.name or '?'}`"


# ---------------------------------------------------------------- body sections
def _intro(report: Report, entry: dict, base: str | None) -> list[str]:
    model = report.model or ModelInfo()
    base_ref = f"[{base}](https://huggingface.co/{base})" if base else _source_ref(model)
    lines = [f"# {entry['name']}", ""]
    if entry["kind"] == "variant":
        variant = _variant(report, entry["name"])
        params = shown_params(variant.params)
        lines.append(f"A **{variant.method or '?'}** quantization of {base_ref} "
                     f"({', '.join(f'{k}={v}' for k, v in params.items()) or 'default settings'}), made with compress.")
    elif entry["kind"] == "draft":
        draft = _draft(report)
        verifier = entry.get("verifier") or draft.verifier or "?"
        if draft.source:
            made = f"`{public(draft.source)}`, used as a **draft model for speculative decoding**"
            made += (f", distilled against the verifier `{verifier}`" if is_distilled(draft) else " (not distilled)")
            lines.append(f"{made}, for {base_ref} (verifier `{verifier}`). "
                         "It shares the verifier's tokenizer; use it as `assistant_model`.")
        else:
            n_layers = draft.num_layers or (len(draft.layers) if draft.layers else None)
            lines.append(f"A {num(n_layers)}-layer **draft model "
                         f"for speculative decoding**, distilled against the verifier `{verifier}` (a version of "
                         f"{base_ref}). It shares the verifier's tokenizer; use it as `assistant_model`.")
    else:
        lines.append(f"The unquantized baseline of this run: {base_ref}.")
    if model.random_init:
        lines += ["", "> **Random weights.** This model was randomly initialised to test the pipeline; "
                  "its outputs and quality figures mean nothing."]
    return lines + [""]


def _provenance(report: Report) -> list[str]:
    model = report.model or ModelInfo()
    provenance = public_text(model.provenance or "", model.source) or "as published"
    return ["## Provenance of the baseline", "",
            f"{_source_line(model)} ({model.architecture or '?'}, "
            f"{num(model.parameters)} parameters, {model.dtype or '?'})",
            f"- provenance: {provenance}",
            f"- license: {model.license or 'unknown (check the source)'}",
            f"- baseline perplexity in this run: {num(_baseline_ppl(report).value)}", ""]


def _results(report: Report, entry: dict) -> list[str]:
    ppl = _baseline_ppl(report)
    lines = ["## Results from this run", "",
             f"Perplexity: {ppl.given('protocol', '?')} protocol on {public(ppl.given('dataset', '?'))} "
             f"({num(ppl.tokens)} tokens); KL and top-1 agreement against the baseline on the same tokens. "
             f"Speed on {report.run.device} (batch-1 decode).", "",
             "| model | perplexity | ppl ratio | KL | top-1 | on disk | bits/weight | in memory | decode tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = [("baseline", report.baseline or ModelEntry())]
    if entry["kind"] == "variant":
        rows.append((entry["name"], _variant(report, entry["name"])))
    for name, m in rows:
        lines.append(f"| {name} | {num(m.perplexity.value if m.perplexity else None)} "
                     f"| {num(1.0 if name == 'baseline' else m.ppl_ratio)} | {num(m.kl)} | {num(m.top1)} "
                     f"| {size(m.size_on_disk_bytes)} | {num(m.bits_per_weight, 3)} "
                     f"| {size(m.footprint_bytes)} | {num(m.speed.decode_tokens_per_s_b1 if m.speed else None, 3)} |")
    lines += _technique_lines(rows)
    coverage = coverage_line(report, rows[-1][1]) if entry["kind"] == "variant" else None
    if coverage:
        lines += ["", coverage[0].upper() + coverage[1:] + "."]
    if entry["kind"] == "draft":
        lines += ["", "| sampling | acceptance α | tokens per verifier forward | speed-up |", "|---|---|---|---|"]
        draft = _draft(report)
        for mode, s in (draft.speculative or {}).items():
            lines.append(f"| {speculative_label(mode, draft.verifier)} | {num(s.alpha, 3)} "
                         f"| {num(s.tokens_per_target_forward, 3)} | {num(s.speedup, 3)} |")
    return lines + _gate_line(report, entry["name"]) + [""]


RUNTIME_TECHNIQUES = ("tensor_parallel", "eager", "sdpa", "flash_attention_2", "static_cache", "compile")


def _technique_lines(rows: list[tuple[str, ModelEntry]]) -> list[str]:
    """One sentence per runtime technique row measured on these models ([validate.speed] techniques): what it did
    here, on which device (an error or skip said as such)."""
    out = []
    for name, m in rows:
        techniques = (m.speed.techniques or {}) if m.speed else {}
        where = m.speed.device_name if m.speed else None
        for t in (t for t in RUNTIME_TECHNIQUES if t in techniques):
            r = techniques[t]
            said = r.error or r.skipped or r.note or ""
            out.append(f"- {name}, {t} on {where or '?'}: {said}")
    return ["", "Runtime techniques measured on these models:", *out] if out else []


def _gate_line(report: Report, name: str) -> list[str]:
    """The model's gates, in the words of the one verdict (results.gates): a warn-only gate that did not pass
    is a warning, never a failure."""
    gates = [g for g in report.gates if g.model == name]
    if not gates:
        return []
    if any(blocks(g) for g in gates):
        verdict = "SOME FAILED"
    elif all(g.passed for g in gates):
        verdict = "all passed"
    else:
        verdict = "passed, with warnings"
    return ["", f"Gates: {verdict} (" + ", ".join(f"{g.gate} {gate_status(g).lower()}" for g in gates) + ")."]


def _usage(report: Report, entry: dict, repo: str) -> list[str]:
    data = entry_data(report, entry)
    c = _method(data)  # None unless data is a quantized variant's ModelEntry
    params, quantize = (data.params or {}, data.quantize or {}) if isinstance(data, ModelEntry) else ({}, {})
    own = c.usage_section(repo, params, quantize, size) if c is not None else None
    if own is not None:  # a format transformers is not the way to run (GGUF): the method's own section
        return own + _runtime_table(data, served_gate_failures(report, entry["name"]))
    lines = ["## How to use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
             f'model = AutoModelForCausalLM.from_pretrained("{repo}")']
    if entry["kind"] == "draft":
        verifier = entry.get("verifier") or _draft(report).verifier or "verifier"
        lines[-2:] = [f'tokenizer = AutoTokenizer.from_pretrained("<{verifier} repo>")',
                      f'model = AutoModelForCausalLM.from_pretrained("<{verifier} repo>")  # the verifier',
                      f'draft = AutoModelForCausalLM.from_pretrained("{repo}")',
                      'inputs = tokenizer("The history of measurement", return_tensors="pt")',
                      "out = model.generate(**inputs, assistant_model=draft, max_new_tokens=64)"]
    lines += ["```", ""]
    if c is not None:
        lines += c.card_usage(repo, params, quantize)
    return lines + _runtime_table(data, served_gate_failures(report, entry["name"]))


def _runtime_table(data, failed: dict[str, str] | None = None) -> list[str]:
    runtimes = list(data.runtimes) if isinstance(data, ModelEntry) else []
    if not runtimes:
        return []
    runtimes += [r for r in _engine_rows(data) if not any(_serves(r2, r) for r2 in runtimes)]
    return (["| runtime | kernel | note | served |", "|---|---|---|---|"]
            + [f"| {r.get('runtime', '')} | {r.get('kernel', '')} | {r.get('note', '')} | "
               f"{served_note(data, r, failed or {})} |" for r in runtimes] + [""])


def _device(s: Served) -> str:
    return "CUDA" if "cuda" in str(s.given("device", "cpu")) else "CPU"


def _engine_rows(data: ModelEntry) -> list[dict]:
    """A runtime row for each engine this run served (or tried) the model in on its device."""
    rows = []
    for engine, s in (data.served or {}).items():
        if s.skipped:
            continue
        kernel = ", ".join(s.kernels or []) or "—"
        rows.append({"runtime": f"{engines.label(engine)} ({_device(s)})", "kernel": kernel,
                     "note": "its own server, this export folder as it is"})
    return rows


def _serves(row: dict, other: dict) -> bool:
    return row.get("runtime") == other.get("runtime")


# Parts of recipe.lock.toml that say when, where or whither a run went, not what produced the weights.
# The lock is rewritten by every `compress run`; a card that embedded them would change on every rerun
# (its sha256 no longer the export manifest's, a new Hub commit on every re-publish) and would publish
# local paths. What remains has every absolute local path (model source, tokenizer, datasets) reduced to
# its file name: the lock's sha256 values identify the files.
_VOLATILE_LOCK = (("lock", "created"), ("lock", "run_id"), ("lock", "model_file"), ("recipe", "run", "output_dir"),
                  ("recipe", "publish"))


def _drop(data: dict, paths) -> dict:
    for path in paths:
        parent: Any = data
        for k in path[:-1]:
            parent = parent.get(k) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    return data


def card_recipe(recipe: dict) -> dict:
    """The part of a resolved recipe (Recipe.dump()) that a card shows; the export stage hashes it."""
    return public_tree(_drop(copy.deepcopy(recipe), [p[1:] for p in _VOLATILE_LOCK if p[0] == "recipe"]))


def card_lock(lock_text: str) -> str:
    """recipe.lock.toml as shown in a card: everything but the per-invocation and machine-local fields."""
    try:
        data = tomllib.loads(lock_text)
    except tomllib.TOMLDecodeError:
        return lock_text.strip()
    return tomli_w.dumps(public_tree(_drop(data, _VOLATILE_LOCK))).strip()


def _mix(report: Report, entry: dict) -> list[str]:
    """A mixed-precision variant's allocation (pipeline/results/mix_render.py)."""
    data = report.variants.get(entry["name"]) if entry["kind"] == "variant" else None
    mix = mix_of(data)
    if data is None or mix is None:
        return []
    return ["## Mixed precision: bits per block", ""] + mix_lines(entry["name"], data, mix)[2:]


def _reproduce(report: Report, recipe_excerpt: str, lock_text: str) -> list[str]:
    versions = report.run.versions
    return ["## Reproduce", "",
            "Made with compress" + (f" ({', '.join(f'{k} {v}' for k, v in versions.items())})" if versions else "")
            + ". The recipe excerpt that produced this folder:", "", "```toml", recipe_excerpt.strip(), "```", "",
            "<details><summary>recipe.lock.toml (resolved recipe, versions, sha256 of model and data)</summary>", "",
            "```toml", card_lock(lock_text), "```", "", "</details>", ""]


def card_text(report: Report, entry: dict, recipe_excerpt: str, lock_text: str) -> str:
    data = card_data(report, entry)
    repo = entry.get("repo_id") or f"./{entry['name']}"
    base = data.base_model if isinstance(data.base_model, str) else None  # card_data sets one id or None
    body = (_intro(report, entry, base) + _provenance(report) + _results(report, entry)
            + _mix(report, entry) + _usage(report, entry, repo) + _reproduce(report, recipe_excerpt, lock_text))
    text = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)
    # the sections above name a local source by its file name; this also catches the path in a caller's text
    return public_text(text, report.model.source if report.model else None)


def write_model_card(export_dir: Path, report: Report, entry: dict, recipe_excerpt: str, lock_text: str) -> None:
    """Write export_dir/README.md (validated by parsing it back with huggingface_hub, offline)."""
    text = card_text(report, entry, recipe_excerpt, lock_text)
    ModelCard(text)  # raises ValueError on metadata the Hub would reject (e.g. a malformed model-index)
    path = Path(export_dir) / "README.md"
    if path.exists() and path.read_text() == text:
        return  # unchanged: keep the file (and the export manifest's hash) as it is
    atomic_write_text(path, text)


def excerpt_from_lock(lock_text: str, entry: dict) -> str:
    """The recipe excerpt for an entry, from the lock's [recipe] table (as the export stage builds it)."""
    recipe = tomllib.loads(lock_text).get("recipe") or {}
    keep = {k: recipe[k] for k in ("model", "calibration") if k in recipe}
    if entry["kind"] == "variant":
        keep["quantize"] = [q for q in recipe.get("quantize", []) if q.get("name") == entry["name"]]
    if entry["kind"] == "draft" and "draft" in recipe:
        keep["draft"] = recipe["draft"]
    return tomli_w.dumps(public_tree(keep))


def render_cards(run_dir: Path, report: Report) -> list[str]:
    """Re-render README.md of every export folder listed in report.exports (for `compress report`)."""
    run_dir = Path(run_dir)
    done: list[str] = []
    lock = run_dir / "recipe.lock.toml"
    if not lock.is_file():
        return done
    lock_text = lock.read_text()
    for name, exp in report.exports.items():
        folder = run_dir / "export" / name
        if folder.is_dir():
            entry = {"kind": exp.kind, "name": exp.name, **({"verifier": exp.verifier} if exp.verifier else {})}
            write_model_card(folder, report, entry, excerpt_from_lock(lock_text, entry), lock_text)
            done.append(name)
    return done


def served_note(data: ModelEntry, runtime: dict, failed: dict[str, str] | None = None) -> str:
    """"served here (engine, version, device, figures)" when validate/<model>/serve/<engine> served it on this
    runtime, "refused here: <the engine's line>" when the engine would not load it, else what the row rests on. A
    runtime row matches an engine whose name it starts with, on the run's device (CPU or CUDA)."""
    rt = str(runtime.get("runtime", ""))
    for engine, s in (data.served or {}).items():
        if not rt.lower().startswith(engine.lower()):
            continue
        if _device(s) not in rt and "(" in rt:
            continue
        versions = ", ".join(f"{k} {v}" for k, v in (s.versions or {}).items())
        if s.refused:
            return f"refused here ({versions}, {_device(s)}): {s.refused}"
        if s.levels:
            top = max(s.levels, key=lambda lv: lv.concurrency)
            eq = s.equality
            greedy = f", greedy = generate {eq.identical}/{eq.prompts}" if eq and eq.prompts else ""
            p = s.perplexity
            ppl = (f", perplexity through it {p.value:.4f} ({p.ratio:.4f}x the in-process figure)"
                   if p is not None and p.value is not None and p.ratio is not None else "")
            verdict = (f"; FAILED a gate as served ({(failed or {})[engine]}): not recommended"
                       if engine in (failed or {}) else "")
            return (f"served here ({versions}, {_device(s)}): {top.output_tok_s:.1f} output tok/s at concurrency "
                    f"{top.concurrency}, {top.errors} errors of {top.requests}{greedy}{ppl}{_path(s)}"
                    f"{served_tasks_note(data, s)}{verdict}")
    if "measured here" in str(runtime.get("note", "")):
        return "loaded and measured here (quality, speed), not served"
    return "expected from the library's documented support, not tried"


def _path(s) -> str:
    """Which computation vLLM's CPU build served a 4-bit checkpoint with, where its record says."""
    if s.int8_activations is None:
        return ""
    return ", W4A8 path (int8 activations)" if s.int8_activations else ", W4A16 path (16-bit activations)"


def served_tasks_note(data: ModelEntry, s) -> str:
    """", tasks through it: arc_easy 0.560 (in process 0.560), ..." where [validate.tasks] engines scored them."""
    if not s.tasks:
        return ""
    mine = data.tasks or {}
    parts = [f"{t} {v.score:.3f}" + (f" (in process {mine[t].score:.3f})" if t in mine and mine[t].score is not None
                                     else "") for t, v in sorted(s.tasks.items()) if v.score is not None]
    return ", tasks through it: " + ", ".join(parts)
