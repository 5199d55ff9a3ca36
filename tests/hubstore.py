"""In-memory storage of the loopback Hub (tests/hubserver.py): repos, branches, commits, LFS, cards,
pull requests.

A commit is a full snapshot {path: Blob}; a branch or PR ref points at a commit. A pull request
(`PullRequest`) is the discussion behind `refs/pr/N`: title, description, author, base branch, status.
Plain data and plain functions; the HTTP handler holds the lock around them.
"""
from __future__ import annotations

import base64
import fnmatch
import hashlib
import itertools
import time
from dataclasses import dataclass, field

import yaml

LFS_THRESHOLD = 10 * 1000 * 1000  # the Hub stores bigger files in LFS whatever .gitattributes says
GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.onnx",
                    "*.h5", "*.msgpack", "*.model", "*.npz", "*.zip", "*.tar.gz", "*tfevents*")
).encode()
_counter = itertools.count(1)
_RELATIONS = {"adapter", "merge", "quantized", "finetune"}


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


@dataclass(frozen=True)
class Blob:
    size: int
    data: bytes | None = None  # regular file content
    lfs_oid: str | None = None  # sha256 of an LFS object

    @property
    def oid(self) -> str:  # git blob id (of the pointer, for LFS files)
        if self.lfs_oid is None:
            return git_oid(self.data or b"")
        return git_oid(lfs_pointer(self.lfs_oid, self.size))

    @property
    def etag(self) -> str:
        return self.lfs_oid or self.oid


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    message: str
    date: str
    files: dict[str, Blob]


@dataclass
class PullRequest:
    """A Hub pull request: the discussion `num` whose commits live on `refs/pr/{num}`."""

    num: int
    title: str
    description: str
    author: str
    base: str  # the branch it targets, e.g. "main"
    created_at: str
    status: str = "open"  # "open" | "draft" | "closed" | "merged"
    events: list[dict] = field(default_factory=list)  # Hub discussion events, oldest first

    @property
    def ref(self) -> str:
        return f"refs/pr/{self.num}"

    @property
    def is_open(self) -> bool:
        return self.status in ("open", "draft")


@dataclass
class Repo:
    repo_id: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # "main" or "refs/pr/1" -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> content
    pulls: dict[int, PullRequest] = field(default_factory=dict)  # discussion number -> PR

    def resolve(self, revision: str) -> Commit | None:
        """A branch name, 'refs/heads/x', 'refs/pr/N' or a (full) commit oid."""
        if revision.startswith("refs/heads/"):
            revision = revision[len("refs/heads/"):]
        oid = self.refs.get(revision, revision)
        return self.commits.get(oid)

    def commit(self, parent: Commit | None, title: str, message: str, files: dict[str, Blob]) -> Commit:
        seed = f"{self.repo_id}{next(_counter)}{time.time_ns()}{title}".encode()
        oid = hashlib.sha1(seed).hexdigest()
        c = Commit(oid, parent.oid if parent else None, title, message, _now(), dict(files))
        self.commits[oid] = c
        return c

    def history(self, revision: str) -> list[Commit]:
        out, c = [], self.resolve(revision)
        while c is not None:
            out.append(c)
            c = self.commits.get(c.parent) if c.parent else None
        return out

    def is_lfs(self, path: str, size: int, revision: str) -> bool:
        head = self.resolve(revision)
        attributes = head.files.get(".gitattributes") if head else None
        text = (attributes.data or b"").decode() if attributes else ""
        patterns = [line.split()[0] for line in text.splitlines()
                    if "filter=lfs" in line and line.split()]
        name = path.rsplit("/", 1)[-1]
        return size >= LFS_THRESHOLD or any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(path, p)
                                            for p in patterns)


def new_repo(repo_id: str, private: bool) -> Repo:
    repo = Repo(repo_id, private)
    first = repo.commit(None, "initial commit", "", {".gitattributes": Blob(len(GITATTRIBUTES), GITATTRIBUTES)})
    repo.refs["main"] = first.oid
    return repo


def tree_entries(files: dict[str, Blob], prefix: str, recursive: bool) -> list[dict] | None:
    """Hub /tree JSON for the folder `prefix` ('' = root); None if the folder does not exist."""
    base = prefix.strip("/") + "/" if prefix.strip("/") else ""
    entries: dict[str, dict] = {}
    for path, blob in sorted(files.items()):
        if not path.startswith(base):
            continue
        parts = path[len(base):].split("/")
        for depth in range(1, len(parts)):
            folder = base + "/".join(parts[:depth])
            if recursive or depth == 1:
                entries.setdefault(folder, {"type": "directory", "path": folder, "size": 0,
                                            "oid": hashlib.sha1(folder.encode()).hexdigest()})
        if recursive or len(parts) == 1:
            entries[path] = file_entry(path, blob)
    if base and not entries:
        return None
    return list(entries.values())


def file_entry(path: str, blob: Blob) -> dict:
    entry = {"type": "file", "path": path, "size": blob.size, "oid": blob.oid}
    if blob.lfs_oid is not None:
        entry["lfs"] = {"oid": blob.lfs_oid, "size": blob.size,
                        "pointerSize": len(lfs_pointer(blob.lfs_oid, blob.size))}
    return entry


def sibling(path: str, blob: Blob, with_blobs: bool) -> dict:
    out: dict = {"rfilename": path}
    if with_blobs:
        out.update(size=blob.size, blobId=blob.oid)
        if blob.lfs_oid is not None:
            out["lfs"] = {"sha256": blob.lfs_oid, "size": blob.size,
                          "pointerSize": len(lfs_pointer(blob.lfs_oid, blob.size))}
    return out


def card_metadata(text: str) -> dict:
    """YAML front matter of a README.md; {} when there is none."""
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        raise HubError(400, "README.md metadata block is not closed by '---'")
    data = yaml.safe_load(text[3:end]) or {}
    if not isinstance(data, dict):
        raise HubError(400, "README.md metadata must be a YAML mapping")
    return data


def validate_card(content: str) -> list[str]:
    try:
        meta = card_metadata(content)
    except (HubError, yaml.YAMLError) as err:
        return [f"Invalid YAML in README.md metadata: {err}"]
    errors = []
    if "base_model_relation" in meta and meta["base_model_relation"] not in _RELATIONS:
        errors.append(f'"base_model_relation" must be one of {sorted(_RELATIONS)}')
    for key in ("tags", "datasets"):
        if key in meta and not (isinstance(meta[key], (list, str))):
            errors.append(f'"{key}" must be a string or a list of strings')
    if "license" in meta and not isinstance(meta["license"], str):
        errors.append('"license" must be a string')
    return errors


def apply_operations(repo: Repo, files: dict[str, Blob], operations: list[dict]) -> dict[str, Blob]:
    for op in operations:
        key, value = op["key"], op["value"]
        path = value["path"]
        if key == "file":
            data = base64.b64decode(value["content"])
            files[path] = Blob(len(data), data=data)
        elif key == "lfsFile":
            if value["oid"] not in repo.lfs:
                raise HubError(422, f"LFS pointer {path} points to {value['oid']}, which was never uploaded")
            files[path] = Blob(len(repo.lfs[value["oid"]]), lfs_oid=value["oid"])
        elif key == "deletedFile":
            if files.pop(path, None) is None:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        elif key == "deletedFolder":
            for p in [p for p in files if p.startswith(path.rstrip("/") + "/")]:
                del files[p]
        else:
            raise HubError(400, f"unknown commit operation {key!r}")
    return files


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


def _user(name: str) -> dict:
    return {"name": name, "fullname": name, "type": "user", "avatarUrl": "", "isPro": False}


def _event(kind: str, author: str, data: dict) -> dict:
    seed = f"{kind}{author}{next(_counter)}{time.time_ns()}".encode()
    return {"id": hashlib.sha1(seed).hexdigest()[:24], "type": kind, "author": _user(author),
            "createdAt": _now(), "data": data}


def _comment(author: str, text: str) -> dict:
    latest = {"raw": text, "html": f"<p>{text}</p>", "updatedAt": _now(), "author": _user(author)}
    return _event("comment", author, {"edited": False, "hidden": False, "latest": latest,
                                      "numEdits": 0, "editors": [author], "reactions": [],
                                      "isReport": False})


def open_pull_request(repo: Repo, base: str, commit: Commit, author: str, description: str) -> PullRequest:
    """A new PR against `base` whose head is `commit` (the Hub numbers PRs and discussions together)."""
    num = max(repo.pulls, default=0) + 1
    pr = PullRequest(num, commit.title, description, author, base, _now())
    pr.events += [_comment(author, description), _event("commit", author, {"subject": commit.title,
                                                                            "oid": commit.oid})]
    repo.pulls[num] = pr
    repo.refs[pr.ref] = commit.oid
    return pr


def pull_request_for_ref(repo: Repo, revision: str) -> PullRequest | None:
    if not revision.startswith("refs/pr/") or not revision[len("refs/pr/"):].isdigit():
        return None
    return repo.pulls.get(int(revision[len("refs/pr/"):]))


def commit_ndjson(repo: Repo, revision: str, lines: list[dict], create_pr: bool, author: str,
                  drop: set[str] = frozenset()) -> tuple[Commit, PullRequest | None]:
    """Apply a /commit NDJSON payload to a branch, to an open PR's `refs/pr/N`, or to a new PR
    against a branch; returns (commit, the PR it opened or went onto)."""
    if not lines or lines[0].get("key") != "header":
        raise HubError(400, "commit payload must start with a header line")
    header = lines[0]["value"]
    pr = pull_request_for_ref(repo, revision)
    if pr is not None:
        if create_pr:
            raise HubError(400, f"cannot open a pull request from {revision}: it is a pull request ref")
        if not pr.is_open:
            raise HubError(403, f"pull request #{pr.num} is {pr.status}: it accepts no more commits")
    elif revision not in repo.refs or revision.startswith("refs/"):
        raise HubError(404, f"Invalid rev id: {revision} (commits go to a branch or an open PR)",
                       "RevisionNotFound")
    base = repo.resolve(revision)
    parent = header.get("parentCommit")
    if parent:
        found = [oid for oid in repo.commits if oid.startswith(parent)]
        if not found:
            raise HubError(404, f"parent commit {parent} not found", "RevisionNotFound")
        if create_pr:  # the PR starts from parentCommit
            base = repo.commits[found[0]]
        elif not base.oid.startswith(parent):
            raise HubError(412, f"A commit has happened since parent {parent}; {revision} is at {base.oid}")
    files = apply_operations(repo, dict(base.files), lines[1:])
    for path in drop:  # test hook: a Hub that silently loses a file
        files.pop(path, None)
    new = repo.commit(base, header["summary"], header.get("description", ""), files)
    if create_pr:
        return new, open_pull_request(repo, revision, new, author, header.get("description", ""))
    repo.refs[revision] = new.oid
    if pr is not None:
        pr.events.append(_event("commit", author, {"subject": new.title, "oid": new.oid}))
    return new, pr


def discussion_json(repo: Repo, pr: PullRequest) -> dict:
    """One entry of GET /api/models/{repo}/discussions."""
    return {"num": pr.num, "title": pr.title, "status": pr.status, "createdAt": pr.created_at,
            "author": _user(pr.author), "repo": {"name": repo.repo_id, "type": "model"},
            "isPullRequest": True, "pinned": False, "topReactions": [], "numReactionUsers": 0,
            "numComments": sum(e["type"] == "comment" for e in pr.events)}


def discussion_details_json(repo: Repo, pr: PullRequest) -> dict:
    """GET /api/models/{repo}/discussions/{num}?diff=1."""
    head, base = repo.resolve(pr.ref), repo.resolve(pr.base)
    before, after = (base.files if base else {}), (head.files if head else {})
    changed = sorted(p for p in set(before) | set(after)
                     if p not in before or p not in after or before[p].oid != after[p].oid)
    changes = {"base": f"refs/heads/{pr.base}"}
    if pr.status == "merged":
        changes["mergeCommitId"] = repo.refs.get(pr.base)
    return {**discussion_json(repo, pr), "events": list(pr.events), "changes": changes,
            "filesWithConflicts": [], "diff": "".join(f"diff --git a/{p} b/{p}\n" for p in changed)}


def model_info_json(repo: Repo, commit: Commit, blobs: bool) -> dict:
    """GET /api/models/{repo}[/revision/{rev}] at one commit."""
    readme = commit.files.get("README.md")
    card = card_metadata((readme.data or b"").decode()) if readme and readme.data else {}
    return {
        "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24], "id": repo.repo_id,
        "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": commit.oid,
        "lastModified": commit.date, "createdAt": repo.history(commit.oid)[-1].date,
        "private": repo.private, "disabled": False, "gated": False, "downloads": 0, "likes": 0,
        "tags": card.get("tags") or [], "library_name": card.get("library_name"), "cardData": card,
        "siblings": [sibling(p, b, blobs) for p, b in sorted(commit.files.items())],
        "spaces": [], "usedStorage": sum(b.size for b in commit.files.values())}
