"""`verify --plot`: per-layer attention-output error per method (log scale) and mean KL(BF16 ‖ method) by position.
matplotlib (Agg backend) is imported lazily: it is an optional dependency (the `test` extra)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from ..errors import InputError
from ..format.verification import NeedleReport, VerifyReport

DEFAULT_SUFFIX = ".png"  # what a --plot name without an extension gets (matplotlib's own default format)
# what savefig raises for a format matplotlib lists but cannot write on this machine (pgf without LaTeX: RuntimeError;
# a Pillow built without a codec: KeyError, OSError or ValueError), met when `check_plot_path` renders a tiny figure
_PROBE_ERRORS = (RuntimeError, ValueError, OSError, KeyError, ImportError)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib, which is not installed",
                         "pip install matplotlib (or install oscar-zoo with the `test` extra)") from None
    return plt


def _render(fig, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def _check_format(fmt: str, what: str) -> None:
    """InputError unless matplotlib writes `fmt` here: one of its Agg canvas's formats, and a tiny figure renders."""
    plt = _pyplot()
    fig = plt.figure(figsize=(0.5, 0.5))
    try:
        formats = fig.canvas.get_supported_filetypes()
        if fmt not in formats:
            raise InputError(f"{what}: matplotlib cannot write .{fmt} files",
                             f"use one of the extensions {', '.join('.' + f for f in sorted(formats))} "
                             f"(none: {DEFAULT_SUFFIX})")
        fig.text(0.5, 0.5, "‖o − o_bf16‖ 1.0")  # text too: pgf lays it out with LaTeX, which may be missing
        try:
            _render(fig, fmt)
        except _PROBE_ERRORS as exc:
            raise InputError(f"{what}: matplotlib cannot write .{fmt} files here "
                             f"({' '.join(str(exc).split()) or type(exc).__name__})",
                             f"use another extension, such as {DEFAULT_SUFFIX} or .pdf") from None
    finally:
        plt.close(fig)


def check_plot_path(path: Path | str, needle_of: Path | None = None, overwrite: bool = False) -> Path:
    """The file `--plot PATH` will write (or, with `needle_of`, the needle heatmap beside the `--plot` file
    `needle_of`), checked before any model work so that a bad name never costs a whole run: PATH gets `.png` when it
    has no extension (as matplotlib's savefig does); the extension must be a format matplotlib writes here (a tiny
    figure is rendered to make sure: pgf needs LaTeX, for one); PATH must name a file: not "", not an existing folder,
    not one ending in `/`, `.` or `..`; an existing file is refused unless `overwrite` (`--overwrite-plot`): a plot
    never replaces a file silently; the nearest existing folder above it must be a folder we can write in (missing
    folders are made when the plot is written). Returns the path to write and report; InputError (exit 2) naming the
    option otherwise."""
    from ..artifacts import check_writable, nearest_existing

    raw = str(path)
    what = f"--plot {raw or repr(raw)}" if needle_of is None else f"--plot {needle_of}: its needle heatmap {raw}"
    given = Path(raw).expanduser()
    if not raw or raw.endswith(("/", os.sep)) or given.name in ("", ".", ".."):
        raise InputError(f"{what} names a folder, not a file; the plot needs a file name",
                         f"name a file, e.g. --plot {given / ('verify' + DEFAULT_SUFFIX)}")
    target = given if given.suffix else given.with_name(given.name + DEFAULT_SUFFIX)
    for shown, folder in ((given, given), (target, Path(os.path.realpath(target)))):  # a symlink: where it points
        if folder.is_dir():
            named = "" if folder == given else f" ({folder})"
            raise InputError(f"{what}{named} is a folder; the plot needs a file name",
                             f"name a file in it, e.g. --plot {shown / ('verify' + DEFAULT_SUFFIX)}"
                             if needle_of is None else "rename that folder, or pick another --plot name")
    if not overwrite and (target.exists() or target.is_symlink()):
        shown = "" if target == given else f" ({target})"
        raise InputError(f"{what}{shown} already exists; verify does not replace a file unless told to",
                         "pass --overwrite-plot to replace it, or pick another --plot name")
    if needle_of is None:  # the needle heatmap has the --plot file's extension, checked by then
        _check_format(target.suffix[1:].lower(), what)
    above = nearest_existing(Path(os.path.realpath(target)).parent)
    if not above.is_dir():
        raise InputError(f"{what} lies under {above}, which is a file", "pick another path")
    check_writable(above, what)
    return target


def _save(fig, path: Path, **kwargs) -> None:
    """The figure rendered in memory in the format of `path`'s extension, then written atomically (a temp file in the
    same folder, renamed), missing folders made: readers never see half a plot, a failed write leaves the old one."""
    from ..artifacts import atomic_write_bytes

    data = _render(fig, Path(path).suffix[1:].lower() or DEFAULT_SUFFIX[1:], **kwargs)
    atomic_write_bytes(Path(os.path.realpath(path)), data)


def write_needle_plot(needle: NeedleReport, model: str, path: Path) -> None:
    """Heatmap of needle accuracy, length × depth, one panel per method."""
    plt = _pyplot()
    n = len(needle.methods)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n + 1, 3.4), squeeze=False)
    for i, (ax, m) in enumerate(zip(axes[0], needle.methods)):
        image = ax.imshow(m.accuracy, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(needle.depths)), [f"{d:g}" for d in needle.depths])
        ax.set_yticks(range(len(needle.lengths)), [f"{x:,}" for x in needle.lengths] if i == 0 else [])
        ax.set_xlabel("needle depth")
        ax.set_title(f"{m.name}: {100 * m.overall:.0f}%", fontsize=10)
        for i, row in enumerate(m.accuracy):
            for j, a in enumerate(row):
                ax.text(j, i, f"{100 * a:.0f}", ha="center", va="center", fontsize=8)
    axes[0][0].set_ylabel("prompt tokens")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.suptitle(f"{model}: passkey retrieval through the runtime ({needle.trials} trial(s) per cell)")
    try:
        _save(fig, path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)


def write_plot(report: VerifyReport, path: Path) -> None:
    """Per-layer attention error and mean KL by position, one line per method, to `path` (its extension gives the
    format; `check_plot_path` first)."""
    plt = _pyplot()
    methods = [m for m in report.methods if m.kind != "reference"]
    fig, (ax_layer, ax_pos) = plt.subplots(1, 2, figsize=(13, 4.8))
    for m in methods:
        style = {"linewidth": 2.4} if m.kind == "artifact" else {"linewidth": 1.2, "alpha": 0.85}
        label = f"{m.name} ({m.bits_per_element:.2f} b/elem)"
        errors = [max(e, 1e-8) for e in m.layer_error]
        ax_layer.plot(range(len(errors)), errors, marker="o", markersize=3, label=label, **style)
        starts = [i * report.bin_size for i in range(len(m.kl_by_position))]
        ax_pos.plot(starts, [max(k, 1e-8) for k in m.kl_by_position], drawstyle="steps-post", label=label, **style)
    ax_layer.set_yscale("log")
    ax_layer.set_xlabel("layer")
    ax_layer.set_ylabel("‖o − o_bf16‖ / ‖o_bf16‖")
    ax_layer.set_title(f"attention-output error per layer (one sequence, queries ≥ {report.positions_from})")
    ax_pos.set_yscale("log")
    ax_pos.set_xlabel("position")
    ax_pos.set_ylabel("KL(BF16 ‖ method)")
    ax_pos.set_title(f"mean KL by position ({report.sequences} sequences, bins of {report.bin_size})")
    ax_pos.axvline(report.positions_from, color="grey", linestyle=":", linewidth=1)
    for ax in (ax_layer, ax_pos):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report.model}: INT2 KV cache vs BF16 at {report.context} tokens "
                 f"(sink {report.sink}, recent {report.recent}, group {report.group_size})")
    fig.tight_layout()
    try:
        _save(fig, path, dpi=110)
    finally:
        plt.close(fig)
