"""The small interface both hub clients implement, the hub timeout, and the redaction every hub message passes through.

A client moves bytes and names commits; it knows nothing about manifests. `publish.py` decides which files move.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from ..errors import HubError, InputError
from ..format.layout import Choice


class Hub(Choice):
    """Where artifacts are published: the `--hub` vocabulary, the catalog's `hub` field."""

    HF = "hf"
    MODELSCOPE = "modelscope"


HUBS = tuple(h.value for h in Hub)
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
TIMEOUT_ENV = "OSCAR_ZOO_HUB_TIMEOUT"
DEFAULT_TIMEOUT = 30.0  # seconds a hub may stay silent: to connect, or between two pieces of an answer
MAX_TIMEOUT = 3600.0  # the most OSCAR_ZOO_HUB_TIMEOUT may say: an hour of silence is a dead hub (and sockets refuse a
# timeout much beyond a few years with an OverflowError)


def check_hub(hub: str) -> Hub:
    """`hub` as a Hub; anything else is an InputError naming the choices (the one check of the vocabulary)."""
    try:
        return Hub(hub)
    except ValueError:
        raise InputError(f"unknown hub {hub!r}", f"use one of {', '.join(HUBS)}") from None


class HubClient(Protocol):
    name: str  # "hf" | "modelscope"
    endpoint: str

    def has_token(self) -> bool:
        """Whether a token is configured in the client's usual places (environment, saved login)."""

    def ensure_repo(self, repo_id: str, private: bool) -> None:
        """Create the model repo unless it exists (needs a token)."""

    def ensure_branch(self, repo_id: str, revision: str) -> None:
        """Create branch `revision` from the default branch unless it exists."""

    def head(self, repo_id: str, revision: str | None) -> str:
        """The commit id `revision` (branch, tag or commit; None = default branch) points to."""

    def file_sizes(self, repo_id: str, folder: str, commit: str) -> dict[str, int] | None:
        """{path in repo: bytes} of the files in `folder` ("" = the root) at `commit`, from the hub's listing, before
        anything is downloaded; None when the hub cannot be asked (offline mode)."""

    def fetch(self, repo_id: str, path: str, commit: str, force: bool = False, sha256: str | None = None,
              size: int | None = None) -> Path | None:
        """Download one file at `commit` into the client's cache and return its local path; None if absent there.
        With `size`, a download that grows past it is stopped and leaves nothing behind (IntegrityError); a client
        that can verify `sha256` on download does. The caller re-checks both and `discard`s what it refuses."""

    def discard(self, local: Path) -> None:
        """Remove a file that `fetch` returned from the client's cache (it was refused)."""

    def commit(self, repo_id: str, files: dict[str, Path], message: str, revision: str | None,
               parent: str | None) -> str:
        """Upload `files` (path in repo -> local file) as one commit on `revision`; fail if the branch moved away
        from `parent`. Returns the new commit id."""

    def web_url(self, repo_id: str, subfolder: str = "") -> str:
        """Where a person can look at the repo (or the subfolder) in a browser."""


def redact(text: str, secrets: list[str | None]) -> str:
    """Replace every occurrence of a secret (a token) in `text`; hub messages go through this before they are shown."""
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, "***")
    return re.sub(r"(?i)(bearer\s+|m_session_id=)[^\s;,'\"]+", r"\1***", text)


def first_line(text: str, limit: int = 200) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


SUBFOLDER = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")
SUBFOLDER_RULE = ("at most 1,024 characters: names of letters, digits, `.`, `_` and `-` joined by single `/`, none of "
                  "them `.` or `..`")


def is_plain_subfolder(value: str) -> bool:
    """The one rule for a model's folder inside a repo, as zoo.json and a catalog entry record it and as push writes
    it: "" (the root) or SUBFOLDER_RULE (so no backslash, space or newline, no leading, trailing or doubled
    `/`)."""
    return not value or (len(value) <= 1024 and SUBFOLDER.fullmatch(value) is not None
                         and not any(part in (".", "..") for part in value.split("/")))


def check_subfolder(value: str) -> str:
    """A folder inside a repo as written in zoo.json or a catalog entry (someone else's file), held to
    `is_plain_subfolder`. Raises ValueError (the schema's IntegrityError, exit 4) otherwise."""
    if not is_plain_subfolder(value):
        raise ValueError(f"subfolder {value!r} is not a plain folder path inside the repo ({SUBFOLDER_RULE})")
    return value


_REPO_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
REPO_RULE = ("`owner/name`, each of letters, digits, `.`, `_` and `-`, at most 96 characters, starting and ending "
             "with a letter or digit, with no `..` or `--`, and not ending in `.git`")


def is_repo_id(value: str) -> bool:
    """Whether `value` is a repo id both hubs take (REPO_RULE): checked before it reaches a client, a URL or a card."""
    parts = value.split("/")
    return len(parts) == 2 and all(_REPO_NAME.fullmatch(p) and ".." not in p and "--" not in p
                                   and not p.endswith(".git") for p in parts)


def split_repo_path(spec: str) -> tuple[str, str]:
    """`owner/name[/sub/dir]` -> (`owner/name`, `sub/dir`)."""
    parts = [p for p in spec.strip("/").split("/") if p]
    return "/".join(parts[:2]), "/".join(parts[2:])


def hub_timeout() -> float:
    """Seconds any hub request may wait for the hub ($OSCAR_ZOO_HUB_TIMEOUT, default 30, at most MAX_TIMEOUT);
    InputError (exit 2) if it is not a number of seconds in (0, MAX_TIMEOUT]."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT):
        raise InputError(f"{TIMEOUT_ENV}={raw[:40]!r}{'…' if len(raw) > 40 else ''} is not a number of seconds in "
                         f"(0, {MAX_TIMEOUT:g}]", f"unset it for the default {DEFAULT_TIMEOUT:g} s")
    return seconds


_TIMEOUT_MODULES = {"builtins", "socket", "httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3",
                    "huggingface_hub", "modelscope_hub"}


def is_timeout(exc: BaseException | None) -> bool:
    """Whether `exc` or an exception it was raised from is a network timeout (socket, httpx, requests, the clients'
    own wrappers). File-lock timeouts and the like are not."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for cls in type(exc).__mro__:
            if cls.__module__.split(".")[0] in _TIMEOUT_MODULES and "Timeout" in cls.__name__:
                return True
        exc = exc.__cause__ or exc.__context__
    return False


def local_write_error(exc: BaseException, cache: str | os.PathLike) -> InputError | None:
    """The InputError (exit 2) for a hub call that failed writing on this machine — a full disk, a file-size limit,
    a read-only or foreign cache — found in `exc` or what it was raised from, naming the file (or, when the OS error
    carries none, the client's cache folder `cache`); None for everything else (a socket error is the network's)."""
    import socket

    from ..artifacts import write_failure

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and not isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror,
                                                             socket.herror)):
            found = write_failure(exc, Path(cache))
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


@contextmanager
def hub_call_errors(where: str, endpoint: str, seconds: float, call: str, cache: str | os.PathLike) -> Iterator[None]:
    """What a hub call's failure means whatever client made it: a write on this machine that failed (full disk,
    file-size limit, read-only cache: `local_write_error`, exit 2), or a request that got no answer in time (one
    HubError line, exit 5, naming the call and, when the client's own retries made the wait longer than `seconds`,
    the seconds the call waited in all). Anything else is left to the client's own mapping."""
    started = time.monotonic()
    try:
        yield
    except Exception as exc:
        if (local := local_write_error(exc, cache)) is not None:
            raise local from None
        if not is_timeout(exc):
            raise
        waited = time.monotonic() - started
        total = (f"; gave up after {waited:.0f} s in all, the hub client's retries included"
                 if waited >= seconds + 1 else "")
        raise HubError(f"{where}: {endpoint} did not answer within {seconds:g} s ({call}){total}",
                       f"check the network and the endpoint; for a slow hub raise {TIMEOUT_ENV} "
                       f"(now {seconds:g} s per request, at most {MAX_TIMEOUT:g})") from None
