"""`verify --plot`: per-layer attention-output error per method (log scale) and mean KL(BF16 ‖ method) by position.
matplotlib (Agg backend) is imported lazily: it is an optional dependency (the `test` extra)."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .report import VerifyReport


def write_plot(report: VerifyReport, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib, which is not installed",
                         "pip install matplotlib (or install oscar-zoo with the `test` extra)") from None
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise InputError(f"cannot write the plot: folder {path.parent} does not exist")
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
