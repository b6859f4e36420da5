"""Hugging Face Hub client: `huggingface_hub.HfApi` for repos and commits, `hf_hub_download` (and its cache) for files.

Every call passes `endpoint=` explicitly (huggingface_hub reads HF_ENDPOINT only at import), tokens come from the
library's usual places (HF_TOKEN, `hf auth login`), and every library error becomes one `HubError` line with the token
redacted. Pulls pin a commit, so `HF_HUB_OFFLINE=1` serves them from the cache. Every request made during a call
waits at most $OSCAR_ZOO_HUB_TIMEOUT seconds for the hub (huggingface_hub's shared client has none of its own).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import HubError, InputError
from .base import COMMIT_RE, first_line, hub_timeout, redact, timeouts_as_hub_errors

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_BRANCH = "main"
_active_timeouts: list[float] = []  # one per oscar-zoo hub call now running; read by the request hook below


def _apply_timeout(request) -> None:
    """httpx request hook: while an oscar-zoo hub call runs, every request it makes (from any thread of the library)
    gets our timeout for connecting, each read, each write and a pooled connection, whatever the caller passed --
    huggingface_hub passes `timeout=None` (no limit) on several calls, such as repo_info."""
    if _active_timeouts:
        seconds = _active_timeouts[-1]
        request.extensions["timeout"] = {"connect": seconds, "read": seconds, "write": seconds, "pool": seconds}


def _install_timeout_hook() -> None:
    """Add `_apply_timeout` to huggingface_hub's shared httpx client (re-created after a fork or a close)."""
    from huggingface_hub import get_session

    session = get_session()
    hooks = session.event_hooks
    if _apply_timeout not in hooks["request"]:
        session.event_hooks = {**hooks, "request": [*hooks["request"], _apply_timeout]}


class HuggingFaceHub:
    name = "hf"

    def __init__(self, endpoint: str | None = None, token: str | None = None):
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self._explicit_token = token
        self.timeout = hub_timeout()

    # -- credentials ------------------------------------------------------------------------------------------------
    def _token(self) -> str | None:
        if self._explicit_token:
            return self._explicit_token
        from huggingface_hub import get_token

        return get_token()

    def has_token(self) -> bool:
        return bool(self._token())

    def _api(self):
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self._token() or False, library_name="oscar-zoo")

    # -- repos and commits ------------------------------------------------------------------------------------------
    def ensure_repo(self, repo_id: str, private: bool) -> None:
        with self._errors(repo_id, call="create_repo"):
            self._api().create_repo(repo_id, private=private, exist_ok=True, repo_type="model")

    def ensure_branch(self, repo_id: str, revision: str) -> None:
        if revision == DEFAULT_BRANCH or COMMIT_RE.match(revision):
            return
        with self._errors(repo_id, call="create_branch"):
            self._api().create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")

    def head(self, repo_id: str, revision: str | None) -> str:
        revision = revision or DEFAULT_BRANCH
        if COMMIT_RE.match(revision):
            return revision
        from huggingface_hub import constants

        if constants.is_offline_mode():
            return self._cached_ref(repo_id, revision)
        with self._errors(repo_id, revision, call=f"repo_info: the commit of {revision}"):
            sha = self._api().repo_info(repo_id, revision=revision, repo_type="model").sha
        if not sha:
            raise HubError(f"hf: {repo_id} answered without a commit id for revision {revision!r}")
        self._remember_ref(repo_id, revision, sha)
        return sha

    @staticmethod
    def _ref_path(repo_id: str, revision: str) -> Path:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / revision

    def _remember_ref(self, repo_id: str, revision: str, sha: str) -> None:
        """Record branch -> commit in the hub cache (its `refs/` layout), as hf_hub_download does for the revisions
        it is given: pulls download by commit id, and an offline pull of the branch must find that commit."""
        ref = self._ref_path(repo_id, revision)
        try:
            ref.parent.mkdir(parents=True, exist_ok=True)
            if not ref.is_file() or ref.read_text() != sha:
                ref.write_text(sha)
        except OSError:  # a read-only cache only costs the offline shortcut
            pass

    def _cached_ref(self, repo_id: str, revision: str) -> str:
        ref = self._ref_path(repo_id, revision)
        if not ref.is_file():
            raise HubError(
                f"hf: offline (HF_HUB_OFFLINE=1) and {repo_id}@{revision} is not in the cache",
                "pull it once while online, or unset HF_HUB_OFFLINE",
            )
        return ref.read_text().strip()

    def fetch(self, repo_id: str, path: str, commit: str, force: bool = False,
              expected: tuple[str, int] | None = None) -> Path | None:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        with self._errors(repo_id, commit, call=f"download of {path}"):
            try:
                local = hf_hub_download(repo_id, path, revision=commit, repo_type="model", endpoint=self.endpoint,
                                        token=self._token() or False, force_download=force,
                                        library_name="oscar-zoo")
            except EntryNotFoundError as exc:
                if _is_local_miss(exc):
                    raise
                return None
        return Path(local)

    def commit(self, repo_id: str, files: dict[str, Path], message: str, revision: str | None,
               parent: str | None) -> str:
        from huggingface_hub import CommitOperationAdd

        ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(f)) for p, f in sorted(files.items())]
        with self._errors(repo_id, revision, committing=True, call="create_commit"):
            info = self._api().create_commit(repo_id, ops, commit_message=message, revision=revision,
                                             parent_commit=parent, repo_type="model")
        return info.oid

    def web_url(self, repo_id: str, subfolder: str = "") -> str:
        return f"{self.endpoint}/{repo_id}" + (f"/tree/main/{subfolder}" if subfolder else "")

    # -- errors -----------------------------------------------------------------------------------------------------
    @contextmanager
    def _errors(self, repo_id: str, revision: str | None = None, committing: bool = False,
                call: str = "hub request") -> Iterator[None]:
        """Run one hub call under the hub timeout and map huggingface_hub's exceptions to one-line HubErrors (exit 5),
        token redacted; `call` names the call in a timeout message."""
        from huggingface_hub import errors as e

        where = f"hf:{repo_id}" + (f"@{revision}" if revision else "")
        _install_timeout_hook()
        _active_timeouts.append(self.timeout)
        try:
            with timeouts_as_hub_errors(where, self.endpoint, self.timeout, call):
                yield
        except HubError:
            raise
        except e.GatedRepoError:
            raise HubError(f"{where} is gated", f"accept its conditions at {self.endpoint}/{repo_id} and log in "
                                                "with a token that has access (HF_TOKEN or `hf auth login`)") from None
        except e.RepositoryNotFoundError:
            raise HubError(f"{where}: repository not found (or private and this token cannot see it)",
                           "check the repo id; for a private repo set HF_TOKEN or run `hf auth login`") from None
        except e.RevisionNotFoundError:
            raise HubError(f"{where}: revision not found", "pass an existing branch, tag or commit with "
                                                           "--revision") from None
        except e.OfflineModeIsEnabled:
            raise HubError(f"{where}: HF_HUB_OFFLINE=1 and the files are not in the cache",
                           "pull once while online, or unset HF_HUB_OFFLINE") from None
        except e.LocalEntryNotFoundError as exc:
            raise HubError(f"{where}: the hub cannot be reached and the file is not cached "
                           f"({self._clean(first_line(str(exc)))})",
                           "check the network or HF_ENDPOINT; offline, only files pulled before are available") from None
        except e.HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            detail = self._clean(first_line(getattr(exc, "server_message", None) or str(exc)))
            if status == 401:
                raise HubError(f"{where}: the hub rejected the token (HTTP 401)",
                               "set a valid HF_TOKEN or run `hf auth login`") from None
            if status == 403:
                raise HubError(f"{where}: the token has no write access (HTTP 403)",
                               "use a token with write permission for this namespace") from None
            if committing and status in (409, 412):
                raise HubError(f"{where}: the branch moved while pushing (a concurrent commit); nothing was "
                               "committed", "re-run the push: it re-reads zoo.json and merges again") from None
            raise HubError(f"{where}: hub request failed (HTTP {status}): {detail}") from None
        except ValueError as exc:  # huggingface_hub validates ids and README metadata with ValueError
            raise InputError(f"{where}: {self._clean(first_line(str(exc)))}") from None
        except OSError as exc:  # connection refused, DNS, timeouts (httpx errors are OSError subclasses or wrapped)
            raise HubError(f"{where}: cannot reach {self.endpoint} ({self._clean(first_line(str(exc)))})",
                           "check the network or HF_ENDPOINT; set HF_HUB_OFFLINE=1 to use cached pulls") from None
        except Exception as exc:
            if _is_network_error(exc):
                raise HubError(f"{where}: cannot reach {self.endpoint} ({self._clean(first_line(str(exc)))})",
                               "check the network or HF_ENDPOINT; set HF_HUB_OFFLINE=1 to use cached pulls") from None
            raise
        finally:
            _active_timeouts.pop()

    def _clean(self, text: str) -> str:
        return redact(text, [self._explicit_token, os.environ.get("HF_TOKEN"), _saved_token()])


def _saved_token() -> str | None:
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # noqa: BLE001 - redaction must never raise
        return None


def _is_local_miss(exc: Exception) -> bool:
    from huggingface_hub.errors import LocalEntryNotFoundError

    return isinstance(exc, LocalEntryNotFoundError)


def _is_network_error(exc: Exception) -> bool:
    """httpx(2) transport errors (connect, read timeouts) are not OSError; recognise them by module and name."""
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"TransportError", "NetworkError", "ConnectError", "TimeoutException", "ConnectionError"})
