"""Push planned export folders to the Hub, idempotently, and read every push back.

One Hub commit per export folder: files go up first (LFS), the commit comes last
and is atomic, so an interrupted push leaves the repo as it was and a rerun
finishes it. Nothing local says "pushed" before the commit has been read back
and verified. The token comes from HF_TOKEN or the user's login only, and every
error from huggingface_hub is rethrown as a PublishError scrubbed of it.

With `[publish] create_pr = true` a folder has at most one open pull request at a time:
  * the target branch already holds the folder: "up to date", nothing is written;
  * else the open PRs of the token's user against that branch are listed
    (`get_repo_discussions` + `get_discussion_details`); ours is the one whose description
    carries this folder's marker line (`compress-publish-target: <branch>:/<folder>`);
    if one of them (or a PR from before the marker existed: same title, no marker) already
    holds the folder, it is "up to date (open pull request #N)", nothing is written;
  * else the folder's changes become one commit onto our open PR's `refs/pr/N`
    (`create_commit(revision="refs/pr/N")`, guarded by `parent_commit`): "pull request updated";
  * else (no open PR of ours: none yet, or it was merged or closed) one commit opens a new PR.
The read-back then checks that `refs/pr/N` points at the verified commit. PRs of other
users, closed or merged PRs and PRs for another branch or folder are never written to.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, ModelCard, get_token
from huggingface_hub.community import DiscussionComment
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils.sha import git_hash

from pipeline.base.errors import PublishError
from pipeline.base.fileio import atomic_write_json
from pipeline.publish.config import PublishConfig, check_endpoint, summary
from pipeline.publish.plan import LocalFile, Plan, PushItem, human, plan, render_dry_run
from pipeline.results.publishing import PublishRefused
from pipeline.results.schema import PublishSection

__all__ = ["plan", "render_dry_run", "push", "publish_run", "resolve_token", "resolve_endpoint",
           "scrub", "PublishRefused", "PushItem", "Plan"]

DEFAULT_ENDPOINT = "https://huggingface.co"
RECORD = Path("publish") / "pushed.json"
_TOKEN_LIKE = re.compile(r"\bhf_[A-Za-z0-9]{8,}")
T = TypeVar("T")
_CARD_KEYS = ("base_model", "base_model_relation", "tags", "library_name", "license", "datasets")
PR_MARKER = "compress-publish-target"  # the line in a PR description naming the folder it carries


# ---------------------------------------------------------------- token and errors


def scrub(text: str, token: str | None) -> str:
    """Remove the token (and anything shaped like a Hub token) from text."""
    if token:
        text = text.replace(token, "<token>")
    return _TOKEN_LIKE.sub("hf_<redacted>", text)


def _explain(err: BaseException | None) -> str:
    """'Type: message' for err and the exceptions it was raised from (huggingface_hub wraps)."""
    parts: list[str] = []
    seen: set[int] = set()
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
    token = hub_call("reading the Hugging Face token", None, get_token)
    if not token:
        raise PublishError("no Hugging Face token: set HF_TOKEN or run `hf auth login` "
                           "(`huggingface-cli login`) before publishing")
    return token


def resolve_endpoint(cfg: PublishConfig) -> str:
    if cfg.endpoint:
        return cfg.endpoint
    try:
        return check_endpoint(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT, "HF_ENDPOINT")
    except ValueError as e:
        raise PublishError(str(e)) from None


# ---------------------------------------------------------------- comparing trees


def _remote_files(api, item: PushItem, revision: str) -> dict:
    tree = api.list_repo_tree(item.repo_id, revision=revision, recursive=True)
    return {f.path: f for f in tree if isinstance(f, RepoFile) and item.in_scope(f.path)}


def _same(local: LocalFile, remote) -> bool:
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
    local = {f.relpath for f in item.files}
    checks = [(name, fn) for name, fn in (("config.json", _check_config), ("README.md", _check_card))
              if name in local]  # a GGUF folder has no config.json: its .gguf's bytes were verified above
    with tempfile.TemporaryDirectory(prefix="compress-readback-") as tmp:
        for name, fn in checks:
            got = hub_call(f"downloading {item.remote_path(name)} from {where}", token, api.hf_hub_download,
                           item.repo_id, item.remote_path(name), revision=oid, cache_dir=tmp)
            hub_call(f"checking {name} read back from {where}", token, fn, item, got)
    return [{"path": item.remote_path(f.relpath), "size": f.size, "sha256": f.sha256,
             "lfs": remote[item.remote_path(f.relpath)].lfs is not None} for f in item.files]


def verify_pr_ref(api, item: PushItem, pr: OpenPR, oid: str, token: str | None) -> None:
    """The pull request's ref points at the commit that was (or will be) read back."""
    at = hub_call(f"reading back {item.repo_id}@{pr.ref}", token, api.repo_info,
                  item.repo_id, revision=pr.ref).sha
    if at != oid:
        raise PublishError(f"read-back of {item.repo_id}: pull request #{pr.num} ({pr.ref}) is at "
                           f"commit {str(at)[:12]}, not at the pushed commit {oid[:12]}")


# ---------------------------------------------------------------- pull requests


@dataclass(frozen=True)
class OpenPR:
    num: int
    url: str
    marked: bool = True  # carries this folder's marker; False: a pre-marker PR matched by title

    @property
    def ref(self) -> str:
        return f"refs/pr/{self.num}"


def pr_marker(item: PushItem) -> str:
    return f"{PR_MARKER}: {item.revision}:/{item.path_in_repo}"


def pr_description(item: PushItem) -> str:
    return (f"Export folder `{item.name}` ({item.kind}) pushed by compress. While this pull request "
            "is open, later pushes of this folder add their commits here instead of opening another "
            f"one.\n\n{pr_marker(item)}\n")


def open_prs(api, item: PushItem, token: str | None) -> list[OpenPR]:
    """The token user's open PRs against item.revision for this folder: marked ones first, then
    pre-marker ones with the item's commit title, newest first within each."""
    me = hub_call("reading the token's user (whoami)", token, api.whoami, cache=True)["name"]
    listed = hub_call(f"listing pull requests of {item.repo_id}", token, lambda: list(api.get_repo_discussions(
        item.repo_id, author=me, discussion_type="pull_request")))
    marked, legacy = [], []
    for d in sorted(listed, key=lambda d: -d.num):
        if not d.is_pull_request or d.status not in ("open", "draft") or d.author != me:
            continue
        details = hub_call(f"reading pull request #{d.num} of {item.repo_id}", token,
                           api.get_discussion_details, item.repo_id, d.num)
        if details.target_branch not in (item.revision, f"refs/heads/{item.revision}"):
            continue
        description = next((e.content for e in details.events if isinstance(e, DiscussionComment)), "")
        lines = [line.strip() for line in description.splitlines()]
        if pr_marker(item) in lines:
            marked.append(OpenPR(d.num, d.url))
        elif not any(line.startswith(PR_MARKER + ":") for line in lines) and d.title == item.commit_message:
            legacy.append(OpenPR(d.num, d.url, marked=False))
    return marked + legacy


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
    ops = []
    for f in changed:
        op = CommitOperationAdd(path_in_repo=item.remote_path(f.relpath), path_or_fileobj=str(f.path))
        op.upload_info.sha256 = bytes.fromhex(f.sha256)  # verified against the manifest in plan()
        ops.append(op)
    return ops + [CommitOperationDelete(path_in_repo=p) for p in stale]


def _log_upload(log: logging.Logger, item: PushItem, changed: list[LocalFile], stale: list[str],
                where: str) -> None:
    log.info("%s: uploading %d file(s) (%s), deleting %d, to %s", item.name, len(changed),
             human(sum(f.size for f in changed)), len(stale), where)


def _push_pr(api, item: PushItem, head: str, changed: list[LocalFile], stale: list[str], token: str,
             log: logging.Logger) -> tuple[str, str, OpenPR]:
    """create_pr: find our open PR for this folder, else open one. Returns (status, oid, PR)."""
    onto = None  # (PR, its head, changed, stale): the newest marked PR, if none is up to date
    for pr in open_prs(api, item, token):
        pr_head = hub_call(f"reading {item.repo_id}@{pr.ref}", token, api.repo_info,
                           item.repo_id, revision=pr.ref).sha
        pr_changed, pr_stale = diff(item, hub_call(f"listing {item.repo_id}@{pr.ref}", token,
                                                   _remote_files, api, item, pr_head))
        if not pr_changed and not pr_stale:
            log.info("%s: %s@%s is up to date (open pull request #%d) at commit %s: %s", item.name,
                     item.repo_id, item.revision, pr.num, pr_head[:12], pr.url)
            return "up to date", pr_head, pr
        if pr.marked and onto is None:
            onto = (pr, pr_head, pr_changed, pr_stale)
    if onto is not None:
        pr, pr_head, changed, stale = onto
        _log_upload(log, item, changed, stale, f"open pull request #{pr.num} ({item.repo_id}@{pr.ref})")
        info = hub_call(
            f"pushing {item.name} onto pull request #{pr.num} of {item.repo_id}", token, api.create_commit,
            item.repo_id, _operations(item, changed, stale), commit_message=item.commit_message,
            commit_description=pr_description(item), revision=pr.ref, parent_commit=pr_head)
        return "pull request updated", info.oid, pr
    _log_upload(log, item, changed, stale, f"a new pull request against {item.repo_id}@{item.revision}")
    info = hub_call(
        f"opening a pull request for {item.name} against {item.repo_id}@{item.revision}", token,
        api.create_commit, item.repo_id, _operations(item, changed, stale),
        commit_message=item.commit_message, commit_description=pr_description(item),
        revision=item.revision, create_pr=True, parent_commit=head)
    if info.pr_num is None:
        raise PublishError(f"pushing {item.name} to {item.repo_id}: the Hub opened no pull request "
                           f"(commit {info.oid[:12]})")
    return "pull request", info.oid, OpenPR(info.pr_num, info.pr_url)


def _push_item(api, item: PushItem, cfg: PublishConfig, token: str, log: logging.Logger) -> dict:
    head = _prepare_target(api, item, cfg, token)
    remote = hub_call(f"listing {item.repo_id}@{item.revision}", token, _remote_files, api, item, head)
    changed, stale = diff(item, remote)
    pr = None
    if not changed and not stale:
        status, oid = "up to date", head
        log.info("%s: %s@%s is up to date (commit %s)", item.name, item.repo_id, item.revision, head[:12])
    elif cfg.create_pr:
        status, oid, pr = _push_pr(api, item, head, changed, stale, token, log)
    else:
        _log_upload(log, item, changed, stale, f"{item.repo_id}@{item.revision}")
        info = hub_call(
            f"pushing {item.name} to {item.repo_id}@{item.revision}", token, api.create_commit,
            item.repo_id, _operations(item, changed, stale), commit_message=item.commit_message,
            revision=item.revision, parent_commit=head)
        status, oid = "pushed", info.oid
    if pr is not None:
        verify_pr_ref(api, item, pr, oid, token)
    files = verify_remote(api, item, oid, token)
    return {"name": item.name, "kind": item.kind, "repo_id": item.repo_id, "revision": item.revision,
            "path_in_repo": item.path_in_repo, "status": status, "commit_oid": oid,
            "commit_url": f"{api.endpoint}/{item.repo_id}/commit/{oid}",
            "pr_url": pr.url if pr else None, "pr_num": pr.num if pr else None, "files": files}


def describe(result: dict) -> str:
    """One line for a pushed item: what happened and where to look."""
    num = result.get("pr_num")
    if num is None:
        return f"{result['status']} {result['commit_url']}"
    what = {"up to date": f"up to date (open pull request #{num})", "pull request": f"opened pull request #{num}",
            "pull request updated": f"updated pull request #{num}"}.get(result["status"], result["status"])
    return f"{what} {result['pr_url']}"


def push(items: Plan | list[PushItem], cfg: PublishConfig, token: str | None = None,
         on_verified: Callable[[list[dict]], None] | None = None,
         log: logging.Logger | None = None) -> list[dict]:
    """Push each item as one commit (or none when up to date) and verify it by reading it back.

    `on_verified(results_so_far)` is called only after an item's commit is read back and verified.
    """
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


def publish_run(run_dir: Path, cfg: PublishConfig, log: logging.Logger,
                record_path: Path | None = None) -> PublishSection:
    """Plan, then dry-run or push; returns the report's `publish` section (the caller records it).

    Raises PublishRefused (a PublishError; `.section` holds the refusal for the report)
    when the publish rule forbids publishing, PublishError for anything else.
    """
    run_dir = Path(run_dir)
    endpoint = resolve_endpoint(cfg)
    the_plan = plan(run_dir, cfg)  # PublishRefused / PublishError: the caller reports it

    text = render_dry_run(the_plan, endpoint) + "\n" + summary(cfg)
    planned = the_plan.as_dict()
    if cfg.dry_run:
        log.info("publish dry run (nothing sent):\n%s", text)
        return PublishSection(status="dry-run", endpoint=endpoint, run_id=the_plan.run_id, **planned)
    log.info("publishing:\n%s", text)
    token = resolve_token()
    record = record_path or run_dir / RECORD
    record.unlink(missing_ok=True)  # a record only ever describes verified commits of this push

    def save(results: list[dict], complete: bool = False) -> None:
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(record, {"complete": complete, "endpoint": endpoint, "run_id": the_plan.run_id,
                                   "items": results, "skipped": the_plan.skipped})

    results = push(the_plan, cfg, token=token, on_verified=save, log=log)
    save(results, complete=True)
    for r in results:
        log.info("%s: %s", r["name"], describe(r))
    return PublishSection(status="pushed", endpoint=endpoint, items=results, skipped=the_plan.skipped,
                          run_id=the_plan.run_id)
