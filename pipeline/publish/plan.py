"""Which export folder goes where on the Hub: a pure plan, no network.

`plan(run_dir, cfg)` reads report.json and export/*/manifest.json, applies the
gate rule, re-verifies every file's sha256 against its manifest and names the
repo, branch and folder each model goes to. `render_dry_run` prints it.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import PublishError
from pipeline.publish.config import PublishConfig, template_fields

MANIFEST = "manifest.json"
LOCAL_ONLY = (MANIFEST, "metrics.json")  # run-folder metadata, never uploaded
DRAFT_FOLDER = "draft"
_KINDS = ("variant", "draft")


class PublishRefused(PublishError):
    """The gate rule forbids publishing; `section` is the report entry saying why."""

    def __init__(self, message: str, failed_gates: list[dict] | None = None):
        super().__init__(message)
        self.section = {"status": "refused", "reason": message, "failed_gates": failed_gates or []}


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


# ---------------------------------------------------------------- reading the run


def dig(data: Any, path: str, where: str) -> Any:
    """data['a']['b'] for path 'a.b', or a PublishError naming the missing key."""
    cur = data
    for i, key in enumerate(path.split(".")):
        if not isinstance(cur, dict) or key not in cur:
            got = ".".join(path.split(".")[:i]) or "top level"
            raise PublishError(f"{where} has no key '{path}' (missing '{key}' under {got})")
        cur = cur[key]
    return cur


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise PublishError(f"{path} not found: run the export stage first")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PublishError(f"{path} is not valid JSON: {err}") from None


def load_exports(run_dir: Path) -> dict[str, Export]:
    root = run_dir / "export"
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not folders:
        raise PublishError(f"no export folders under {root}: run the export stage first")
    exports = {}
    for folder in folders:
        where = f"{folder / MANIFEST}"
        man = _read_json(folder / MANIFEST)
        # the runner's manifest: the export entry is the unit's metrics, the files its outputs
        entry = dig(man, "metrics", where)
        kind, name = dig(entry, "kind", where + " metrics"), dig(entry, "name", where + " metrics")
        verifier = dig(entry, "verifier", where + " metrics")
        files = {rel: meta.get("sha256") for rel, meta in dig(man, "outputs", where).items() if rel not in LOCAL_ONLY}
        if kind not in _KINDS:
            raise PublishError(f"{where}: kind {kind!r} is not one of {list(_KINDS)}")
        if name != folder.name:
            raise PublishError(f"{where}: name {name!r} differs from its folder name {folder.name!r}")
        if kind == "draft" and not verifier:
            raise PublishError(f"{where}: a draft must name its verifier")
        if not isinstance(files, dict) or not files:
            raise PublishError(f"{where}: 'files' must map each file to its sha256")
        exports[name] = Export(name, kind, verifier, folder, dict(files))
    return exports


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    for rel in ("config.json", "README.md"):
        if rel not in on_disk:
            raise PublishError(f"{where} has no {rel}: a publishable checkpoint needs one")
    out = []
    for rel in sorted(on_disk):
        if rel.startswith("/") or ".." in rel.split("/"):
            raise PublishError(f"{where}: unsafe file path {rel!r} in manifest")
        digest = _sha256(on_disk[rel])
        if digest != export.files[rel]:
            raise PublishError(f"{where}: {rel} changed since export (sha256 {digest[:12]}… "
                               f"!= manifest {str(export.files[rel])[:12]}…); re-run the export stage")
        out.append(LocalFile(rel, on_disk[rel], on_disk[rel].stat().st_size, digest))
    return tuple(out)


# ---------------------------------------------------------------- the gate rule


def _gates(report: dict) -> list[dict]:
    gates = dig(report, "gates", "report.json")
    if not isinstance(gates, list):
        raise PublishError("report.json: 'gates' must be a list")
    for i, g in enumerate(gates):
        for key in ("model", "gate", "passed"):
            dig(g, key, f"report.json gates[{i}]")
    return gates


def _describe(g: dict) -> str:
    return f"{g['model']}/{g['gate']} (value {g.get('value')}, bound {g.get('bound')})"


def select(exports: dict[str, Export], gates: list[dict], cfg: PublishConfig) -> tuple[list[str], dict[str, str]]:
    """Names to push (variants first) and {name: reason} for the ones left out."""
    wanted = list(cfg.include) if cfg.include is not None else list(exports)
    unknown = [n for n in wanted if n not in exports]
    if unknown:
        raise PublishError(f"[publish].include names {unknown}, not exports of this run; "
                           f"available: {sorted(exports)}")
    skipped = {n: "not in [publish].include" for n in exports if n not in wanted}
    failed = [g for g in gates if not g["passed"]]
    if failed and not cfg.partial:
        raise PublishRefused(
            f"refusing to publish: {len(failed)} gate(s) failed: "
            + "; ".join(_describe(g) for g in failed)
            + ". Nothing was pushed; use --partial (or [publish].partial = true) to push "
              "only the models whose gates passed", failed)
    bad = {g["model"]: _describe(g) for g in failed}
    chosen = []
    for name in sorted(wanted, key=lambda n: (exports[n].kind == "draft", n)):
        export = exports[name]
        if name in bad:
            skipped[name] = f"gate failed: {bad[name]}"
        elif export.kind == "draft" and not _verifier_ok(export, exports, chosen, cfg, skipped):
            continue
        else:
            chosen.append(name)
    if not chosen:
        raise PublishRefused("refusing to publish: no export passed its gates ("
                             + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + ")", failed)
    return chosen, skipped


def _verifier_ok(draft: Export, exports: dict[str, Export], chosen: list[str],
                 cfg: PublishConfig, skipped: dict[str, str]) -> bool:
    verifier = draft.verifier
    if verifier == "baseline":
        if cfg.draft == "folder":
            raise PublishError(f"draft {draft.name!r} verifies against the baseline model, which "
                               "is not published here: use [publish].draft = 'repo'")
        return True
    if verifier not in exports:
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


def _message(cfg: PublishConfig, report: dict, export: Export, run: str) -> str:
    used = template_fields(cfg.commit_message)
    values: dict[str, Any] = {"variant": export.name, "run": run}
    if used & {"perplexity", "ppl_ratio"}:
        # a draft has no perplexity of its own: its commit carries its verifier's figures
        name = export.verifier if export.kind == "draft" else export.name
        entry_path = "baseline" if name == "baseline" else f"variants.{name}"
        entry = dig(report, entry_path, "report.json")
        ppl = dig(entry, "perplexity.value", f"report.json {entry_path}")
        values["perplexity"] = float(ppl)
        if "ppl_ratio" in used:
            values["ppl_ratio"] = _ratio(report, entry, float(ppl), entry_path)
    return cfg.commit_message.format(**values)


def _ratio(report: dict, entry: dict, ppl: float, entry_path: str) -> float:
    if isinstance(entry.get("perplexity"), dict) and "ratio" in entry["perplexity"]:
        return float(entry["perplexity"]["ratio"])
    for path in ("baseline.perplexity.value", "model.perplexity.value"):
        try:
            return ppl / float(dig(report, path, "report.json"))
        except PublishError:
            continue
    raise PublishError(f"report.json has neither {entry_path}.perplexity.ratio nor a baseline "
                       "perplexity (baseline.perplexity.value or model.perplexity.value), needed "
                       "by the {ppl_ratio} placeholder of [publish].commit_message")


def _repo(cfg: PublishConfig, model: str, variant: str) -> str:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

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
    """What `push` would do. Raises PublishRefused per the gate rule, PublishError otherwise."""
    run_dir = Path(run_dir)
    report = _read_json(run_dir / "report.json")
    model = str(dig(report, "model.name", "report.json")).rstrip("/").split("/")[-1]
    exports = load_exports(run_dir)
    if cfg.main_variant is not None and cfg.main_variant not in exports:
        raise PublishError(f"[publish].main_variant {cfg.main_variant!r} is not an export "
                           f"of this run; available: {sorted(exports)}")
    chosen, skipped = select(exports, _gates(report), cfg)
    items, targets, seen = [], {}, set()
    for name in chosen:
        export = exports[name]
        files = verify_files(export)
        if export.kind == "draft" and cfg.draft == "folder":
            repo_id, revision = targets[export.verifier]
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
    return Plan(items, skipped)


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
