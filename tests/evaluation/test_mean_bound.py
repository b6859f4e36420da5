"""The model's bound on a centred artifact's means (`format.model_bounds`): no key or value a model's attention
produces is longer than `mean_bounds` says (measured by running random-weight models of every supported family over
random tokens and reading their own KV cache), the bound is reached by the input aimed at it (so it is not loose, and
Gemma's 1 + γ norm and YaRN's key scaling are in it), a calibrated artifact and the real SmolLM2's means pass with
room, and the hostile trial's case — v_mean = 1000 everywhere, within the format's 2^14 — is refused by
`oscar-zoo verify` (exit 4, one line, no traceback, before any evaluation), by the library call, and by the runtime
when a cache read from the folder meets the model.

Fixtures: tests/evaluation/conftest.py (the 9/3-head random Llama with outlier channels and its centred artifact)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oscar_zoo.artifacts import load_artifacts, write_artifacts
from oscar_zoo.errors import IntegrityError
from oscar_zoo.format.model_bounds import NORM_OFFSET, RELATIVE_SLACK, check_means_against_model, mean_bounds
from oscar_zoo.models import ARCHITECTURES

from ..conftest import tiny_model

FAMILIES = {  # every supported family, tiny; qwen3_moe with few small experts
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma": {}, "gemma2": {},
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2),
    "llama-yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                        "rope_theta": 10000.0}),  # RoPE that scales keys (attention_scaling 1.14)
}


def _random_model(name: str, zero_bias: bool = False):
    """A tiny random model of family `name` whose norms (input and k_norm) have random weights of both signs around
    their stored value, and random projection biases where the family has them (zeroed with `zero_bias`)."""
    model = tiny_model(name.split("-")[0], seed=1, **FAMILIES[name])
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for module in model.modules():
            for norm in (getattr(module, "input_layernorm", None), getattr(module, "k_norm", None)):
                if norm is not None:
                    norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) * 3 - 1.5)
            for proj in (getattr(module, "k_proj", None), getattr(module, "v_proj", None)):
                if proj is not None and proj.bias is not None:
                    proj.bias.copy_(0 if zero_bias else torch.randn(proj.bias.shape, generator=g) * 0.5)
    return model


def _kv(model, **inputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the post-RoPE keys and the values the model's own cache holds, [H_kv, T, D] each (batch 1)."""
    with torch.no_grad():
        cache = model(**inputs, use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def test_every_supported_family_has_a_derivation():
    assert set(NORM_OFFSET) == set(ARCHITECTURES)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_no_key_or_value_is_longer_than_the_bound(name):
    """Random tokens through the model: every key and value vector of every (layer, head) is within its bound (up to
    float32 rounding, no slack), so every mean of them is too."""
    model = _random_model(name)
    bounds = mean_bounds(model)
    kv = _kv(model, input_ids=torch.randint(0, 512, (1, 96), generator=torch.Generator().manual_seed(3)))
    assert len(bounds) == len(kv) * kv[0][0].shape[0]
    for layer, (k, v) in enumerate(kv):
        for h in range(k.shape[0]):
            k_bound, v_bound = bounds[(layer, h)]
            assert k[h].norm(dim=-1).max() <= k_bound * (1 + 1e-5), (layer, h)
            assert v[h].norm(dim=-1).max() <= v_bound * (1 + 1e-5), (layer, h)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_bound_is_reached_by_the_input_aimed_at_it(name):
    """Without biases, the first layer's input along the top right singular vector of W_h·diag(γ_eff) gives a value
    (and, without k_norm, a key at position 0, where RoPE only scales) of exactly the bound: the effective norm weight
    (1 + γ for Gemma), sqrt(hidden) and RoPE's attention_scaling are all right, and nothing larger is claimed."""
    model = _random_model(name, zero_bias=True)
    bounds = mean_bounds(model)
    block = model.model.layers[0]
    attn, hidden = block.self_attn, block.input_layernorm.weight.numel()
    gamma = block.input_layernorm.weight.double() + NORM_OFFSET[model.config.model_type]
    D = attn.head_dim
    checks = [("value", attn.v_proj, 1)] + ([] if hasattr(attn, "k_norm") else [("key", attn.k_proj, 0)])
    for what, proj, which in checks:
        W = (proj.weight.double() * gamma).view(-1, D, hidden)
        for h in range(W.shape[0]):
            u = torch.linalg.svd(W[h]).Vh[0]  # [hidden], unit: the input direction W_h·diag γ stretches most
            k, v = _kv(model, inputs_embeds=(u * hidden**0.5).float().view(1, 1, hidden))[0]
            got = (v if which else k)[h, 0].norm().item()
            assert got == pytest.approx(bounds[(0, h)][which], rel=1e-4), (what, h)


def test_a_calibrated_artifact_passes(good_artifacts, loaded):
    """The library pipeline's centred artifact (means of real activations of the outlier model) passes, with room."""
    _, rot = load_artifacts(good_artifacts)
    assert rot.centred
    check_means_against_model(loaded.model, rot.k_mean, rot.v_mean, rot.layer_ids.tolist())
    bounds = mean_bounds(loaded.model)
    for i, layer in enumerate(rot.layer_ids.tolist()):
        for h in range(rot.k_mean.shape[1]):
            k_bound, v_bound = bounds[(layer, h)]
            assert rot.k_mean[i, h].norm() < k_bound / 2 and rot.v_mean[i, h].norm() < v_bound / 2


def test_the_real_model_means_pass_with_room(smollm2):
    """SmolLM2's own per-head key and value means over 512 tokens of a play: within the bound, by a factor of 3 or
    more (observed over 1,024 tokens: ≥ 3.5 for keys, ≥ 9.1 for values; the largest single vector reaches 0.42 of
    its bound)."""
    from oscar_zoo.texts import corpus_dir

    text = (corpus_dir() / "hamlet_gut.txt").read_text()[:8000]
    ids = smollm2.tokenizer(text, return_tensors="pt").input_ids[:, :512]
    kv = _kv(smollm2.model, input_ids=ids)
    k_mean = torch.stack([k.mean(1) for k, _ in kv])  # [L, H_kv, D], as calibrate's means
    v_mean = torch.stack([v.mean(1) for _, v in kv])
    check_means_against_model(smollm2.model, k_mean, v_mean, list(range(len(kv))))
    bounds = mean_bounds(smollm2.model)
    ratios = [bounds[(layer, h)][which] / m[layer, h].norm().item()
              for which, m in enumerate((k_mean, v_mean)) for layer in range(len(kv)) for h in range(m.shape[1])]
    assert min(ratios) > 3, min(ratios)


@pytest.fixture(scope="module")
def huge_v_mean(good_artifacts):
    """The calibrated artifact with v_mean = 1000 in every element (‖μ‖ = 8000 per head: within the format's 2^14, far
    beyond anything the model's values reach), written as a consistent folder (checksums updated)."""
    manifest, rot = load_artifacts(good_artifacts)
    dest = good_artifacts.parent / "huge-v-mean"
    write_artifacts(dest, manifest, dataclasses.replace(rot, v_mean=torch.full_like(rot.v_mean, 1000.0)))
    load_artifacts(dest)  # every format check passes: only the model can refuse it
    return dest


def test_verify_refuses_means_the_model_cannot_produce(run_cli, huge_v_mean, model_dir, heldout_file, monkeypatch):
    """`oscar-zoo verify` as a user types it: exit 4, one line naming the tensor, layer, head, norm and bound, no
    traceback, and no held-out text read (the refusal comes before the evaluation)."""
    from oscar_zoo.evaluation import verification_run

    def refuse(*args, **kwargs):
        raise AssertionError("verify started the evaluation before checking the means")

    monkeypatch.setattr(verification_run, "load_texts", refuse)
    code, out, err = run_cli("verify", huge_v_mean, "--model", model_dir, "--dataset", heldout_file, "--context",
                             "192", "--sequences", "1", "--generate", "0", "--baselines", "none", "--device", "cpu",
                             "--dtype", "float32")
    assert code == 4, (code, out, err)
    assert "Traceback" not in out + err and "AssertionError" not in out + err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    flat = " ".join(err.split())
    assert "v_mean layer 0 head 0: ‖μ‖ = 8000 exceeds" in flat, err
    assert "the largest value norm this model's layer can produce" in flat, err


def test_the_library_call_refuses_them_too(huge_v_mean, model_dir, monkeypatch):
    from oscar_zoo.evaluation import verification_run
    from oscar_zoo.evaluation.verification_passes import VerifySettings

    monkeypatch.setattr(verification_run, "load_texts", lambda *a, **k: pytest.fail("evaluation started"))
    request = verification_run.VerifyRequest(artifacts=huge_v_mean, model=str(model_dir), device="cpu",
                                             dtype="float32", settings=VerifySettings(context=192, sequences=1,
                                                                                      generate_tokens=0, baselines=()))
    with pytest.raises(IntegrityError, match=r"v_mean layer 0 head 0: ‖μ‖ = 8000 exceeds [0-9.]+, the largest value"
                                             ) as info:
        verification_run.verify_artifacts(request)
    assert info.value.exit_code == 4


def test_the_runtime_refuses_them_when_the_cache_meets_the_model(huge_v_mean, good_artifacts, model_dir):
    """`OscarCache.from_folder` knows no model; the first forward of an "oscar" model with that cache does, and refuses
    (IntegrityError, a ValueError) before any token is filed. The calibrated folder runs."""
    from transformers import AutoModelForCausalLM

    from oscar_zoo.runtime.attention import enable_oscar
    from oscar_zoo.runtime.cache import OscarCache

    model = enable_oscar(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), compile=False)
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, cache=OscarCache.from_folder(good_artifacts))
        cache = OscarCache.from_folder(huge_v_mean)
        with pytest.raises(IntegrityError, match=r"v_mean layer 0 head 0: ‖μ‖ = 8000 exceeds"):
            model(ids, cache=cache)
    assert all(layer.get_seq_length() == 0 for layer in cache.layers)


def test_the_slack_is_small():
    assert 1 < RELATIVE_SLACK <= 1.05
