"""In-memory storage of the loopback Hub (tests/hubserver.py): repos, branches, commits, LFS, cards.

A commit is a full snapshot {path: Blob}; a branch or PR ref points at a commit.
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
class Repo:
    repo_id: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # "main" or "refs/pr/1" -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> content
    prs: int = 0

    def resolve(self, revision: str) -> Commit | None:
        """A branch name, 'refs/heads/x', 'refs/pr/N' or a (full) commit oid."""
        if revision.startswith("refs/heads/"):
            revision = revision[len("refs/heads/"):]
        oid = self.refs.get(revision, revision)
        return self.commits.get(oid)

    def commit(self, parent: Commit | None, title: str, message: str, files: dict[str, Blob]) -> Commit:
        seed = f"{self.repo_id}{next(_counter)}{time.time_ns()}{title}".encode()
        oid = hashlib.sha1(seed).hexdigest()
        date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
        c = Commit(oid, parent.oid if parent else None, title, message, date, dict(files))
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


def commit_ndjson(repo: Repo, branch: str, lines: list[dict], create_pr: bool,
                  drop: set[str] = frozenset()) -> tuple[Commit, int | None]:
    """Apply a /commit NDJSON payload to a branch (or a new PR ref); returns (commit, PR number)."""
    if not lines or lines[0].get("key") != "header":
        raise HubError(400, "commit payload must start with a header line")
    header = lines[0]["value"]
    if branch not in repo.refs or branch.startswith("refs/"):
        raise HubError(404, f"Invalid rev id: {branch} (commits go to a branch)", "RevisionNotFound")
    base = repo.resolve(branch)
    parent = header.get("parentCommit")
    if parent and not create_pr and not base.oid.startswith(parent):
        raise HubError(412, f"A commit has happened since parent {parent}; {branch} is at {base.oid}")
    files = apply_operations(repo, dict(base.files), lines[1:])
    for path in drop:  # test hook: a Hub that silently loses a file
        files.pop(path, None)
    new = repo.commit(base, header["summary"], header.get("description", ""), files)
    if not create_pr:
        repo.refs[branch] = new.oid
        return new, None
    repo.prs += 1
    repo.refs[f"refs/pr/{repo.prs}"] = new.oid
    return new, repo.prs


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
