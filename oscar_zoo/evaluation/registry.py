"""Every method `verify` knows, registered once: the BF16 reference, the artifact, each baseline and each of
transformers' QuantizedCache peers, under its command-line name with its table name, its label and how it is built.
What a method does (teacher-forced attention, bits, the cache it decodes through) is the method's own (baselines.py,
peers.py); `verify`, the verification passes, the needle grid and the benchmarks read the methods from here. A new
baseline is one entry in BASELINES (or in _PEERS for another QuantizedCache setting).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import InputError
from ..format import layout
from .baselines import Exact, Kivi, Method, RotatedInt2, hadamard_rotation
from .peers import PeerCache, PeerSpec, require_installed

K_CLIP, V_CLIP = layout.DEFAULT_K_CLIP, layout.DEFAULT_V_CLIP


@dataclass(frozen=True)
class Setup:
    """What methods are built from: the artifact's rotations (artifacts.Rotations, indexed by model layer once sorted)
    and quant settings, the model's geometry, config (transformers' caches need it) and dtype (the reference's label).
    key_bits: the history keys' bits per entry of the rotations' layer_ids; pin: the artifact's pinned tokens."""

    rotations: Any
    num_layers: int
    head_dim: int
    group_size: int
    sink: int
    recent: int
    key_bits: list[int]
    flush: int = layout.FLUSH
    pin: int = 0
    key_block: int = 0
    config: Any = None
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def of(cls, manifest, rotations, model, info) -> Setup:
        """The setup `verify` runs: the manifest's quant settings, the loaded model's geometry, config and dtype."""
        q = manifest.quant
        return cls(rotations, info.num_layers, info.head_dim, q.group_size, q.sink, q.recent, manifest.key_bits,
                   q.flush, getattr(manifest, "pin", 0), getattr(manifest, "key_block", 0), model.config,
                   next(model.parameters()).dtype)


@dataclass(frozen=True)
class Entry:
    """A registered method: `name` on the command line and in reports, `short` its row in verify's tables; default:
    a baseline verify runs when --baselines is not given."""

    name: str
    short: str
    default: bool = field(default=False, kw_only=True)

    def check(self) -> None:
        """InputError when the method cannot run on this machine (checked before the model loads)."""

    def build(self, setup: Setup) -> Method:
        raise NotImplementedError


@dataclass(frozen=True)
class Reference(Entry):
    """The model's own attention and cache, labelled by the dtype it runs in (its row is named by that dtype)."""

    def build(self, setup):
        exact = Exact.for_dtype(setup.dtype)
        exact.head_dim = setup.head_dim
        return exact


@dataclass(frozen=True)
class Artifact(Entry):
    """The artifact's OSCAR rotations, clips, means and key bits, as its manifest asks."""

    def build(self, s):
        rot = s.rotations
        order = torch.argsort(rot.layer_ids.long())  # entries sorted by model layer
        H = rot.k_rotation.shape[1]
        layer_bits = [s.key_bits[i] for i in order.tolist()]
        three = f", 3-bit keys in {layer_bits.count(3)}/{len(layer_bits)} layers" if max(layer_bits) > 2 else ""
        three += f", keys per channel over {s.key_block}-token blocks" if s.key_block else ""
        means = (None, None) if rot.k_mean is None else (rot.k_mean[order], rot.v_mean[order])
        oscar = RotatedInt2(
            self.name, f"OSCAR INT2 ({'per-head' if H > 1 else 'per-layer'} U·H·P, "
            f"{'unclipped' if s.key_block else 'calibrated clips'}"
            f"{', centred' if rot.k_mean is not None else ''}{three})", "artifact",
            rot.k_rotation[order], rot.v_rotation[order], rot.k_clip[order], rot.v_clip[order], s.group_size,
            s.sink, s.recent, *means, key_bits=layer_bits, flush=s.flush, pin=s.pin, key_block=s.key_block)
        oscar.head_dim = s.head_dim
        return oscar


@dataclass(frozen=True)
class Baseline(Entry):
    """A data-free baseline: `make(setup)` builds it (name and label are set from the entry). Baselines use the
    artifact's group size and windows, and INT2 keys."""

    label: str = ""
    make: Callable[[Setup], Method] | None = None

    def build(self, setup):
        method = self.make(setup)
        method.name, method.label, method.kind, method.head_dim = self.name, self.label, "baseline", setup.head_dim
        return method


@dataclass(frozen=True)
class Peer(Entry):
    """transformers' QuantizedCache with its defaults, only the backend and nbits chosen (peers.py)."""

    spec: PeerSpec | None = None

    def check(self):
        require_installed(self.name, self.spec)

    def build(self, setup):
        return PeerCache(self.name, self.spec, setup.config, setup.head_dim)


def _int2(s: Setup, rotation: Tensor | None, k_clip: float, v_clip: float) -> RotatedInt2:
    """Uncentred INT2 with one rotation for K and V in every layer (None: none) and fixed clips (0: none)."""
    L = s.num_layers
    return RotatedInt2("", "", "baseline", rotation, rotation, torch.full((L, 1), k_clip), torch.full((L, 1), v_clip),
                       s.group_size, s.sink, s.recent, flush=s.flush)


REFERENCE = Reference("bf16", "BF16")
ARTIFACT = Artifact("oscar", "OSCAR")
_PEERS = (
    Peer("hf-quanto-int2", "HF quanto INT2", PeerSpec("quanto", 2)),
    Peer("hf-hqq-int2", "HF HQQ INT2", PeerSpec("hqq", 2)),
    Peer("hf-quanto-int4", "HF quanto INT4", PeerSpec("quanto", 4)),
    Peer("hf-hqq-int4", "HF HQQ INT4", PeerSpec("hqq", 4)),
)
# the order here is the order of verify's rows
BASELINES: dict[str, Entry] = {e.name: e for e in (
    Baseline("naive", "naive INT2", "naive INT2 (no rotation, no clip)", lambda s: _int2(s, None, 0.0, 0.0),
             default=True),
    Baseline("clip-only", "clip-only INT2", f"clip-only INT2 (no rotation, clip {K_CLIP}/{V_CLIP})",
             lambda s: _int2(s, None, K_CLIP, V_CLIP)),
    Baseline("hadamard", "Hadamard INT2", f"Hadamard-only INT2 (H·P, fixed clip {K_CLIP}/{V_CLIP})",
             lambda s: _int2(s, hadamard_rotation(s.num_layers, s.head_dim), K_CLIP, V_CLIP), default=True),
    Baseline("kivi", "KIVI-2-style", Kivi.label, lambda s: Kivi(s.head_dim, s.sink, s.recent), default=True),
    *_PEERS,
)}
PEERS = {e.name: e.spec for e in _PEERS}
DEFAULT_BASELINES = tuple(n for n, e in BASELINES.items() if e.default)
SHORT = {e.name: e.short for e in (REFERENCE, ARTIFACT, *BASELINES.values())}


def check_baselines(names: tuple[str, ...]) -> None:
    """The one check of requested baseline names: InputError (exit 2) for an unknown name, or for a baseline that
    cannot run here (a missing package)."""
    unknown = [b for b in names if b not in BASELINES]
    if unknown:
        raise InputError(f"unknown baseline(s) {', '.join(unknown)}", f"choose from {', '.join(BASELINES)}, or none")
    for name in BASELINES:
        if name in names:
            BASELINES[name].check()


def build_methods(setup: Setup, baselines: tuple[str, ...]) -> list[Method]:
    """The reference, the artifact, then the requested baselines in the order of BASELINES."""
    check_baselines(baselines)
    return [REFERENCE.build(setup), ARTIFACT.build(setup)] + [e.build(setup) for n, e in BASELINES.items()
                                                              if n in baselines]
