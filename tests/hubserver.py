"""A loopback Hub: the HTTP endpoints huggingface_hub 2.4 calls to push and read back a model repo.

    with HubServer(token="hf_...") as hub:        # 127.0.0.1, free port
        HfApi(endpoint=hub.url, token=...).create_repo(...)
        hub.fail_next("lfs_upload", after=1)       # the 2nd LFS upload answers 507
        hub.requests                               # every request: (method, path, kind)

Implemented (model repos): whoami-v2, repos/create, validate-yaml, model info (+/revision/),
preupload, NDJSON commit (base64 files, LFS pointers, deletes, create_pr, parentCommit; to a
branch or to an open PR's refs/pr/N), LFS batch + the upload/verify URLs it hands out, tree
(recursive), paths-info, branch, refs, commits, resolve GET/HEAD with ETag / X-Repo-Commit /
X-Linked-Etag / X-Linked-Size, discussions: the paginated list (type / status / author filters;
pull requests only, since only commits open them here) and one discussion's details (?diff=1).
Every write is made by the token's user, USER.
Set HF_HUB_DISABLE_XET=1 (and huggingface_hub.constants.HF_HUB_DISABLE_XET) in clients:
Xet uploads need a Xet server. Injected failures use status 507, which the client does not
retry, so failure tests stay fast.
"""
from __future__ import annotations

import hashlib
import json
import threading
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from tests.hubstore import (HubError, PullRequest, Repo, commit_ndjson, discussion_details_json, discussion_json,
                            file_entry, model_info_json, new_repo, tree_entries, validate_card)

USER = "loopback"  # whoami of the server's token: the author of every commit and pull request
DISCUSSIONS_PAGE = 50  # the Hub's page size for GET /api/models/{repo}/discussions


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    kind: str
    authorized: bool  # carried the server's token


@dataclass
class _Fault:
    kind: str
    after: int
    times: int
    status: int
    message: str


class HubServer:
    """In-process Hub on 127.0.0.1:<free port>. `token=None` accepts any or no token."""

    def __init__(self, token: str | None = None):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.errors: list[str] = []  # server-side tracebacks (a bug in this server or a test)
        self.echo_auth = False  # misbehave: echo the Authorization header in error bodies
        self.drop_on_next_commit: set[str] = set()  # misbehave: silently drop these paths once
        self.lock = threading.RLock()
        self._faults: list[_Fault] = []
        self._httpd: ThreadingHTTPServer | None = None

    # -- lifecycle
    def __enter__(self) -> HubServer:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self  # type: ignore[attr-defined]
        threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "use HubServer as a context manager"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    # -- test controls
    def fail_next(self, kind: str, *, after: int = 0, times: int = 1, status: int = 507,
                  message: str = "injected failure") -> None:
        """The (after+1)th request of `kind` (and `times`-1 more) answers `status`."""
        with self.lock:
            self._faults.append(_Fault(kind, after, times, status, message))

    def requests_of(self, kind: str) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.kind == kind]

    def head(self, repo_id: str, revision: str = "main") -> str:
        return self.repos[repo_id].resolve(revision).oid

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        out = {}
        for path, blob in repo.resolve(revision).files.items():
            out[path] = blob.data if blob.lfs_oid is None else repo.lfs[blob.lfs_oid]
        return out

    def commit_titles(self, repo_id: str, revision: str = "main") -> list[str]:
        return [c.title for c in self.repos[repo_id].history(revision)]

    def pull_requests(self, repo_id: str) -> list[PullRequest]:
        """Every pull request of the repo, oldest first (the objects themselves: a test may
        set `.status = "closed"` or `.author = ...`)."""
        return sorted(self.repos[repo_id].pulls.values(), key=lambda pr: pr.num)

    def _fault_for(self, kind: str) -> _Fault | None:
        with self.lock:
            for fault in self._faults:
                if fault.kind != kind:
                    continue
                if fault.after > 0:
                    fault.after -= 1
                    return None
                fault.times -= 1
                if fault.times <= 0:
                    self._faults.remove(fault)
                return fault
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "LoopbackHub/1.0"

    def log_message(self, *args) -> None:  # quiet
        pass

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    # -- plumbing
    def do_GET(self):  # noqa: N802
        self._dispatch("GET")

    def do_HEAD(self):  # noqa: N802
        self._dispatch("HEAD")

    def do_POST(self):  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self):  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self):  # noqa: N802
        self._dispatch("DELETE")

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body=b"", headers: dict | None = None, length: int | None = None):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _authorized(self) -> bool:
        token = self.hub.token
        return token is None or self.headers.get("Authorization") == f"Bearer {token}"

    def _require_auth(self) -> None:
        if not self._authorized():
            raise HubError(401, "Invalid credentials in Authorization header")

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        segs = [unquote(s) for s in split.path.split("/")[1:]]
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        body = self._body() if method in ("POST", "PUT") else b""
        try:
            kind, handler, args = _route(method, segs)
            with self.hub.lock:
                self.hub.requests.append(Request(method, split.path, kind,
                                                 self.hub.token is not None and self._authorized()))
            fault = self.hub._fault_for(kind)
            if fault is not None:
                raise HubError(fault.status, f"{fault.message} ({kind})")
            handler(self, *args, query=query, body=body)
        except HubError as err:
            headers = {"X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            body = err.message
            if self.hub.echo_auth:
                body += f" [request had Authorization: {self.headers.get('Authorization')}]"
            self._send(err.status, {"error": body}, headers)
        except Exception:  # a bug here: keep it for the test to see
            self.hub.errors.append(traceback.format_exc())
            self._send(500, {"error": "loopback hub internal error"})

    # -- repos
    def _repo(self, ns: str, name: str, write: bool = False) -> Repo:
        if write:
            self._require_auth()
        repo = self.hub.repos.get(f"{ns}/{name}")
        if repo is None or (repo.private and not self._authorized()):
            raise HubError(404 if repo is None else 401, "Repository not found", "RepoNotFound")
        return repo

    def _commit_at(self, repo: Repo, revision: str):
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def whoami(self, *, query, body):
        self._require_auth()
        self._send(200, {"type": "user", "name": USER, "orgs": [], "auth": {"type": "access_token"}})

    def create_repo(self, *, query, body):
        self._require_auth()
        data = json.loads(body or b"{}")
        if data.get("type", "model") != "model":
            raise HubError(400, "the loopback hub serves model repos only")
        repo_id = f"{data.get('organization') or USER}/{data['name']}"
        with self.hub.lock:
            if repo_id in self.hub.repos:  # the Hub's 409 carries the url; create_repo reads it
                self._send(409, {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo_id}"},
                           {"X-Error-Message": "You already created this model repo"})
                return
            private = data.get("visibility", "public") == "private" or bool(data.get("private"))
            self.hub.repos[repo_id] = new_repo(repo_id, private)
        self._send(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id})

    def validate_yaml(self, *, query, body):
        errors = validate_card(json.loads(body).get("content", ""))
        self._send(400 if errors else 200, {"errors": [{"message": e} for e in errors], "warnings": []})

    def model_info(self, ns, name, revision="main", *, query, body):
        repo = self._repo(ns, name)
        with self.hub.lock:
            info = model_info_json(repo, self._commit_at(repo, revision),
                                   blobs=query.get("blobs", "").lower() in ("1", "true"))
        self._send(200, info)

    def create_branch(self, ns, name, branch, *, query, body):
        repo = self._repo(ns, name, write=True)
        start = json.loads(body or b"{}").get("startingPoint") or "main"
        with self.hub.lock:
            if branch in repo.refs:
                raise HubError(409, "Reference already exists")
            repo.refs[branch] = self._commit_at(repo, start).oid
        self._send(200, {})

    def refs(self, ns, name, *, query, body):
        repo = self._repo(ns, name)
        with self.hub.lock:
            items = sorted(repo.refs.items())
        branches = [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": o}
                    for n, o in items if not n.startswith("refs/")]
        prs = [{"name": n, "ref": n, "targetCommit": o} for n, o in items if n.startswith("refs/pr/")]
        self._send(200, {"branches": branches, "converts": [], "tags": [], "pullRequests": prs})

    def commits(self, ns, name, revision, *, query, body):
        repo = self._repo(ns, name)
        with self.hub.lock:
            history = repo.history(self._commit_at(repo, revision).oid)
        self._send(200, [{"id": c.oid, "title": c.title, "message": c.message, "date": c.date,
                          "authors": [{"user": "loopback", "avatar": ""}]} for c in history])

    # -- discussions (pull requests)
    def discussions(self, ns, name, *, query, body):
        repo = self._repo(ns, name)
        kind, status = query.get("type", "all"), query.get("status", "all")
        if kind not in ("all", "discussion", "pull_request") or status not in ("all", "open", "closed"):
            raise HubError(400, f"invalid type {kind!r} or status {status!r}")
        try:
            page = int(query.get("p", "0"))
        except ValueError:
            raise HubError(400, "p must be an integer") from None
        with self.hub.lock:
            # newest first, as on the Hub; "open" includes drafts, "closed" includes merged
            pulls = [pr for pr in sorted(repo.pulls.values(), key=lambda pr: -pr.num)
                     if kind != "discussion" and (status == "all" or (status == "open") == pr.is_open)
                     and query.get("author") in (None, pr.author)]
            start = page * DISCUSSIONS_PAGE
            listed = [discussion_json(repo, pr) for pr in pulls[start:start + DISCUSSIONS_PAGE]]
            closed = sum(not pr.is_open for pr in repo.pulls.values())
        self._send(200, {"discussions": listed, "count": len(pulls), "start": start,
                         "numClosedDiscussions": closed})

    def discussion(self, ns, name, num, *, query, body):
        repo = self._repo(ns, name)
        with self.hub.lock:
            pr = repo.pulls.get(int(num)) if num.isdigit() else None
            if pr is None:
                raise HubError(404, f"Discussion {num} not found", "DiscussionNotFound")
            details = discussion_details_json(repo, pr)
        self._send(200, details)

    # -- reading files
    def tree(self, ns, name, revision, *path, query, body):
        repo = self._repo(ns, name)
        recursive = query.get("recursive", "").lower() in ("1", "true")
        with self.hub.lock:
            entries = tree_entries(self._commit_at(repo, revision).files, "/".join(path), recursive)
        if entries is None:
            raise HubError(404, f"{'/'.join(path)} does not exist", "EntryNotFound")
        self._send(200, entries)

    def paths_info(self, ns, name, revision, *, query, body):
        repo = self._repo(ns, name)
        form = parse_qs(body.decode())
        with self.hub.lock:
            files = self._commit_at(repo, revision).files
        out = [file_entry(p, files[p]) for p in form.get("paths", []) if p in files]
        out += [{"type": "directory", "path": p, "size": 0, "oid": hashlib.sha1(p.encode()).hexdigest()}
                for p in form.get("paths", []) if p not in files and any(f.startswith(p + "/") for f in files)]
        self._send(200, out)

    def resolve(self, ns, name, revision, *path, query, body):
        repo = self._repo(ns, name)
        with self.hub.lock:
            commit = self._commit_at(repo, revision)
            blob = commit.files.get("/".join(path))
            if blob is None:
                raise HubError(404, "Entry not found", "EntryNotFound")
            data = blob.data if blob.lfs_oid is None else repo.lfs[blob.lfs_oid]
        headers = {"ETag": f'"{blob.etag}"', "X-Repo-Commit": commit.oid,
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if blob.lfs_oid is not None:
            headers.update({"X-Linked-Etag": f'"{blob.lfs_oid}"', "X-Linked-Size": blob.size})
        self._send(200, data, headers, length=len(data))

    # -- uploading
    def preupload(self, ns, name, revision, *, query, body):
        repo = self._repo(ns, name, write=True)
        with self.hub.lock:
            files = self._commit_at(repo, revision).files
            out = []
            for f in json.loads(body)["files"]:
                existing = files.get(f["path"])
                mode = "lfs" if repo.is_lfs(f["path"], f["size"], revision) else "regular"
                oid = None if existing is None else (existing.lfs_oid or existing.oid)
                out.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._send(200, {"files": out, "commitOid": repo.resolve(revision).oid})

    def lfs_batch(self, ns, name, *, query, body):
        repo = self._repo(ns, name.removesuffix(".git"), write=True)
        data = json.loads(body)
        if data.get("operation") != "upload":
            raise HubError(400, "the loopback hub only handles LFS uploads")
        objects = []
        for obj in data["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in repo.lfs:
                href = f"{self.hub.url}/_lfs/{repo.repo_id}/{obj['oid']}"
                entry["actions"] = {"upload": {"href": href, "expires_in": 3600},
                                    "verify": {"href": href + "/verify", "expires_in": 3600}}
            objects.append(entry)
        self._send(200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                   {"Content-Type": "application/vnd.git-lfs+json"})

    def lfs_upload(self, ns, name, oid, *, query, body):
        repo = self.hub.repos.get(f"{ns}/{name}")  # like a presigned URL: no token needed
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, f"uploaded content does not hash to {oid}")
        with self.hub.lock:
            repo.lfs[oid] = body
        self._send(200, b"", {"ETag": f'"{oid}"'})

    def lfs_verify(self, ns, name, oid, *, query, body):
        repo = self._repo(ns, name, write=True)
        data = json.loads(body)
        if data["oid"] != oid or oid not in repo.lfs or len(repo.lfs[oid]) != data["size"]:
            raise HubError(404, f"LFS object {oid} was not uploaded or has the wrong size")
        self._send(200, {})

    def commit(self, ns, name, revision, *, query, body):
        repo = self._repo(ns, name, write=True)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        create_pr = query.get("create_pr") == "1"
        with self.hub.lock:
            new, pr = commit_ndjson(repo, revision, lines, create_pr, USER, drop=self.hub.drop_on_next_commit)
            self.hub.drop_on_next_commit = set()
        self._send(200, {"success": True, "commitOid": new.oid, "hookOutput": "",
                         "commitUrl": f"{self.hub.url}/{repo.repo_id}/commit/{new.oid}",
                         "pullRequestUrl": f"{self.hub.url}/{repo.repo_id}/discussions/{pr.num}" if create_pr else None})


_H = _Handler
_ROUTES: list[tuple[str, tuple, str, object]] = [
    # method, pattern ("*" = one segment, "**" = the rest), kind, handler
    ("GET", ("api", "whoami-v2"), "whoami", _H.whoami),
    ("POST", ("api", "repos", "create"), "create_repo", _H.create_repo),
    ("POST", ("api", "validate-yaml"), "validate_yaml", _H.validate_yaml),
    ("GET", ("api", "models", "*", "*"), "model_info", _H.model_info),
    ("GET", ("api", "models", "*", "*", "revision", "*"), "model_info", _H.model_info),
    ("POST", ("api", "models", "*", "*", "preupload", "*"), "preupload", _H.preupload),
    ("POST", ("api", "models", "*", "*", "commit", "*"), "commit", _H.commit),
    ("GET", ("api", "models", "*", "*", "tree", "*", "**"), "tree", _H.tree),
    ("POST", ("api", "models", "*", "*", "paths-info", "*"), "paths_info", _H.paths_info),
    ("POST", ("api", "models", "*", "*", "branch", "*"), "create_branch", _H.create_branch),
    ("GET", ("api", "models", "*", "*", "refs"), "refs", _H.refs),
    ("GET", ("api", "models", "*", "*", "commits", "*"), "commits", _H.commits),
    ("GET", ("api", "models", "*", "*", "discussions"), "discussions", _H.discussions),
    ("GET", ("api", "models", "*", "*", "discussions", "*"), "discussion", _H.discussion),
    ("POST", ("*", "*", "info", "lfs", "objects", "batch"), "lfs_batch", _H.lfs_batch),
    ("PUT", ("_lfs", "*", "*", "*"), "lfs_upload", _H.lfs_upload),
    ("POST", ("_lfs", "*", "*", "*", "verify"), "lfs_verify", _H.lfs_verify),
    ("GET", ("*", "*", "resolve", "*", "**"), "resolve", _H.resolve),
    ("HEAD", ("*", "*", "resolve", "*", "**"), "resolve", _H.resolve),
]


def _route(method: str, segs: list[str]):
    for m, pattern, kind, handler in _ROUTES:
        if m != method:
            continue
        args, ok = [], True
        for i, part in enumerate(pattern):
            if part == "**":
                args.extend(segs[i:])
                break
            if i >= len(segs) or (part != "*" and part != segs[i]):
                ok = False
                break
            if part == "*":
                args.append(segs[i])
        else:
            ok = ok and len(segs) == len(pattern)
        if ok:
            return kind, handler, args
    raise HubError(404, f"the loopback hub does not implement {method} /{'/'.join(segs)}")
