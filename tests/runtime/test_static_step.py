"""The static (CUDA-graph capturable) decode step of OscarCache and the explicit cache binding of the attention.

The static step writes by device-side lengths and demotes in place; the general filing path (`OscarLayer._append`,
Python-int slices and a cat) is an independent implementation of the same tier rule, so the two must give identical
tiers and identical logits. On CPU both run through the reference ops, and under TRITON_INTERPRET=1 through the
Triton kernels; the GPU copies check capture + replay in generate() (marked gpu)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen3Config

from oscar_zoo.format import layout, reference
from oscar_zoo.runtime import ops
from oscar_zoo.runtime.attention import enable_oscar, fold_value_rotation, oscar_attention
from oscar_zoo.runtime.cache import OscarCache, OscarLayer
from oscar_zoo.runtime.graph import DecodeGraphs, _Step, decode_graphs

D = 64


def _rotations(L: int, H: int, D: int = D, seed: int = 0) -> torch.Tensor:
    mats = [reference.random_orthogonal(D, seed=seed + i) for i in range(L * H)]
    return torch.stack(mats).float().reshape(L, H, D, D)


def _llama(layers: int = 2, dtype=torch.bfloat16, device="cpu"):
    """SmolLM2's attention shape (9 q / 3 kv heads, head_dim 64), small elsewhere, random weights."""
    cfg = LlamaConfig(vocab_size=512, hidden_size=144, intermediate_size=288, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=D, max_position_embeddings=2048,
                      initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def _cache(L: int, H: int = 3, D: int = D, centred: bool = False, **kw) -> OscarCache:
    """Random rotations and clips; `centred`: with random per-(layer, head) means (the codec of docs/format.md §6a)."""
    clips = torch.linspace(0.9, 0.97, L * H).reshape(L, H)
    if centred:
        g = torch.Generator().manual_seed(3)
        kw = {**kw, "k_mean": torch.randn(L, H, D, generator=g), "v_mean": torch.randn(L, H, D, generator=g)}
    return OscarCache.from_tensors(_rotations(L, H, D), _rotations(L, H, D, seed=50), clips, 0.92, **kw)


@torch.no_grad()
def _decode_logits(model, cache, ids, prompt: int) -> torch.Tensor:
    """Prefill ids[:, :prompt], then teacher-force the rest one token at a time; logits [B, steps, V] fp32."""
    out = [model(ids[:, :prompt], cache=cache).logits[:, -1]]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], cache=cache).logits[:, -1])
    return torch.stack(out, 1).float()


def _general_path_only(monkeypatch):
    monkeypatch.setattr(OscarLayer, "is_static_step", lambda self, n: False)


@pytest.mark.parametrize(("backend", "B", "steps", "tiers", "centred", "key_bits"),
                         [("reference", 1, 45, (64, 256), False, 2), ("reference", 3, 45, (64, 256), False, 2),
                          ("reference", 2, 45, (64, 256), True, 2), ("reference", 2, 45, (64, 256), False, 3),
                          ("interpreter", 1, 17, (16, 32), False, 2), ("interpreter", 1, 9, (16, 32), True, 2),
                          ("interpreter", 2, 9, (16, 32), False, 3)])
def test_static_step_equals_general_path(backend, B, steps, tiers, centred, key_bits, monkeypatch,
                                         fewest_programs):
    """A prefill 10 tokens past sink + recent, then teacher-forced decode steps (45: 5 demotions; under the
    interpreter, with small tiers to keep it quick, 17: 2, and 9 for the centred codec and 3-bit keys: 1): the static
    step (device-indexed writes, in-place demotion) gives bit-identical logits and tiers to the general filing path,
    through the reference ops or the Triton kernels (interpreter); the static path and the kernels were taken."""
    sink, recent = tiers
    prompt = sink + recent + 10
    if backend == "interpreter":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:  # the reference ops, also when the whole run has TRITON_INTERPRET=1
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel_calls = []
    real = ops.launch_decode
    monkeypatch.setattr(ops, "launch_decode", lambda *a, **k: kernel_calls.append(1) or real(*a, **k))
    static_writes = []
    real_write = OscarLayer.write_token
    monkeypatch.setattr(OscarLayer, "write_token", lambda self, *a: static_writes.append(1) or real_write(self, *a))
    model = enable_oscar(_llama(layers=1))
    ids = torch.randint(0, 512, (B, prompt + steps), generator=torch.Generator().manual_seed(B))
    static_cache = _cache(1, sink=sink, recent=recent, centred=centred, key_bits=[key_bits])
    static = _decode_logits(model, static_cache, ids, prompt)
    assert len(static_writes) == steps and (len(kernel_calls) == steps) == (backend == "interpreter")

    with monkeypatch.context() as m:
        _general_path_only(m)
        general_cache = _cache(1, sink=sink, recent=recent, centred=centred, key_bits=[key_bits])
        general = _decode_logits(model, general_cache, ids, prompt)
    assert len(static_writes) == steps  # the general path never went through write_token
    assert torch.equal(static, general)
    a, b = static_cache.layers[0], general_cache.layers[0]
    assert a.hist_k.shape[-1] == layout.packed_dim(D, key_bits)
    assert (a.n_sink, a.n_hist, a.n_recent) == (b.n_sink, b.n_hist, b.n_recent)
    assert (a.n_sink, a.n_hist, a.n_recent) == (sink, 10 + 8 * (steps // 8), recent + steps % 8)
    assert a.hist_len.tolist() == [a.n_hist] * B and a.recent_len.tolist() == [a.n_recent] * B
    for name in ("sink_k", "sink_v", "recent_k", "recent_v"):
        assert torch.equal(getattr(a, name)[:, :, : a.n_recent], getattr(b, name)[:, :, : a.n_recent]), name
    for name in ("hist_k", "hist_v", "sz_k", "sz_v"):
        assert torch.equal(getattr(a, name)[:, :, : a.n_hist], getattr(b, name)[:, :, : a.n_hist]), name


def test_static_step_keeps_every_address_and_lengths_on_the_device():
    """Across 20 static steps (two demotions) no storage tensor moves (after the history is reserved), the host mirror
    equals the device lengths, and the key of the next step says when a demotion comes."""
    cache = _cache(1)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 3, 340, D, generator=g).bfloat16(), torch.randn(2, 3, 340, D, generator=g).bfloat16()
    cache.update(k[:, :, :320], v[:, :, :320], 0)
    cache.reserve(340)
    ptrs = {name: getattr(layer, name).data_ptr() for name in layer._STORAGE + layer._LENGTHS}
    kinds = []
    for t in range(320, 340):
        kinds.append(cache.static_step_key()[0])
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
        assert (layer.sink_len.tolist(), layer.hist_len.tolist(), layer.recent_len.tolist()) == (
            [64, 64], [layer.n_hist] * 2, [layer.n_recent] * 2)  # fmt: skip
    assert {name: getattr(layer, name).data_ptr() for name in ptrs} == ptrs
    assert kinds == [n % 8 == 7 for n in range(20)]  # recent 256 → 263, the 8th step demotes


def test_step_is_not_static_while_the_windows_fill():
    cache = _cache(1)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 100, D, generator=g).bfloat16()
    assert cache.static_step_key() is None  # uninitialised
    cache.update(k, k, 0)
    assert cache.static_step_key() is None  # recent window 36 < 256: single tokens still go to the general path


def test_a_deep_copy_or_a_value_fold_never_replays_another_steps_graph():
    """Graphs replay fixed addresses: a deep copy of a prefilled cache (the prompt-reuse pattern: same storage
    versions, other tensors) must not match the step key of the cache it was copied from, nor a cache whose values
    were folded into o_proj since; consecutive steps of one cache keep their key (the captured graph is reused)."""
    cache = _cache(1)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 330, D, generator=g).bfloat16()
    cache.update(k[:, :, :320], k[:, :, :320], 0)
    a, b = copy.deepcopy(cache), copy.deepcopy(cache)
    key_a = a.static_step_key()
    assert b.static_step_key() != key_a and cache.static_step_key() != key_a
    a.update(k[:, :, 320:321], k[:, :, 320:321], 0)
    assert a.static_step_key() == key_a
    a.layers[0].bind_value_fold(a.layers[0].v_fingerprint)  # what the attention hook does after fold_value_rotation
    assert a.static_step_key() != key_a


def test_decode_graphs_capture_anew_for_a_deep_copy(monkeypatch):
    """DecodeGraphs' dispatch on CPU, with capture recording the cache it captured for: decoding two deep copies of one
    prefilled cache replays only each copy's own graph (before, the second copy replayed the first's: on a GPU its
    steps would have written into the first copy's tiers)."""
    model = enable_oscar(_llama(layers=2))
    graphs = DecodeGraphs(model)
    replayed = []

    class Recorded:  # stands in for a CUDA graph: replay records the cache it was captured for
        def __init__(self, cache):
            self.cache = cache

        def replay(self):
            replayed.append(self.cache)

    def capture(cache, kwargs):
        step = _Step(kwargs)
        lengths = cache.host_lengths()
        step.keep(model(**{**kwargs, **step.inputs}))
        cache.restore_host_lengths(lengths)
        step.graph = Recorded(cache)
        return step

    monkeypatch.setattr(graphs, "_step_kind", lambda kwargs, cache: (tuple(kwargs["input_ids"].shape), ()))
    monkeypatch.setattr(graphs, "_capture", capture)
    base = _cache(2)
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 330), generator=torch.Generator().manual_seed(1)), cache=base)
        copies = copy.deepcopy(base), copy.deepcopy(base)
        for cache in copies:
            for t in range(3):
                pos = torch.tensor([[cache.get_seq_length()]])
                graphs(input_ids=torch.tensor([[7 + t]]), position_ids=pos, cache=cache, use_cache=True)
    assert len(replayed) == 4  # per copy: one eager step that captures both step kinds, then two replays
    assert all(c is copies[0] for c in replayed[:2]) and all(c is copies[1] for c in replayed[2:])


@pytest.mark.parametrize("lead", [0, 7])
def test_decode_graphs_capture_both_step_kinds_at_the_first_step(monkeypatch, lead):
    """DecodeGraphs' dispatch on CPU, with capture recording the host mirror it captured under: the first static step
    runs eagerly and captures the plain and the demoting step at once (the demoting one rehearsed: the mirror set as
    before a demotion, then put back), so no capture lands mid-generation; then every step, across four demotions, is
    a replay of the graph of its own kind, and the host lengths advance as the eager path's do. With `lead` eager steps
    first (7: the first step DecodeGraphs sees demotes itself) it is the same: the history keeps room for the
    demotion after it, so the storage the captures saw does not move."""
    model = enable_oscar(_llama(layers=2))
    graphs = DecodeGraphs(model)
    captured, replayed = {}, []

    class Recorded:  # stands in for a CUDA graph: replay records the kind it was captured as and the kind due now
        def __init__(self, cache, demote):
            self.cache, self.demote = cache, demote

        def replay(self):
            replayed.append((self.demote, self.cache.layers[0].demotes_next()))

    def capture(cache, kwargs):
        step = _Step(kwargs)
        step.out_type, step.logits, step.cache_field = type(out), torch.zeros(1, 1, 512), None
        demote = cache.layers[0].demotes_next()
        assert all(layer.demotes_next() == demote for layer in cache.layers)
        captured[demote] = cache.host_lengths()
        step.graph = Recorded(cache, demote)
        return step

    monkeypatch.setattr(graphs, "_step_kind", lambda kwargs, cache: (tuple(kwargs["input_ids"].shape), ()))
    monkeypatch.setattr(graphs, "_capture", capture)
    cache, twin = _cache(2), _cache(2)
    flush = cache.layers[0].flush
    with torch.no_grad():
        ids = torch.randint(0, 512, (1, 568), generator=torch.Generator().manual_seed(1))
        out = model(ids, cache=cache)
        model(ids, cache=twin)
        for t in range(lead):
            for c in (cache, twin):
                model(torch.tensor([[3 + t]]), position_ids=torch.tensor([[c.get_seq_length()]]), cache=c)
        # (568 tokens: 248 history rows in a 256-row allocation; had the steps kept room for one demotion only, the
        # first step's own demotion would leave none for the rehearsed one, and the history would grow under it)
        assert cache.layers[0].demotes_next() == (lead == flush - 1)
        for t in range(4 * flush + 3):
            before = cache.host_lengths()
            pos = torch.tensor([[cache.get_seq_length()]])
            graphs(input_ids=torch.tensor([[7 + t]]), position_ids=pos, cache=cache, use_cache=True)
            if t == 0:  # the eager step filed its token; both kinds captured under rehearsed mirrors, then put back
                assert graphs.warm == {(False, (1, 1), ()), (True, (1, 1), ())} and set(captured) == {False, True}
                assert cache.host_lengths() != before
            model(torch.tensor([[7 + t]]), position_ids=pos, cache=twin)  # the eager path, for the host lengths
            assert cache.host_lengths() == twin.host_lengths()
    n_recent = cache.layers[0].recent
    assert [state[0][2] for state in (captured[False], captured[True])] == [n_recent, n_recent + flush - 1]
    assert len(replayed) == 4 * flush + 2 and all(kind == due for kind, due in replayed)
    assert sum(kind for kind, _ in replayed) == 4


# ------------------------------------------------------------------------------------------------------ binding


def test_attention_refuses_a_layer_that_was_not_updated_and_a_copied_key():
    """Binding is by the module's layer_idx: attention for a layer whose cache layer got no update raises (a cache
    whose layers do not line up with the model's), and so does a key that is not the tensor update returned."""
    cache = _cache(2)
    k = torch.randn(1, 3, 10, D).bfloat16()
    key, value = cache.update(k, k, 0)
    q = torch.randn(1, 9, 10, D).bfloat16()
    stub = lambda idx: type("Attn", (), {"layer_idx": idx, "training": False})()  # noqa: E731
    with pytest.raises(RuntimeError, match="layer 1 was not updated"):
        oscar_attention(stub(1), q, key, value, None, oscar_cache=cache)
    with pytest.raises(RuntimeError, match="copied or cast"):
        oscar_attention(stub(0), q, key.clone(), value, None, oscar_cache=cache)


def test_model_that_copies_the_key_raises(monkeypatch):
    """A whole model whose keys reach attention as a copy (here: an update wrapper that clones) fails loudly instead
    of attending unrotated queries to rotated keys; without an OscarCache the same model runs exact."""
    model = enable_oscar(_llama(dtype=torch.float32))
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    real = OscarCache.update
    monkeypatch.setattr(OscarCache, "update", lambda self, *a, **kw: tuple(t.clone() for t in real(self, *a, **kw)))
    with pytest.raises(RuntimeError, match="copied or cast"), torch.no_grad():
        model(ids, cache=_cache(2))
    with torch.no_grad():
        exact = model(ids, cache=DynamicCache()).logits
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(exact, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_enable_oscar_hooks_attention_modules_once_and_routes_generate():
    model = _llama()
    enable_oscar(model)
    enable_oscar(model)
    hooked = [m for m in model.modules() if getattr(m, "_oscar_bound", False)]
    assert [m.layer_idx for m in hooked] == [0, 1]
    assert all(len(m._forward_pre_hooks) == 1 for m in hooked)
    assert isinstance(model.get_compiled_call(None), DecodeGraphs)
    assert all(layer.is_compileable for layer in _cache(2).layers)


# ---------------------------------------------------------------------------------------------------------- GPU


def _qwen3(device):
    """Qwen3-8B's attention shape (32 q / 8 kv heads, head_dim 128, QK-norm), 4 layers, small MLP and vocab."""
    cfg = Qwen3Config(vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      initializer_range=0.08)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device=device, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.mark.gpu
@pytest.mark.parametrize(("arch", "B", "fold", "centred", "key_bits", "pin"),
                         [("qwen3", 1, False, False, False, 0), ("qwen3", 4, True, True, False, 0),
                          ("llama", 1, False, True, False, 0), ("llama", 3, True, False, False, 0),
                          ("qwen3", 2, True, False, True, 0), ("llama", 1, False, False, True, 0),
                          ("qwen3", 2, False, False, True, 32), ("llama", 3, True, True, False, 16)])
def test_generate_replays_captured_steps_equal_to_eager(arch, B, fold, centred, key_bits, pin):
    """generate() on a GPU with OscarCache replays a captured decode step (no user code): 220 greedy tokens from a
    400-token prompt (27 demotions, one history reallocation) equal the eager path's (compile disabled), logits
    included, and all but the first few steps were replays; with the value rotation folded into the weights too, and
    with centred tiers (means: the in-step subtraction and add-back are captured like the rest), and with 3-bit keys in
    every other layer (docs/format.md §6b), and with pinned tokens (§6c: the prompt pins them, decode reads them in
    the sink tier). Layers uncompiled: the capture alone is compared bit for bit (test_compiled_step.py: compiled)."""
    model = enable_oscar(_qwen3("cuda") if arch == "qwen3" else _llama(device="cuda"), compile=False)
    cfg = model.config
    L, H, Dh = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    if fold:
        fold_value_rotation(model, _cache(L, H, Dh, centred=centred))
    ids = torch.randint(0, cfg.vocab_size, (B, 400), generator=torch.Generator().manual_seed(0)).cuda()
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    runs = {}
    bits = [3 - i % 2 if key_bits else 2 for i in range(L)]
    for mode in ("eager", "graph"):
        cache = _cache(L, H, Dh, centred=centred, key_bits=bits, pin=pin)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=220, do_sample=False,
                             disable_compile=mode == "eager", output_logits=True, return_dict_in_generate=True,
                             **{cache_kw: cache})  # fmt: skip
        runs[mode] = (out.sequences, torch.stack(out.logits, 1).float(), cache.layers[0].n_hist)
    graphs = decode_graphs(model)
    assert graphs.replays >= 210 and graphs.captures >= 2
    assert torch.equal(runs["graph"][0], runs["eager"][0])
    assert torch.equal(runs["graph"][1], runs["eager"][1])
    assert runs["graph"][2] == runs["eager"][2] == 400 - layout.SINK - layout.RECENT - pin + 8 * (219 // 8)
