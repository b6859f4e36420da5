"""The one error base of oscar-zoo and the format's own error.

`OscarZooError` carries a one-line message, optional advice and the exit code the CLI maps it to (README, "Commands").
`IntegrityError` (exit 4) is everything the format refuses: an unreadable or invalid manifest, a file whose size or
sha256 differs from the manifest's, tensors the format refuses. It is a ValueError too, so a library caller of the
runtime (`OscarCache.from_folder`) catches it as one; the commands report it with its exit code.
"""

from __future__ import annotations


class OscarZooError(Exception):
    """Base of every error oscar-zoo reports to a user as one line (plus optional advice) instead of a traceback."""

    exit_code = 1

    def __init__(self, message: str, advice: str | None = None):
        super().__init__(message)
        self.message = message
        self.advice = advice

    def __str__(self) -> str:
        return self.message if not self.advice else f"{self.message} ({self.advice})"


class IntegrityError(OscarZooError, ValueError):
    """Artifact integrity: checksum mismatch, invalid or unknown-version manifest, manifest/model mismatch, refused
    pickle, tensors the format refuses."""

    exit_code = 4
