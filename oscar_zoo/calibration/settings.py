"""What a calibration is asked, typed and checked once. Closed vocabularies are str Enums, the same members from the
command line's choices to the manifest's values; every bound is checked when `CalibrationSettings` (the fit) or
`CalibrationRequest` (model, data, devices) is made, the group size against the head dim by `group_for` once the
model's config is read. Errors are `SettingError`s naming the setting (`group_size 5: expected …`); the command spells
them as its flags (`--group-size 5: expected …`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from ..errors import SettingError, literal
from ..format import layout
from ..format.layout import Centring, Choice
from ..format.schema import ClipMode, Granularity, ValueTarget
from ..models import DEMO, check_revision_applies
from ..texts import check_dataset_options, check_seq_len
from . import clip_search, distributed

# benchmarks/notes/2026-12-04-retrieval-3-bit-keys.md: 2.98 bits/element at 32K for D = 64 (≤ 3.0), needle 57 → 72 %
DEFAULT_KEY_BITS = 2.7


class AccumulateOn(Choice):
    """Where the float64 sums live: the model's first device, or the CPU (products still form on each layer's)."""

    MODEL = "model"
    CPU = "cpu"


class DeviceMap(Choice):
    """accelerate's ways to spread the layers over the visible GPUs (then CPU, then disk)."""

    AUTO = "auto"
    BALANCED = "balanced"
    SEQUENTIAL = "sequential"


def _vocabulary(obj, name: str, kind: type[Enum]) -> None:
    """obj.name as a member of `kind` (its value is accepted too); SettingError naming the setting otherwise."""
    value = getattr(obj, name)
    try:
        object.__setattr__(obj, name, kind(value))
    except ValueError:
        raise SettingError(name, f"{{{name}}} {literal(repr(value))}: expected one of "
                           f"{', '.join(m.value for m in kind)}") from None


def _need(ok: bool, setting: str, value, expected: str, advice: str | None = None) -> None:
    if not ok:  # NaN fails every comparison, so it lands here too
        raise SettingError.bound(setting, value, expected, advice)


@dataclass(frozen=True)
class CalibrationSettings:
    """How the rotations and clips are fitted and what the manifest prescribes to runtimes. Strings are accepted for
    the vocabularies (`clip="fixed"`) and become their Enum members; bounds are checked here, once."""

    granularity: Granularity = Granularity.PER_HEAD
    value_target: ValueTarget = ValueTarget.WEIGHTED
    # None: search for keys per row, fixed (both unclipped) for keys per channel (`key_block`)
    clip: ClipMode | None = None
    k_clip: float | None = None  # fixed key clip ratio, for clip "fixed" only (None: layout.DEFAULT_K_CLIP)
    v_clip: float | None = None  # fixed value clip ratio, likewise (None: layout.DEFAULT_V_CLIP; 1.0 per channel)
    grid: tuple[float, ...] = clip_search.DEFAULT_GRID
    group_size: int = 0
    key_bits: float = DEFAULT_KEY_BITS  # mean history-key bits over the layers: the round((key_bits − 2)·L) layers
    # whose INT2 keys add the most logit noise get 3-bit, unclipped keys (docs/format.md §6b; 2 = the INT2 codec)
    sink: int = layout.SINK
    recent: int = layout.RECENT
    flush: int = layout.FLUSH
    pin: int = 0  # history tokens per KV head a prompt pins in BF16 (docs/format.md §6c; 0: none, the default)
    # history keys per channel over blocks of this many tokens, unclipped, values unclipped (docs/format.md §6d;
    # None: `layout.default_key_block` of the head dim, the default codec); 0: keys per row with searched clips
    key_block: int | None = None
    centring: Centring = Centring.NONE  # none: rows stored as x·M (schema 1's); mean: the centred codec
    # (docs/format.md §6a), lower KL but worse needle retrieval (benchmarks/notes/2026-12-01-codec-v2-centring.md)
    centred_value_target: bool = False  # weighted value target about μ_V (a covariance) instead of about 0; measured
    # in benchmarks/QUALITY.md, not a default (library only)
    batch_size: int = 4
    seed: int = 0
    accumulate_on: AccumulateOn = AccumulateOn.MODEL

    def __post_init__(self) -> None:
        """The sink and recent windows are not used by the calibration itself (the clip search scores every held-out
        position); they are the cache tiers the manifest prescribes to runtimes. So they are checked for sanity, not
        against the sequence length: each ≥ 0, and together (with the pinned tokens) below layout.MAX_WINDOWS so that
        a long context has INT2 history at all (`layout.check_windows`, the bound every reader applies)."""
        if self.key_block is not None and self.key_block != 0 and self.key_block not in layout.KEY_BLOCKS:
            raise SettingError.bound("key_block", self.key_block, "0 (keys per row) or a block of "
                                     + ", ".join(map(str, layout.KEY_BLOCKS)) + " tokens")
        if self.clip is None:  # per-channel keys are unclipped: nothing to search
            object.__setattr__(self, "clip", ClipMode.FIXED if self.per_channel else ClipMode.SEARCH)
        for name, kind in (("granularity", Granularity), ("value_target", ValueTarget), ("clip", ClipMode),
                           ("centring", Centring), ("accumulate_on", AccumulateOn)):
            _vocabulary(self, name, kind)
        given = [(name, v) for name, v in (("k_clip", self.k_clip), ("v_clip", self.v_clip)) if v is not None]
        if self.clip == ClipMode.SEARCH and given:
            raise SettingError(given[0][0], " ".join(f"{{{name}}} {literal(v)}" for name, v in given)
                               + ": fixed clip ratios are used by {clip} fixed only; {clip} search finds its own",
                               "add {clip} fixed, or leave the clip ratios out")
        for name, value in given:
            _need(0 < value <= 1, name, value, "a clip ratio in (0, 1]")
        _need(self.group_size >= 0, "group_size", self.group_size, "0 (one group per row) or a divisor of the "
              "model's head_dim")
        _need(2 <= self.key_bits <= 3, "key_bits", self.key_bits, "a mean key bit width in [2, 3]",
              "2 keeps INT2 keys everywhere, 3 gives every layer 3-bit keys")
        _need(self.sink >= 0, "sink", self.sink, "a number of full-precision sink tokens ≥ 0")
        _need(self.recent >= 0, "recent", self.recent, "a number of full-precision recent tokens ≥ 0")
        _need(0 <= self.pin <= layout.MAX_WINDOW, "pin", self.pin,
              f"a number of pinned tokens in [0, {layout.MAX_WINDOW:,}]")
        if self.per_channel:
            for name, bad, why in (("clip", self.clip == ClipMode.SEARCH, "{clip} search"),
                                   ("k_clip", self.k_clip is not None, f"{{k_clip}} {literal(self.k_clip)}"),
                                   ("pin", self.pin != 0, f"{{pin}} {self.pin}")):
                if bad:
                    raise SettingError(name, f"{why} with keys per channel ({{key_block}} "
                                       f"{self.key_block if self.key_block is not None else 'default'}): its keys are "
                                       "unclipped and its history holds whole token blocks (docs/format.md §6d)",
                                       "add {key_block} 0 for the per-row codec, or leave it out")
        if not self.sink + self.pin + self.recent < layout.MAX_WINDOWS:
            raise SettingError("sink", f"{{sink}} + {{pin}} + {{recent}} {self.sink} + {self.pin} + {self.recent}: "
                               f"expected less than {layout.MAX_WINDOWS:,} tokens (beyond that a 32K context keeps no "
                               "INT2 history)")
        _need(self.batch_size >= 1, "batch_size", self.batch_size, "at least 1 sequence per forward pass")
        if self.centred_value_target and self.value_target != ValueTarget.WEIGHTED:
            raise SettingError("centred_value_target", "a centred value target ({centred_value_target}) is defined "
                               "for {value_target} weighted only")

    @property
    def per_channel(self) -> bool:
        """Keys per channel over token blocks (docs/format.md §6d): the default, unless key_block is 0."""
        return self.key_block != 0

    def key_block_for(self, head_dim: int) -> int:
        """The key block for rows of `head_dim`: 0 (keys per row), the block asked, or the head dim's default."""
        return layout.default_key_block(head_dim) if self.key_block is None else self.key_block

    @property
    def fixed_clips(self) -> tuple[float, float]:
        """The (key, value) ratios of clip "fixed", also the manifest's defaults: k_clip, v_clip or the format's (per
        channel: keys and, by default, values unclipped, 1.0)."""
        if self.per_channel:
            return 1.0, 1.0 if self.v_clip is None else self.v_clip
        return (layout.DEFAULT_K_CLIP if self.k_clip is None else self.k_clip,
                layout.DEFAULT_V_CLIP if self.v_clip is None else self.v_clip)

    def group_for(self, head_dim: int) -> int:
        """The group size G for rows of `head_dim` (group_size 0: one group per row); SettingError naming group_size
        when it does not divide the head dim (the one check of it, run as soon as the model's config is read)."""
        try:
            G = layout.resolve_group_size(head_dim, self.group_size)
        except ValueError as exc:
            raise SettingError.bound("group_size", self.group_size, f"0 or a divisor of the model's head_dim "
                                     f"{head_dim} ({literal(exc)})") from None
        if self.per_channel and G != head_dim:
            raise SettingError("group_size", f"{{group_size}} {self.group_size} with keys per channel: values are "
                               f"coded per row (G = head_dim {head_dim})", "add {key_block} 0, or leave it out")
        return G


# calibrate's default sample: 131,072 tokens (256 sequences of 512). On the demo model, 16,384 (the earlier default)
# lost 2.0 / 3.0 / 5.2 points of needle retrieval against BF16 at 1K / 2K / 4K; 131,072 lost none (−0.2 / +1.7 / +1.5)
# at the same bits, and teacher-forced KL fell 0.0208 → 0.0186 (benchmarks/notes/2026-12-05-calibration-tokens.md)
DEFAULT_TOKENS = 131072


@dataclass(frozen=True)
class CalibrationRequest:
    """What `calibrate` was asked beyond the fit: the model, the text, the devices and where to write. Checked when
    made: options that would do nothing in the combination given are refused, never ignored."""

    out: Path
    settings: CalibrationSettings = field(default_factory=CalibrationSettings)
    model: str = DEMO
    revision: str | None = None
    dataset: str | None = None
    text_field: str | None = None
    split: str | None = None
    tokens: int = DEFAULT_TOKENS  # rounded down to whole sequences
    seq_len: int = 512
    heldout: int = 2  # held-out sequences for the clip search
    chat_template: bool = False
    device: str = "auto"
    dtype: str = "auto"
    device_map: DeviceMap | None = None
    max_memory: str | None = None  # e.g. 0=70GiB,1=70GiB,cpu=200GiB (default: what is free)
    offload_folder: Path | None = None
    nproc: int = 1  # data-parallel processes to launch on this machine (1 under torchrun: the ranks come from it)
    argv: tuple[str, ...] = ()  # the command line each launched process runs (`python -m oscar_zoo ARGV`)

    def __post_init__(self) -> None:
        check_dataset_options(self.dataset, self.split, self.text_field)
        check_revision_applies(self.model, self.revision)
        if self.device_map is not None:
            _vocabulary(self, "device_map", DeviceMap)
        if self.offload_folder is not None and self.device_map is None:
            raise SettingError("offload_folder", f"{{offload_folder}} {literal(self.offload_folder)}: only "
                               "{device_map} offloads weights to disk",
                               "add {device_map} auto, or leave {offload_folder} out")
        if self.device_map is not None and self.device != "auto":
            raise SettingError("device", f"{{device}} {literal(self.device)} with {{device_map}} "
                               f"{self.device_map.value}: the device map places the layers", "leave {device} out")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if distributed.in_distributed_env() and self.nproc not in (1, world):
            raise SettingError("nproc", f"{{nproc}} {self.nproc} under torchrun with WORLD_SIZE {world}: the "
                               "processes come from torchrun", "leave {nproc} out")
        if (self.nproc > 1 or distributed.in_distributed_env()) and re.fullmatch(r"cuda:\d+", self.device):
            raise SettingError("device", f"{{device}} {literal(self.device)} with several processes: each process "
                               "takes the GPU of its local rank",
                               "use {device} cuda (or auto); choose the GPUs with CUDA_VISIBLE_DEVICES")
        check_seq_len(self.seq_len)
        _need(self.tokens >= self.seq_len, "tokens", self.tokens,
              f"at least one sequence of {{seq_len}} {self.seq_len} tokens")
        _need(self.heldout >= 0, "heldout", self.heldout, "a number of held-out sequences ≥ 0")
        s = self.settings
        _need((s.clip != ClipMode.SEARCH and s.key_bits == layout.BITS) or self.heldout >= 1, "heldout", self.heldout,
              "≥ 1 with {clip} search or {key_bits} above 2 (the clip search and the choice of 3-bit key layers "
              "score on held-out sequences)", "or use {clip} fixed with {key_bits} 2")
        _need(self.nproc >= 1, "nproc", self.nproc, "at least 1 process")
        cores = os.cpu_count() or 1  # each process needs a core of its own (on a GPU machine, a GPU too)
        _need(self.nproc <= cores or distributed.in_distributed_env(), "nproc", self.nproc,
              f"at most one process per CPU core of this machine ({cores})")

    @property
    def n_sequences(self) -> int:
        return self.tokens // self.seq_len

    @property
    def heldout_tokens(self) -> int:
        return self.heldout * self.seq_len

