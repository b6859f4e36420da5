"""`calibrate` as one library call: launch the data-parallel processes when asked (or join torchrun's group), plan the
memory on the model's config before any weight is read (the group size against the head dim first), load the model
and the text, calibrate (resumable), and write the artifact folder. Ctrl-C becomes `CalibrationInterrupted`, saying
what was kept. Library code: lines for a person go to `say`, long work to the callback `progress_scope` yields.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from ..artifacts import check_writable, nearest_existing, write_artifacts
from ..errors import SettingError
from ..format.schema import Manifest
from ..models import arch_info, cache_root, load_model, resolve_device, resolve_dtype
from ..texts import load_texts, make_sequences
from . import distributed, memory
from .calibration_passes import CalibrationResult, Progress, calibrate, checkpoint_state, default_store_dir
from .settings import CalibrationRequest

# progress_scope(enabled) → a context yielding the progress callback; enabled is False on ranks other than 0
ProgressScope = Callable[[bool], AbstractContextManager[Progress]]


class CalibrationInterrupted(KeyboardInterrupt):
    """Ctrl-C during a calibration (still a KeyboardInterrupt): `message` says which checkpoint was kept and how to
    resume; `report` is False on ranks other than 0, whose user hears it from rank 0."""

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.message, self.report = message, report


@dataclass(frozen=True)
class CalibrationOutcome:
    """What a run left: the result and the manifest as written (rank 0 of one run), or neither (another rank, or
    the process that launched `nproc` ranks: then `exit_code` is the first failing rank's, else 0)."""

    result: CalibrationResult | None = None
    manifest: Manifest | None = None  # with its file list and the wall time
    wall_seconds: float = 0.0
    exit_code: int = 0


def _quiet(enabled: bool) -> AbstractContextManager[Progress]:
    return contextlib.nullcontext(lambda *a, **k: None)


def run_calibration(request: CalibrationRequest, say: Callable[[str], None] | None = None,
                    progress_scope: ProgressScope = _quiet) -> CalibrationOutcome:
    """Calibrate as `request` says and write `request.out` (which the caller has checked with
    `artifacts.check_destination`)."""
    start = time.perf_counter()
    check_writable(nearest_existing(cache_root()), f"the oscar-zoo cache {cache_root()} (OSCAR_ZOO_CACHE)")
    if request.nproc > 1 and not distributed.in_distributed_env():
        return CalibrationOutcome(exit_code=distributed.launch(request.nproc, list(request.argv)))
    device, settings = request.device, request.settings
    dp = distributed.from_env(device)
    store_dir: Path | None = None  # the checkpoint folder, once the token ids are known
    is_main = dp is None or dp.is_main
    say = say if say is not None and is_main else (lambda msg: None)
    finished = False
    try:
        if dp:
            if request.device_map and dp.local_world > 1:
                raise SettingError("device_map", "{device_map} with several processes per node would give every "
                                   "process all GPUs", "run one process per node (torchrun --nproc-per-node 1) "
                                   "with {device_map}")
            device = distributed.rank_device(dp, device)
            say(f"data parallel: {dp.world} processes, sequences split between them (per-rank accumulator caches)")
        replicas = dp.local_world if dp and resolve_device(device).type == "cpu" else 1
        loaded = load_model(request.model, revision=request.revision, device=device, dtype=request.dtype,
                            progress=say, placement=_memory_check(say, request, device, replicas),
                            offload_folder=str(request.offload_folder) if request.offload_folder else None)
        where = "a device map" if getattr(loaded.model, "hf_device_map", None) else str(loaded.model.device)
        say(f"model {loaded.identity.id}: {loaded.info.num_layers} layers, {loaded.info.num_q_heads} query / "
            f"{loaded.info.num_kv_heads} KV heads, head_dim {loaded.info.head_dim} on {where}")
        texts, source = load_texts(request.dataset, split=request.split, text_field=request.text_field)
        seqs = make_sequences(loaded.tokenizer, texts, request.seq_len, request.n_sequences, request.heldout,
                              settings.seed, request.chat_template, source)
        store_dir = default_store_dir(loaded, seqs)
        with progress_scope(is_main) as report:
            result = calibrate(loaded, seqs, settings, progress=report, store_dir=store_dir, dp=dp, note=say)
        finished = True
    except KeyboardInterrupt:
        raise CalibrationInterrupted(interrupted_message(store_dir), is_main) from None
    finally:
        distributed.shutdown(finished)
    if result is None:  # a rank other than 0: its share is in rank 0's sums, rank 0 writes
        return CalibrationOutcome()
    wall = time.perf_counter() - start
    manifest = result.manifest.replace(calibration=result.manifest.calibration.replace(wall_seconds=round(wall, 3)))
    manifest = write_artifacts(request.out, manifest, result.rotations)
    return CalibrationOutcome(result, manifest, wall)


def _memory_check(say: Callable[[str], None], request: CalibrationRequest, device: str, replicas: int):
    """The hook load_model runs on the config before any weight is read: the group size against the head dim, then
    the memory plan, reported line by line, then refused (InputError) with its numbers if it cannot fit; returns the
    device map to load with."""
    max_memory = memory.parse_max_memory(request.max_memory)

    def check(config) -> dict | None:
        request.settings.group_for(arch_info(config).head_dim)  # the first moment the head dim is known
        plan = memory.plan(config, arch_info(config), dtype=resolve_dtype(request.dtype, device),
                           device=resolve_device(device), batch_size=request.settings.batch_size,
                           seq_len=request.seq_len, heldout_tokens=request.heldout_tokens,
                           accumulate_on=request.settings.accumulate_on.value,
                           device_map=request.device_map.value if request.device_map else None,
                           max_memory=max_memory, offload=request.offload_folder is not None, replicas=replicas)
        for need in plan.needs:
            say(f"memory {need.describe()}")
        for note in plan.notes:
            say(f"memory: {note}")
        plan.check()
        return plan.device_map

    return check


def interrupted_message(store_dir: Path | None) -> str:
    """The one line after Ctrl-C: what was kept, where, and how to resume."""
    kept = checkpoint_state(store_dir) if store_dir is not None and store_dir.is_dir() else []
    if not kept:
        return "interrupted: no calibration checkpoint was written yet (nothing to resume); re-run the same command " \
               "to start again"
    return (f"interrupted: the calibration checkpoint is kept in {store_dir} ({'; '.join(kept)}); re-run the same "
            "command to resume from it")
