"""benchmarks/bench_generate.py on CPU: its prefill + decode loop is `generate` (same tokens), every cache kind runs
through `run_row`, and its memory accounting equals the bytes the cache's tensors actually hold (transformers'
QuantizedCache rows: a count by hand from the storage format)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_generate as bg
from oscar_zoo.runtime.cache import OscarCache

B, T = 2, 344  # 344 > sink 64 + recent 256: the history tier is populated


@pytest.fixture(scope="module")
def model():
    return bg.build_model("demo", 2, torch.device("cpu"))  # bf16, as on the GPU


def _storage_bytes(cache) -> int:
    """Independent count: every tensor attribute of every layer (OSCAR, bf16graph) or its K/V (transformers' caches
    and prealloc), by storage."""
    seen, total = set(), 0
    for layer in cache.layers:
        own = isinstance(cache, (OscarCache, bg.GraphBF16Cache))  # caches whose every tensor is per-token storage
        for t in vars(layer).values() if own else (layer.keys, layer.values):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def test_prefill_and_decode_reproduce_generate(model):
    """The benchmark's loop (one-chunk prefill, then decode steps) gives the tokens `generate` gives, OscarCache."""
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    bg.use_attention(model, "oscar")
    cache = bg.make_cache("oscar", model, T + 16)
    first = bg.prefill(model, cache, ids, chunk=T)
    got = torch.cat([first, bg.decode(model, cache, first, 9)], dim=1)
    kw = {bg.cache_kwarg(model): bg.make_cache("oscar", model, T + 16)}
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, **kw)
    assert torch.equal(got, expected[:, T:])
    assert cache.get_seq_length() == T + 9  # crossed one demotion


@pytest.mark.parametrize("kind", [k for k in bg.KINDS if k not in bg.PEER_KINDS + ("static-compiled",)])  # its
# cache is "static"'s; its decode is checked against it below
def test_run_row_and_memory_accounting(model, kind):
    """Every cache kind through run_row (chunked model prefill for OSCAR, K/V fill for the rest), decode steps across
    a demotion; kv_bytes == the bytes its tensors hold == the analytic expected_kv_bytes."""
    fill = "model" if kind == "oscar" else "kv"
    row = bg.run_row(model, kind, B, T, steps=2, warmup=8, fill=fill, chunk=256, phases=kind == "oscar")
    assert row["status"] == "ok" and row["generated"] == 2
    assert row["kv_bytes"] == row["expected_kv_bytes"]
    if kind == "oscar":
        assert {"attention kernels", "rotation", "cache write + demotion"} <= set(row["phases_ms_per_step"])
        assert row["warmup"] == 8 + 2  # a demotion (8 tokens) before the timed steps: its first-use compile untimed

    cache = bg.make_cache(kind, model, T + 20)
    bg.use_attention(model, kind)
    bg.fill_kv(cache, model, B, T, reserve=20)
    bg.decode(model, cache, torch.zeros(B, 1, dtype=torch.long), 9)  # 9 steps: one demotion of 8 tokens
    cfg = model.config
    cap = cache.layers[0].hist_k.shape[2] if kind == "oscar" else T + 20
    expected = bg.expected_kv_bytes(kind, B, T + 9, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cap)
    assert bg.kv_bytes(cache) == _storage_bytes(cache) == expected
    if kind == "oscar":
        assert cache.layers[0].n_hist == T + 9 - 64 - 257  # recent holds 256 + 1 after the demotion


# Bytes a QuantizedCache layer pair (K and V) of the demo model holds after a fill of T = 344 tokens and 8 + 128
# decode steps (B 2, H_kv 3, D 64, bf16): the fill and the 128th step quantize, so 472 tokens are quantized and 8 sit
# in the residual window. Per K (or V): 2·3·472 = 2832 groups of 64; INT2 codes 2832·64/4 = 45,312 bytes (quanto packs
# rows four to a byte: ⌈2832/4⌉ = 708 rows of 64 bytes, the same), INT4 90,624; scale + zero 2832·2·2 = 11,328;
# residual 8·2·3·64·2 = 6,144. Two layers, K and V: × 4.
PEER_BYTES = {"hf-quanto-int2": 4 * 62_784, "hf-hqq-int2": 4 * 62_784, "hf-quanto-int4": 4 * 108_096,
              "hf-hqq-int4": 4 * 108_096}


@pytest.mark.parametrize("kind", bg.PEER_KINDS)
def test_peer_rows(model, kind):
    """transformers' QuantizedCache rows: eager and said so, timed over a whole 128-step residual cycle, and their
    KV bytes are what the storage format says (a count made by hand above)."""
    row = bg.run_row(model, kind, B, T, steps=2, warmup=8, fill="kv", chunk=256, phases=True, graph=True)
    assert row["status"] == "ok" and row["graph"] is False and row["graph_note"].startswith("eager")
    assert row["steps"] == row["generated"] == 128
    assert row["kv_bytes"] == row["expected_kv_bytes"] == PEER_BYTES[kind]
    assert row["bytes_per_token_per_layer"] == PEER_BYTES[kind] / (B * (T + 136) * 2)
    assert {"attention kernels", "cache write"} <= set(row["phases_ms_per_step"])


def test_peer_rows_without_the_package_and_the_comparison_table(model, monkeypatch, capsys):
    args = bg.argparse.Namespace(steps=2, warmup=8, fill="kv", chunk=256, graph=False, fold=False, bandwidth_tbs=4.27,
                                 pin=0, key_block=0)
    monkeypatch.setattr(bg.peer_caches, "missing_package", lambda backend: "hqq" if backend == "hqq" else None)
    missing = bg.safe_row(model, "hf-hqq-int2", B, T, args)
    assert missing["status"] == "not installed" and "hqq" in missing["note"]
    rows = [bg.safe_row(model, k, B, T, args) for k in ("oscar", "hf-quanto-int2")] + [missing]
    bg.print_tables(dict(model="demo", layers=2, device="cpu", steps=2, fill="kv", rows=rows))
    out = capsys.readouterr().out
    oscar, quanto = rows[0]["ms_per_step"], rows[1]["ms_per_step"]
    assert f"| {T} | {B} | {oscar:.2f} | hf-quanto-int2 | {quanto:.2f} | {quanto / oscar:.2f}x |" in out


def test_max_batch_uses_measured_bytes():
    assert bg.max_batch(4096.0, 100_000, 36, 100e9) == 6
    assert bg.max_batch(590.0, 100_000, 36, 100e9) == 47


def test_pinned_rows_are_counted_and_pinned_by_the_kv_fill(model):
    """bench_generate --pin: the K/V fill pins as a prompt chunk would, and the analytic byte count (sink + pin BF16
    rows) equals what the tensors hold."""
    model._oscar_pin = 16
    try:
        cache = bg.make_cache("oscar", model, T + 20)
        bg.use_attention(model, "oscar")
        bg.fill_kv(cache, model, B, T, reserve=20)
        layer = cache.layers[0]
        assert (layer.n_pinned, layer.n_hist) == (16, T - 64 - 256 - 16) and layer.staged is None
        cfg = model.config
        expected = bg.expected_kv_bytes("oscar", B, T, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                        layer.hist_k.shape[2], pin=16)
        assert bg.kv_bytes(cache) == _storage_bytes(cache) == expected
    finally:
        del model._oscar_pin


def test_prefill_benchmark_reads_the_first_token_generate_would(model):
    """benchmarks/bench_prefill.py: its chunked prefill gives the first token transformers' generate() gives with the
    same cache kind (one whole-prompt chunk), for every kind; a chunked row runs too."""
    from benchmarks import bench_prefill as bp

    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    for kind in bp.KINDS:
        bg.use_attention(model, kind)
        got = bp.first_token(model, bg.make_cache(kind, model, T + 64), ids, chunk=T)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                             **{bg.cache_kwarg(model): bg.make_cache(kind, model, T + 64)})
        assert torch.equal(got, out[:, -1]), kind
        row = bp.run_row(model, kind, B, T, chunk=128)  # chunked: later chunks read the earlier ones' tiers
        assert row["tokens_per_s"] > 0 and len(row["first_token"]) == B


def test_prefill_repeats_take_turns_and_report_the_median(monkeypatch, capsys):
    """bench_prefill --repeats: each repeat runs every kind in turn (after the warm-up rows), a row reports the median
    of its runs with every run kept, and a kind out of memory once is not run again and stands as OOM."""
    from types import SimpleNamespace

    from benchmarks import bench_prefill as bp

    times = {"oscar": iter([30.0, 10.0, 11.0]), "bf16graph": iter([9.0, 11.0, 1.0])}  # medians 11 and 9, not means
    order = []

    def fake_row(model, kind, B, T, chunk):
        if T != 400:
            return {}  # the warm-up rows
        order.append(kind)
        if kind == "dynamic":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return dict(kind=kind, batch=B, context=T, chunk=chunk, ms=next(times[kind]), kv_bytes=1, first_token=[0],
                    tokens_per_s=0.0)

    monkeypatch.setattr(bp, "build_model", lambda *a: SimpleNamespace(config=SimpleNamespace(num_hidden_layers=1)))
    monkeypatch.setattr(bp, "run_row", fake_row)
    monkeypatch.delenv("OUT", raising=False)
    out = bp.main(["--contexts", "400", "--extra", "--kinds", "oscar", "bf16graph", "dynamic", "--repeats", "3"])
    assert order == ["oscar", "bf16graph", "dynamic", "oscar", "bf16graph", "oscar", "bf16graph"]
    rows = {r["kind"]: r for r in out["rows"]}
    assert (rows["oscar"]["ms"], rows["oscar"]["ms_runs"]) == (11.0, [30.0, 10.0, 11.0])
    assert rows["oscar"]["tokens_per_s"] == 400 / 0.011
    assert rows["bf16graph"]["ms"] == 9.0 and rows["dynamic"]["status"] == "OOM"
    assert "| 400 | 1 | oscar | 11.0 | 10.0–30.0 |" in capsys.readouterr().out
    even = [dict(kind="oscar", batch=1, context=400, ms=ms, kv_bytes=1) for ms in (5.0, 1.0, 3.0, 9.0)]
    assert bp.median_row(even)["ms"] == 3.0  # the lower middle of an even count


def test_per_channel_key_rows_are_counted_as_the_tensors_hold_them(model):
    """bench_generate --key-block: the K/V fill leaves whole key blocks in the history (the rest in the recent tier, up
    to recent + block) and the analytic byte count (one pair per channel and block) equals what the tensors hold."""
    model._oscar_key_block = 16
    try:
        cache = bg.make_cache("oscar", model, T + 20)
        bg.use_attention(model, "oscar")
        bg.fill_kv(cache, model, B, T, reserve=20)
        layer = cache.layers[0]
        assert (layer.n_hist, layer.n_recent) == (16, T - 64 - 16) and layer.sz_k.shape[2] * 16 == layer.hist_k.shape[2]
        cfg = model.config
        expected = bg.expected_kv_bytes("oscar", B, T, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                        layer.hist_k.shape[2], key_block=16)
        assert bg.kv_bytes(cache) == _storage_bytes(cache) == expected
    finally:
        del model._oscar_key_block


def test_bf16graph_cache_enters_a_compiled_step(model):
    """The BF16 graph's cache through the binding a compiled decode step runs under (`OscarBinding.compiled`, what the
    GPU's bf16graph rows take): entered and bound like an OscarCache, with no artifact means to check."""
    from oscar_zoo.runtime.binding import binding_of

    bg.use_attention(model, "bf16graph")
    binding = binding_of(model.model.layers[0].self_attn)
    cache = bg.make_cache("bf16graph", model, T + 20)
    with binding.compiled(cache):
        assert cache.binding is binding and binding.stepping
    assert not binding.stepping


def test_bf16graph_cache_speaks_the_static_step_protocol(model):
    """Every attribute DecodeGraphs reads of a cache (`cache.NAME` in graph.py) is in graph.STATIC_STEP_PROTOCOL and
    both caches that offer a static step have it; and capturing ahead (the rehearsal of both step kinds, what
    generate()'s first static step runs on a GPU) captures only the plain kind of a prefilled BF16 graph cache, which
    never demotes."""
    import ast
    import inspect

    from oscar_zoo.runtime import graph

    read = {node.attr for node in ast.walk(ast.parse(inspect.getsource(graph)))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cache"}
    assert read == set(graph.STATIC_STEP_PROTOCOL)
    bg.use_attention(model, "bf16graph")
    cache = bg.make_cache("bf16graph", model, T + 20)
    for kind in (bg.GraphBF16Cache, OscarCache):
        assert [n for n in graph.STATIC_STEP_PROTOCOL if not hasattr(kind, n)] == []
    with torch.inference_mode():
        ids = torch.randint(0, model.config.vocab_size, (B, T))
        model(input_ids=ids, use_cache=True, **{bg.cache_kwarg(model): cache})
    graphs = graph.DecodeGraphs(model, compile=False)
    graphs.versions = cache.static_step_key()[1]
    captured = []
    graphs._capture = lambda c, kwargs: captured.append(c.static_step_key()[0]) or object()
    kind = ((B, 1), ())
    graphs._capture_ahead(cache, {}, (False,) + kind)
    assert captured == [False] and set(graphs.graphs) == {(False,) + kind}
    assert cache.host_lengths() == [T] * len(cache.layers)


def test_a_budget_batch_that_does_not_fit_says_so(capsys):
    """The KV-budget table of a card with less memory than the budget: the batch that does not fit is named as such,
    not printed as nan, and no ratio is made of it; a timed row keeps its numbers."""
    budget = [dict(context=100_000, kind="oscar", max_batch=40, status="does not fit", ms_per_step=float("nan"),
                   tokens_per_s=float("nan")),
              dict(context=100_000, kind="bf16graph", max_batch=6, status="ok", ms_per_step=40.0, tokens_per_s=150.0),
              dict(context=100_000, kind="static", max_batch=0)]  # fmt: skip
    bg.print_tables(dict(model="demo", layers=2, device="cpu", steps=2, fill="kv", rows=[], budget_gb=100,
                         budget=budget))  # fmt: skip
    out = capsys.readouterr().out
    assert "| 100000 | oscar | 40 | does not fit | — |  |" in out
    assert "| 100000 | bf16graph | 6 | 40.00 | 150 |  |" in out
    assert "| 100000 | static | 0 | no batch fits | — |  |" in out and "nan" not in out
    ok = dict(status="ok", tokens_per_s=150.0)
    assert bg.throughput_ratio({"oscar": budget[0], "bf16graph": budget[1]}) is None
    assert bg.throughput_ratio({"oscar": dict(ok, tokens_per_s=600.0), "bf16graph": budget[1]}) == "4.00x"
    untimed = dict(status="does not fit")
    assert bg.throughput_ratio({"oscar": dict(ok, tokens_per_s=600.0), "bf16graph": untimed}) is None
