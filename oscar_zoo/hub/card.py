"""The generated model card (`README.md`) pushed beside an artifact folder, and the zoo card at a zoo repo's root.

YAML front matter (base_model, library_name, tags) so the hubs index the repo; the body says what the rotations are,
with which settings, how many bits per element they buy, how well they verified, and how to pull and use them.
"""

from __future__ import annotations

import html
import json
import re

from ..format import layout
from ..format.schema import Manifest
from ..format.verification import describe_thresholds, read_report
from .zoo import ZooIndex, format_value, non_default_gate, verification_rows, verification_summary

TAGS = ["oscar-zoo", "kv-cache", "quantization", "int2", "rotation"]
CONTEXTS = (32768, 131072)


_MARKDOWN = re.compile(r"([\\`*{}\[\]()#!|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")  # `_` inside a word is text


MAX_CELL = 4096  # characters of one value from someone else's file that a card shows


def visible(value) -> str:
    """Text from a manifest, a report or zoo.json (someone else's) on one line with nothing a terminal or a renderer
    acts on: runs of whitespace become one space, and every other character that is not printable (ESC and the other
    controls, DEL, C1 controls, bidi overrides, separators) is written as its escape (`\\x1b`, `\\u202e`): a card
    printed with `cat` changes no terminal, and a reader sees what the file holds. At most MAX_CELL characters of it
    (then `… (N characters in all)`)."""
    flat = " ".join(str(value).split())
    more = f"… ({len(flat):,} characters in all)" if len(flat) > MAX_CELL else ""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in flat[:MAX_CELL]) + more


def md(value) -> str:
    """Text from a manifest or zoo.json (someone else's) as plain Markdown text in a table cell: one line, controls
    escaped (`visible`), HTML escaped (`<`, `>`, `&`), Markdown punctuation backslash-escaped, so `|`, links, images
    or tags stay text."""
    return _MARKDOWN.sub(r"\\\1", html.escape(visible(value), quote=False))


def code(value) -> str:
    """A value as inline code in a table cell (controls escaped by `visible`; `|` escaped, as GFM tables need even in
    code); one holding a backtick is shown as escaped plain text instead (it would end the code span)."""
    flat = visible(value)
    return md(flat) if "`" in flat else "`" + flat.replace("|", "\\|") + "`"


def _front_matter(base_models: list[str]) -> str:
    lines = ["---"]
    if base_models:
        lines.append("base_model:")
        lines += [f"- {json.dumps(m)}" for m in base_models]
    lines.append("library_name: oscar-zoo")
    lines.append("tags:")
    lines += [f"- {t}" for t in TAGS]
    lines.append("---")
    return "\n".join(lines) + "\n"


def render_model_card(manifest: Manifest, repo_id: str, subfolder: str, hub: str) -> str:
    m, q, r, c, cal = manifest.model, manifest.quant, manifest.rotation, manifest.clip, manifest.calibration
    G = layout.resolve_group_size(m.head_dim, q.group_size)
    source = f"{repo_id}/{subfolder}" if subfolder else repo_id
    hub_flag = "" if hub == "hf" else f" --hub {hub}"
    out = [_front_matter([m.id]), f"# OSCAR 2-bit KV-cache rotations for {md(m.id)}\n",
           "Offline, attention-aware rotations (OSCAR, arXiv 2605.17757) that let this model keep its KV cache in "
           "2-bit integers with little loss: keys and values are rotated by `M = U·H·P` (eigenvectors of the "
           "attention targets, a Hadamard mix, an eigenvalue-sorted bit-reversal permutation), clipped and "
           "quantized to INT2 with float16 scale/zero; the first and last tokens stay BF16.\n",
           "## Settings\n",
           "| | |", "|---|---|",
           f"| base model | {code(m.id)}{f' @ {code(m.revision)}' if m.revision else ''} ({md(m.architecture)}) |",
           f"| geometry | {m.num_layers} layers, {m.num_q_heads} query / {m.num_kv_heads} KV heads, head_dim "
           f"{m.head_dim} |",
           f"| rotation | {r.composition}, {r.granularity.value}, key target {r.key_target}, value target "
           f"{r.value_target.value}, mixing {md(r.hadamard)} |",
           f"| clipping | {c.mode.value} (K default {c.k_default}, V default {c.v_default}) |",
           f"| quantization | {manifest.codec}, group {G}, scale {q.scale_dtype}, {q.packing} packing, {q.codebook} "
           f"levels |",
           f"| cache tiers | sink {q.sink} + recent {q.recent} tokens BF16, flush every {q.flush} |",
           f"| calibration | {cal.tokens:,} tokens of {code(cal.dataset)} ({cal.sequences}×{cal.seq_len}), seed "
           f"{cal.seed} |",
           ""]
    out += ["## Bits per element\n", "| context | bits/element (K and V) | vs BF16 |", "|---:|---:|---:|"]
    for ctx in CONTEXTS:
        bpe = manifest.bits_at(ctx)
        out.append(f"| {ctx // 1024}K | {bpe:.2f} | {16 / bpe:.1f}× smaller |")
    out.append("")
    out += ["## Verification\n", *_verification_section(manifest), ""]
    out += ["## Files\n", "| file | bytes | sha256 |", "|---|---:|---|"]
    out += [f"| `{a.path}` | {a.bytes:,} | `{a.sha256}` |" for a in manifest.artifacts]
    out += ["| `manifest.json` | | lists every file with its checksum |", ""]
    out += ["## Use\n", "```bash", "pip install oscar-zoo",
            f"oscar-zoo pull {visible(source)}{hub_flag} --dest rotations/   # checks every sha256",
            "oscar-zoo inspect rotations/",
            "oscar-zoo export rotations/ --format sglang --out sglang/   # reference-runtime .pt files + settings",
            "```", "",
            "In Python, `oscar_zoo.runtime.OscarCache` serves the rotations with `model.generate` (see the "
            "oscar-zoo README).", ""]
    return "\n".join(out)


def _verification_section(manifest: Manifest) -> list[str]:
    report = manifest.verification
    if report is None:
        return ["Not verified: these artifacts were published with `--allow-unverified`. Run `oscar-zoo verify` "
                "before relying on them."]
    lines = [f"Summary: **{md(verification_summary(report))}**", ""]
    parsed, _ = read_report(report)
    if parsed is not None:
        default = "verify's defaults" if not non_default_gate(parsed) else "**not** verify's defaults"
        needle = (f"; needle ≥ {parsed.needle.min_relative_accuracy:g} × BF16's accuracy" if parsed.needle else "")
        lines += [f"Thresholds the report was judged by: {md(describe_thresholds(parsed.thresholds) + needle)} "
                  f"({default}). The hub re-checks the report's numbers against them; it cannot re-run the "
                  "measurement.", ""]
    settings = {k: v for k, v in report.items() if k not in ("methods", "passed") and not isinstance(v, (dict, list))}
    if settings and isinstance(report.get("methods"), (dict, list)):
        lines += ["Setup: " + ", ".join(f"{md(k)} = {md(format_value(v))}" for k, v in settings.items()), ""]
    columns, rows = verification_rows(report)
    if rows:
        lines += ["| method | " + " | ".join(md(c) for c in columns) + " |", "|---|" + "---:|" * len(columns)]
        lines += [f"| {md(name)} | " + " | ".join(md(format_value(metrics[c])) if c in metrics else "" for c in columns)
                  + " |" for name, metrics in rows]
    return lines


def render_zoo_card(index: ZooIndex, repo_id: str, hub: str) -> str:
    """The root README of a zoo repo: one row per model subfolder, regenerated on every push."""
    hub_flag = "" if hub == "hf" else f" --hub {hub}"
    out = [_front_matter(sorted({m.model_id for m in index.models})), f"# {md(repo_id)}: OSCAR rotation zoo\n",
           "2-bit KV-cache rotations made and checked with oscar-zoo, one folder per model. `zoo.json` is the "
           "machine-readable index.\n",
           "| folder | model | granularity | bits/element @128K | verification |", "|---|---|---|---:|---|"]
    out += [f"| [{code(m.subfolder)}]({m.subfolder}) | {code(m.model_id)} | {md(m.granularity)} | "
            f"{m.bits_per_element_128k:.2f} | {md(m.verification)} |" for m in index.models]
    out += ["", "```bash", f"oscar-zoo pull {visible(repo_id)}/<folder>{hub_flag} --dest rotations/", "```", ""]
    return "\n".join(out)
