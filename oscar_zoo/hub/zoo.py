"""`zoo.json`: the index a zoo repo keeps at its root, one entry per model subfolder (read-modify-written by push).

Also the one place that turns a manifest's verification record into a short summary and a table, so the model card,
zoo.json and `oscar-zoo list` all say the same thing.
"""

from __future__ import annotations

from typing import Any, Literal

from ..errors import IntegrityError
from ..format.records import Record, SchemaError, canonical_json, load_json, one_line, record, spec
from ..format.schema import Manifest
from ..format.verification import (
    DEFAULT_MIN_NEEDLE_ACCURACY,
    DEFAULT_THRESHOLDS,
    VerifyReport,
    check_thresholds,
    describe_thresholds,
    needle_gate,
    read_report,
)
from .base import check_subfolder

ZOO_NAME = "zoo.json"
ZOO_SCHEMA_VERSION = 1
CONTEXT_128K = 131072
MAX_BITS_PER_ELEMENT = 64.0  # above any codec's: 16-bit windows, 3-bit codes with a float16 pair per 1-dim group
PREFERRED_METRICS = ("kl", "top1", "ppl_increase", "bits_per_element")  # shown first, and in one-line summaries


@record
class ZooModel(Record):
    subfolder: str = spec(check=check_subfolder)  # "" when the model lives at the repo root
    model_id: str
    model_revision: str | None = None
    granularity: str
    manifest_sha256: str
    bits_per_element_128k: float = spec(ge=0, le=MAX_BITS_PER_ELEMENT)
    verification: str  # one-line summary, "unverified" when the manifest has none
    updated: str  # ISO time of the push that wrote this entry


@record
class ZooIndex(Record):
    schema_version: Literal[1] = ZOO_SCHEMA_VERSION
    tool: Literal["oscar-zoo"] = "oscar-zoo"
    models: list[ZooModel] = spec(factory=list)

    def with_model(self, entry: ZooModel) -> ZooIndex:
        """A new index with `entry` replacing any entry of the same subfolder; entries sorted by subfolder."""
        kept = [m for m in self.models if m.subfolder != entry.subfolder]
        return ZooIndex(models=sorted([*kept, entry], key=lambda m: m.subfolder))

    def to_json(self) -> str:
        return canonical_json(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes, source: str = ZOO_NAME) -> ZooIndex:
        advice = "fix or delete zoo.json in the repo, then push again"
        try:
            return cls.from_dict(load_json(text, source))  # UTF-8, depth and numbers checked: IntegrityError
        except IntegrityError as exc:
            raise IntegrityError(exc.message, advice) from None
        except SchemaError as exc:
            raise IntegrityError(f"{source} is not a valid oscar-zoo index: field '{one_line(exc.where, 80)}': "
                                 f"{one_line(exc.msg, 200)}", advice) from None


def bpe_128k(manifest: Manifest) -> float:
    return round(manifest.bits_at(CONTEXT_128K), 4)


def zoo_entry(manifest: Manifest, subfolder: str, manifest_sha256: str, updated: str) -> ZooModel:
    return ZooModel(subfolder=subfolder, model_id=manifest.model.id, model_revision=manifest.model.revision,
                    granularity=manifest.rotation.granularity.value, manifest_sha256=manifest_sha256,
                    bits_per_element_128k=bpe_128k(manifest), verification=verification_summary(
                        manifest.verification), updated=updated)


# -- verification reports, read generically ---------------------------------------------------------------------------
def verification_rows(report: dict[str, Any] | None) -> tuple[list[str], list[tuple[str, dict[str, Any]]]]:
    """(metric names, [(method, {metric: value})]) from a verify report of unknown exact shape.

    Understood: `{"methods": {name: {metric: value}}}`, `{"methods": [{"name"|"method": ..., metric: value}]}` (the
    `verify` report's form), or a flat `{metric: value}` (one row named "oscar"). Nested dicts, lists and a method's
    `label` are skipped; PREFERRED_METRICS come first."""
    if not report:
        return [], []
    methods = report.get("methods")
    rows: list[tuple[str, dict[str, Any]]] = []
    if isinstance(methods, dict):
        rows = [(str(k), v) for k, v in methods.items() if isinstance(v, dict)]
    elif isinstance(methods, list):
        for i, v in enumerate(methods):
            if isinstance(v, dict):
                name = v.get("name", v.get("method", f"method {i}"))
                rows.append((str(name), {k: x for k, x in v.items() if k not in ("name", "method", "label")}))
    else:
        rows = [("oscar", {k: v for k, v in report.items() if _scalar(v)})]
    rows = [(name, {k: v for k, v in metrics.items() if _scalar(v)}) for name, metrics in rows]
    seen = {k for _, metrics in rows for k in metrics}
    columns = [k for k in PREFERRED_METRICS if k in seen]
    for _, metrics in rows:
        columns += [k for k in metrics if k not in columns]
    return columns, rows


def report_verdict(report: VerifyReport) -> list[str]:
    """Re-check a report from its own numbers: the thresholds it states against its artifact row's metrics, and its
    needle grid's pass rule (`needle_gate`, verify's and push's: a reference that answered nothing passes nothing).
    Returns the failures (empty: it passes); a report without exactly one artifact row fails."""
    artifacts = [m for m in report.methods if m.kind == "artifact"]
    if len(artifacts) != 1:
        return [f"the report has {len(artifacts)} artifact rows, not 1"]
    failures = check_thresholds(artifacts[0], report.thresholds)
    needle = report.needle
    if needle is not None:
        refs = [m for m in needle.methods if m.kind == "reference"]
        arts = [m for m in needle.methods if m.kind == "artifact"]
        if len(refs) != 1 or len(arts) != 1:
            failures.append("the needle grid lacks its BF16 or artifact row")
        else:
            prompts = len(refs[0].answers)
            failures += needle_gate(refs[0].overall, arts[0].overall, needle.min_relative_accuracy, prompts)
    return failures


def verification_summary(report: dict[str, Any] | None) -> str:
    """What a person reads of a manifest's `verification`: `✓ +5.1 % PPL, KL 0.052` (passed), `✗ +12.0 % PPL, KL 0.31`
    (failed), with `(non-default thresholds: …)` when the report was judged by others than verify's defaults,
    `unverified`, or for a record that is not a `verify` report, `not a verify report`. The mark is the report's
    numbers re-checked against its thresholds (`report_verdict`), not its own `passed` flag."""
    if report is None:
        return "unverified"
    parsed, _ = read_report(report)
    if parsed is None:
        return "not a verify report"
    art = next((m for m in parsed.methods if m.kind == "artifact"), None)
    if art is None:
        return "not a verify report"
    mark = "✓" if parsed.passed and not report_verdict(parsed) else "✗"
    return f"{mark} {100 * art.ppl_increase:+.1f} % PPL, KL {art.kl:.2g}{non_default_gate(parsed)}"


def non_default_gate(report: VerifyReport) -> str:
    """'' when the report was judged with verify's default thresholds (and needle gate), else what it used: a pass
    under loosened thresholds must not read like one under the defaults."""
    changed = []
    if report.thresholds != DEFAULT_THRESHOLDS:
        changed.append(describe_thresholds(report.thresholds))
    if report.needle is not None and report.needle.min_relative_accuracy != DEFAULT_MIN_NEEDLE_ACCURACY:
        changed.append(f"needle ≥ {report.needle.min_relative_accuracy:g} × BF16")
    return f" (non-default thresholds: {'; '.join(changed)})" if changed else ""


def format_value(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None
