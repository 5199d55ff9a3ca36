"""Which export folder goes where on the Hub: a pure plan, no network.

`plan(run_dir, cfg)` reads report.json, applies the publish rule (pipeline/results/publishing.py) to the
exports it lists, re-verifies every file's sha256 against its manifest and names the repo, branch and
folder each model goes to. `render_dry_run` prints it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub.utils import HFValidationError, validate_repo_id

from pipeline.base.errors import PublishError
from pipeline.base.fileio import sha256_file
from pipeline.publish.config import PublishConfig, template_fields
from pipeline.results import schema
from pipeline.results.publishing import PublishRefused, eligible
from pipeline.results.schema import ExportEntry, Report

MANIFEST = "manifest.json"
LOCAL_ONLY = (MANIFEST, "metrics.json")  # run-folder metadata, never uploaded
DRAFT_FOLDER = "draft"
_KINDS = ("baseline", "variant", "draft")


@dataclass(frozen=True)
class LocalFile:
    relpath: str  # relative to the export folder, posix
    path: Path
    size: int
    sha256: str


@dataclass(frozen=True)
class PushItem:
    name: str
    kind: str  # "variant" | "draft"
    folder: Path
    repo_id: str
    revision: str
    path_in_repo: str  # "" for the repo root, "draft" for a draft inside its verifier's repo
    files: tuple[LocalFile, ...]
    commit_message: str
    keep_prefixes: tuple[str, ...] = ()  # remote paths under these belong to another item

    def remote_path(self, relpath: str) -> str:
        return f"{self.path_in_repo}/{relpath}" if self.path_in_repo else relpath

    def in_scope(self, remote_path: str) -> bool:
        """Whether a remote file is this item's to add, keep or delete."""
        if remote_path == ".gitattributes" or remote_path.startswith(self.keep_prefixes):
            return False
        return not self.path_in_repo or remote_path.startswith(self.path_in_repo + "/")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def as_dict(self) -> dict:
        return {
            "name": self.name, "kind": self.kind, "repo_id": self.repo_id,
            "revision": self.revision, "path_in_repo": self.path_in_repo,
            "commit_message": self.commit_message, "bytes": self.total_bytes,
            "files": [{"path": self.remote_path(f.relpath), "size": f.size, "sha256": f.sha256}
                      for f in self.files],
        }


@dataclass
class Plan:
    items: list[PushItem]
    skipped: dict[str, str] = field(default_factory=dict)  # export name -> why it is not pushed
    run_id: str | None = None  # the run whose report allowed these exports

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def as_dict(self) -> dict:
        return {"items": [i.as_dict() for i in self.items], "skipped": dict(self.skipped)}


@dataclass(frozen=True)
class Export:
    name: str
    kind: str
    verifier: str | None
    folder: Path
    files: dict[str, str]  # relpath -> sha256 from the manifest

    @property
    def draft_verifier(self) -> str:
        """A draft's verifier (load_export refuses a draft that names none)."""
        if not self.verifier:
            raise PublishError(f"{self.name}: a draft must name its verifier")
        return self.verifier


# ---------------------------------------------------------------- reading the run


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise PublishError(f"{path} not found: run the export stage first")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PublishError(f"{path} is not valid JSON: {err}") from None


def load_export(run_dir: Path, listed: ExportEntry) -> Export:
    """The export folder the report lists, read through its manifest; its manifest must be the one the
    report's run recorded (same outputs_hash), so a folder rewritten since is refused."""
    folder = run_dir / "export" / listed.name
    where = f"{folder / MANIFEST}"
    man = _read_json(folder / MANIFEST)
    if not isinstance(man, dict) or man.get("outputs_hash") != listed.outputs_hash:
        raise PublishError(f"{where} is not the export this run's report lists (outputs_hash "
                           f"{str(man.get('outputs_hash'))[:12]}… != report {str(listed.outputs_hash)[:12]}…); "
                           "rerun `compress run`")
    outputs = man.get("outputs") if isinstance(man, dict) else None
    if not isinstance(outputs, dict):
        raise PublishError(f"{where} has no 'outputs' table: rerun `compress run`")
    files = {rel: meta.get("sha256") for rel, meta in outputs.items() if rel not in LOCAL_ONLY}
    if listed.kind not in _KINDS:
        raise PublishError(f"export {listed.name!r}: kind {listed.kind!r} is not one of {list(_KINDS)}")
    if listed.kind == "draft" and not listed.verifier:
        raise PublishError(f"{where}: a draft must name its verifier")
    if not files:
        raise PublishError(f"{where}: the manifest lists no files")
    return Export(listed.name, listed.kind, listed.verifier, folder, dict(files))


def verify_files(export: Export) -> tuple[LocalFile, ...]:
    """Every file on disk is in the manifest with the same sha256, and vice versa."""
    on_disk = {p.relative_to(export.folder).as_posix(): p
               for p in export.folder.rglob("*") if p.is_file()}
    for local in LOCAL_ONLY:
        on_disk.pop(local, None)
    where = f"export {export.name!r} ({export.folder})"
    unlisted = sorted(set(on_disk) - set(export.files))
    missing = sorted(set(export.files) - set(on_disk))
    if unlisted or missing:
        raise PublishError(f"{where} does not match its manifest: "
                           f"missing files {missing}, files not in the manifest {unlisted}")
    # an HF checkpoint needs its config.json; a GGUF folder (a `method = "gguf"` variant) its one .gguf file
    gguf = "config.json" not in on_disk and any(rel.endswith(".gguf") and "/" not in rel for rel in on_disk)
    for rel in ("README.md",) if gguf else ("config.json", "README.md"):
        if rel not in on_disk:
            raise PublishError(f"{where} has no {rel}: a publishable checkpoint needs one")
    out = []
    for rel in sorted(on_disk):
        if rel.startswith("/") or ".." in rel.split("/"):
            raise PublishError(f"{where}: unsafe file path {rel!r} in manifest")
        digest = sha256_file(on_disk[rel])
        if digest != export.files[rel]:
            raise PublishError(f"{where}: {rel} changed since export (sha256 {digest[:12]}… "
                               f"!= manifest {str(export.files[rel])[:12]}…); re-run the export stage")
        out.append(LocalFile(rel, on_disk[rel], on_disk[rel].stat().st_size, digest))
    return tuple(out)


# ---------------------------------------------------------------- choosing what to push


def select(exports: dict[str, Export], skipped: dict[str, str], cfg: PublishConfig) -> list[str]:
    """Names to push (variants first) among the exports the publish rule allows; `skipped` gains
    {name: reason} for the ones left out."""
    listed = set(exports) | set(skipped)
    wanted = list(cfg.include) if cfg.include is not None else sorted(listed)
    unknown = [n for n in wanted if n not in listed]
    if unknown:
        raise PublishError(f"[publish].include names {unknown}, not exports of this run; "
                           f"available: {sorted(listed)}")
    skipped.update({n: "not in [publish].include" for n in exports if n not in wanted})
    chosen: list[str] = []
    for name in sorted((n for n in wanted if n in exports), key=lambda n: (exports[n].kind == "draft", n)):
        if exports[name].kind != "draft" or _verifier_ok(exports[name], exports, chosen, cfg, skipped):
            chosen.append(name)
    if not chosen:
        raise PublishRefused("refusing to publish: nothing left to push ("
                             + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + ")")
    return chosen


def _verifier_ok(draft: Export, exports: dict[str, Export], chosen: list[str],
                 cfg: PublishConfig, skipped: dict[str, str]) -> bool:
    verifier = draft.verifier
    if verifier == "baseline":
        if cfg.draft == "folder":
            raise PublishError(f"draft {draft.name!r} verifies against the baseline model, which "
                               "is not published here: use [publish].draft = 'repo'")
        return True
    if verifier not in exports and verifier not in skipped:
        raise PublishError(f"draft {draft.name!r} names verifier {verifier!r}, which is not an "
                           f"export of this run (exports: {sorted(exports)})")
    if verifier in chosen:
        return True
    reason = f"its verifier {verifier!r} is not being pushed ({skipped.get(verifier, 'unknown')})"
    if cfg.partial:
        skipped[draft.name] = reason
        return False
    raise PublishError(f"cannot push draft {draft.name!r}: {reason}; include its verifier too")


# ---------------------------------------------------------------- naming targets


def _message(cfg: PublishConfig, report: Report, export: Export, run: str) -> str:
    used = template_fields(cfg.commit_message)
    values: dict[str, Any] = {"variant": export.name, "run": run}
    if used & {"perplexity", "ppl_ratio"}:
        # a draft has no perplexity of its own: its commit carries its verifier's figures
        name = export.draft_verifier if export.kind == "draft" else export.name
        entry = report.baseline if name == "baseline" else report.variants.get(name)
        ppl = entry.perplexity.value if entry and entry.perplexity else None
        base = report.baseline.perplexity.value if report.baseline and report.baseline.perplexity else None
        if ppl is None or ("ppl_ratio" in used and not base):
            raise PublishError(f"report.json has no perplexity for {name!r} (or for the baseline), needed by the "
                               "{perplexity}/{ppl_ratio} placeholders of [publish].commit_message")
        values["perplexity"] = float(ppl)
        if "ppl_ratio" in used:
            assert base  # checked above
            values["ppl_ratio"] = float(ppl) / float(base)
    return cfg.commit_message.format(**values)


def _repo(cfg: PublishConfig, model: str, variant: str) -> str:
    repo_id = cfg.repo_id.format(org=cfg.org, model=model, variant=variant)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise PublishError(f"[publish].repo_id gives {repo_id!r}, not a valid Hub repo id: {err}") from None
    if repo_id.count("/") != 1:
        raise PublishError(f"[publish].repo_id gives {repo_id!r}; expected 'namespace/name'")
    return repo_id


def _target(cfg: PublishConfig, model: str, export: Export) -> tuple[str, str]:
    if cfg.layout == "branches":
        branch = "main" if export.name == cfg.main_variant else export.name
        if not re.fullmatch(r"[\w.-]+", branch) or branch.startswith(("refs", ".")):
            raise PublishError(f"export name {export.name!r} cannot be a branch name")
        return _repo(cfg, model, ""), branch
    return _repo(cfg, model, export.name), cfg.revision


def plan(run_dir: Path, cfg: PublishConfig) -> Plan:
    """What `push` would do. Raises PublishRefused per the publish rule, PublishError otherwise."""
    run_dir = Path(run_dir)
    report = schema.load(run_dir)
    allowed, skipped = eligible(run_dir, report, cfg.partial)
    model = str((report.model and report.model.name) or run_dir.name).rstrip("/").split("/")[-1]
    exports = {name: load_export(run_dir, listed) for name, listed in allowed.items()}
    if cfg.main_variant is not None and cfg.main_variant not in report.exports:
        raise PublishError(f"[publish].main_variant {cfg.main_variant!r} is not an export "
                           f"of this run; available: {sorted(report.exports)}")
    chosen = select(exports, skipped, cfg)
    items: list[PushItem] = []
    targets: dict[str, tuple[str, str]] = {}
    seen: set[tuple[str, str, str]] = set()
    keep: tuple[str, ...]
    for name in chosen:
        export = exports[name]
        files = verify_files(export)
        if export.kind == "draft" and cfg.draft == "folder":
            repo_id, revision = targets[export.draft_verifier]
            path_in_repo, keep = DRAFT_FOLDER, ()
        else:
            repo_id, revision = _target(cfg, model, export)
            path_in_repo = ""
            keep = (DRAFT_FOLDER + "/",) if cfg.draft == "folder" else ()
        if (repo_id, revision, path_in_repo) in seen:
            raise PublishError(f"two exports would go to {repo_id}@{revision}/{path_in_repo}")
        seen.add((repo_id, revision, path_in_repo))
        targets[name] = (repo_id, revision)
        items.append(PushItem(name, export.kind, export.folder, repo_id, revision, path_in_repo,
                              files, _message(cfg, report, export, run_dir.name), keep))
    return Plan(items, skipped, report.run.id)


# ---------------------------------------------------------------- dry run


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def render_dry_run(items: Plan | list[PushItem], endpoint: str | None = None) -> str:
    """Exactly which files go where, with sizes. Pure: touches nothing."""
    items_list = list(items)
    base = (endpoint or "").rstrip("/")
    lines = [f"Publish plan: {len(items_list)} model(s), "
             f"{human(sum(i.total_bytes for i in items_list))} in all"]
    for item in items_list:
        where = f"{base}/{item.repo_id}" if base else item.repo_id
        folder = f", folder {item.path_in_repo}/" if item.path_in_repo else ""
        lines.append(f"- {item.name} ({item.kind}) -> {where} @ {item.revision}{folder}: "
                     f"{len(item.files)} files, {human(item.total_bytes)}")
        lines.append(f"    commit message: {item.commit_message}")
        width = max(len(item.remote_path(f.relpath)) for f in item.files)
        for f in item.files:
            lines.append(f"    {item.remote_path(f.relpath):<{width}}  {human(f.size):>9}"
                         f"  ({f.size} bytes, sha256 {f.sha256[:12]})")
    for name, why in getattr(items, "skipped", {}).items():
        lines.append(f"- {name}: not pushed: {why}")
    return "\n".join(lines)
