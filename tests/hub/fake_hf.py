"""A small Hugging Face Hub on 127.0.0.1 speaking the subset of the API that huggingface_hub's HfApi and
hf_hub_download call: create repo, branch, revision info, preupload (always `regular`, so no Xet/LFS), NDJSON commit
(honouring `parentCommit`), validate-yaml, tree, paths-info, and resolve (HEAD/GET with X-Repo-Commit and ETag)."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import threading
from urllib.parse import unquote, urlsplit

from .local_server import LocalServer, TrackedHandler

REPO = r"(?P<repo>[^/]+/[^/]+)"
_counter = itertools.count(1)


def _new_commit_id() -> str:
    return hashlib.sha1(f"commit-{next(_counter)}".encode()).hexdigest()


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubState:
    def __init__(self, tokens: set[str]):
        self.tokens = tokens  # tokens with write access
        self.repos: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.requests: list[str] = []
        self.connections: set = set()  # open sockets, closed by stop() so keep-alive clients see the server go away
        self.overlong: dict[str, bytes] = {}  # path -> bytes a GET streams instead (no Content-Length): a lying hub
        self.sent: dict[str, int] = {}  # bytes of an `overlong` body written before the client hung up

    def create(self, repo_id: str, private: bool) -> None:
        first = _new_commit_id()
        self.repos[repo_id] = {"private": private, "branches": {"main": first},
                               "commits": {first: {".gitattributes": b"*.safetensors filter=lfs diff=lfs\n"}}}

    def resolve(self, repo_id: str, rev: str) -> str | None:
        repo = self.repos[repo_id]
        if rev in repo["branches"]:
            return repo["branches"][rev]
        if rev in repo["commits"]:
            return rev
        return None

    def tamper(self, repo_id: str, path: str, data: bytes, branch: str = "main") -> None:
        """Change a file's bytes server-side without a new commit (a corrupted or altered hub copy)."""
        repo = self.repos[repo_id]
        repo["commits"][repo["branches"][branch]][path] = data


class Handler(TrackedHandler):
    state: HubState

    # -- helpers --------------------------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, data, headers: dict | None = None) -> None:
        self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str | None, message: str, head: bool = False) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers, head=head)

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[7:] if auth.lower().startswith("bearer ") else None

    def _authorized_write(self) -> bool:
        token = self._token()
        if token not in self.state.tokens:
            self._error(401, None, "Invalid credentials in Authorization header")
            return False
        return True

    def _repo(self, repo_id: str, head: bool = False) -> dict | None:
        repo = self.state.repos.get(repo_id)
        if repo is None or (repo["private"] and self._token() not in self.state.tokens):
            self._error(404, "RepoNotFound", "Repository not found", head=head)
            return None
        return repo

    # -- dispatch -------------------------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        path = unquote(urlsplit(self.path).path)
        self.state.requests.append(f"{method} {path}")
        with self.state.lock:
            if self._token() is not None and self._token() not in self.state.tokens:  # like the Hub: a bad token
                self._body()  # is refused on every request, reads of public repos included
                return self._error(401, None, "Invalid credentials in Authorization header", head=(method == "HEAD"))
            if method == "POST" and path == "/api/repos/create":
                return self._create_repo()
            if method == "POST" and path == "/api/validate-yaml":
                self._body()
                return self._json(200, {"errors": [], "warnings": []})
            routes = [
                ("GET", rf"^/api/models/{REPO}(?:/revision/(?P<rev>.+))?$", self._revision_info),
                ("POST", rf"^/api/models/{REPO}/preupload/(?P<rev>.+)$", self._preupload),
                ("POST", rf"^/api/models/{REPO}/commit/(?P<rev>.+)$", self._commit),
                ("POST", rf"^/api/models/{REPO}/branch/(?P<rev>.+)$", self._branch),
                ("GET", rf"^/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$", self._tree),
                ("POST", rf"^/api/models/{REPO}/paths-info/(?P<rev>.+)$", self._paths_info),
                ("HEAD", rf"^/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", self._resolve),
                ("GET", rf"^/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", self._resolve),
            ]
            for m, pattern, fn in routes:
                match = re.match(pattern, path)
                if m == method and match:
                    return fn(head=(method == "HEAD"), **match.groupdict())
            self._error(404, None, f"no route for {method} {path}", head=(method == "HEAD"))

    # -- endpoints ------------------------------------------------------------------------------------------------
    def _create_repo(self) -> None:
        body = json.loads(self._body() or b"{}")
        if not self._authorized_write():
            return
        repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else f"user/{body['name']}"
        if repo_id in self.state.repos:
            return self._json(409, {"error": "You already created this model repo",
                                    "url": f"http://{self.headers['Host']}/{repo_id}"})
        self.state.create(repo_id, body.get("visibility") == "private" or body.get("private") is True)
        self._json(200, {"url": f"http://{self.headers['Host']}/{repo_id}", "name": repo_id})

    def _revision_info(self, repo: str, rev: str | None, head: bool = False) -> None:
        r = self._repo(repo)
        if r is None:
            return
        sha = self.state.resolve(repo, rev or "main")
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        files = r["commits"][sha]
        self._json(200, {"id": repo, "modelId": repo, "sha": sha, "private": r["private"], "disabled": False,
                         "gated": False, "downloads": 0, "likes": 0, "tags": [],
                         "siblings": [{"rfilename": p} for p in sorted(files)]})

    def _preupload(self, repo: str, rev: str, head: bool = False) -> None:
        body = json.loads(self._body())
        if not self._authorized_write() or self._repo(repo) is None:
            return
        sha = self.state.resolve(repo, rev)
        existing = self.state.repos[repo]["commits"][sha] if sha else {}
        self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                    "oid": git_blob_sha1(existing[f["path"]]) if f["path"] in existing else None}
                                   for f in body["files"]]})

    def _commit(self, repo: str, rev: str, head: bool = False) -> None:
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        if not self._authorized_write() or self._repo(repo) is None:
            return
        r = self.state.repos[repo]
        if rev not in r["branches"]:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        current = r["branches"][rev]
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent and not current.startswith(parent):
            return self._error(412, None, "A commit has happened since. Please refresh and try again.")
        files = dict(r["commits"][current])
        for op in lines[1:]:
            if op["key"] == "file":
                files[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
            elif op["key"] == "deletedFile":
                files.pop(op["value"]["path"], None)
            else:
                return self._error(400, None, f"unsupported operation {op['key']}")
        new = _new_commit_id()
        r["commits"][new] = files
        r["branches"][rev] = new
        self._json(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{new}", "commitOid": new,
                         "success": True})

    def _branch(self, repo: str, rev: str, head: bool = False) -> None:
        self._body()
        if not self._authorized_write() or self._repo(repo) is None:
            return
        r = self.state.repos[repo]
        if rev in r["branches"]:
            return self._error(409, None, "Reference already exists")
        r["branches"][rev] = r["branches"]["main"]
        self._json(200, {})

    def _entries(self, files: dict[str, bytes], paths) -> list[dict]:
        return [{"type": "file", "path": p, "oid": git_blob_sha1(files[p]), "size": len(files[p])} for p in paths]

    def _tree(self, repo: str, rev: str, path: str | None, head: bool = False) -> None:
        if self._repo(repo) is None:
            return
        sha = self.state.resolve(repo, rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        files = self.state.repos[repo]["commits"][sha]
        prefix = (path or "").strip("/")
        chosen = sorted(p for p in files if not prefix or p.startswith(prefix + "/"))
        self._json(200, self._entries(files, chosen))

    def _paths_info(self, repo: str, rev: str, head: bool = False) -> None:
        body = self._body()
        if self._repo(repo) is None:
            return
        sha = self.state.resolve(repo, rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        try:
            wanted = json.loads(body).get("paths", [])
        except json.JSONDecodeError:
            from urllib.parse import parse_qs

            wanted = parse_qs(body.decode()).get("paths", [])
        files = self.state.repos[repo]["commits"][sha]
        self._json(200, self._entries(files, [p for p in wanted if p in files]))

    def _resolve(self, repo: str, rev: str, path: str, head: bool = False) -> None:
        if self._repo(repo, head=head) is None:
            return
        sha = self.state.resolve(repo, rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head=head)
        files = self.state.repos[repo]["commits"][sha]
        if path not in files:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}", head=head)
        data = files[path]
        headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_sha1(data)}"', "Content-Type": "application/octet-stream"}
        if not head and path in self.state.overlong:
            return self._stream_until_hung_up(path, self.state.overlong[path], headers)
        self._send(200, data, {**headers, "Accept-Ranges": "bytes"}, head=head)

    def _stream_until_hung_up(self, path: str, body: bytes, headers: dict) -> None:
        """Send `body` with no Content-Length (delimited by closing the connection), counting what got out."""
        self.send_response(200)
        for k, v in {**headers, "Connection": "close"}.items():
            self.send_header(k, v)
        self.end_headers()
        self.close_connection = True
        self.state.sent[path] = 0
        try:
            for i in range(0, len(body), 1 << 16):
                self.wfile.write(body[i:i + (1 << 16)])
                self.state.sent[path] += len(body[i:i + (1 << 16)])
        except (BrokenPipeError, ConnectionResetError):
            pass


class FakeHub(LocalServer):
    """Start with `FakeHub(tokens={...}).start()`; `.url` is the endpoint; `.stop()` shuts it down."""

    def __init__(self, tokens: set[str]):
        super().__init__(Handler, HubState(tokens))
