"""Push and pull: exactly the files a manifest lists (plus the manifest, a model card and the zoo index), checked
before upload and after download, never a glob of a folder.

push: check every sha256 and shape, refuse unverified artifacts unless asked, pin the branch head, read-modify-write
`zoo.json`, and upload everything in one commit whose parent is that head (a concurrent push fails cleanly).
pull: resolve a catalog name or `REPO_ID[/SUBDIR]` to a commit, fetch the manifest, then the files it lists at that
commit, check schema and every sha256 in a temp folder next to the destination, and only then move it into place.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..artifacts import (
    atomic_write_text,
    check_destination,
    check_file,
    check_files,
    load_artifacts,
    remove_stale_staging,
    staging_folder,
    swap_into_place,
)
from ..errors import HubError, InputError, IntegrityError, VerificationFailed
from ..format.io import check_rotations_size, sha256_file
from ..format.records import MANIFEST_MAX_BYTES, one_line
from ..format.schema import MANIFEST_NAME, ROTATIONS_NAME, Manifest
from ..format.verification import VerifyReport, binding_mismatch, looser_than_defaults, needle_gate
from .base import REPO_RULE, SUBFOLDER_RULE, Hub, HubClient, check_hub, is_plain_subfolder, is_repo_id, split_repo_path
from .card import render_model_card, render_zoo_card
from .catalog import CatalogEntry, find_entry
from .zoo import ZOO_NAME, ZooIndex, report_verdict, zoo_entry

Progress = Callable[[str], None]
CARD_NAME = "README.md"


def make_client(hub: str) -> HubClient:
    if check_hub(hub) is Hub.HF:
        from .huggingface import HuggingFaceHub

        return HuggingFaceHub()
    from .modelscope import ModelScopeHub

    return ModelScopeHub()


def default_subfolder(manifest: Manifest) -> str:
    """`HuggingFaceTB/SmolLM2-135M-Instruct` -> `smollm2-135m-instruct` (per-layer artifacts get `-per-layer`)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", manifest.model.id.rstrip("/").split("/")[-1].lower()).strip("-")
    return name + ("-per-layer" if manifest.rotation.granularity.value == "per-layer" else "")


def _push_subfolder(subfolder: str | None, manifest: Manifest) -> str:
    """The folder push writes to and records in zoo.json: `--path-in-repo` (surrounding `/` dropped; "" is the root)
    or the one derived from the model id, held to the rule zoo.json's schema applies (`is_plain_subfolder`), so push
    never writes an entry its own reader refuses. Checked before any network call; InputError (exit 2) otherwise."""
    if subfolder is None:
        sub = default_subfolder(manifest)
        what = f"the subfolder {sub!r} derived from the model id {manifest.model.id!r}"
        advice = "name one with --path-in-repo"
        if not sub:
            raise InputError(f"no subfolder can be derived from the model id {manifest.model.id!r}", advice)
    else:
        sub = subfolder.strip("/")
        what = f"--path-in-repo {subfolder!r}"
        advice = 'pass a plain folder path, or "" for the repo root'
    if not is_plain_subfolder(sub):
        raise InputError(f"{what} is not a plain folder path inside the repo ({SUBFOLDER_RULE})", advice)
    top = sub.split("/")[0]
    if top in (ZOO_NAME, CARD_NAME):  # files push writes at the root of a zoo repo: no folder may take their name
        raise InputError(f"{what} starts with a folder named {top}, the file push writes at the repo root", advice)
    return sub


def _pull_subfolder(source: str, sub: str) -> str:
    """A folder named on the command line to pull from (possibly uploaded by other tools): no `.`, `..` or backslash."""
    parts = sub.split("/") if sub else []
    if any(p in (".", "..") for p in parts) or "\\" in sub or (parts and parts[0] == ZOO_NAME):
        raise InputError(f"{source!r}: {sub!r} is not a plain folder path inside the repo",
                         "pass OWNER/REPO[/SUBFOLDER]")
    return sub


def _in_repo(subfolder: str, name: str) -> str:
    return f"{subfolder}/{name}" if subfolder else name


# -- push -------------------------------------------------------------------------------------------------------------
@dataclass
class PushPlan:
    hub: str
    repo_id: str
    subfolder: str
    revision: str | None
    manifest: Manifest
    files: dict[str, Path]  # path in repo -> local file (the zoo index and root card are added at commit time)
    manifest_sha256: str
    commit: str | None = None
    url: str = ""
    zoo_models: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[str, int, str]]:
        return [(p, f.stat().st_size, sha256_file(f)) for p, f in sorted(self.files.items())]


def plan_push(artifacts: Path, repo_id: str, hub: str, subfolder: str | None, revision: str | None,
              allow_unverified: bool, workdir: Path, allow_loose_thresholds: bool = False) -> PushPlan:
    """Check the artifact folder and list what push would upload; writes the model card into `workdir`."""
    check_hub(hub)
    if not is_repo_id(repo_id):
        raise InputError(f"{one_line(repo_id, 120)!r} is not a repo id: {REPO_RULE}",
                         "pass OWNER/NAME (a folder inside the repo goes in --path-in-repo)")
    manifest, _ = load_artifacts(artifacts)  # schema, every sha256, tensor shapes and orthogonality (exit 4)
    if not allow_unverified:
        check_verified(manifest, artifacts, allow_loose_thresholds)
    sub = _push_subfolder(subfolder, manifest)
    files = {_in_repo(sub, a.path): Path(artifacts) / a.path for a in manifest.artifacts}
    files[_in_repo(sub, MANIFEST_NAME)] = Path(artifacts) / MANIFEST_NAME
    card = workdir / "model-card.md"
    atomic_write_text(card, render_model_card(manifest, repo_id, sub, hub))
    files[_in_repo(sub, CARD_NAME)] = card
    return PushPlan(hub, repo_id, sub, revision, manifest, files, sha256_file(Path(artifacts) / MANIFEST_NAME))


def check_verified(manifest: Manifest, artifacts: Path, allow_loose_thresholds: bool = False) -> None:
    """The push gate (docs/hub.md, "The push gate"): trust only a report that `oscar-zoo verify --write` stored (its
    schema), about this very artifact (its binding: the files' sha256, the model, the settings), of the artifact
    itself (not --as-exported), whose metrics meet the thresholds it states, whose `passed` agrees with them, whose
    needle grid had something to compare against, and whose thresholds are no looser than verify's defaults unless
    `allow_loose_thresholds`. VerificationFailed (exit 3) otherwise."""
    advice = f"run `oscar-zoo verify {artifacts} --write`, or push with --allow-unverified"
    if manifest.verification is None:
        raise VerificationFailed(f"{artifacts} has not been verified (manifest.verification is null)", advice)
    report, why = manifest.report()
    if report is None:
        raise VerificationFailed(f"{artifacts}: manifest.verification is not a report written by `oscar-zoo verify` "
                                 f"(field {why})", advice)
    mismatch = binding_mismatch(report, manifest)
    if mismatch is not None:
        raise VerificationFailed(f"{artifacts}: the verification report is not bound to this artifact ({mismatch})",
                                 advice)
    if report.as_exported:
        raise VerificationFailed(f"{artifacts}: the verification report measured the exported form "
                                 "(--as-exported), not the artifact", advice)
    failures, empty = report_verdict(report), _empty_needle(report)
    judged = [f for f in failures if f not in empty]  # a report written before the empty-needle rule passed it
    if report.passed != (not judged) and (report.passed or not empty):
        said = "passed" if report.passed else "failed"
        raise VerificationFailed(f"{artifacts}: the verification report says it {said}, but its own metrics say "
                                 f"otherwise ({'; '.join(judged) or 'every threshold is met'}); the report was "
                                 "edited", advice)
    failures += [f for f in empty if f not in failures]
    if failures:
        raise VerificationFailed(f"{artifacts} failed its verification: {'; '.join(failures)}",
                                 "re-calibrate, or push with --allow-unverified to publish it anyway")
    looser = looser_than_defaults(report.thresholds, None if report.needle is None
                                  else report.needle.min_relative_accuracy)
    if looser and not allow_loose_thresholds:
        raise VerificationFailed(f"{artifacts} was verified with thresholds looser than verify's defaults: "
                                 f"{'; '.join(looser)}",
                                 f"run `oscar-zoo verify {artifacts} --write` with the default thresholds, or push "
                                 "with --allow-loose-thresholds (the card and zoo.json then show the thresholds used)")


def _empty_needle(report: VerifyReport) -> list[str]:
    """The needle gate's failure when the report's grid had nothing to compare against (the reference answered no
    prompt: `needle_gate`); empty otherwise, and for a grid without its reference or artifact row
    (`report_verdict` names that)."""
    needle = report.needle
    if needle is None:
        return []
    refs = [m for m in needle.methods if m.kind == "reference"]
    arts = [m for m in needle.methods if m.kind == "artifact"]
    if len(refs) != 1 or len(arts) != 1 or refs[0].overall > 0:
        return []
    prompts = len(needle.lengths) * len(needle.depths) * needle.trials
    return needle_gate(refs[0].overall, arts[0].overall, needle.min_relative_accuracy, prompts)


def push(plan: PushPlan, private: bool, workdir: Path, client: HubClient | None = None,
         progress: Progress = lambda msg: None) -> PushPlan:
    """Upload a checked plan as one commit, merging the model into the repo's zoo.json."""
    client = client or make_client(plan.hub)
    if not client.has_token():
        advice = ("set HF_TOKEN or run `hf auth login`" if plan.hub == "hf"
                  else "set MODELSCOPE_API_TOKEN or run `modelscope login`")
        raise HubError(f"no {plan.hub} token found: pushing needs one with write access", advice)
    progress(f"creating {plan.hub}:{plan.repo_id} if needed")
    client.ensure_repo(plan.repo_id, private=private)
    if plan.revision:
        client.ensure_branch(plan.repo_id, plan.revision)
    parent = client.head(plan.repo_id, plan.revision)
    progress(f"reading {ZOO_NAME} at {parent[:12]}")
    index = read_zoo(client, plan.repo_id, parent)
    now = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    index = index.with_model(zoo_entry(plan.manifest, plan.subfolder, plan.manifest_sha256, now))
    files = dict(plan.files)
    atomic_write_text(workdir / ZOO_NAME, index.to_json())
    files[ZOO_NAME] = workdir / ZOO_NAME
    if plan.subfolder:  # a zoo repo: the root card lists every model; a single-model repo has its card at the root
        atomic_write_text(workdir / "zoo-card.md", render_zoo_card(index, plan.repo_id, plan.hub))
        files[CARD_NAME] = workdir / "zoo-card.md"
    progress(f"uploading {len(files)} files in one commit")
    message = f"oscar-zoo: {plan.manifest.model.id} rotations in {plan.subfolder or '/'}"
    plan.commit = client.commit(plan.repo_id, files, message, plan.revision, parent)
    plan.url = client.web_url(plan.repo_id, plan.subfolder)
    plan.zoo_models = [m.subfolder or "/" for m in index.models]
    return plan


def read_zoo(client: HubClient, repo_id: str, commit: str) -> ZooIndex:
    path = client.fetch(repo_id, ZOO_NAME, commit, force=True)
    if path is None:
        return ZooIndex()
    return ZooIndex.from_json(path.read_bytes(), source=f"{client.name}:{repo_id}/{ZOO_NAME}")


# -- pull -------------------------------------------------------------------------------------------------------------
@dataclass
class PullSource:
    hub: str
    repo_id: str
    subfolder: str
    revision: str | None
    entry: CatalogEntry | None = None


def resolve_source(source: str, hub: str | None, revision: str | None) -> PullSource:
    """A catalog name (no `/`) or `REPO_ID[/SUBDIR]`; `--hub` picks the catalog location or the hub of a repo id."""
    if hub is not None:
        check_hub(hub)
    if "/" not in source:
        entry = find_entry(source)
        if entry is None:
            raise InputError(f"{source!r} is neither a catalog name nor a repo id",
                             "see `oscar-zoo list`, or pass OWNER/REPO[/SUBFOLDER]")
        loc = entry.location(hub)
        return PullSource(loc.hub, loc.repo_id, loc.subfolder, revision or loc.revision, entry)
    repo_id, sub = split_repo_path(source)
    if not is_repo_id(repo_id):
        raise InputError(f"{one_line(source, 120)!r} is not a repo id: {REPO_RULE}", "pass OWNER/REPO[/SUBFOLDER]")
    return PullSource(hub or "hf", repo_id, _pull_subfolder(source, sub), revision)


@dataclass
class PullResult:
    source: PullSource
    commit: str
    dest: Path
    manifest: Manifest
    files: list[tuple[str, int, str]]


def pull(src: PullSource, dest: Path | None, client: HubClient | None = None, force_download: bool = False,
         progress: Progress = lambda msg: None) -> PullResult:
    client = client or make_client(src.hub)
    dest = Path(dest) if dest is not None else Path(src.subfolder.split("/")[-1] or src.repo_id.split("/")[-1])
    check_destination(dest, "--dest")  # an earlier pull (or calibrate) may be replaced, nothing else (exit 2)
    commit = client.head(src.repo_id, src.revision)
    where = f"{src.hub}:{src.repo_id}/{src.subfolder}".rstrip("/") + f"@{commit[:12]}"
    sizes = client.file_sizes(src.repo_id, src.subfolder, commit)  # None offline: then the cached copies are checked
    manifest_in_repo = _in_repo(src.subfolder, MANIFEST_NAME)
    manifest_size = None if sizes is None else sizes.get(manifest_in_repo)
    if sizes is not None and manifest_size is None:
        raise _no_manifest(where)
    if manifest_size is not None and manifest_size > MANIFEST_MAX_BYTES:
        raise IntegrityError(f"{where}/{MANIFEST_NAME} has {manifest_size:,} bytes, too many for a manifest; nothing "
                             "was downloaded", "this is not an oscar-zoo artifact folder; do not use it")
    progress(f"reading {MANIFEST_NAME} from {where}")
    manifest_path = client.fetch(src.repo_id, manifest_in_repo, commit, force=force_download, size=manifest_size)
    if manifest_path is None:
        raise _no_manifest(where)
    try:
        manifest = _read_pulled_manifest(manifest_path, where, src.entry)
        _check_listing(manifest, sizes, src.subfolder, where)  # before any listed file is downloaded
    except IntegrityError:
        client.discard(manifest_path)  # a refused manifest does not stay in the hub cache
        raise
    local: dict[str, Path] = {}
    for i, art in enumerate(manifest.artifacts, 1):
        progress(f"downloading {art.path} ({art.bytes:,} bytes) [{i}/{len(manifest.artifacts)}]")
        path = client.fetch(src.repo_id, _in_repo(src.subfolder, art.path), commit, force=force_download,
                            sha256=art.sha256, size=art.bytes)
        if path is None:
            raise HubError(f"{where}: {art.path} is listed in the manifest but missing from the repo")
        try:
            check_file(path, art)
        except IntegrityError as exc:
            client.discard(path)  # nor does a refused file
            raise IntegrityError(f"{where}: {exc.message}", exc.advice) from None
        local[art.path] = path
    _install(dest, manifest_path, local, manifest)
    files = [(a.path, a.bytes, a.sha256) for a in manifest.artifacts]
    return PullResult(src, commit, dest, manifest, files)


def _no_manifest(where: str) -> HubError:
    return HubError(f"{where} has no {MANIFEST_NAME}: it is not an oscar-zoo artifact folder",
                    "pass REPO_ID/SUBFOLDER for a zoo repo (its zoo.json lists the folders)")


def _read_pulled_manifest(path: Path, where: str, entry: CatalogEntry | None) -> Manifest:
    """Schema first (exit 4); with a catalog name, byte-identical to the catalogued manifest."""
    if path.stat().st_size > MANIFEST_MAX_BYTES:
        raise IntegrityError(f"{where}/{MANIFEST_NAME} has {path.stat().st_size:,} bytes, too many for a manifest")
    manifest = Manifest.from_json(path.read_bytes(), source=f"{where}/{MANIFEST_NAME}")  # UTF-8, depth, schema
    if entry is not None and sha256_file(path) != entry.manifest_sha256:
        raise IntegrityError(f"{where}/{MANIFEST_NAME} differs from the catalog's copy of {entry.name!r}",
                             "the hub copy changed after it was catalogued; pull by repo id to accept it")
    return manifest


def _check_listing(manifest: Manifest, sizes: dict[str, int] | None, subfolder: str, where: str) -> None:
    """Before downloading: the schema admits only the format's files; each must be as big as the manifest's geometry
    implies and, when the hub's listing is at hand, exactly as big there as the manifest says."""
    check_rotations_size(manifest, f"{where}/{MANIFEST_NAME}")
    for art in manifest.artifacts if sizes is not None else ():
        on_hub = sizes.get(_in_repo(subfolder, art.path))
        if on_hub is None:
            raise HubError(f"{where}: {art.path} is listed in the manifest but missing from the repo")
        if on_hub != art.bytes:
            raise IntegrityError(f"{where}: {art.path} has {on_hub:,} bytes on the hub, the manifest says "
                                 f"{art.bytes:,}; nothing was downloaded",
                                 "the hub copy was altered or corrupted; do not use it")


def _install(dest: Path, manifest_path: Path, files: dict[str, Path], manifest: Manifest) -> None:
    """Copy into a staging folder beside `dest`, check every sha256 and shape there, then swap it into place."""
    dest = check_destination(dest, "--dest")  # again: the folder may have changed during the download
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(dest)  # left by pulls that were killed mid-copy
    tmp = staging_folder(dest, "pull")
    try:
        shutil.copyfile(manifest_path, tmp / MANIFEST_NAME)
        for rel, src in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / rel)
        check_files(tmp, manifest)  # IntegrityError names the file whose sha256 differs
        load_artifacts(tmp)  # tensor names, shapes, orthogonality
        check_destination(dest, "--dest")
        swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
