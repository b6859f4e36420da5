"""The zoo catalog: one JSON per published entry (the artifact manifest plus where to pull it from), shipped in the
wheel as package data `oscar_zoo/catalog/*.json` (the repo-root `manifests/` is a symlink to that folder).

`OSCAR_ZOO_CATALOG=/some/folder` replaces the bundled catalog (private zoos, tests). Pulling by name checks that the
downloaded manifest is byte-for-byte the one the catalog recorded (its sha256), so a catalog name pins content.
"""

from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..errors import InputError, IntegrityError
from ..format.records import Record, canonical_json, parse_document, record, spec
from ..format.schema import Manifest
from .base import Hub, check_subfolder

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable  # Python 3.11+; only named in an annotation

CATALOG_SCHEMA_VERSION = 1
CATALOG_ENV = "OSCAR_ZOO_CATALOG"


@record
class HubLocation(Record):
    hub: Hub
    repo_id: str
    subfolder: str = spec("", check=check_subfolder)
    revision: str | None = None  # a commit id pins the entry; None follows the default branch
    published: bool  # False: the planned location, not uploaded yet

    @property
    def spec(self) -> str:
        return f"{self.repo_id}/{self.subfolder}" if self.subfolder else self.repo_id


@record
class CatalogEntry(Record):
    catalog_version: Literal[1] = CATALOG_SCHEMA_VERSION
    name: str = spec(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    description: str
    locations: list[HubLocation] = spec(min_length=1)
    manifest_sha256: str = spec(pattern=r"^[0-9a-f]{64}$")
    manifest: Manifest

    def check(self) -> None:
        digest = manifest_sha256(self.manifest)
        if digest != self.manifest_sha256:
            raise ValueError(f"manifest_sha256 {self.manifest_sha256[:12]}… does not match the embedded manifest "
                             f"({digest[:12]}…)")

    def location(self, hub: str | None) -> HubLocation:
        """The published location on `hub` (any hub when None); InputError when there is none."""
        candidates = [loc for loc in self.locations if hub in (None, loc.hub)]
        published = [loc for loc in candidates if loc.published]
        if published:
            return published[0]
        if candidates:
            loc = candidates[0]
            raise InputError(f"catalog entry {self.name!r} is not published yet (planned: {loc.hub}:{loc.spec})",
                             "calibrate it yourself: `oscar-zoo calibrate " + self.manifest.model.id + "`")
        raise InputError(f"catalog entry {self.name!r} has no location on {hub}",
                         f"available: {', '.join(sorted({loc.hub for loc in self.locations}))}")

    def to_json(self) -> str:
        return canonical_json(self.to_dict())


def manifest_sha256(manifest: Manifest) -> str:
    """sha256 of the manifest's canonical JSON: what `manifest.json` holds byte for byte."""
    return hashlib.sha256(manifest.to_json().encode()).hexdigest()


def catalog_files() -> list[tuple[str, bytes]]:
    """(source name, content) of every catalog JSON, sorted by name (the parser checks it is UTF-8). An entry that
    cannot be read is refused like a malformed one (IntegrityError, exit 4), naming it."""
    override = os.environ.get(CATALOG_ENV)
    if override:
        folder = Path(override)
        if not folder.is_dir():
            raise InputError(f"{CATALOG_ENV}={override} is not a folder")
        try:
            paths = sorted(p for p in folder.iterdir() if p.name.endswith(".json"))
        except OSError as exc:
            raise InputError(f"{CATALOG_ENV}={override} cannot be listed: {exc.strerror or exc}") from None
        return [(str(p), _read_entry(p, str(p))) for p in paths]
    root = resources.files("oscar_zoo") / "catalog"
    if not root.is_dir():
        return []
    return [(f"catalog/{p.name}", _read_entry(p, f"catalog/{p.name}"))
            for p in sorted(root.iterdir(), key=lambda p: p.name) if p.name.endswith(".json")]


def _read_entry(path: Traversable, source: str) -> bytes:
    """The bytes of one `*.json` in the catalog folder; a folder, a dangling symlink, a pipe or a file that cannot be
    read is an IntegrityError naming it, never a traceback (nor, for a pipe, a read that waits forever)."""
    advice = f"fix or remove {source}"
    try:
        if path.is_file():
            return path.read_bytes()
        if path.is_dir():
            what = "a folder, not a file"
        elif isinstance(path, Path) and path.is_symlink():
            what = f"a symlink to {os.readlink(path)!r}, which is not a readable file"
        else:
            what = "not a regular file"
    except OSError as exc:
        raise IntegrityError(f"catalog entry {source} cannot be read: {exc.strerror or exc}", advice) from None
    raise IntegrityError(f"catalog entry {source} is {what}", advice)


def parse_entry(text: str | bytes, source: str) -> CatalogEntry:
    return parse_document(CatalogEntry, text, source, "catalog_version", (CATALOG_SCHEMA_VERSION,))


def load_catalog() -> list[CatalogEntry]:
    entries = [parse_entry(text, source) for source, text in catalog_files()]
    names = [e.name for e in entries]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise IntegrityError(f"the catalog has duplicate names: {', '.join(dupes)}")
    return entries


def find_entry(name: str) -> CatalogEntry | None:
    return next((e for e in load_catalog() if e.name == name), None)
