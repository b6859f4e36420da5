"""`verify --plot`: per-layer attention-output error per method (log scale) and mean KL(BF16 ‖ method) by position.
matplotlib (Agg backend) is imported lazily: it is an optional dependency (the `test` extra)."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .report import NeedleReport, VerifyReport


def _pyplot(path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib, which is not installed",
                         "pip install matplotlib (or install oscar-zoo with the `test` extra)") from None
    if path.parent and not path.parent.exists():
        raise InputError(f"cannot write the plot: folder {path.parent} does not exist")
    return plt


def write_needle_plot(needle: NeedleReport, model: str, path: Path) -> None:
    """Heatmap of needle accuracy, length × depth, one panel per method."""
    path = Path(path)
    plt = _pyplot(path)
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
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_plot(report: VerifyReport, path: Path) -> None:
    path = Path(path)
    plt = _pyplot(path)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
