"""The runtime's launch and tuning settings as one frozen value (`RuntimeConfig`), and the scope in which one applies.

Every host wrapper (`ops`, `quantize_ops`, `rotate_op`) reads `current()` when it launches; nothing reassigns a
module global. The defaults are the measured ones (benchmarks/RESULTS.md); the four `OSCAR_*` switches of the
environment (docs/runtime.md, "Environment") are read once, when this module is imported. A benchmark or a test
that tries other settings passes a changed copy for a block:

    from dataclasses import replace
    from oscar_zoo.runtime import config

    with config.use(replace(config.current(), merge_tile=4096)):
        ...  # every launch in the block (this thread or task) uses merge_tile 4096
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator, Mapping


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch settings of the decode kernel for one head dim."""

    block_n: int  # INT2 history tokens per tile (the MMA rows of the score dot)
    warps: int
    stages: int  # software-pipeline depth of the history loop
    programs_per_sm: int  # split-K: at most this many INT2 (batch, KV head, split) programs per SM (resident at once)
    maxnreg: int | None  # register cap (None: the compiler's choice)
    # online softmax: 0 rescales the running sums whenever a maximum grows; s > 0 keeps a stale maximum until one grows
    # by more than s (log2 units), so most tiles skip the rescale (the partial sums stay ≤ 2^s times larger)
    rescale_slack: float = 8.0


def _switch(env: Mapping[str, str], name: str) -> bool:
    """An on/off switch of the environment: on unless set to something other than "1"."""
    return env.get(name, "1") == "1"


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Every launch and tuning setting of the runtime's kernels. Frozen: make another with `dataclasses.replace`.

    The decode settings were chosen on an H200 with `bench_decode.py --sweep` (rescale_slack with
    `--sweep-variants`); the measurements behind each, d = 128's 64-token tile included, are in benchmarks/RESULTS.md.
    `programs_per_sm` must not exceed what fits an SM (registers, shared memory); tests/runtime/test_kernel_compiles.py
    checks it for GQA and multi-head shapes at d = 64, 128 and 256. Head dims above 128 use `decode_128`."""

    decode_64: DecodeConfig = DecodeConfig(64, 1, 3, 12, 168)  # head dims ≤ 64
    decode_128: DecodeConfig = DecodeConfig(64, 1, 3, 8, None)  # larger head dims
    decode_block_nb: int = 32  # BF16 sink/recent tokens per tile (not pipelined: 320 tokens in all)
    decode_min_tiles: int = 2  # INT2 history tiles per split at least (short contexts: fewer, longer splits)
    # a padded batch's decode (rows of different lengths) takes up to this many times the splits: the INT2 programs
    # come in as many waves, so the SM slots that a short row's programs free take the long rows' next ones (in one
    # wave a step costs about B × the longest row; benchmarks/RESULTS.md, "Padded batches")
    ragged_waves: int = 8
    merge_programs: int = 512  # the merge splits head dims until it has about this many programs
    merge_tile: int = 8192  # [splits × dims] elements a merge program loads per step
    int2_asm: bool = True  # GPU: PTX byte-permute unpack of the INT2 codes (False: plain Triton); OSCAR_INT2_ASM
    quant_asm: bool = True  # GPU: quantize/pack sorts |x| as bf16x2/f16x2 pairs (False: float32); OSCAR_QUANT_ASM
    pdl: bool = True  # GPU ≥ sm_90: programmatic dependent launch of the decode, merge and prepass; OSCAR_PDL
    # keys per channel on the integer score path: each block's q·s as int8 operands first (kernels/block_query.py);
    # False: the bfloat16 dots with q·s folded per tile. OSCAR_BLOCK_QUERY
    block_query: bool = True
    quant_warps: int = 4  # quantize/pack: one row per thread, 32·quant_warps rows per program
    quant_channel_chunk: int = 16  # keys per channel: tokens a thread holds at once (blocks of more take two passes)
    # the interpreter runs a build of its own for keys per channel (a block's tile as one load, one pass); True runs
    # the GPU's build (per-token loads joined in registers, chunks of quant_channel_chunk) on the CPU too
    quant_channel_interpret_gpu_build: bool = False
    rotate_rows: int = 8  # rows (batch entries) of one head a rotate program serves with the block of M it loaded
    rotate_block_e: int = 32  # rotate: output columns per program (M read in [D, rotate_block_e] blocks)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RuntimeConfig:
        """The defaults with the environment's switches: OSCAR_INT2_ASM, OSCAR_QUANT_ASM, OSCAR_PDL and
        OSCAR_BLOCK_QUERY (each on unless set to something other than "1")."""
        env = os.environ if env is None else env
        return cls(int2_asm=_switch(env, "OSCAR_INT2_ASM"), quant_asm=_switch(env, "OSCAR_QUANT_ASM"),
                   pdl=_switch(env, "OSCAR_PDL"), block_query=_switch(env, "OSCAR_BLOCK_QUERY"))

    def decode_config(self, D: int) -> DecodeConfig:
        """The decode launch settings for head dim D."""
        return self.decode_64 if D <= 64 else self.decode_128

    def with_decode(self, **changes) -> RuntimeConfig:
        """This config with the same changes to the decode settings of every head dim (e.g. `rescale_slack=0`)."""
        return dataclasses.replace(self, decode_64=dataclasses.replace(self.decode_64, **changes),
                                   decode_128=dataclasses.replace(self.decode_128, **changes))


DEFAULT = RuntimeConfig.from_env()  # read once, at import
_CURRENT: contextvars.ContextVar[RuntimeConfig] = contextvars.ContextVar("oscar_runtime_config", default=DEFAULT)


def current() -> RuntimeConfig:
    """The config the launches of this thread or task use now (`DEFAULT` outside any `use` block)."""
    return _CURRENT.get()


@contextlib.contextmanager
def use(config: RuntimeConfig) -> Iterator[RuntimeConfig]:
    """Within the block, every launch of this thread or task uses `config`; the previous one comes back on exit."""
    if not isinstance(config, RuntimeConfig):
        raise TypeError(f"config.use needs a RuntimeConfig, got {type(config).__name__}")
    token = _CURRENT.set(config)
    try:
        yield config
    finally:
        _CURRENT.reset(token)
