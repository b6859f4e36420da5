"""Limits on huggingface_hub's shared httpx client while an oscar-zoo hub call runs: a timeout on every request, and
at most the expected number of bytes in a download.

huggingface_hub's client has no timeout of its own and several calls (repo_info among them) pass `timeout=None`, so a
hub that accepts a connection and never answers would hang us. Its downloads check a file's size only once every byte
has arrived. Two event hooks on that client fix both; outside a `limits(...)` block they do nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx2  # huggingface_hub's HTTP client (this module is imported only with huggingface_hub)


class DownloadTooLarge(Exception):
    """A response body grew past the bytes the manifest allows for the file being downloaded."""


@dataclass(frozen=True)
class _Limits:
    timeout: float  # seconds: to connect, for each read or write, for a pooled connection
    max_bytes: int | None  # body bytes a GET may carry (None: any)


_active: list[_Limits] = []  # one per running call, innermost last; module-wide so the library's threads see it
_lock = threading.Lock()


@contextmanager
def limits(timeout: float, max_bytes: int | None = None) -> Iterator[None]:
    """Apply these limits to every request huggingface_hub makes inside the block."""
    _install_hooks()
    entry = _Limits(timeout, max_bytes)
    with _lock:
        _active.append(entry)
    try:
        yield
    finally:
        with _lock:
            _active.remove(entry)


def _current() -> _Limits | None:
    with _lock:
        return _active[-1] if _active else None


def _on_request(request) -> None:
    """Every request gets our timeout, whatever its caller passed."""
    now = _current()
    if now is not None:
        t = now.timeout
        request.extensions["timeout"] = {"connect": t, "read": t, "write": t, "pool": t}


def _on_response(response) -> None:
    """A GET answered with a body gets its bytes counted as they arrive, and refused past the limit."""
    now = _current()
    if now is None or now.max_bytes is None or response.request.method != "GET" or response.status_code >= 300:
        return
    announced = response.headers.get("Content-Length")
    if response.headers.get("Content-Encoding", "identity") == "identity" and announced and announced.isdigit() \
            and int(announced) > now.max_bytes:
        response.close()
        raise DownloadTooLarge(f"the hub announced {int(announced):,} bytes, the manifest allows {now.max_bytes:,}")
    response.stream = _CappedStream(response.stream, now.max_bytes)


class _CappedStream(httpx2.SyncByteStream):
    """Wraps a response's byte stream; raises DownloadTooLarge once more than `limit` bytes came over the wire."""

    def __init__(self, inner, limit: int):
        self._inner, self._limit = inner, limit

    def __iter__(self):
        seen = 0
        for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                raise DownloadTooLarge(f"the hub sent more than the {self._limit:,} bytes the manifest allows")
            yield chunk

    def close(self) -> None:
        self._inner.close()


def _install_hooks() -> None:
    """Add both hooks to the shared client (idempotent; the library re-creates its client after a fork or close)."""
    from huggingface_hub import get_session

    session = get_session()
    hooks = session.event_hooks
    if _on_request not in hooks["request"] or _on_response not in hooks["response"]:
        session.event_hooks = {"request": [h for h in hooks["request"] if h is not _on_request] + [_on_request],
                               "response": [h for h in hooks["response"] if h is not _on_response] + [_on_response]}
