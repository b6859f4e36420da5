"""Verify test set-up: a random-weight Llama (9 query / 3 KV heads, head_dim 64, 2 layers) with outlier key/value
channels, like real models, saved with the SmolLM2 tokenizer; OSCAR artifacts calibrated for it by the library pipeline
(tiny windows: sink 16, recent 32) and a broken but orthogonal copy; short held-out text files; what verify must report
for both, computed independently in float64 (`float64_reference.py`), and CLI thresholds derived from it."""

import dataclasses

import pytest
import torch

from ..conftest import tiny_model

SINK, RECENT, CONTEXT = 16, 32, 192


def outlier_model(seed: int = 0, **overrides):
    """Random Llama with sharper attention (q, k ×3), a few outlier key channels (×10, both RoPE halves) and one
    outlier value channel per KV head, and a sharper LM head (×8): INT2 without rotation hurts it, as real models."""
    config = dict(vocab_size=49152, num_attention_heads=9, num_key_value_heads=3, hidden_size=144)
    model = tiny_model("llama", seed=seed, **{**config, **overrides})
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.mul_(3.0)
            attn.k_proj.weight.mul_(3.0)
            for h in range(attn.k_proj.weight.shape[0] // 64):
                channels = torch.randint(0, 32, (2,), generator=g).tolist()
                for c in channels:
                    attn.k_proj.weight[h * 64 + c].mul_(10.0)
                    attn.k_proj.weight[h * 64 + c + 32].mul_(10.0)
                attn.v_proj.weight[h * 64 + channels[0]].mul_(10.0)
    return model


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from oscar_zoo.models import ensure_demo_model

    return AutoTokenizer.from_pretrained(ensure_demo_model())


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("outlier-llama")
    outlier_model().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def heldout_file(tmp_path_factory):
    """A short held-out text (an evaluation play's opening), so the CLI tests tokenize little."""
    from oscar_zoo.texts import corpus_dir

    path = tmp_path_factory.mktemp("text") / "henry_v.txt"
    path.write_text((corpus_dir() / "henry_v_gut.txt").read_text()[:60000])
    return path


@pytest.fixture(scope="session")
def loaded(model_dir):
    """The random outlier model in float32 on every CPU (not `--dtype auto`'s machine-dependent choice): calibration
    fixtures are the same artifact everywhere, and verify's numbers equal the float64 expectation up to fp32
    rounding."""
    from oscar_zoo.models import load_model

    return load_model(str(model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def loaded_bf16(model_dir):
    """The same model in bfloat16, for the tests of what a bfloat16 model does with the runtime's bfloat16 tiers."""
    from oscar_zoo.models import load_model

    return load_model(str(model_dir), device="cpu", dtype="bfloat16")


@pytest.fixture(scope="session")
def good_artifacts(tmp_path_factory, loaded):
    """OSCAR artifacts calibrated by the library pipeline on 4×128 tokens of a calibration play (fixed clips), with
    the centred codec (`centring="mean"`, schema 2 with k_mean/v_mean; not calibrate's default, which is uncentred)
    with keys per row (`key_block=0`; the default codes them per channel, docs/format.md §6d):
    the verify tests check the means' path against the float64 reference; the version-1 fixture covers uncentred."""
    from oscar_zoo.artifacts import write_artifacts
    from oscar_zoo.calibration.calibration_passes import CalibrationSettings, calibrate
    from oscar_zoo.texts import corpus_dir, make_sequences

    text = (corpus_dir() / "hamlet_gut.txt").read_text()[:60000]
    seqs = make_sequences(loaded.tokenizer, [text], 128, 4, 1, dataset="hamlet excerpt")
    root = tmp_path_factory.mktemp("artifacts")
    result = calibrate(loaded, seqs, CalibrationSettings(clip="fixed", sink=SINK, recent=RECENT, batch_size=4,
                                                            centring="mean", key_block=0),
                       store_dir=root / "store")
    write_artifacts(root / "good", result.manifest, result.rotations)
    return root / "good"


@pytest.fixture(scope="session")
def bad_artifacts(good_artifacts):
    """The same artifacts with every key rotation replaced by one permutation matrix: orthogonal, so integrity checks
    pass, but it mixes nothing, leaving the outlier key channels to INT2."""
    from oscar_zoo.artifacts import load_artifacts, write_artifacts

    manifest, rot = load_artifacts(good_artifacts)
    perm = torch.eye(64)[torch.randperm(64, generator=torch.Generator().manual_seed(1))]
    broken = dataclasses.replace(rot, k_rotation=perm.expand_as(rot.k_rotation).contiguous())
    dest = good_artifacts.parent / "bad"
    write_artifacts(dest, manifest, broken)
    return dest


@pytest.fixture(scope="session")
def heldout_ids(loaded, heldout_file):
    from oscar_zoo.texts import make_sequences

    return make_sequences(loaded.tokenizer, [heldout_file.read_text()], CONTEXT, 2, 0).input_ids


@pytest.fixture(scope="session")
def model64():
    return outlier_model().double()


@pytest.fixture(scope="session")
def expected(model64, heldout_ids, good_artifacts, bad_artifacts):
    """The float64 expectation (KL, top-1, perplexity increase) of the OSCAR method of each artifact folder."""
    from oscar_zoo.artifacts import load_artifacts

    from .float64_reference import expected_metrics

    out = {}
    for name, folder in (("good", good_artifacts), ("bad", bad_artifacts)):
        manifest, rot = load_artifacts(folder)
        out[name] = expected_metrics(model64, heldout_ids, rot, SINK, RECENT, key_bits=manifest.key_bits)
    return out


# How far a float32 verify run may be from the float64 expectation: fp32 rounding, plus now and then a rotated row that
# rounds to other INT2 codes (observed: KL 6e-5 relative to 0.27, perplexity ratio 4e-4, top-1 identical).
KL_RTOL, PPL_ATOL, TOP1_POSITIONS = 1e-3, 2e-3, 1


@pytest.fixture(scope="session")
def thresholds(expected):
    """CLI thresholds just past what the calibrated artifact must score (its float64 expectation, moved by a few times
    the fp32 tolerance above): a correct verify passes it; anything measurably worse fails, the perplexity gate
    included."""
    good = expected["good"]
    return ("--max-kl", f"{good.kl * (1 + 20 * KL_RTOL):.6f}",
            "--min-top1", f"{good.top1 - 2 * TOP1_POSITIONS / good.scored:.6f}",
            "--max-ppl-increase", f"{good.ppl_increase + 5 * PPL_ATOL:.6f}")
