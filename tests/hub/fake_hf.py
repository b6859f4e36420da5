"""A small Hugging Face Hub on 127.0.0.1 speaking the subset of the API that huggingface_hub's HfApi and
hf_hub_download call: create repo, branch, revision info, preupload, NDJSON commit (honouring `parentCommit`),
validate-yaml, tree, paths-info, and resolve (HEAD/GET with X-Repo-Commit and ETag).

Binary files take the path they take on the real Hub (with HF_HUB_DISABLE_XET=1; Xet storage is not faked): preupload
answers `lfs` for paths the repo's .gitattributes tracks with LFS and for samples with a NUL byte; the client asks
`POST {repo}.git/info/lfs/objects/batch` where to put each object, PUTs it to the returned (pre-signed) href and
confirms it at the `verify` href; the commit then carries an `lfsFile` line (oid, size), and a regular `file` line for
such a path is refused. Downloads of LFS files are answered with a 302 to a "CDN" on another host name (`localhost`
instead of `127.0.0.1`, same port) carrying X-Linked-Etag (the sha256) and X-Linked-Size, as the Hub does; the client
must not send its token there. Commits keep every file's content; LFS objects live in `HubState.lfs_objects` by
sha256, which is what the CDN serves."""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import hmac
import itertools
import json
import re
import threading
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

from .local_server import LocalServer, TrackedHandler

REPO = r"(?P<repo>[^/]+/[^/]+)"
LFS_REPO = r"(?P<repo>[^/]+/[^/]+?)\.git/info/lfs/objects"
CDN_HOST = "localhost"  # the other loopback name: another origin for the client, the same server for us
_counter = itertools.count(1)


def _new_commit_id() -> str:
    return hashlib.sha1(f"commit-{next(_counter)}".encode()).hexdigest()


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The git-lfs pointer file git stores in place of an LFS-tracked file."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256_hex(data)}\nsize {len(data)}\n".encode()


def is_lfs(files: dict[str, bytes], path: str, sample: bytes) -> bool:
    """Whether the Hub stores `path` with LFS: its .gitattributes (at this revision) tracks it, or it looks binary."""
    patterns = [line.split()[0] for line in files.get(".gitattributes", b"").decode().splitlines()
                if "filter=lfs" in line.split()[1:]]
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(name if "/" not in pat else path, pat) for pat in patterns) or b"\0" in sample


class HubState:
    def __init__(self, tokens: set[str]):
        self.tokens = tokens  # tokens with write access
        self.repos: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.requests: list[str] = []
        self.connections: set = set()  # open sockets, closed by stop() so keep-alive clients see the server go away
        self.overlong: dict[str, bytes] = {}  # path -> bytes a GET streams instead (no Content-Length): a lying hub
        self.sent: dict[str, int] = {}  # bytes of an `overlong` body written before the client hung up
        self.lfs_objects: dict[str, bytes] = {}  # sha256 hex -> object bytes (the LFS store the CDN serves)
        self.cdn_requests: list[tuple[str, str, bool]] = []  # (method, path, sent an Authorization header)
        self.commit_lines: list[dict] = []  # every NDJSON operation line of every commit, in order
        self.validated_yaml: list[str] = []  # README contents posted to /api/validate-yaml
        self.secret = hashlib.sha256(f"cdn-{id(self)}".encode()).digest()  # signs CDN and upload URLs

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
        """Change a file's bytes server-side without a new commit (an altered hub copy): its pointer, size and hashes
        change with it, and an LFS file's new object is stored for the CDN."""
        repo = self.repos[repo_id]
        files = repo["commits"][repo["branches"][branch]]
        files[path] = data
        if is_lfs(files, path, data[:512]):
            self.lfs_objects[sha256_hex(data)] = data

    def corrupt_lfs_object(self, repo_id: str, path: str, data: bytes, branch: str = "main") -> None:
        """Replace the bytes the CDN serves for an LFS file while the Hub still announces the committed sha256 and
        size (a corrupted storage object: the client does not hash what it downloads)."""
        repo = self.repos[repo_id]
        self.lfs_objects[sha256_hex(repo["commits"][repo["branches"][branch]][path])] = data

    def sign(self, what: str) -> str:
        return hmac.new(self.secret, what.encode(), hashlib.sha256).hexdigest()[:32]


class Handler(TrackedHandler):
    state: HubState

    # -- helpers --------------------------------------------------------------------------------------------------
    def _body(self) -> bytes:
        """The request body, by Content-Length or chunked transfer encoding (how httpx streams a file object)."""
        if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
            return super()._body()
        chunks = []
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(chunks)
            chunks.append(self.rfile.read(size))
            self.rfile.readline()  # the CRLF after each chunk

    def _host(self) -> str:
        return (self.headers.get("Host") or "").rsplit(":", 1)[0]

    def _cdn_url(self, kind: str, oid: str, path: str = "") -> str:
        """A pre-signed URL on the CDN host: /{kind}/{oid}[/{repo path}]?sig=…"""
        port = self.server.server_address[1]
        tail = f"/{quote(path)}" if path else ""
        return f"http://{CDN_HOST}:{port}/{kind}/{oid}{tail}?sig={self.state.sign(f'{kind}/{oid}')}"

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

    def do_PUT(self) -> None:
        self._route("PUT")

    def _route(self, method: str) -> None:
        path = unquote(urlsplit(self.path).path)
        if self._host() == CDN_HOST:
            self.state.requests.append(f"CDN {method} {path}")
            self.state.cdn_requests.append((method, path, "Authorization" in self.headers))
            with self.state.lock:
                return self._cdn(method, path)
        self.state.requests.append(f"{method} {path}")
        with self.state.lock:
            if self._token() is not None and self._token() not in self.state.tokens:  # like the Hub: a bad token
                self._body()  # is refused on every request, reads of public repos included
                return self._error(401, None, "Invalid credentials in Authorization header", head=(method == "HEAD"))
            if method == "POST" and path == "/api/repos/create":
                return self._create_repo()
            if method == "POST" and path == "/api/validate-yaml":
                return self._validate_yaml()
            routes = [
                ("POST", rf"^/{LFS_REPO}/batch$", self._lfs_batch),
                ("POST", rf"^/{LFS_REPO}/verify$", self._lfs_verify),
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
        answer = []
        for f in body["files"]:
            lfs = is_lfs(existing, f["path"], base64.b64decode(f["sample"]))
            old = existing.get(f["path"])  # the oid the client compares to skip unchanged files: sha256 for LFS
            oid = None if old is None else sha256_hex(old) if lfs else git_blob_sha1(old)
            answer.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                           "oid": oid})
        self._json(200, {"files": answer})

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
        self.state.commit_lines.extend(lines[1:])
        for op in lines[1:]:
            value = op["value"]
            if op["key"] == "file":
                data = base64.b64decode(value["content"])
                if is_lfs(files, value["path"], data[:512]):
                    return self._error(400, None, f"Your push was rejected because it contains binary files "
                                                  f"({value['path']}): store them with LFS")
                files[value["path"]] = data
            elif op["key"] == "lfsFile":
                data = self.state.lfs_objects.get(value["oid"])
                if value.get("algo") != "sha256" or data is None or len(data) != value["size"]:
                    return self._error(400, None, f"Your push was rejected because an LFS pointer pointed to a file "
                                                  f"that does not exist ({value['path']})")
                files[value["path"]] = data
            elif op["key"] == "deletedFile":
                files.pop(value["path"], None)
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
        entries = []
        for p in paths:
            data = files[p]
            if is_lfs(files, p, data[:512]):  # git holds the pointer; size and lfs describe the object
                pointer = lfs_pointer(data)
                entries.append({"type": "file", "path": p, "oid": git_blob_sha1(pointer), "size": len(data),
                                "lfs": {"oid": sha256_hex(data), "size": len(data), "pointerSize": len(pointer)}})
            else:
                entries.append({"type": "file", "path": p, "oid": git_blob_sha1(data), "size": len(data)})
        return entries

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
        if is_lfs(files, path, data[:512]):  # the Hub's answer for an LFS file: a redirect to the CDN, both verbs
            return self._send(302, b"", {"X-Repo-Commit": sha, "ETag": f'"{git_blob_sha1(lfs_pointer(data))}"',
                                         "X-Linked-Etag": f'"{sha256_hex(data)}"', "X-Linked-Size": str(len(data)),
                                         "Location": self._cdn_url("cdn-lfs", sha256_hex(data), path)}, head=head)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_sha1(data)}"', "Content-Type": "application/octet-stream"}
        if not head and path in self.state.overlong:
            return self._stream_until_hung_up(path, self.state.overlong[path], headers)
        self._send(200, data, {**headers, "Accept-Ranges": "bytes"}, head=head)

    def _validate_yaml(self) -> None:
        """README metadata check: the front matter between the leading `---` lines must be a YAML mapping."""
        content = json.loads(self._body() or b"{}").get("content", "")
        self.state.validated_yaml.append(content)
        if content.startswith("---\n"):
            end = content.find("\n---", 3)
            try:
                meta = yaml.safe_load(content[4:end]) if end >= 0 else None
                problem = None if isinstance(meta, dict) else "the metadata block is not a YAML mapping"
            except yaml.YAMLError as exc:
                problem = f"invalid YAML: {exc}"
            if problem:
                return self._json(400, {"errors": [{"message": problem}]})
        self._json(200, {"errors": [], "warnings": []})

    def _lfs_batch(self, repo: str, head: bool = False) -> None:
        """git-lfs batch API (upload): an upload and a verify action per object the store lacks, none otherwise."""
        body = json.loads(self._body() or b"{}")
        if not self._authorized_write() or self._repo(repo) is None:
            return
        if body.get("operation") != "upload" or body.get("hash_algo", "sha256") != "sha256":
            return self._error(422, None, "only sha256 uploads are supported here")
        objects = []
        for obj in body["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            stored = self.state.lfs_objects.get(obj["oid"])
            if stored is None or len(stored) != obj["size"]:
                port = self.server.server_address[1]
                entry["actions"] = {
                    "upload": {"href": self._cdn_url("lfs-upload", obj["oid"]), "expires_in": 900},
                    "verify": {"href": f"http://{self._host()}:{port}/{repo}.git/info/lfs/objects/verify"},
                }
            objects.append(entry)
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                   {"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_verify(self, repo: str, head: bool = False) -> None:
        body = json.loads(self._body() or b"{}")
        if not self._authorized_write() or self._repo(repo) is None:
            return
        stored = self.state.lfs_objects.get(body.get("oid", ""))
        if stored is None or len(stored) != body.get("size"):
            return self._error(404, None, f"LFS object {body.get('oid')} was not uploaded")
        self._json(200, {"success": True})

    def _cdn(self, method: str, path: str) -> None:
        """The storage host: PUT /lfs-upload/{oid} (pre-signed upload), GET/HEAD /cdn-lfs/{oid}/{repo path}."""
        head = method == "HEAD"
        parts = path.lstrip("/").split("/", 2)
        signature = parse_qs(urlsplit(self.path).query).get("sig", [""])[0]
        if len(parts) < 2 or not hmac.compare_digest(signature, self.state.sign(f"{parts[0]}/{parts[1]}")):
            self._body()
            return self._send(403, b"<Error><Code>AccessDenied</Code></Error>", head=head)
        kind, oid = parts[0], parts[1]
        if kind == "lfs-upload" and method == "PUT":
            data = self._body()
            if sha256_hex(data) != oid:
                return self._send(400, b"<Error><Code>BadDigest</Code></Error>")
            self.state.lfs_objects[oid] = data
            return self._send(200, b"", {"ETag": f'"{hashlib.md5(data).hexdigest()}"'})
        if kind == "cdn-lfs" and method in ("GET", "HEAD") and oid in self.state.lfs_objects:
            repo_path = parts[2] if len(parts) == 3 else ""
            name = repo_path.rsplit("/", 1)[-1]
            headers = {"ETag": f'"{oid}"', "Content-Type": "application/octet-stream",
                       "Content-Disposition": f"attachment; filename*=UTF-8''{quote(name)}; filename=\"{name}\";"}
            if not head and repo_path in self.state.overlong:
                return self._stream_until_hung_up(repo_path, self.state.overlong[repo_path], headers)
            return self._send(200, self.state.lfs_objects[oid], {**headers, "Accept-Ranges": "bytes"}, head=head)
        self._body()
        self._send(404, b"<Error><Code>NoSuchKey</Code></Error>", head=head)

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
