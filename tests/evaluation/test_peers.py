"""transformers' QuantizedCache (quanto and HQQ, the real classes with their defaults) as verify baselines: what verify
reports for them is what real token-by-token decoding through that cache gives (metrics recomputed in float64 from
those logits), bits per element are the bytes the cache holds (against a count from the storage format), the needle
grid and the greedy comparison run them through their own cache, and a missing package is one line and exit 2."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
from transformers import QuantizedCache

from oscar_zoo.evaluation import peers
from oscar_zoo.evaluation.peers import PeerCache, flush_chunks
from oscar_zoo.evaluation.registry import PEERS
from oscar_zoo.format.verification import VerifyReport

from .conftest import CONTEXT, KL_RTOL, PPL_ATOL, RECENT, SINK, TOP1_POSITIONS
from .test_verify import _args

INT2 = ("hf-quanto-int2", "hf-hqq-int2")


@dataclass
class Expected:
    kl: float
    top1: float
    ppl_increase: float
    scored: int


@torch.inference_mode()
def _decode_logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits [T, V] of ids [1, T] fed one token at a time through `cache` (the model's own attention): what
    generate() computes at each position with that cache."""
    rows = [model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1] for t in range(ids.shape[1])]
    return torch.stack(rows)


def _expected(model, ids: torch.Tensor, name: str, start: int) -> Expected:
    """Float64 KL(exact ‖ peer), top-1 agreement and perplexity increase at positions ≥ start, from real decoding."""
    kl, top1, nll_ref, nll_got = [], [], [], []
    for s in range(ids.shape[0]):
        x = ids[s : s + 1]
        with torch.inference_mode():
            exact = model(input_ids=x, use_cache=False).logits[0].double().log_softmax(-1)[start:-1]
        got = _decode_logits(model, x, QuantizedCache(backend=PEERS[name].backend, config=model.config,
                                                      nbits=PEERS[name].nbits))
        got = got.double().log_softmax(-1)[start:-1]
        targets = x[0, start + 1 :, None]
        kl.append((exact.exp() * (exact - got)).sum(-1))
        top1.append((exact.argmax(-1) == got.argmax(-1)).double())
        nll_ref.append(-exact.gather(-1, targets).squeeze(-1))
        nll_got.append(-got.gather(-1, targets).squeeze(-1))
    kl, top1 = torch.cat(kl), torch.cat(top1)
    ppl = math.exp(torch.cat(nll_got).mean().item() - torch.cat(nll_ref).mean().item()) - 1
    return Expected(kl.mean().item(), top1.mean().item(), ppl, kl.numel())


def _stored_bits(backend: str, nbits: int, T: int, H: int, D: int, elem_bytes: int) -> float:
    """Bits per element from the storage format, for one of K or V of [1, H, T, D] after the decode schedule: the first
    token, then flushes every 128 tokens quantize everything so far; the rest is the residual window. Codes pack
    8/nbits per byte (quanto: along the rows of [H·T_q·D/64, 64], rows rounded up to a whole byte; HQQ: all codes);
    one scale and one zero/shift of the tensor's dtype per 64-element group."""
    T_q = 1 + 128 * ((T - 1) // 128)  # tokens quantized at the last flush
    groups = H * T_q * D // 64
    per_byte = 8 // nbits
    codes = (-(-groups // per_byte) * 64) if backend == "quanto" else groups * 64 // per_byte
    total = codes + 2 * groups * elem_bytes + (T - T_q) * H * D * elem_bytes
    return 8 * total / (H * T * D)


def test_flush_chunks():
    assert flush_chunks(1, 128) == [(0, 1)]
    assert flush_chunks(129, 128) == [(0, 1), (1, 129)]
    assert flush_chunks(300, 128) == [(0, 1), (1, 129), (129, 257), (257, 300)]


@pytest.mark.parametrize("name", list(PEERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bits_are_the_bytes_the_cache_holds(loaded, name, dtype):
    """PeerCache.bits after a run equals the count from the storage format, at lengths with and without a residual
    window, in float32 and bfloat16 (scales, zeros and residual in the cache's dtype)."""
    H, D = 3, 64
    method = PeerCache(name, PEERS[name], loaded.model.config, D)
    assert method.settings == {"nbits": PEERS[name].nbits, "axis_key": 0, "axis_value": 0, "q_group_size": 64,
                               "residual_length": 128}  # the installed transformers' documented defaults
    for T in (129, 300, 385):
        g = torch.Generator().manual_seed(T)
        q = torch.randn(1, 9, T, D, generator=g).to(dtype)
        k, v = torch.randn(2, 1, H, T, D, generator=g).to(dtype)
        method.attend(0, q, k, v, D**-0.5)
        want = _stored_bits(PEERS[name].backend, PEERS[name].nbits, T, H, D, torch.finfo(dtype).bits // 8)
        assert method.bits(T) == pytest.approx((want, want), rel=1e-12), (T, method.bits(T), want)
        assert method.stored_state_bits(T, dtype) == method.bits(T)  # the two-update shortcut holds the same bytes
    assert method.history_bits() == pytest.approx(PEERS[name].nbits + 2 * 16 / 64)  # + bf16 scale and zero per 64


def test_verify_reports_what_token_by_token_decoding_gives(run_cli, good_artifacts, model_dir, heldout_file,
                                                          loaded, heldout_ids):
    """verify's teacher-forced numbers for the 2-bit peers equal the float64 metrics of real token-by-token decoding
    through the same QuantizedCache (the model's own attention, one token per forward, across a flush), within the
    fp32 tolerances of the OSCAR expectation; the bits are the storage count; greedy runs through the real cache."""
    code, out, err = run_cli("verify", *_args(good_artifacts, model_dir, heldout_file, "--json", "--baselines",
                                              ",".join(INT2)))
    assert code == 0, err
    report = VerifyReport.from_dict(json.loads(out))
    assert [m.name for m in report.methods] == ["bf16", "oscar", *INT2]
    assert report.positions_from == SINK + RECENT and report.context == CONTEXT
    for name in INT2:
        got, want = report.method(name), _expected(loaded.model, heldout_ids, name, SINK + RECENT)
        assert want.kl > 0.01 and want.top1 < 1  # the quantization shows in the metrics
        assert got.kl == pytest.approx(want.kl, rel=KL_RTOL), (name, got.kl, want.kl)
        assert abs(got.top1 - want.top1) <= TOP1_POSITIONS / want.scored + 1e-12, (name, got.top1, want.top1)
        assert got.ppl_increase == pytest.approx(want.ppl_increase, abs=PPL_ATOL), (name, got.ppl_increase,
                                                                                     want.ppl_increase)
        bits = _stored_bits(PEERS[name].backend, 2, CONTEXT, 3, 64, 4)  # float32 run: fp32 scales and residual
        assert got.bits_per_element_k == got.bits_per_element_v == pytest.approx(bits, abs=1e-4)
        assert got.generation.path == "quantized-cache" and got.generation.new_tokens == 4
        assert len(got.layer_error) == 2 and all(e > 0 for e in got.layer_error)


def test_needle_and_table_run_the_peers(run_cli, good_artifacts, model_dir, heldout_file):
    code, out, err = run_cli("verify", *_args(good_artifacts, model_dir, heldout_file, "--generate", 0, "--baselines",
                                              "naive,hf-quanto-int4,hf-hqq-int2", "--needle", "--needle-lengths",
                                              "300", "--needle-depths", "0.5", "--needle-trials", "1",
                                              "--min-needle-accuracy", "0", "--sequences", 1))
    assert code == 0, err
    assert "HF quanto INT4" in out and "HF HQQ INT2" in out and "residual_length 128" in out
    code, out, err = run_cli("verify", *_args(good_artifacts, model_dir, heldout_file, "--generate", 0, "--baselines",
                                              "hf-hqq-int2", "--needle", "--needle-lengths", "300", "--needle-depths",
                                              "0.5", "--needle-trials", "1", "--min-needle-accuracy", "0",
                                              "--sequences", 1, "--json"))
    needle = json.loads(out)["needle"]
    assert [m["name"] for m in needle["methods"]] == ["bf16", "oscar", "hf-hqq-int2"]
    assert all(len(m["answers"]) == 1 for m in needle["methods"])


def test_missing_peer_package_is_one_line_exit_2(run_cli, good_artifacts, model_dir, heldout_file, monkeypatch):
    monkeypatch.setitem(peers.PACKAGES, "hqq", ("oscar_zoo_no_such_module", "hqq"))
    code, out, err = run_cli("verify", *_args(good_artifacts, model_dir, heldout_file, "--baselines", "hf-hqq-int2"))
    assert code == 2
    assert "hqq" in err and "oscar-zoo[peers]" in err and "Traceback" not in err + out
    code, out, err = run_cli("verify", *_args(good_artifacts, model_dir, heldout_file, "--baselines", "hf-fp8"))
    assert code == 2 and "hf-fp8" in err and "Traceback" not in err + out
