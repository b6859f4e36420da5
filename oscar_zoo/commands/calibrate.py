"""`oscar-zoo calibrate [MODEL]`: capture, targets, rotations, clips → an artifact folder; summary table or JSON."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..artifacts import check_destination, check_writable, nearest_existing, write_artifacts
from ..calibration import distributed, memory
from ..calibration.clip_search import DEFAULT_GRID
from ..calibration.data import check_dataset_options, load_texts, make_sequences
from ..calibration.pipeline import (
    DEFAULT_KEY_BITS,
    CalibrationResult,
    CalibrationSettings,
    calibrate,
    checkpoint_state,
    default_store_dir,
)
from ..console import console, err_console, progress_reporter
from ..errors import InputError
from ..manifest import ClipMode, Granularity, ValueTarget
from ..models import (
    DEMO,
    arch_info,
    cache_root,
    check_revision_applies,
    load_model,
    model_id_of,
    resolve_device,
    resolve_dtype,
)
from ..runtime import layout
from .options import Dataset, Device, Dtype, Json, ModelArg, Revision, Split, TextField


class AccumulateOn(str, Enum):
    MODEL = "model"
    CPU = "cpu"


class Centring(str, Enum):
    MEAN = "mean"
    NONE = "none"


class DeviceMap(str, Enum):
    AUTO = "auto"
    BALANCED = "balanced"
    SEQUENTIAL = "sequential"


def calibrate_command(
    model: ModelArg = DEMO,
    revision: Revision = None,
    dataset: Dataset = None,
    text_field: TextField = None,
    split: Split = None,
    tokens: Annotated[int, typer.Option(help="Calibration tokens (rounded down to whole sequences).")] = 16384,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration sequence (≥ 16).")] = 512,
    heldout: Annotated[int, typer.Option(help="Held-out sequences for the clip search.")] = 2,
    chat_template: Annotated[bool, typer.Option(help="Wrap text blocks in the tokenizer's chat template.")] = False,
    granularity: Annotated[Granularity, typer.Option(help="One rotation per KV head, or one shared per layer.")] =
    Granularity.PER_HEAD,
    value_target: Annotated[ValueTarget, typer.Option(help="weighted (reference code) or softmax (paper figure).")] =
    ValueTarget.WEIGHTED,
    clip: Annotated[ClipMode, typer.Option(help="search per (layer, head, K/V), or the fixed ratios.")] =
    ClipMode.SEARCH,
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
    start = time.perf_counter()
    check_dataset_options(dataset, split, text_field)
    check_revision_applies(model, revision)
    check_combinations(clip=clip, k_clip=k_clip, v_clip=v_clip, device=device, device_map=device_map,
                       offload_folder=offload_folder, nproc=nproc)
    k_clip = layout.DEFAULT_K_CLIP if k_clip is None else k_clip
    v_clip = layout.DEFAULT_V_CLIP if v_clip is None else v_clip
    check_options(tokens=tokens, seq_len=seq_len, heldout=heldout, clip=clip, k_clip=k_clip, v_clip=v_clip,
                  group_size=group_size, sink=sink, recent=recent, batch_size=batch_size, nproc=nproc,
                  key_bits=key_bits, pin=pin)
    n_sequences = tokens // seq_len
    out = out or Path("artifacts") / _slug(model_id_of(model))
    check_destination(out, "--out")  # before any model work: refuse to replace someone else's folder (exit 2)
    check_writable(nearest_existing(cache_root()), f"the oscar-zoo cache {cache_root()} (OSCAR_ZOO_CACHE)")
    if nproc > 1 and not distributed.in_distributed_env():
        raise typer.Exit(distributed.launch(nproc, distributed.without_option(sys.argv[1:], "--nproc")))
    dp = distributed.from_env(device)
    store_dir: Path | None = None  # the checkpoint folder, once the token ids are known
    is_main = dp is None or dp.is_main
    finished = False
    try:
        if dp:
            if device_map and dp.local_world > 1:
                raise InputError("--device-map with several processes per node would give every process all GPUs",
                                 "run one process per node (torchrun --nproc-per-node 1) with --device-map")
            device = distributed.rank_device(dp, device)
        say = (lambda msg: None) if json_output or not is_main else (lambda msg: err_console.print(f"[dim]{msg}[/]"))
        if dp:
            say(f"data parallel: {dp.world} processes, sequences split between them (per-rank accumulator caches)")
        check_memory = _memory_check(say, device, dtype, batch_size, seq_len, heldout * seq_len, accumulate_on.value,
                                     device_map.value if device_map else None, memory.parse_max_memory(max_memory),
                                     offload_folder is not None,
                                     dp.local_world if dp and resolve_device(device).type == "cpu" else 1,
                                     group_size)
        loaded = load_model(model, revision=revision, device=device, dtype=dtype, progress=say,
                            placement=check_memory, offload_folder=str(offload_folder) if offload_folder else None)
        where = "a device map" if getattr(loaded.model, "hf_device_map", None) else str(loaded.model.device)
        say(f"model {loaded.identity.id}: {loaded.info.num_layers} layers, {loaded.info.num_q_heads} query / "
            f"{loaded.info.num_kv_heads} KV heads, head_dim {loaded.info.head_dim} on {where}")
        texts, source = load_texts(dataset, split=split, text_field=text_field)
        seqs = make_sequences(loaded.tokenizer, texts, seq_len, n_sequences, heldout, seed, chat_template, source)
        settings = CalibrationSettings(granularity=granularity.value, value_target=value_target.value,
                                       clip=clip.value, k_clip=k_clip, v_clip=v_clip, grid=DEFAULT_GRID,
                                       group_size=group_size, sink=sink, recent=recent, batch_size=batch_size,
                                       seed=seed, accumulate_on=accumulate_on.value, centring=centring.value,
                                       key_bits=key_bits, pin=pin)
        store_dir = default_store_dir(loaded, seqs)
        with progress_reporter(enabled=not json_output and is_main) as report:
            result = calibrate(loaded, seqs, settings, progress=report, store_dir=store_dir, dp=dp, note=say)
        finished = True
    except KeyboardInterrupt:
        if is_main:
            err_console.print(_interrupted(store_dir), highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    finally:
        distributed.shutdown(finished)
    if result is None:  # a rank other than 0: its share is in rank 0's sums, rank 0 writes and prints
        return
    wall = time.perf_counter() - start
    manifest = result.manifest.model_copy(
        update={"calibration": result.manifest.calibration.model_copy(update={"wall_seconds": round(wall, 3)})})
    manifest = write_artifacts(out, manifest, result.rotations)
    if json_output:
        console.print_json(json.dumps(_summary(result, out, wall)))
        return
    console.print(_table(result))
    reused = "all accumulators reused from the cache" if not result.forward_passes else \
        f"forward passes run: {', '.join(result.forward_passes)}"
    console.print(f"BPE: {manifest.bits_per_element['32768']:.3f} at 32K, {manifest.bits_per_element['131072']:.3f} "
                  f"at 128K · keys {manifest.mean_key_bits:.2f} bits · "
                  f"{'centred' if manifest.centred else 'uncentred'} · {seqs.input_ids.numel():,} tokens · {reused} · "
                  f"{wall:.1f} s")
    console.print(f"[green]wrote[/] {out}/ (manifest.json, rotations.safetensors)")
    console.print(f"next: [bold]oscar-zoo verify {out}[/] (quality vs BF16), [bold]oscar-zoo inspect {out}[/]")


MIN_SEQ_LEN = 16  # shorter sequences give the held-out clip search almost no causal context
MAX_WINDOWS = 32768  # sink + recent must stay below the 32K context of the BPE summary, so long contexts are INT2


def check_combinations(*, clip: ClipMode, k_clip: float | None, v_clip: float | None, device: str,
                       device_map: DeviceMap | None, offload_folder: Path | None, nproc: int) -> None:
    """Options that would do nothing in the combination given are refused (InputError, exit 2), never ignored."""
    if clip == ClipMode.SEARCH and (k_clip is not None or v_clip is not None):
        given = " ".join(f"{o} {v}" for o, v in (("--k-clip", k_clip), ("--v-clip", v_clip)) if v is not None)
        raise InputError(f"{given}: fixed clip ratios are used by --clip fixed only; --clip search finds its own",
                         "add --clip fixed, or leave the clip ratios out")
    if offload_folder is not None and device_map is None:
        raise InputError(f"--offload-folder {offload_folder}: only --device-map offloads weights to disk",
                         "add --device-map auto, or leave --offload-folder out")
    if device_map is not None and device != "auto":
        raise InputError(f"--device {device} with --device-map {device_map.value}: the device map places the layers",
                         "leave --device out")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if distributed.in_distributed_env() and nproc not in (1, world):
        raise InputError(f"--nproc {nproc} under torchrun with WORLD_SIZE {world}: the processes come from torchrun",
                         "leave --nproc out")
    if (nproc > 1 or distributed.in_distributed_env()) and re.fullmatch(r"cuda:\d+", device):
        raise InputError(f"--device {device} with several processes: each process takes the GPU of its local rank",
                         "use --device cuda (or auto); choose the GPUs with CUDA_VISIBLE_DEVICES")


def check_options(*, tokens: int, seq_len: int, heldout: int, clip: ClipMode, k_clip: float, v_clip: float,
                  group_size: int, sink: int, recent: int, batch_size: int, nproc: int,
                  key_bits: float = DEFAULT_KEY_BITS, pin: int = 0) -> None:
    """Every numeric option, before any work: InputError (exit 2) naming the option, its value and what is expected.

    The sink and recent windows are not used by the calibration itself (the clip search scores every held-out
    position); they are the cache tiers the manifest prescribes to runtimes. So they are checked for sanity, not
    against --seq-len: each ≥ 0, and together below MAX_WINDOWS so that a long context has INT2 history at all."""

    def need(ok: bool, option: str, value, expected: str, advice: str | None = None) -> None:
        if not ok:  # NaN fails every comparison, so it lands here too
            raise InputError(f"{option} {value}: expected {expected}", advice)

    need(seq_len >= MIN_SEQ_LEN, "--seq-len", seq_len, f"at least {MIN_SEQ_LEN} tokens per sequence")
    need(tokens >= seq_len, "--tokens", tokens, f"at least one sequence of --seq-len {seq_len} tokens")
    need(heldout >= 0, "--heldout", heldout, "a number of held-out sequences ≥ 0")
    need(clip != ClipMode.SEARCH or heldout >= 1, "--heldout", heldout, "≥ 1 with --clip search (the search scores "
         "clip ratios on held-out sequences)", "or use --clip fixed")
    for option, value in (("--k-clip", k_clip), ("--v-clip", v_clip)):
        need(0 < value <= 1, option, value, "a clip ratio in (0, 1]")
    need(group_size >= 0, "--group-size", group_size, "0 (one group per row) or a divisor of the model's head_dim")
    need(2 <= key_bits <= 3, "--key-bits", key_bits, "a mean key bit width in [2, 3]")
    need(sink >= 0, "--sink", sink, "a number of full-precision sink tokens ≥ 0")
    need(recent >= 0, "--recent", recent, "a number of full-precision recent tokens ≥ 0")
    need(0 <= pin <= layout.MAX_WINDOW, "--pin", pin, f"a number of pinned tokens in [0, {layout.MAX_WINDOW:,}]")
    need(sink + recent < MAX_WINDOWS, "--sink + --recent", f"{sink} + {recent}", f"less than {MAX_WINDOWS:,} tokens "
         "(beyond that a 32K context keeps no INT2 history)")
    need(batch_size >= 1, "--batch-size", batch_size, "at least 1 sequence per forward pass")
    need(nproc >= 1, "--nproc", nproc, "at least 1 process")


def _memory_check(say, device: str, dtype: str, batch_size: int, seq_len: int, heldout_tokens: int,
                  accumulate_on: str, device_map: str | None, max_memory: dict, offload: bool, replicas: int,
                  group_size: int):
    """The hook load_model runs on the config before any weight is read: --group-size against the head dim, then the
    memory plan, reported line by line, then refused (InputError, exit 2) with its numbers if it cannot fit; returns
    the device map to load with."""

    def check(config) -> dict | None:
        head_dim = arch_info(config).head_dim
        try:  # the first moment the head dim is known, still before any weight is read
            layout.resolve_group_size(head_dim, group_size)
        except ValueError as exc:
            raise InputError(f"--group-size {group_size}: expected 0 or a divisor of the model's head_dim {head_dim} "
                             f"({exc})") from None
        plan = memory.plan(config, arch_info(config), dtype=resolve_dtype(dtype, device), device=resolve_device(device),
                           batch_size=batch_size, seq_len=seq_len, heldout_tokens=heldout_tokens,
                           accumulate_on=accumulate_on, device_map=device_map, max_memory=max_memory,
                           offload=offload, replicas=replicas)
        for need in plan.needs:
            say(f"memory {need.describe()}")
        for note in plan.notes:
            say(f"memory: {note}")
        plan.check()
        return plan.device_map

    return check


def _interrupted(store_dir: Path | None) -> str:
    """The one line after Ctrl-C: what was kept, where, and how to resume."""
    kept = checkpoint_state(store_dir) if store_dir is not None and store_dir.is_dir() else []
    if not kept:
        return "interrupted: no calibration checkpoint was written yet (nothing to resume); re-run the same command " \
               "to start again"
    return (f"interrupted: the calibration checkpoint is kept in {store_dir} ({'; '.join(kept)}); re-run the same "
            "command to resume from it")


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
        "centring": m.quant.centring,
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
