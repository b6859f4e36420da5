"""The tables bench_generate prints from its result: one row per (context, batch, cache), OSCAR against the fastest
2-bit QuantizedCache, the fixed-KV-budget rows, and the kernel and phase breakdowns.
"""

from __future__ import annotations

import math

from . import peer_caches

PEER_KINDS = peer_caches.PEER_KINDS
BF16_KINDS = ("dynamic", "static", "static-compiled", "prealloc", "bf16graph")
GB = 1e9


def print_tables(result: dict) -> None:
    rows = [r for r in result["rows"]]
    best = {}
    for r in rows:
        if r["status"] == "ok" and r["kind"] in BF16_KINDS:
            key = (r["context"], r["batch"])
            best[key] = min(best.get(key, math.inf), r["ms_per_step"])
    compiled = ("compiled layers" + (f" ({result['compile_s']:.0f} s to compile)" if result.get("compile_s") else "")
                if result.get("compile") else "eager layers")
    print(f"\n{result['model']} ({result['layers']} layers), {result['device']}, {result['steps']} timed decode steps, "
          f"fill={result['fill']}, graph rows: {compiled}")  # fmt: skip
    print("| context | batch | cache | graph | KV B/token/layer | KV GB | peak GB | ms/step | host ms/step | "
          "kernels ms/step | step / kernels | floor ms | tok/s | speedup vs best BF16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['context']} | {r['batch']} | {r['kind']} | | | | | {r['status']} | | | | | | "
                  f"{r.get('note', '')} |")  # fmt: skip
            continue
        b = best.get((r["context"], r["batch"]))
        sp = f"{b / r['ms_per_step']:.2f}x" if b else "—"
        kern = r.get("kernel_ms_per_step")
        kern_s, over = (f"{kern:.2f}", f"{r['ms_per_step'] / kern:.2f}x") if kern else ("", "")
        print(f"| {r['context']} | {r['batch']} | {r['kind']} | {'yes' if r.get('graph') else 'no'} | "
              f"{r['bytes_per_token_per_layer']:.0f} | {r['kv_bytes'] / GB:.2f} | {r.get('peak_bytes', 0) / GB:.1f} | "
              f"{r['ms_per_step']:.2f} | {r['host_ms_per_step']:.2f} | {kern_s} | {over} | "
              f"{r.get('floor_ms', float('nan')):.2f} | {r['tokens_per_s']:.0f} | {sp} |")  # fmt: skip
    peer_lines = peer_comparison(rows)
    if peer_lines:
        print(f"\nOSCAR vs transformers' QuantizedCache 2-bit ({peer_caches.EAGER_NOTE}; timed over "
              f"{peer_caches.RESIDUAL}+ steps)")
        print("| context | batch | OSCAR ms/step | fastest QuantizedCache INT2 | its ms/step | OSCAR speedup | "
              "KV bytes OSCAR / peer |")
        print("|---|---|---|---|---|---|---|")
        for line in peer_lines:
            print(line)
    if result.get("budget"):
        print(f"\nFixed KV budget {result['budget_gb']:.0f} GB: largest batch that fits, measured decode throughput")
        print("| context | cache | max batch | ms/step | tok/s | throughput vs BF16 |")
        print("|---|---|---|---|---|---|")
        for b in result["budget"]:
            if b.get("status") == "ok":
                timed = f"{b['ms_per_step']:.2f} | {b['tokens_per_s']:.0f}"
            else:  # not timed: what stopped it (a batch whose KV exceeds this card's memory: "does not fit")
                timed = f"{b.get('status', 'no batch fits')} | —"
            print(f"| {b['context']} | {b['kind']} | {b['max_batch']} | {timed} | {b.get('ratio', '')} |")
    for r in rows:
        if r.get("top_kernels"):
            top = "; ".join(f"{name} {ms:.3f} ms ×{n:.0f}" for name, ms, n in r["top_kernels"][:5])
            print(f"kernels {r['kind']} ctx {r['context']} batch {r['batch']}: {r['kernels_per_step']} per eager step, "
                  f"{r.get('graph_kernels_per_step')} per replayed step; {top}")
    for r in rows:
        if r.get("phases_ms_per_step"):
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r["phases_ms_per_step"].items())
            print(f"phases {r['kind']} ctx {r['context']} batch {r['batch']} (ms/step of {r['phases_step_ms']:.2f}): "
                  f"{parts}")  # fmt: skip


def peer_comparison(rows: list[dict]) -> list[str]:
    """Per (context, batch): OSCAR's step against the fastest 2-bit QuantizedCache row that ran; not-run peers named."""
    lines = []
    for (T, B) in sorted({(r["context"], r["batch"]) for r in rows if r["kind"] in PEER_KINDS}):
        here = [r for r in rows if (r["context"], r["batch"]) == (T, B)]
        oscar = next((r for r in here if r["kind"] == "oscar" and r["status"] == "ok"), None)
        peers = [r for r in here if r["kind"] in peer_caches.INT2_PEERS]
        ok = [r for r in peers if r["status"] == "ok"]
        if not ok or oscar is None:
            why = "; ".join(f"{r['kind']}: {r['status']} {r.get('note', '')}" for r in peers if r["status"] != "ok")
            lines.append(f"| {T} | {B} | {oscar['ms_per_step'] if oscar else float('nan'):.2f} | — | | | {why} |")
            continue
        best = min(ok, key=lambda r: r["ms_per_step"])
        lines.append(f"| {T} | {B} | {oscar['ms_per_step']:.2f} | {best['kind']} | {best['ms_per_step']:.2f} | "
                     f"{best['ms_per_step'] / oscar['ms_per_step']:.2f}x | "
                     f"{oscar['kv_bytes'] / best['kv_bytes']:.2f} |")
    return lines
