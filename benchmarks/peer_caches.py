"""transformers' QuantizedCache (quanto, HQQ) rows for bench_generate: the cache, its stored bytes, and what those
bytes must be from the storage format. The backend packages are imported only when a row builds its cache; a machine
without them gets a "not installed" row.

The cache is what `generate(cache_implementation="quantized", cache_config={"backend": b, "nbits": n})` builds: the
layer defaults of the installed transformers (axis_key 0, axis_value 0, q_group_size 64, residual_length 128 in 5.24).
Its decode step dequantizes the whole history and concatenates it with the residual window on every call, and every
`residual_length` steps re-quantizes everything: shapes change per step, so it runs eager (no CUDA graph).
"""

from __future__ import annotations

from oscar_zoo.evaluation.peers import layer_bytes, missing_package, new_cache
from oscar_zoo.evaluation.registry import PEERS

PEER_KINDS = tuple(PEERS)  # hf-quanto-int2, hf-hqq-int2, hf-quanto-int4, hf-hqq-int4
INT2_PEERS = tuple(k for k in PEER_KINDS if PEERS[k].nbits == 2)
EAGER_NOTE = "eager: QuantizedCache dequantizes and concatenates the history each step (shapes change), not capturable"
RESIDUAL = 128  # QuantizedLayer's default residual_length (checked against the instance in make_peer_cache)
GROUP = 64  # its default q_group_size


class PeerUnavailable(Exception):
    """The backend package of a peer row is not installed here."""


def make_peer_cache(kind: str, config):
    package = missing_package(PEERS[kind].backend)
    if package is not None:
        raise PeerUnavailable(f"not installed: {package} (pip install 'oscar-zoo[peers]')")
    cache = new_cache(PEERS[kind], config)
    layer = cache.layers[0]
    if (layer.residual_length, layer.q_group_size) != (RESIDUAL, GROUP):
        raise ValueError(f"this transformers' QuantizedCache defaults changed: residual_length "
                         f"{layer.residual_length}, q_group_size {layer.q_group_size}; "
                         "update benchmarks/peer_caches.py")
    return cache


def peer_kv_bytes(cache) -> int:
    """Bytes the cache holds: packed codes, scales, zeros/shifts and the residual window of every layer."""
    return sum(sum(layer_bytes(layer)) for layer in cache.layers if layer.is_initialized)


def expected_peer_kv_bytes(kind: str, B: int, T: int, L: int, H_kv: int, D: int, filled: int,
                           elem_bytes: int = 2) -> int:
    """What `peer_kv_bytes` must be after a one-update fill of `filled` tokens and T − filled decode steps: the fill
    and every 128th step quantize everything so far; the other steps sit in the residual window. Codes pack 8/nbits per
    byte (quanto along the rows of [numel/64, 64], rows rounded up to a whole byte; HQQ all codes); one scale and one
    zero (shift) of the model's dtype per group of 64."""
    steps = max(T - filled, 0)
    T_q = filled + RESIDUAL * (steps // RESIDUAL)
    groups = B * H_kv * T_q * D // GROUP
    per_byte = 8 // PEERS[kind].nbits
    codes = -(-groups // per_byte) * GROUP if PEERS[kind].backend == "quanto" else groups * GROUP // per_byte
    one = codes + 2 * groups * elem_bytes + (steps % RESIDUAL) * B * H_kv * D * elem_bytes  # K or V of one layer
    return L * 2 * one
