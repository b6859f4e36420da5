"""`oscar-zoo calibrate [MODEL]`: parse the options into a `CalibrationRequest`, run it
(`calibration.calibration_run`), render the summary table or JSON. Settings' errors name the setting; here they are
spelled as flags (group_size → --group-size)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..artifacts import check_destination
from ..calibration import distributed
from ..calibration.calibration_passes import CalibrationResult
from ..calibration.calibration_run import CalibrationInterrupted, run_calibration
from ..calibration.settings import (
    DEFAULT_KEY_BITS,
    DEFAULT_TOKENS,
    AccumulateOn,
    CalibrationRequest,
    CalibrationSettings,
    Centring,
    ClipMode,
    DeviceMap,
    Granularity,
    ValueTarget,
)
from ..console import console, err_console, progress_reporter, shown
from ..errors import SettingError
from ..format import layout
from ..models import DEMO, model_id_of
from ..texts import MIN_SEQ_LEN
from .options import Dataset, Device, Dtype, Json, ModelArg, Revision, Split, TextField

TOKENS_HELP = ("Calibration tokens (rounded down to whole sequences; fewer lose long-context retrieval: "
               'benchmarks/notes/2026-12-05-calibration-tokens.md).')


def calibrate_command(
    model: ModelArg = DEMO,
    revision: Revision = None,
    dataset: Dataset = None,
    text_field: TextField = None,
    split: Split = None,
    tokens: Annotated[int, typer.Option(help=TOKENS_HELP)] = DEFAULT_TOKENS,
    seq_len: Annotated[int, typer.Option(help=f"Tokens per calibration sequence (≥ {MIN_SEQ_LEN}).")] = 512,
    heldout: Annotated[int, typer.Option(help="Held-out sequences for the clip search.")] = 2,
    chat_template: Annotated[bool, typer.Option(help="Wrap text blocks in the tokenizer's chat template.")] = False,
    granularity: Annotated[Granularity, typer.Option(help="One rotation per KV head, or one shared per layer.")] =
    Granularity.PER_HEAD,
    value_target: Annotated[ValueTarget, typer.Option(help="weighted (reference code) or softmax (paper figure).")] =
    ValueTarget.WEIGHTED,
    clip: Annotated[ClipMode | None, typer.Option(help="search per (layer, head, K/V), or the fixed ratios. Default: "
                    "search with --key-block 0; fixed (keys and values unclipped) with keys per channel.")] = None,
    k_clip: Annotated[float | None, typer.Option(help=f"Fixed key clip ratio for --clip fixed (default "
                      f"{layout.DEFAULT_K_CLIP}).")] = None,
    v_clip: Annotated[float | None, typer.Option(help=f"Fixed value clip ratio for --clip fixed (default "
                      f"{layout.DEFAULT_V_CLIP}).")] = None,
    group_size: Annotated[int, typer.Option(help="Quantization group along head_dim; 0 = one group per row.")] = 0,
    key_bits: Annotated[float, typer.Option(help="Mean bits of the history keys over the layers, in [2, 3]: the "
                        "layers whose INT2 keys add the most logit noise get 3-bit unclipped keys (docs/format.md "
                        "§6b); 2 keeps INT2 keys everywhere (the schema-2 codec). The default keeps needle retrieval "
                        "at BF16's level (benchmarks/QUALITY.md).")] = DEFAULT_KEY_BITS,
    centring: Annotated[Centring, typer.Option(help="none (default): uncentred rows. mean: store K/V rows minus their "
                        "calibrated per-(layer, KV head) mean (docs/format.md §6a): lower KL at 2K, worse needle "
                        "retrieval (benchmarks/QUALITY.md) — measure with `verify --needle` before adopting.")] =
    Centring.NONE,
    sink: Annotated[int, typer.Option(help="Full-precision sink tokens the runtime keeps (≥ 0; sink + recent < "
                                           "32768).")] = layout.SINK,
    recent: Annotated[int, typer.Option(help="Full-precision recent tokens the runtime keeps (≥ 0).")] =
    layout.RECENT,
    key_block: Annotated[int | None, typer.Option(help="History keys per channel over blocks of this many tokens "
                         f"({', '.join(map(str, layout.KEY_BLOCKS))}), unclipped, values unclipped (docs/format.md "
                         "§6d). Default: max(64, head_dim) — it keeps needle retrieval near BF16 "
                         "(benchmarks/QUALITY.md). 0: keys per row with searched clips (schema 4's codec).")] = None,
    pin: Annotated[int, typer.Option(help="History tokens per KV head that a prompt's last queries pin in BF16 "
                   "(docs/format.md §6c). Default 0: on the demo model's needle prompts 32 pins retrieved no more "
                   "(benchmarks/QUALITY.md \"Pinned tokens\").")] = 0,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed for the document order.")] = 0,
    device: Device = "auto",
    dtype: Dtype = "auto",
    out: Annotated[Path | None, typer.Option(help="Output folder (default: artifacts/<model>). It must be new, empty, "
                   "or an earlier artifact folder (a valid manifest.json and exactly the files it lists), which is "
                   "replaced once the new one is complete; anything else is refused before any work starts.")] = None,
    json_output: Json = False,
    device_map: Annotated[DeviceMap | None, typer.Option(help="Spread the layers over all visible GPUs (then CPU, "
                          "then disk with --offload-folder) through accelerate; --device is then unused.")] = None,
    max_memory: Annotated[str | None, typer.Option(help="Memory per device for the plan and the device map, e.g. "
                          "0=70GiB,1=70GiB,cpu=200GiB (default: what is free).")] = None,
    offload_folder: Annotated[Path | None, typer.Option(help="Folder for weights offloaded to disk by --device-map."
                              )] = None,
    accumulate_on: Annotated[AccumulateOn, typer.Option(help="Where the float64 sums live: the model's first device, "
                             "or cpu (products still form on each layer's device).")] = AccumulateOn.MODEL,
    nproc: Annotated[int, typer.Option(help="Data-parallel processes to launch on this machine (one per GPU; gloo "
                     "on CPU). Under torchrun, leave it out: the ranks come from torchrun.")] = 1,
) -> None:
    """Calibrate OSCAR rotations and clip ratios for MODEL and write an artifact folder."""
    try:
        settings = CalibrationSettings(
            granularity=granularity, value_target=value_target, clip=clip, k_clip=k_clip, v_clip=v_clip,
            group_size=group_size, key_bits=key_bits, sink=sink, recent=recent, pin=pin, centring=centring,
            key_block=key_block,
            batch_size=batch_size, seed=seed, accumulate_on=accumulate_on)
        request = CalibrationRequest(
            out=out or Path("artifacts") / _slug(model_id_of(model)), settings=settings, model=model,
            revision=revision, dataset=dataset, text_field=text_field, split=split, tokens=tokens, seq_len=seq_len,
            heldout=heldout, chat_template=chat_template, device=device, dtype=dtype, device_map=device_map,
            max_memory=max_memory, offload_folder=offload_folder, nproc=nproc,
            argv=tuple(distributed.without_option(sys.argv[1:], "--nproc")))
        check_destination(request.out, "--out")  # before any model work: refuse to replace someone else's folder
        say = None if json_output else (lambda msg: err_console.print(f"[dim]{shown(msg)}[/]"))
        outcome = run_calibration(request, say,
                                  lambda enabled: progress_reporter(enabled=enabled and not json_output))
    except SettingError as exc:
        raise exc.spelled(flag) from None
    except CalibrationInterrupted as exc:
        if exc.report:
            err_console.print(exc.message, highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    if outcome.exit_code:  # the launcher of --nproc processes: the first failing rank's code
        raise typer.Exit(outcome.exit_code)
    if outcome.result is None:  # the launcher, or a rank other than 0: rank 0 prints
        return
    result, manifest, wall, out = outcome.result, outcome.manifest, outcome.wall_seconds, request.out
    if json_output:
        console.print_json(json.dumps(_summary(result, out, wall)))
        return
    console.print(_table(result))
    reused = "all accumulators reused from the cache" if not result.forward_passes else \
        f"passes run: {', '.join(result.forward_passes)}"
    console.print(f"BPE: {manifest.bits_per_element['32768']:.3f} at 32K, {manifest.bits_per_element['131072']:.3f} "
                  f"at 128K · keys {manifest.mean_key_bits:.2f} bits · "
                  f"{'centred' if manifest.centred else 'uncentred'} · {manifest.calibration.tokens:,} tokens · "
                  f"{reused} · {wall:.1f} s")
    console.print(f"[green]wrote[/] {out}/ (manifest.json, rotations.safetensors)")
    console.print(f"next: [bold]oscar-zoo verify {out}[/] (quality vs BF16), [bold]oscar-zoo inspect {out}[/]")


def flag(setting: str) -> str:
    """A setting's command-line flag: group_size → --group-size."""
    return "--" + setting.replace("_", "-")


def _slug(model_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model_id.split("/")[-1]).strip("-").lower() or "model"


def _summary(result: CalibrationResult, out: Path, wall: float) -> dict:
    r, m = result.rotations, result.manifest
    return {
        "out": str(out),
        "model": m.model.id,
        "granularity": m.rotation.granularity.value,
        "value_target": m.rotation.value_target.value,
        "clip": m.clip.mode.value,
        "centring": m.quant.centring.value,
        "key_bits": m.key_bits,
        "tokens": m.calibration.tokens,
        "bits_per_element": m.bits_per_element,
        "forward_passes": result.forward_passes,
        "wall_seconds": round(wall, 3),
        "layers": [
            {"layer": int(lid), "k_spectrum_ratio": round(float(ks), 3), "v_spectrum_ratio": round(float(vs), 3),
             "k_clip": [round(float(c), 4) for c in kc], "v_clip": [round(float(c), 4) for c in vc]}
            for lid, ks, vs, kc, vc in zip(r.layer_ids, result.k_spectrum, result.v_spectrum, r.k_clip, r.v_clip)
        ],
    }


def _table(result: CalibrationResult) -> Table:
    r = result.rotations
    table = Table(title=f"{result.manifest.model.id}: OSCAR rotations ({result.manifest.rotation.granularity.value})")
    for col in ("layer", "K λmax/λmean", "V λmax/λmean", "K bits", "K clip", "V clip"):
        table.add_column(col, justify="right")
    for lid, ks, vs, kb, kc, vc in zip(r.layer_ids, result.k_spectrum, result.v_spectrum, result.manifest.key_bits,
                                       r.k_clip, r.v_clip):
        table.add_row(str(int(lid)), f"{ks:.1f}", f"{vs:.1f}", str(kb), _clips(kc), _clips(vc))
    return table


def _clips(c) -> str:
    values = sorted({round(float(x), 2) for x in c})
    return " ".join(f"{v:.2f}" for v in values)


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_command)
