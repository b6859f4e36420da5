"""ModelScope client: the `modelscope` package's `HubApi` (repo creation, one upload_folder commit, file downloads).

Tokens come from MODELSCOPE_API_TOKEN or `modelscope login`; the endpoint from MODELSCOPE_ENDPOINT. ModelScope's
commit API has no parent-commit precondition and its file API names branches, not commit ids, so here:
`head` returns the branch name, pulls pin content through the manifest's sha256 (every file is downloaded with its
expected sha256 and size, and the client re-checks them), and push re-reads zoo.json just before committing to narrow
(not close) the window in which a concurrent push could be overwritten. The `modelscope` client reads its timeouts from
the environment when first imported; $OSCAR_ZOO_HUB_TIMEOUT becomes those that the user has not set.
"""

from __future__ import annotations

import importlib
import io
import logging
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

from ..errors import HubError, InputError, IntegrityError
from .base import first_line, hub_call_errors, hub_timeout, redact

DEFAULT_ENDPOINT = "https://www.modelscope.cn"
DEFAULT_BRANCH = "master"
# The client's per-request limits (connect; each read; a tree page; connecting for a blob upload). Its own retry
# policy (MODELSCOPE_API_MAX_RETRIES, default 5, with backoff) still applies on top.
TIMEOUT_VARIABLES = ("MODELSCOPE_API_CONNECT_TIMEOUT", "MODELSCOPE_API_TIMEOUT", "MODELSCOPE_DOWNLOAD_TIMEOUT",
                     "MODELSCOPE_REPO_TREE_PAGE_TIMEOUT_SECONDS", "MODELSCOPE_UPLOAD_BLOB_CONNECT_TIMEOUT_SECONDS")


def _configure_timeouts(seconds: float) -> None:
    """Give the `modelscope` client our timeout wherever the user has not set one. It takes whole seconds from the
    environment once, when `modelscope_hub.constants` is first imported: so set them for that import only (child
    processes see the user's environment). Already imported (by the embedding program), it keeps what it read."""
    if "modelscope_hub.constants" in sys.modules:
        return
    added = [name for name in TIMEOUT_VARIABLES if name not in os.environ]
    os.environ.update({name: str(max(1, math.ceil(seconds))) for name in added})
    try:
        importlib.import_module("modelscope_hub.constants")
    finally:
        for name in added:
            os.environ.pop(name, None)


def _quiet_client_log() -> None:
    """The client logs its progress and every failure (INFO and up) to stderr; oscar-zoo reports a failure as its one
    line, so the client's own records are silenced unless the user asks for them with MODELSCOPE_LOG_LEVEL."""
    if "MODELSCOPE_LOG_LEVEL" not in os.environ:
        importlib.import_module("modelscope_hub.utils.logger").get_logger()  # its handler and level, set once
        logging.getLogger("modelscope_hub").setLevel(logging.CRITICAL + 1)


class ModelScopeHub:
    name = "modelscope"

    def __init__(self, endpoint: str | None = None, token: str | None = None):
        self.endpoint = (endpoint or os.environ.get("MODELSCOPE_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self._explicit_token = token
        self.timeout = hub_timeout()
        _configure_timeouts(self.timeout)
        _quiet_client_log()

    def _token(self) -> str | None:
        if self._explicit_token:
            return self._explicit_token
        from modelscope_hub.config import HubConfig  # installed with `modelscope`; env var, then the saved login

        return HubConfig().token or None

    def has_token(self) -> bool:
        return bool(self._token())

    def _api(self):
        from modelscope.hub.api import HubApi

        return HubApi(endpoint=self.endpoint, token=self._token() or None)

    # -- repos and commits ------------------------------------------------------------------------------------------
    def ensure_repo(self, repo_id: str, private: bool) -> None:
        with self._errors(repo_id, call="repo_exists / create_repo"):
            api = self._api()
            if not api.repo_exists(repo_id, repo_type="model", re_raise=True):
                api.create_repo(repo_id, repo_type="model", visibility="private" if private else "public",
                                exist_ok=True)

    def ensure_branch(self, repo_id: str, revision: str) -> None:
        if revision != DEFAULT_BRANCH:
            raise HubError("modelscope: pushing to a branch other than master is not supported by oscar-zoo yet",
                           "omit --revision for ModelScope")

    def head(self, repo_id: str, revision: str | None) -> str:
        """The branch name itself (see the module docstring); checks that the repo is visible first."""
        with self._errors(repo_id, revision, call="repo_exists"):
            if not self._api().repo_exists(repo_id, repo_type="model", re_raise=True):
                raise HubError(f"modelscope:{repo_id}: repository not found (or private and this token cannot "
                               "see it)", "check the repo id; for a private repo set MODELSCOPE_API_TOKEN")
        return revision or DEFAULT_BRANCH

    def file_sizes(self, repo_id: str, folder: str, commit: str) -> dict[str, int] | None:
        with self._errors(repo_id, commit, call=f"get_model_files of {folder or '/'}"):
            files = self._api().get_model_files(repo_id, revision=commit, root=folder or None, recursive=True)
        return {f["Path"]: int(f["Size"]) for f in files if f.get("Size") is not None}

    def fetch(self, repo_id: str, path: str, commit: str, force: bool = False, sha256: str | None = None,
              size: int | None = None) -> Path | None:
        """The client checks `size` against what the server announces and sends, and `sha256` (also validating a
        cache hit), discarding what it refuses; the cache is keyed by branch name, so a file without a sha256
        (manifest, zoo.json) is always downloaded afresh."""
        from modelscope_hub.errors import NotExistError

        with self._errors(repo_id, commit, call=f"download of {path}"):
            try:
                local = self._api().download_file(repo_id, "model", path, revision=commit,
                                                  force=force or sha256 is None, expected_sha256=sha256,
                                                  file_size=size)
            except NotExistError:
                return None
        return Path(local)

    def discard(self, local: Path) -> None:
        """Remove a refused download from the client's cache (a plain file under snapshots/<branch>/)."""
        Path(local).unlink(missing_ok=True)

    def commit(self, repo_id: str, files: dict[str, Path], message: str, revision: str | None,
               parent: str | None) -> str:
        """One upload_folder call over a staging folder that mirrors the repo layout (only the given files)."""
        revision = revision or DEFAULT_BRANCH
        with tempfile.TemporaryDirectory(prefix="oscar-zoo-ms-") as tmp:
            stage = Path(tmp) / "stage"
            for path_in_repo, local in files.items():
                (stage / path_in_repo).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(local, stage / path_in_repo)
            # upload_folder print()s a report on stdout; keep stdout for our tables and --json
            with self._errors(repo_id, revision, committing=True, call="upload_folder"), \
                    redirect_stdout(io.StringIO()):
                result = self._api().upload_folder(repo_id=repo_id, folder_path=str(stage), path_in_repo="",
                                                   commit_message=message, revision=revision, use_cache=False,
                                                   disable_tqdm=True, tracker_path=str(Path(tmp) / "tracker"))
        if isinstance(result, list):  # the client split the upload into several commits (many files)
            result = result[-1] if result else None
        info = result if isinstance(result, dict) else {}
        return str(info.get("CommitId") or info.get("commit_id") or revision)

    def web_url(self, repo_id: str, subfolder: str = "") -> str:
        return f"{self.endpoint}/models/{repo_id}" + (f"/files?path={subfolder}" if subfolder else "")

    # -- errors -----------------------------------------------------------------------------------------------------
    @contextmanager
    def _errors(self, repo_id: str, revision: str | None = None, committing: bool = False,
                call: str = "hub request") -> Iterator[None]:
        """Map the client's exceptions to one-line errors; a timeout names `call`."""
        from modelscope_hub import errors as e

        where = f"modelscope:{repo_id}" + (f"@{revision}" if revision else "")
        try:
            with hub_call_errors(where, self.endpoint, self.timeout, call,
                                 os.environ.get("MODELSCOPE_CACHE") or "the ModelScope cache"):
                yield
        except (HubError, InputError):
            raise
        except e.FileIntegrityError as exc:
            raise IntegrityError(f"{where}: a downloaded file does not match the manifest "
                                 f"({self._clean(first_line(str(exc)))})",
                                 "the hub copy was altered or corrupted; do not use it") from None
        except e.AuthenticationError:
            raise HubError(f"{where}: ModelScope rejected the token",
                           "set a valid MODELSCOPE_API_TOKEN or run `modelscope login`") from None
        except e.PermissionDeniedError:
            raise HubError(f"{where}: permission denied (private repo, or no write access for this token)",
                           "check MODELSCOPE_API_TOKEN and the repo owner") from None
        except e.NotExistError:
            raise HubError(f"{where}: repository or revision not found", "check the repo id and --revision") from None
        except e.NetworkError as exc:
            raise HubError(f"{where}: cannot reach {self.endpoint} ({self._clean(first_line(str(exc)))})",
                           "check the network or MODELSCOPE_ENDPOINT") from None
        except e.HubError as exc:
            raise HubError(f"{where}: hub request failed: {self._clean(first_line(str(exc)))}") from None
        except (OSError, ValueError) as exc:
            raise HubError(f"{where}: {type(exc).__name__}: {self._clean(first_line(str(exc)))}") from None

    def _clean(self, text: str) -> str:
        return redact(text, [self._explicit_token, os.environ.get("MODELSCOPE_API_TOKEN")])
