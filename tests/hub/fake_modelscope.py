"""A small ModelScope on 127.0.0.1 speaking what the `modelscope` HubApi calls for repo lookup/creation,
upload_folder (LFS batch pre-validation, blob PUT, JSON commit) and download_file; answers use the
`{"Code": 200, "Data": ..., "Success": true}` envelope."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import threading
from urllib.parse import parse_qs, unquote, urlsplit

from .local_server import LocalServer, TrackedHandler

REPO = r"(?P<repo>[^/]+/[^/]+)"
_counter = itertools.count(1)


class MsState:
    def __init__(self, tokens: set[str]):
        self.tokens = tokens
        self.repos: dict[str, dict] = {}  # repo -> {"private": bool, "branches": {name: {path: bytes}}}
        self.blobs: dict[str, bytes] = {}  # LFS store by sha256
        self.commits: list[str] = []
        self.requests: list[str] = []
        self.connections: set = set()
        self.lock = threading.Lock()

    def tamper(self, repo_id: str, path: str, data: bytes, branch: str = "master") -> None:
        self.repos[repo_id]["branches"][branch][path] = data


class Handler(TrackedHandler):
    state: MsState

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _ok(self, data=None) -> None:
        self._send(200, json.dumps({"Code": 200, "Data": data if data is not None else {}, "Message": "success",
                                    "Success": True, "RequestId": "req"}).encode())

    def _fail(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"Code": status, "Message": message, "Success": False,
                                       "RequestId": "req"}).encode())

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        if auth.lower().startswith("bearer "):
            return auth[7:]
        cookie = re.search(r"m_session_id=([^;]+)", self.headers.get("Cookie") or "")
        return cookie.group(1) if cookie else None

    def _readable(self, repo_id: str) -> dict | None:
        repo = self.state.repos.get(repo_id)
        if repo is None or (repo["private"] and self._token() not in self.state.tokens):
            self._fail(404, f"model {repo_id} not exists")
            return None
        return repo

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        path, query = unquote(url.path), {k: v[0] for k, v in parse_qs(url.query).items()}
        self.state.requests.append(f"{method} {path}")
        body = self._body()
        with self.state.lock:
            if self._token() is not None and self._token() not in self.state.tokens:
                return self._fail(401, "Unauthorized: invalid access token")
            routes = [
                ("GET", r"^/api/v1/repos/internalAccelerationInfo$", lambda: self._ok({})),
                ("GET", rf"^/openapi/v1/models/{REPO}$", self._repo_info),
                ("GET", rf"^/api/v1/models/{REPO}$", self._repo_info),
                ("POST", r"^/api/v1/models$", self._create),
                ("POST", rf"^/api/v1/repos/models/{REPO}/info/lfs/objects/batch$", self._lfs_batch),
                ("PUT", r"^/lfs-upload/(?P<oid>[0-9a-f]{64})$", self._lfs_put),
                ("POST", rf"^/api/v1/repos/models/{REPO}/commit/(?P<rev>.+)$", self._commit),
                ("GET", rf"^/api/v1/models/{REPO}/repo/files$", self._files),
                ("GET", rf"^/api/v1/models/{REPO}/repo$", self._download),
                ("HEAD", rf"^/api/v1/models/{REPO}/repo$", self._download),
                ("GET", rf"^/api/v1/models/{REPO}/revisions$", self._revisions),
            ]
            for m, pattern, fn in routes:
                match = re.match(pattern, path)
                if m == method and match:
                    return fn(**match.groupdict(), **({"query": query} if "query" in fn.__code__.co_varnames
                                                       else {}), **({"body": body} if "body" in
                                                                    fn.__code__.co_varnames else {}))
            self._fail(404, f"no route for {method} {path}")

    def _repo_info(self, repo: str) -> None:
        r = self._readable(repo)
        if r is not None:
            owner, name = repo.split("/")
            self._ok({"Id": 1, "Path": owner, "Name": name, "id": repo, "name": name, "owner": owner,
                      "visibility": "private" if r["private"] else "public", "Visibility": 1 if r["private"] else 5})

    def _create(self, body: bytes) -> None:
        if self._token() not in self.state.tokens:
            return self._fail(401, "Unauthorized: login required")
        data = json.loads(body)
        repo_id = f"{data['Path']}/{data['Name']}"
        if repo_id in self.state.repos:
            return self._fail(400, f"model {repo_id} already exists")
        self.state.repos[repo_id] = {"private": data.get("Visibility") == 1, "branches": {"master": {}}}
        self._ok({"Path": data["Path"], "Name": data["Name"]})

    def _lfs_batch(self, repo: str, body: bytes) -> None:
        if self._token() not in self.state.tokens:
            return self._fail(401, "Unauthorized")
        objects = json.loads(body)["objects"]
        host = self.headers["Host"]
        self._ok({"objects": [
            {"oid": o["oid"], "size": o["size"]} if o["oid"] in self.state.blobs else
            {"oid": o["oid"], "size": o["size"], "actions": {"upload": {"href": f"http://{host}/lfs-upload/{o['oid']}"}}}
            for o in objects]})

    def _lfs_put(self, oid: str, body: bytes) -> None:
        if hashlib.sha256(body).hexdigest() != oid:
            return self._fail(400, "sha256 mismatch")
        self.state.blobs[oid] = body
        self._ok({})

    def _commit(self, repo: str, rev: str, body: bytes) -> None:
        if self._token() not in self.state.tokens:
            return self._fail(401, "Unauthorized")
        r = self._readable(repo)
        if r is None:
            return
        payload = json.loads(body)
        files = dict(r["branches"].setdefault(rev, dict(r["branches"]["master"])))
        for action in payload["actions"]:
            if action["action"] == "delete":
                files.pop(action["path"], None)
            elif action["type"] == "lfs":
                if action["sha256"] not in self.state.blobs:
                    return self._fail(400, f"lfs object {action['sha256']} not uploaded")
                files[action["path"]] = self.state.blobs[action["sha256"]]
            else:
                files[action["path"]] = base64.b64decode(action["content"])
        r["branches"][rev] = files
        commit = hashlib.sha1(f"ms-commit-{next(_counter)}".encode()).hexdigest()
        self.state.commits.append(commit)
        self._ok({"CommitId": commit, "CommitMessage": payload["commit_message"]})

    def _branch_files(self, repo: str, query: dict) -> dict | None:
        """The files of the asked revision, or None after answering the error (unreadable repo, unknown revision)."""
        r = self._readable(repo)
        if r is None:
            return None
        files = r["branches"].get(query.get("Revision", "master"))
        if files is None:
            self._fail(404, "revision not exists")
        return files

    def _files(self, repo: str, query: dict) -> None:
        files = self._branch_files(repo, query)
        if files is None:
            return
        self._ok({"Files": [{"Path": p, "Name": p.split("/")[-1], "Size": len(d), "Type": "blob",
                             "Sha256": hashlib.sha256(d).hexdigest()} for p, d in sorted(files.items())]})

    def _download(self, repo: str, query: dict) -> None:
        files = self._branch_files(repo, query)
        if files is None:
            return
        data = files.get(query.get("FilePath", ""))
        if data is None:
            return self._fail(404, f"file {query.get('FilePath')} not exists")
        self._send(200, data, "application/octet-stream")

    def _revisions(self, repo: str) -> None:
        r = self._readable(repo)
        if r is not None:
            self._ok({"RevisionMap": {"Branches": [{"Revision": b} for b in r["branches"]], "Tags": []}})


class FakeModelScope(LocalServer):
    def __init__(self, tokens: set[str]):
        super().__init__(Handler, MsState(tokens))
