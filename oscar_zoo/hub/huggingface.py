"""Hugging Face Hub client: `huggingface_hub.HfApi` for repos and commits, `hf_hub_download` (and its cache) for files.

Every call passes `endpoint=` explicitly (huggingface_hub reads HF_ENDPOINT only at import), tokens come from the
library's usual places (HF_TOKEN, `hf auth login`), and every library error becomes one `HubError` line with the token
redacted. Pulls pin a commit, so `HF_HUB_OFFLINE=1` serves them from the cache. Every request made during a call
waits at most $OSCAR_ZOO_HUB_TIMEOUT seconds for the hub, and a download stops past its expected size (`hf_limits`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import HubError, InputError, IntegrityError
from .base import COMMIT_RE, first_line, hub_call_errors, hub_timeout, redact
from .hf_limits import DownloadTooLarge, limits

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_BRANCH = "main"


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
        with self._errors(repo_id, call="create_repo", writing=True):
            self._api().create_repo(repo_id, private=private, exist_ok=True, repo_type="model")

    def ensure_branch(self, repo_id: str, revision: str) -> None:
        if revision == DEFAULT_BRANCH or COMMIT_RE.match(revision):
            return
        with self._errors(repo_id, call="create_branch", writing=True):
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

    def file_sizes(self, repo_id: str, folder: str, commit: str) -> dict[str, int] | None:
        from huggingface_hub import constants
        from huggingface_hub.errors import EntryNotFoundError
        from huggingface_hub.hf_api import RepoFile

        if constants.is_offline_mode():
            return None
        with self._errors(repo_id, commit, call=f"list_repo_tree of {folder or '/'}"):
            try:
                entries = list(self._api().list_repo_tree(repo_id, path_in_repo=folder or None, revision=commit,
                                                          repo_type="model"))
            except EntryNotFoundError:  # no such folder at this commit
                return {}
        return {e.path: e.size for e in entries if isinstance(e, RepoFile)}

    def fetch(self, repo_id: str, path: str, commit: str, force: bool = False, sha256: str | None = None,
              size: int | None = None) -> Path | None:
        """`size` caps the download as it arrives (DownloadTooLarge -> IntegrityError, nothing cached); the caller
        checks size and sha256 of the result. `sha256` is not needed here: huggingface_hub cannot check it."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        with self._errors(repo_id, commit, call=f"download of {path}", max_bytes=size):
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
        with self._errors(repo_id, revision, committing=True, call="create_commit", writing=True):
            info = self._api().create_commit(repo_id, ops, commit_message=message, revision=revision,
                                             parent_commit=parent, repo_type="model")
        return info.oid

    def discard(self, local: Path) -> None:
        """Remove a refused download from the hub cache: its snapshot entry and the blob it points to."""
        local = Path(local)
        blob = local.resolve()
        local.unlink(missing_ok=True)
        if blob != local and "blobs" in blob.parts:
            blob.unlink(missing_ok=True)

    def web_url(self, repo_id: str, subfolder: str = "") -> str:
        return f"{self.endpoint}/{repo_id}" + (f"/tree/main/{subfolder}" if subfolder else "")

    # -- errors -----------------------------------------------------------------------------------------------------
    @contextmanager
    def _errors(self, repo_id: str, revision: str | None = None, committing: bool = False,
                call: str = "hub request", max_bytes: int | None = None, writing: bool = False) -> Iterator[None]:
        """Run one hub call under the hub timeout (and a download under `max_bytes`) and map huggingface_hub's
        exceptions to one-line HubErrors (exit 5), token redacted; `call` names the call in a timeout message. A 403 is
        "no write access" for a `writing` call (create repo/branch, commit), "access denied" (gated/private) for a
        read."""
        from huggingface_hub import errors as e

        where = f"hf:{repo_id}" + (f"@{revision}" if revision else "")
        try:
            with limits(self.timeout, max_bytes), \
                    hub_call_errors(where, self.endpoint, self.timeout, call, _hub_cache()):
                yield
        except (HubError, InputError):
            raise
        except DownloadTooLarge as exc:
            raise IntegrityError(f"{where}: refused the {call}: {exc}; nothing was kept",
                                 "the hub copy does not match its manifest; do not use it") from None
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
                           "check the network or HF_ENDPOINT; offline, only files pulled before are "
                           "available") from None
        except e.HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            detail = self._clean(first_line(getattr(exc, "server_message", None) or str(exc)))
            if status == 401:
                raise HubError(f"{where}: the hub rejected the token (HTTP 401)",
                               "set a valid HF_TOKEN or run `hf auth login`") from None
            if status == 403 and writing:
                raise HubError(f"{where}: the token has no write access (HTTP 403)",
                               "use a token with write permission for this namespace") from None
            if status == 403:
                raise HubError(f"{where}: access denied (HTTP 403): the repo is gated or private and this token (or "
                               "no token) may not read it",
                               f"request access at {self.endpoint}/{repo_id} and log in with a token that has it "
                               "(HF_TOKEN or `hf auth login`)") from None
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

    def _clean(self, text: str) -> str:
        return redact(text, [self._explicit_token, os.environ.get("HF_TOKEN"), _saved_token()])


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


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
