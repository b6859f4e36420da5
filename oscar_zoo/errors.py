"""Typed errors, each carrying its exit code (README, "Commands") and the advice a user needs; `cli.main` maps them."""

from __future__ import annotations

from .runtime.artifact import ArtifactError


class OscarZooError(Exception):
    """Base of every error oscar-zoo reports to a user as one line (plus optional advice) instead of a traceback."""

    exit_code = 1

    def __init__(self, message: str, advice: str | None = None):
        super().__init__(message)
        self.message = message
        self.advice = advice

    def __str__(self) -> str:
        return self.message if not self.advice else f"{self.message} ({self.advice})"


class InputError(OscarZooError):
    """Bad user input: a missing model path or dataset file, an unsupported architecture, a bad option value."""

    exit_code = 2


class VerificationFailed(OscarZooError):
    """An artifact was verified and missed a quality threshold."""

    exit_code = 3


class IntegrityError(OscarZooError, ArtifactError):
    """Artifact integrity: checksum mismatch, invalid or unknown-version manifest, manifest/model mismatch, refused
    pickle. An ArtifactError (a ValueError): what `OscarCache.from_folder` raises for the same folder, same message."""

    exit_code = 4


class HubError(OscarZooError):
    """A hub or network failure: not found, gated, offline, wrong revision, missing or rejected credentials."""

    exit_code = 5
