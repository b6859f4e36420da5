"""Calibration orchestration: capture passes → float64 targets → rotations → clip search → manifest + tensors.

Pass 2 needs only each token's key and value, which pass 1 computes already: when the model runs on the CPU and
they fit in a share of the host memory (`REPLAY_SHARE`), pass 1 keeps them and pass 2 replays them, batch by batch
and layer by layer as its forward pass would present them (the same tensors, so the same sums bit for bit), instead
of running the model a second time.

Accumulators are checkpointed after batches (in a background writer, skipped while the last write is in flight; the end
of each pass always) into a cache folder keyed by (model, token ids, dtype): a re-run with
the same inputs reuses them (a re-fit with another granularity, value target or clip mode runs no forward pass), and
an interrupted run resumes from the last finished batch. Data-parallel runs (`dp`) keep one store per rank holding
that rank's local sums; the all-reduce is redone on every run, so reuse and resume stay exact (same world size).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import __version__
from ..artifacts import Rotations, save_tensors
from ..format import layout, reference
from ..format.io import load_tensors
from ..format.layout import Centring
from ..format.schema import (
    CalibrationRecord,
    ClipMode,
    ClipSpec,
    Granularity,
    Manifest,
    QuantSpec,
    RotationSpec,
    ValueTarget,
)
from ..models import LoadedModel, cache_root
from ..texts import TokenSequences
from . import clip_search
from .capture import capturing, forward_batches
from .distributed import DataParallel
from .memory import GiB, host_available
from .placement import accumulator_device, layer_devices, model_device, sample_on
from .rotation_fit import fit_rotations, spectrum_ratio
from .settings import DEFAULT_KEY_BITS, CalibrationSettings  # noqa: F401 -- DEFAULT_KEY_BITS: read from here too
from .targets import FirstMoment, SecondMoment, centred_target, group_heads, key_weights

Progress = Callable[..., None]  # progress(description, done, total, rate="", run_left=None)
Info = Callable[[str], None]  # one line for the user (resumed from where, reused what)
BPE_CONTEXTS = (2048, 32768, 131072)
PASS1, HELDOUT, PASS2 = "pass 1/2: key target", "held-out capture", "pass 2/2: value target"  # the passes' bars
REPLAY_SHARE = 0.5  # pass 1 keeps the keys and values for pass 2 when they take at most this share of the host
# memory available as it starts (per process on the host, under data parallelism)
class PassesClock:
    """Time left for all of a run's capture passes together, not for the one running: the tokens still to go in
    every planned pass (`plan`) over the rate this run has measured across its passes so far. `clock` is injectable
    for tests."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._left: dict[str, int] = {}  # tokens still to forward, per pass
        self._forwarded = 0  # tokens forwarded in this run, all passes
        self._busy = 0.0  # seconds spent forwarding them
        self._since: float | None = None

    def plan(self, name: str, tokens: int) -> None:
        """`tokens` still to forward in pass `name` (0: nothing to run there)."""
        self._left[name] = max(int(tokens), 0)

    def start(self, name: str, tokens: int) -> None:
        """Pass `name` starts with `tokens` to go (its exact count, replacing the plan's)."""
        self.plan(name, tokens)
        self._since = self._clock()

    def advance(self, name: str, tokens: int) -> None:
        """`tokens` of pass `name` forwarded since the last call."""
        now = self._clock()
        if self._since is not None:
            self._busy += now - self._since
        self._since = now
        self._forwarded += tokens
        self._left[name] = max(self._left.get(name, 0) - tokens, 0)

    def seconds_left(self) -> float | None:
        """Seconds until every planned pass is done; None before the first batch has given a rate."""
        left = sum(self._left.values())
        if left == 0:
            return 0.0
        if self._forwarded == 0 or self._busy <= 0:
            return None
        return left * self._busy / self._forwarded


@dataclass
class CalibrationResult:
    manifest: Manifest
    rotations: Rotations
    k_spectrum: torch.Tensor  # λmax/λmean per layer (mean over heads) of the key target
    v_spectrum: torch.Tensor
    key_objective: torch.Tensor | None  # [L, R, H] clip-search tables (None for fixed clips)
    value_objective: torch.Tensor | None
    grid: list[float]
    # which passes ran (empty: all reused from the cache); "pass2" also when replayed from pass 1's keys and values
    forward_passes: list[str] = field(default_factory=list)


class AccumulatorStore:
    """Checkpoints of the streaming accumulators in `folder`. Each checkpoint is ONE atomic safetensors file holding
    the sums and the progress counters (`state.<name>` scalars) together, so a crash can never pair sums with a
    counter from another moment (which would count batches twice on resume)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    @staticmethod
    def progress(saved: dict[str, torch.Tensor] | None, counter: str) -> int:
        """A counter stored with a checkpoint (0 when there is no checkpoint)."""
        return int(saved[f"state.{counter}"]) if saved and f"state.{counter}" in saved else 0

    def counter(self, name: str, counter: str) -> int:
        """A checkpoint's progress counter read without its sums (0 without a checkpoint or that counter)."""
        from safetensors import safe_open

        path = self.folder / f"{name}.safetensors"
        if not path.is_file():
            return 0
        with safe_open(str(path), "pt") as f:
            return int(f.get_tensor(f"state.{counter}")) if f"state.{counter}" in f.keys() else 0

    def load(self, name: str) -> dict[str, torch.Tensor] | None:
        path = self.folder / f"{name}.safetensors"
        return load_tensors(path) if path.is_file() else None

    def save(self, name: str, tensors: dict[str, torch.Tensor], **state) -> None:
        self.flush()
        self._write(name, tensors, state)

    def save_async(self, name: str, tensors: Callable[[], dict[str, torch.Tensor]], wait: bool = False,
                   **state) -> bool:
        """Checkpoint without stalling the forward passes: `tensors()` is copied to host memory now and written by a
        background thread. While a write is in flight this returns False and saves nothing, unless `wait` (a pass's
        last checkpoint): then the write is queued behind the in-flight one, still without blocking the caller.
        `flush()` waits for both."""
        previous = self._writer if self._writer is not None and self._writer.is_alive() else None
        if previous is not None and not wait:
            return False
        if previous is None:
            self.flush()  # a finished write's error surfaces here
        snapshot = {k: v.detach().to("cpu", copy=True) for k, v in tensors().items()}

        def write() -> None:
            if previous is not None:
                previous.join()
                if self._error is not None:  # the earlier write failed: flush() raises that error
                    return
            try:
                self._write(name, snapshot, state)
            except BaseException as exc:  # re-raised by flush() in the calling thread
                self._error = exc

        self._writer = threading.Thread(target=write, name=f"checkpoint-{name}")
        self._writer.start()
        return True

    def flush(self) -> None:
        """Wait for the background write, if any; raise its error."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, name: str, tensors: dict[str, torch.Tensor], state: dict) -> None:
        counters = {f"state.{k}": torch.tensor(int(v), dtype=torch.int64) for k, v in state.items()}
        save_tensors(self.folder / f"{name}.safetensors", {**tensors, **counters})


def checkpoint_state(folder: Path) -> list[str]:
    """What the checkpoints under `folder` hold, for a person: e.g. `pass 1/2: 4 of 8 sequences`, `held-out capture`
    (per rank for data-parallel runs); empty when nothing was kept. Reads only the counters, not the sums."""
    from safetensors import safe_open

    folder = Path(folder)
    stores = sorted(p for p in folder.glob("rank*-of-*") if p.is_dir()) or [folder]
    kept = []
    for store in stores:
        rank = f"{store.name}: " if store != folder else ""
        for name, label in (("pass1", "pass 1/2 (key target)"), ("heldout", "held-out capture"),
                            ("pass2", "pass 2/2 (value target)")):
            path = store / f"{name}.safetensors"
            if not path.is_file():
                continue
            try:
                with safe_open(str(path), "pt") as f:
                    done = int(f.get_tensor(f"state.{name}_done")) if f"state.{name}_done" in f.keys() else None
            except Exception:  # noqa: BLE001 - a damaged checkpoint is reported as such, never raised from here
                kept.append(f"{rank}{label}: unreadable")
                continue
            kept.append(f"{rank}{label}" + (f": {done} sequences done" if done is not None else ""))
    return kept


def default_store_dir(loaded: LoadedModel, seqs: TokenSequences) -> Path:
    """The checkpoint folder of this (model, token ids, dtype): $OSCAR_ZOO_CACHE/calibration/<key>."""
    return cache_root() / "calibration" / store_key(loaded, seqs)


def store_key(loaded: LoadedModel, seqs: TokenSequences) -> str:
    ident = loaded.identity
    parts = [ident.id, str(ident.revision), ident.config_sha256, seqs.sha256, str(seqs.input_ids.shape),
             str(seqs.heldout_ids.shape), str(next(loaded.model.parameters()).dtype)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _pass(model, ids: torch.Tensor, batch_size: int, start: int, observer, desc: str, progress: Progress,
          checkpoint: Callable[[int, bool], None], clock: PassesClock | None = None) -> None:
    """One capture pass over sequences [start:]; `checkpoint(done, final)` after each batch (final: the last one).
    Each report carries `run_left`, the seconds left for all the run's passes (`clock`), not for this one."""
    T, n, t0 = ids.shape[1], ids.shape[0], time.perf_counter()
    clock = clock or PassesClock()
    clock.start(desc, (n - start) * T)
    last = start

    def on_batch(done: int) -> None:
        nonlocal last
        checkpoint(done, done == n)
        clock.advance(desc, (done - last) * T)
        last = done
        rate = (done - start) * T / max(time.perf_counter() - t0, 1e-9)
        progress(desc, done * T, n * T, rate=f"{rate:,.0f} tok/s", run_left=clock.seconds_left())

    progress(desc, start * T, n * T, rate="", run_left=clock.seconds_left())
    with capturing(model, observer):
        forward_batches(model, ids, batch_size, start=start, on_batch=on_batch)


def replay_bytes(ids: torch.Tensor, loaded: LoadedModel) -> int:
    """Bytes of the keys and values of every layer for the sequences `ids` [N, T], in the model's dtype."""
    info = loaded.info
    element = next(loaded.model.parameters()).element_size()
    return 2 * ids.numel() * info.num_layers * info.num_kv_heads * info.head_dim * element


def can_replay(loaded: LoadedModel, nbytes: int, dp: DataParallel | None = None) -> bool:
    """Whether pass 1 may keep `nbytes` of keys and values for pass 2: every layer runs on the CPU (there the second
    forward pass is the long part of a run) and they fit in `REPLAY_SHARE` of the host memory available now."""
    model = loaded.model
    if model_device(model).type != "cpu" or any(d.type != "cpu" for d in layer_devices(model).values()):
        return False
    return nbytes <= REPLAY_SHARE * host_available() / (dp.local_world if dp else 1)


Kept = list[list[tuple[int, torch.Tensor, torch.Tensor]]]  # per batch, in call order: (layer, k, v)


def _replay(kept: Kept, n: int, T: int, batch_size: int, observer, desc: str, progress: Progress,
            checkpoint: Callable[[int, bool], None], clock: PassesClock) -> None:
    """Pass `desc` over the keys and values pass 1 kept (per batch, the attention calls in the order they came):
    `observer` sees them in the order a forward pass over the sequences would show them, with the same checkpoints,
    clock and progress as `_pass`. Each batch is released once replayed."""
    t0 = time.perf_counter()
    clock.start(desc, n * T)
    progress(desc, 0, n * T, rate="", run_left=clock.seconds_left())
    with torch.inference_mode():
        for b in range(len(kept)):
            for layer, k, v in kept[b]:
                observer(layer, None, k, v, None, None)
            kept[b] = []
            done = min((b + 1) * batch_size, n)
            checkpoint(done, done == n)
            clock.advance(desc, (done - min(b * batch_size, n)) * T)
            rate = done * T / max(time.perf_counter() - t0, 1e-9)
            progress(desc, done * T, n * T, rate=f"{rate:,.0f} tok/s", run_left=clock.seconds_left())


def accumulate(loaded: LoadedModel, seqs: TokenSequences, settings: CalibrationSettings, store: AccumulatorStore,
               progress: Progress, dp: DataParallel | None = None, note: Info = lambda msg: None
               ) -> tuple[SecondMoment, SecondMoment, SecondMoment, dict, list[str], tuple[FirstMoment, ...]]:
    """The capture passes, resumable: (key target, weighted value target, softmax value target, held-out samples,
    passes run, (key mean, value mean, key-weighted value mean Σ w v / Σ w)). With `dp`, this rank's share of the
    sequences is accumulated, the returned sums are over all ranks, and the held-out samples are those of this rank's
    layers (`DataParallel.layers`). `note` hears what was resumed or reused."""
    info, model = loaded.info, loaded.model
    device = accumulator_device(model, settings.accumulate_on)
    L, H_kv, D = info.num_layers, info.num_kv_heads, info.head_dim
    ids = dp.shard(seqs.input_ids) if dp else seqs.input_ids
    N, bs = ids.shape[0], settings.batch_size
    ran: list[str] = []
    try:
        reduce = dp.reduce if dp else (lambda moment: moment)
        Moment = SecondMoment  # products form on each layer's device, sums live on `device`

        # Pass 1: key target, softmax value target and the key and value means (one forward over the sequences).
        saved = store.load("pass1")
        if saved and "k_mean.sums" not in saved:  # a checkpoint of an oscar-zoo without the means: start pass 1 again
            note(f"pass 1/2: the checkpoint in {store.folder} predates the key/value means; running pass 1 again")
            saved = None
        key = Moment.from_state(saved, "key", device) if saved else Moment.zeros(L, H_kv, D, device)
        soft = Moment.from_state(saved, "softmax", device) if saved else Moment.zeros(L, H_kv, D, device)
        k_mean = FirstMoment.from_state(saved, "k_mean", device) if saved else FirstMoment.zeros(L, H_kv, D, device)
        v_mean = FirstMoment.from_state(saved, "v_mean", device) if saved else FirstMoment.zeros(L, H_kv, D, device)
        done1 = store.progress(saved, "pass1_done")
        _report_checkpoint(note, store, "pass 1/2", done1, N)
        # the whole run's forward work, so every pass's bar shows the time left for all of them
        clock = PassesClock()
        T = ids.shape[1]
        clock.plan(PASS1, (N - done1) * T)
        clock.plan(HELDOUT, 0 if (store.folder / "heldout.safetensors").is_file() else seqs.heldout_ids.numel())
        weighted = settings.value_target == ValueTarget.WEIGHTED
        done2_kept = min(store.counter("pass2", "pass2_done"), N)
        # pass 2 replays pass 1's keys and values when this run forwards all of both passes and they fit in memory
        nbytes = replay_bytes(ids, loaded)
        replay = weighted and done1 == 0 and done2_kept == 0 and can_replay(loaded, nbytes, dp)
        if replay:
            note(f"pass 1/2 keeps the keys and values in host memory ({nbytes / GiB:.2f} GiB): pass 2/2 replays them "
                 "instead of a second forward pass")
        kept: Kept = []  # per finished batch of pass 1, when replaying
        batch: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        clock.plan(PASS2, (N - done2_kept) * T if weighted and not replay else 0)
        if done1 < N:
            def observe1(layer, q, k, v, out, scaling):
                key.add(layer, group_heads(q, H_kv))
                soft.add(layer, group_heads(out, H_kv))
                k_mean.add(layer, group_heads(k, H_kv))
                v_mean.add(layer, group_heads(v, H_kv))
                if replay:  # clones: the values and strides the attention call of pass 2 would hand its observer
                    batch.append((layer, k.clone(), v.clone()))

            def state1() -> dict[str, torch.Tensor]:
                return {**key.state("key"), **soft.state("softmax"), **k_mean.state("k_mean"),
                        **v_mean.state("v_mean")}

            def checkpoint1(done: int, final: bool) -> None:
                nonlocal batch
                if replay:
                    kept.append(batch)
                    batch = []
                store.save_async("pass1", state1, wait=final, pass1_done=done)

            _pass(model, ids, bs, done1, observe1, PASS1, progress, checkpoint1, clock)
            ran.append("pass1")
        # the checkpoint keeps this rank's sums; the reduced ones are new objects
        key, soft, k_mean, v_mean = reduce(key), reduce(soft), reduce(k_mean), reduce(v_mean)

        # Held-out attention inputs for the clip search (small: a few sequences), kept so re-fits need no forward.
        heldout = store.load("heldout")
        owned = set(dp.layers(L) if dp else range(L))
        if heldout:
            note(f"held-out capture: reused from the checkpoint in {store.folder}")
        if heldout is None:
            captured: dict[str, list[torch.Tensor]] = {}

            def observe_heldout(layer, q, k, v, out, scaling):
                if layer not in owned:
                    return
                for name, t in (("q", q), ("k", k), ("v", v)):
                    captured.setdefault(f"{layer}.{name}", []).append(t.detach().cpu())
                captured[f"{layer}.scaling"] = [torch.tensor([scaling], dtype=torch.float64)]

            _pass(model, seqs.heldout_ids, bs, 0, observe_heldout, HELDOUT, progress, lambda *_: None, clock)
            heldout = {k: torch.cat(v) for k, v in captured.items()}
            store.save("heldout", heldout)
            ran.append("heldout")

        # Pass 2: the weighted value target needs the finished key target (w_t = k_tᵀ C_Q k_t).
        saved = store.load("pass2")
        if saved and "v_wmean.sums" not in saved:  # a checkpoint without the weighted value mean: pass 2 again
            note(f"pass 2/2: the checkpoint in {store.folder} predates the weighted value mean; running pass 2 again")
            saved = None
        value = Moment.from_state(saved, "value", device) if saved else Moment.zeros(L, H_kv, D, device)
        v_wmean = FirstMoment.from_state(saved, "v_wmean", device) if saved else FirstMoment.zeros(L, H_kv, D, device)
        done2 = store.progress(saved, "pass2_done")
        if settings.value_target == ValueTarget.WEIGHTED:
            _report_checkpoint(note, store, "pass 2/2", done2, N)
        if settings.value_target == ValueTarget.WEIGHTED and done2 < N:
            replay = replay and done2 == 0 and len(kept) == -(-N // bs)  # every batch of pass 1 kept
            key_target = key.mean()
            on_layer_device: dict[int, torch.Tensor] = {}  # C_Q[layer] where that layer runs (one copy per run)

            def observe2(layer, q, k, v, out, scaling):
                kg, vg = group_heads(k, H_kv), group_heads(v, H_kv)
                if layer not in on_layer_device:
                    on_layer_device[layer] = key_target[layer].to(k.device)
                w = key_weights(kg, on_layer_device[layer])
                value.add(layer, vg, w)
                v_wmean.add(layer, vg, w)

            def checkpoint2(done: int, final: bool) -> None:
                store.save_async("pass2", lambda: {**value.state("value"), **v_wmean.state("v_wmean")}, wait=final,
                                 pass2_done=done)

            if replay:
                _replay(kept, N, T, bs, observe2, PASS2, progress, checkpoint2, clock)
            else:
                _pass(model, ids, bs, done2, observe2, PASS2, progress, checkpoint2, clock)
            ran.append("pass2")
        kept.clear()
        return key, reduce(value), soft, heldout, ran, (k_mean, v_mean, reduce(v_wmean))
    finally:
        store.flush()  # the last checkpoints are on disk before anyone reads the store


def _report_checkpoint(note: Info, store: AccumulatorStore, what: str, done: int, total: int) -> None:
    if done >= total:
        note(f"{what}: all {total} sequences reused from the checkpoint in {store.folder}")
    elif done:
        note(f"{what}: resuming from the checkpoint in {store.folder} after {done} of {total} sequences")


def layer_sample(heldout: dict[str, torch.Tensor], layer: int) -> clip_search.LayerSample:
    return clip_search.LayerSample(heldout[f"{layer}.q"], heldout[f"{layer}.k"], heldout[f"{layer}.v"],
                                   float(heldout[f"{layer}.scaling"][0]))


def calibrate(loaded: LoadedModel, seqs: TokenSequences, settings: CalibrationSettings,
              progress: Progress | None = None, store_dir: Path | None = None,
              dp: DataParallel | None = None, note: Info | None = None) -> CalibrationResult | None:
    """Run (or resume, or reuse) calibration and return the manifest (without its file list) and the tensors.
    With `dp`, every rank accumulates its share of the sequences; then each rank fits the rotations and runs the clip
    search of its own layers (round-robin), the results are gathered on rank 0 (bit for bit), and the other ranks
    return None. `note(line)` hears which checkpoints were resumed or reused (default: nobody)."""
    progress = progress or (lambda *a, **k: None)
    note = note or (lambda msg: None)
    t0 = time.perf_counter()
    info = loaded.info
    settings.group_for(info.head_dim)  # before any forward pass
    store_dir = Path(store_dir or default_store_dir(loaded, seqs))
    store = AccumulatorStore(store_dir / f"rank{dp.rank}-of-{dp.world}" if dp else store_dir)
    key, value, soft, heldout, ran, (k_sum, v_sum, v_wsum) = accumulate(loaded, seqs, settings, store, progress, dp,
                                                                        note)

    key_target = key.mean().cpu()
    value_target = (value if settings.value_target == ValueTarget.WEIGHTED else soft).mean().cpu()
    if settings.centred_value_target:
        value_target = centred_target(value_target, v_wsum.mean().cpu(), v_sum.mean().cpu())
    L = key_target.shape[0]
    mine = dp.layers(L) if dp else list(range(L))
    gather = dp.gather_layers if dp else (lambda t: t)

    def fit(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's layers fitted, the others' zero; then the whole [L, ...] tensors (on rank 0)."""
        rot, ev = fit_rotations(target[mine], settings.granularity)
        full_rot = torch.zeros((L, *rot.shape[1:]), dtype=rot.dtype)
        full_ev = torch.zeros((L, *ev.shape[1:]), dtype=ev.dtype)
        full_rot[mine], full_ev[mine] = rot, ev
        return full_rot, full_ev

    progress("rotations", 0, len(mine))
    (k_rot, k_ev), (v_rot, v_ev) = fit(key_target), fit(value_target)
    progress("rotations", len(mine), len(mine))
    k_mean = v_mean = None
    if settings.centring == Centring.MEAN:  # per KV head, or (per-layer rotations) the mean over the layer's heads
        k_mean, v_mean = (m.mean().float().cpu() for m in (k_sum, v_sum))
        if settings.granularity == Granularity.PER_LAYER:
            k_mean, v_mean = k_mean.mean(1, keepdim=True), v_mean.mean(1, keepdim=True)

    H = k_rot.shape[1]
    grid = clip_search.search_grid(settings.grid)
    search = settings.clip == ClipMode.SEARCH
    # a layer's search runs where the layer runs; with a device map the layers are visited round-robin over the
    # devices, so while one layer's inputs are copied to its GPU (a copy that waits for that GPU's queue) the
    # searches already queued on the other GPUs run
    devices = layer_devices(loaded.model)
    by_device: dict[torch.device, list[int]] = {}
    for layer in mine:
        by_device.setdefault(devices.get(layer, torch.device("cpu")), []).append(layer)
    order = [layer for turn in itertools.zip_longest(*by_device.values()) for layer in turn if layer is not None]
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    noises: dict[int, torch.Tensor] = {}
    stage = "clip search" if search else "key noise"  # fixed clips: only the key noise that ranks 3-bit layers
    for i, layer in enumerate(order):
        progress(stage, i, len(mine))
        on = devices.get(layer, torch.device("cpu"))
        means = {} if k_mean is None else {
            "k_mean": reference.rotate_mean(k_mean[layer], k_rot[layer]).to(on),
            "v_mean": reference.rotate_mean(v_mean[layer], v_rot[layer]).to(on)}
        sample = sample_on(layer_sample(heldout, layer), on)
        noises[layer] = clip_search.key_noise(sample, k_rot[layer].to(on), key_target[layer].to(on),
                                              settings.group_size, means.get("k_mean"))
        if search:
            tables[layer] = clip_search.objectives(sample, k_rot[layer].to(on), v_rot[layer].to(on),
                                                   key_target[layer].to(on), grid, settings.group_size, **means)
    progress(stage, len(mine), len(mine))
    R = len(grid)
    key_noise = torch.zeros(L, H, dtype=torch.float64)
    for layer, noise in noises.items():
        key_noise[layer] = noise.cpu()
    key_tables = value_tables = None
    if search:  # [L, R, H] float64 (the objectives' dtype), filled by the layers' owners
        key_tables, value_tables = (torch.zeros(L, R, H, dtype=torch.float64) for _ in range(2))
        for layer, (kt, vt) in tables.items():  # the first wait for a search result
            key_tables[layer], value_tables[layer] = kt.cpu(), vt.cpu()
    (k_rot, k_ev, v_rot, v_ev, key_noise) = (gather(t) for t in (k_rot, k_ev, v_rot, v_ev, key_noise))
    if key_tables is not None:
        key_tables, value_tables = gather(key_tables), gather(value_tables)
    if dp and not dp.is_main:
        return None
    if key_tables is not None:
        k_clip = torch.stack([clip_search.pick(t, grid) for t in key_tables])
        v_clip = torch.stack([clip_search.pick(t, grid) for t in value_tables])
    else:
        k_clip, v_clip = (torch.full((L, H), ratio, dtype=torch.float32) for ratio in settings.fixed_clips)
    key_bits = clip_search.choose_key_bits(key_noise, settings.key_bits)
    k_clip[torch.tensor(key_bits) == 3] = 1.0  # 3-bit keys are not clipped: a clip costs retrieval (QUALITY.md)
    # (per-channel keys, docs/format.md §6d, are never clipped: their k_clip is 1.0 from `fixed_clips`)

    rotations = Rotations(k_rotation=k_rot, v_rotation=v_rot, k_eigenvalues=k_ev, v_eigenvalues=v_ev,
                          k_clip=k_clip, v_clip=v_clip, layer_ids=torch.arange(L, dtype=torch.int32),
                          k_mean=k_mean, v_mean=v_mean)
    manifest = build_manifest(loaded, seqs, settings, grid, mixing=reference.mixing_matrix(info.head_dim)[1],
                              wall_seconds=time.perf_counter() - t0, key_bits=key_bits)
    return CalibrationResult(manifest, rotations, spectrum_ratio(k_ev).mean(-1), spectrum_ratio(v_ev).mean(-1),
                             key_tables, value_tables, grid, ran)


def build_manifest(loaded: LoadedModel, seqs: TokenSequences, settings: CalibrationSettings, grid: list[float],
                   mixing: str, wall_seconds: float, key_bits: list[int]) -> Manifest:
    """The manifest of a calibration; `key_bits`: the bits of each rotation layer's history keys (2 or 3)."""
    import transformers

    info, param = loaded.info, next(loaded.model.parameters())
    device = model_device(loaded.model)
    G = settings.group_for(info.head_dim)
    key_block = settings.key_block_for(info.head_dim)
    stored_bits = key_bits if max(key_bits) > layout.BITS else None  # 2-bit keys everywhere: the field stays absent
    search, (k_default, v_default) = settings.clip == ClipMode.SEARCH, settings.fixed_clips
    return Manifest(
        model=loaded.identity,
        quant=QuantSpec(group_size=G, sink=settings.sink, recent=settings.recent, flush=key_block or settings.flush,
                        centring=settings.centring, key_bits=stored_bits, pin=settings.pin or None,
                        key_block=key_block or None),
        rotation=RotationSpec(granularity=settings.granularity, value_target=settings.value_target, hadamard=mixing,
                              layer_ids=list(range(info.num_layers))),
        clip=ClipSpec(mode=settings.clip, grid=grid if search else [], k_default=k_default, v_default=v_default,
                      objective="key: E[(q·δk)²] under C_Q; value: attention-output MSE on held-out sequences"
                      + ("; on centred rows" if settings.centring == Centring.MEAN else "")
                      if search else "none (keys per channel unclipped; values unclipped unless fixed)" if key_block
                      else "none (fixed ratios)"),
        calibration=CalibrationRecord(
            dataset=seqs.dataset, token_ids_sha256=seqs.sha256, tokens=seqs.input_ids.numel(),
            sequences=seqs.input_ids.shape[0], seq_len=seqs.seq_len, heldout_tokens=seqs.heldout_ids.numel(),
            chat_template=seqs.chat_template, seed=settings.seed, device=str(device),
            dtype=str(param.dtype).removeprefix("torch."),
            versions={"oscar-zoo": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"), wall_seconds=round(wall_seconds, 3),
        ),
        bits_per_element={str(c): round(layout.kv_bits_per_element(c, G, settings.sink, settings.recent,
                                                                   key_bits, settings.pin, key_block), 4)
                          for c in BPE_CONTEXTS},
    )
