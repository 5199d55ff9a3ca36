"""Push planned export folders to the Hub, idempotently, and read every push back.

One Hub commit per export folder: files go up first (LFS), the commit comes last
and is atomic, so an interrupted push leaves the repo as it was and a rerun
finishes it. Nothing local says "pushed" before the commit has been read back
and verified. The token comes from HF_TOKEN or the user's login only, and every
error from huggingface_hub is rethrown as a PublishError scrubbed of it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pipeline.errors import PublishError
from pipeline.publish.config import PublishConfig
from pipeline.publish.plan import LocalFile, Plan, PublishRefused, PushItem, human, plan, render_dry_run

__all__ = ["plan", "render_dry_run", "push", "publish_run", "resolve_token", "resolve_endpoint",
           "scrub", "PublishRefused", "PushItem", "Plan"]

DEFAULT_ENDPOINT = "https://huggingface.co"
RECORD = Path("publish") / "pushed.json"
_TOKEN_LIKE = re.compile(r"\bhf_[A-Za-z0-9]{8,}")
T = TypeVar("T")
_CARD_KEYS = ("base_model", "base_model_relation", "tags", "library_name", "license", "datasets")


# ---------------------------------------------------------------- token and errors


def scrub(text: str, token: str | None) -> str:
    """Remove the token (and anything shaped like a Hub token) from text."""
    if token:
        text = text.replace(token, "<token>")
    return _TOKEN_LIKE.sub("hf_<redacted>", text)


def _explain(err: BaseException) -> str:
    """'Type: message' for err and the exceptions it was raised from (huggingface_hub wraps)."""
    parts, seen = [], set()
    while err is not None and id(err) not in seen and len(parts) < 4:
        seen.add(id(err))
        text = " ".join(str(err).split())
        parts.append(f"{type(err).__name__}: {text}" if text else type(err).__name__)
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return " <- ".join(parts)


def hub_call(what: str, token: str | None, fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs); any failure becomes a PublishError whose text cannot carry the token."""
    try:
        return fn(*args, **kwargs)
    except PublishError:
        raise
    except Exception as err:  # huggingface_hub, httpx, OS: all end as one clear line
        message = scrub(f"{what} failed: {_explain(err)}", token)
    # Raised outside the except block, so it has no __context__ holding the original text.
    raise PublishError(message)


def resolve_token() -> str:
    """HF_TOKEN, else the token saved by `hf auth login`; never a recipe value."""
    from huggingface_hub import get_token

    token = hub_call("reading the Hugging Face token", None, get_token)
    if not token:
        raise PublishError("no Hugging Face token: set HF_TOKEN or run `hf auth login` "
                           "(`huggingface-cli login`) before publishing")
    return token


def resolve_endpoint(cfg: PublishConfig) -> str:
    return (cfg.endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


# ---------------------------------------------------------------- comparing trees


def _remote_files(api, item: PushItem, revision: str) -> dict:
    from huggingface_hub.hf_api import RepoFile

    tree = api.list_repo_tree(item.repo_id, revision=revision, recursive=True)
    return {f.path: f for f in tree if isinstance(f, RepoFile) and item.in_scope(f.path)}


def _same(local: LocalFile, remote) -> bool:
    from huggingface_hub.utils.sha import git_hash

    if remote.size != local.size:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == local.sha256
    return remote.blob_id == git_hash(local.path.read_bytes())


def diff(item: PushItem, remote: dict) -> tuple[list[LocalFile], list[str]]:
    """(local files the remote lacks or holds differently, remote files in scope to delete)."""
    local = {item.remote_path(f.relpath): f for f in item.files}
    changed = [f for path, f in local.items() if path not in remote or not _same(f, remote[path])]
    stale = sorted(path for path in remote if path not in local)
    return changed, stale


# ---------------------------------------------------------------- read-back


def _check_config(item: PushItem, downloaded: str) -> None:
    local = json.loads((item.folder / "config.json").read_text(encoding="utf-8"))
    remote = json.loads(Path(downloaded).read_text(encoding="utf-8"))
    if "quantization_config" in local and remote.get("quantization_config") != local["quantization_config"]:
        raise PublishError(f"read-back of {item.repo_id}: {item.remote_path('config.json')} lost or "
                           "changed its quantization_config")


def _card_data(path: Path | str) -> dict:
    from huggingface_hub import ModelCard

    data = ModelCard.load(Path(path)).data.to_dict()
    return {k: data.get(k) for k in _CARD_KEYS}


def _check_card(item: PushItem, downloaded: str) -> None:
    local, remote = _card_data(item.folder / "README.md"), _card_data(downloaded)
    wrong = sorted(k for k in _CARD_KEYS if local[k] != remote[k])
    if wrong:
        raise PublishError(f"read-back of {item.repo_id}: model card metadata differs for {wrong}")


def verify_remote(api, item: PushItem, oid: str, token: str | None) -> list[dict]:
    """Read the commit back: file list, sizes, sha256 / LFS oids, config and card."""
    where = f"{item.repo_id}@{oid[:12]}"
    remote = hub_call(f"reading back {where}", token, _remote_files, api, item, oid)
    changed, stale = diff(item, remote)
    if changed or stale:
        raise PublishError(f"read-back of {where} does not match {item.folder}: missing or different "
                           f"{[item.remote_path(f.relpath) for f in changed]}, unexpected {stale}")
    with tempfile.TemporaryDirectory(prefix="compress-readback-") as tmp:
        config, card = (
            hub_call(f"downloading {item.remote_path(name)} from {where}", token, api.hf_hub_download,
                     item.repo_id, item.remote_path(name), revision=oid, cache_dir=tmp)
            for name in ("config.json", "README.md"))
        hub_call(f"checking config.json read back from {where}", token, _check_config, item, config)
        hub_call(f"checking README.md read back from {where}", token, _check_card, item, card)
    return [{"path": item.remote_path(f.relpath), "size": f.size, "sha256": f.sha256,
             "lfs": remote[item.remote_path(f.relpath)].lfs is not None} for f in item.files]


# ---------------------------------------------------------------- push


def _prepare_target(api, item: PushItem, cfg: PublishConfig, token: str) -> str:
    """Create repo and branch if needed; return the head commit of the target revision."""
    what = f"creating or opening repo {item.repo_id}"
    hub_call(what, token, api.create_repo, item.repo_id, private=cfg.private, exist_ok=True)
    info = hub_call(what, token, api.repo_info, item.repo_id)
    if cfg.private and not info.private:
        raise PublishError(f"{item.repo_id} already exists and is public, but [publish].private = "
                           "true: refusing to push; make the repo private or set private = false")
    if item.revision != "main":
        hub_call(f"creating branch {item.revision!r} in {item.repo_id}", token,
                 api.create_branch, item.repo_id, branch=item.revision, exist_ok=True)
    info = hub_call(f"reading {item.repo_id}@{item.revision}", token,
                    api.repo_info, item.repo_id, revision=item.revision)
    return info.sha


def _operations(item: PushItem, changed: list[LocalFile], stale: list[str]) -> list:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    ops = []
    for f in changed:
        op = CommitOperationAdd(path_in_repo=item.remote_path(f.relpath), path_or_fileobj=str(f.path))
        op.upload_info.sha256 = bytes.fromhex(f.sha256)  # verified against the manifest in plan()
        ops.append(op)
    return ops + [CommitOperationDelete(path_in_repo=p) for p in stale]


def _push_item(api, item: PushItem, cfg: PublishConfig, token: str, log: logging.Logger) -> dict:
    head = _prepare_target(api, item, cfg, token)
    remote = hub_call(f"listing {item.repo_id}@{item.revision}", token, _remote_files, api, item, head)
    changed, stale = diff(item, remote)
    pr_url = None
    if not changed and not stale:
        status, oid = "up to date", head
        log.info("%s: %s@%s is up to date (commit %s)", item.name, item.repo_id, item.revision, head[:12])
    else:
        log.info("%s: uploading %d file(s) (%s), deleting %d, to %s@%s", item.name, len(changed),
                 human(sum(f.size for f in changed)), len(stale), item.repo_id, item.revision)
        info = hub_call(
            f"pushing {item.name} to {item.repo_id}@{item.revision}", token, api.create_commit,
            item.repo_id, _operations(item, changed, stale), commit_message=item.commit_message,
            revision=item.revision, create_pr=cfg.create_pr, parent_commit=None if cfg.create_pr else head)
        status, oid, pr_url = ("pull request" if cfg.create_pr else "pushed"), info.oid, info.pr_url
    files = verify_remote(api, item, oid, token)
    return {"name": item.name, "kind": item.kind, "repo_id": item.repo_id, "revision": item.revision,
            "path_in_repo": item.path_in_repo, "status": status, "commit_oid": oid,
            "commit_url": f"{api.endpoint}/{item.repo_id}/commit/{oid}", "pr_url": pr_url,
            "files": files}


def push(items: Plan | list[PushItem], cfg: PublishConfig, token: str | None = None,
         on_verified: Callable[[list[dict]], None] | None = None,
         log: logging.Logger | None = None) -> list[dict]:
    """Push each item as one commit (or none when up to date) and verify it by reading it back.

    `on_verified(results_so_far)` is called only after an item's commit is read back and verified.
    """
    from huggingface_hub import HfApi

    log = log or logging.getLogger(__name__)
    token = token or resolve_token()
    api = HfApi(endpoint=resolve_endpoint(cfg), token=token, library_name="compress")
    results: list[dict] = []
    for item in items:
        results.append(_push_item(api, item, cfg, token, log))
        if on_verified is not None:
            on_verified(list(results))
    return results


# ---------------------------------------------------------------- the stage entry point


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def publish_run(run_dir: Path, cfg: PublishConfig, log: logging.Logger,
                record_path: Path | None = None) -> dict:
    """Plan, then dry-run or push; returns the report's `publish` section.

    Raises PublishRefused (a PublishError; `.section` holds the refusal for the report)
    when the gate rule forbids publishing, PublishError for anything else.
    """
    run_dir = Path(run_dir)
    endpoint = resolve_endpoint(cfg)
    the_plan = plan(run_dir, cfg)  # PublishRefused / PublishError: the caller reports it
    text = render_dry_run(the_plan, endpoint)
    if cfg.dry_run:
        log.info("publish dry run (nothing sent):\n%s", text)
        return {"status": "dry-run", "endpoint": endpoint, **the_plan.as_dict()}
    log.info("publishing:\n%s", text)
    token = resolve_token()
    record = record_path or run_dir / RECORD
    record.unlink(missing_ok=True)  # a record only ever describes verified commits of this push

    def save(results: list[dict], complete: bool = False) -> None:
        _write_json_atomic(record, {"complete": complete, "endpoint": endpoint, "items": results,
                                    "skipped": the_plan.skipped})

    results = push(the_plan, cfg, token=token, on_verified=save, log=log)
    save(results, complete=True)
    for r in results:
        log.info("%s: %s %s", r["name"], r["status"], r["pr_url"] or r["commit_url"])
    return {"status": "pushed", "endpoint": endpoint, "items": results, "skipped": the_plan.skipped}
