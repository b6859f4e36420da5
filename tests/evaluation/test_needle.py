"""`verify --needle`: the prompt builder, the retrieval loop through the runtime (random model: an exact cache answers
exactly as BF16), the real SmolLM2 (BF16 and a usable INT2 cache retrieve, a broken one does not and fails the gate),
and the CLI plumbing (table, JSON, heatmap, exit codes)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from oscar_zoo.artifacts import Rotations
from oscar_zoo.evaluation.baselines import RotatedInt2
from oscar_zoo.evaluation.needle import NeedleSettings, answer_is_right, build_prompt, run_needle
from oscar_zoo.runtime.cache import OscarCache


def _filler(tokenizer, path) -> list[int]:
    return tokenizer(path.read_text(), add_special_tokens=False).input_ids


def _rotations(L: int, D: int, M: torch.Tensor | None = None, clip: float = 0.96) -> Rotations:
    M = torch.eye(D).expand(L, 1, D, D).contiguous() if M is None else M
    return Rotations(M, M, torch.zeros(L, 1, D), torch.zeros(L, 1, D), torch.full((L, 1), clip),
                     torch.full((L, 1), clip), torch.arange(L, dtype=torch.int32))


def _manifest(sink: int, recent: int, layers: int):
    """What run_needle reads of a manifest: the quant settings and the per-layer key bits (2-bit keys)."""
    return SimpleNamespace(quant=SimpleNamespace(sink=sink, recent=recent, group_size=0, flush=8, key_bits=None),
                           key_bits=[2] * layers)


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.37, 0.5, 0.9, 1.0])
def test_prompt_puts_the_whole_needle_at_its_depth(tokenizer, heldout_file, depth):
    filler = _filler(tokenizer, heldout_file)
    p = build_prompt(tokenizer, filler, 2000, depth, random.Random(3))
    needle_ids = tokenizer(f" The secret passkey is {p.key}. Remember it: the passkey is {p.key}. ",
                           add_special_tokens=False).input_ids
    assert len(p.context) + len(p.question) == 2000 and len(p.key) == 5 and p.key.isdigit()
    assert p.context[p.needle_start : p.needle_start + p.needle_len] == needle_ids  # whole, in order, where it says
    n_filler = len(p.context) - p.needle_len
    assert abs(p.needle_start / n_filler - depth) <= 0.01
    rest = p.context[: p.needle_start] + p.context[p.needle_start + p.needle_len :]
    start = next(i for i in range(len(filler)) if filler[i : i + 8] == rest[:8])
    assert filler[start : start + n_filler] == rest  # the filler around it is one contiguous run of the text
    again = build_prompt(tokenizer, filler, 2000, depth, random.Random(3))
    assert again == p and build_prompt(tokenizer, filler, 2000, depth, random.Random(4)) != p


def test_answer_check_is_exact():
    assert answer_is_right(" 48213.", "48213") and answer_is_right("48213\n", "48213")
    assert not answer_is_right(" 4821.", "48213") and not answer_is_right(" 148213", "48213")
    assert not answer_is_right(" 482139", "48213") and not answer_is_right("", "48213")
    assert not answer_is_right(" the passkey is 48213", "48213")


def test_a_batch_refuses_hqq_whose_groups_span_rows():
    from oscar_zoo.errors import InputError
    from oscar_zoo.evaluation.needle import check_batch

    check_batch(1, ("hf-hqq-int2",))
    check_batch(4, ("naive", "hf-quanto-int2"))  # quanto's groups of 64 lie within one row
    with pytest.raises(InputError, match="hf-hqq"):
        check_batch(2, ("naive", "hf-hqq-int4"))
    with pytest.raises(InputError, match="batch must be positive"):
        NeedleSettings(lengths=(300,), batch=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_exact_cache_answers_as_bf16(loaded_bf16, tokenizer, heldout_file, monkeypatch, batch):
    """Identity rotations and BF16 history (no quantization error): through the runtime path (second chunk over the
    tiers, decode steps) every answer equals BF16's, token for token, on a random-weight bfloat16 model (the tiers
    hold bfloat16, so the model must too for token-for-token equality) — with the default follow-up protocol's
    context filed into each cache as rows of one batch too (4 prompts per length: a batch of 3 and one of 1)."""
    loaded = loaded_bf16
    L, D = loaded.info.num_layers, loaded.info.head_dim
    sink, recent = 16, 32

    def exact_cache(method):
        eye = torch.eye(D).expand(L, 1, D, D).contiguous()
        return OscarCache.from_tensors(eye, eye, quantize=False, sink=sink, recent=recent, num_layers=L)

    monkeypatch.setattr(RotatedInt2, "make_cache", exact_cache)
    settings = NeedleSettings(lengths=(300, 400), depths=(0.3, 0.8), trials=2, new_tokens=5, batch=batch)
    report = run_needle(loaded, _manifest(sink, recent, L), _rotations(L, D), _filler(tokenizer, heldout_file),
                        settings, baselines=())
    bf16, oscar = report.method("bf16"), report.method("oscar")
    assert len(bf16.answers) == 8 and len(set(bf16.answers[:4])) > 1 and len(set(bf16.answers[4:])) > 1
    assert oscar.answers == bf16.answers and oscar.accuracy == bf16.accuracy


@pytest.mark.parametrize("batch", [1, 3])
def test_prompt_protocol_answers_as_generate_does(loaded, tokenizer, heldout_file, monkeypatch, batch):
    """--needle-protocol prompt is `model.generate(prompt, past_key_values=cache)`'s path: every answer equals what
    transformers' own generate() writes for that prompt alone with a fresh quantizing OscarCache (random rotations,
    INT2 history between a 16-token sink and a 32-token recent window) and, for BF16, with no cache at all; and each
    first answer token is BF16's (the prompt attends to its own exact K/V), which the follow-up protocol does not
    promise. With --needle-batch 3 the 4 prompts of a length run as a batch of 3 and one of 1: the same answers, in
    the grid's order."""
    from oscar_zoo.evaluation.needle import NeedleProtocol
    from oscar_zoo.evaluation.teacher_forcing import cache_argument
    from oscar_zoo.format.reference import random_orthogonal
    from oscar_zoo.runtime.attention import enable_oscar

    model, L, D = loaded.model, loaded.info.num_layers, loaded.info.head_dim
    sink, recent = 16, 32
    M = torch.stack([random_orthogonal(D, seed=i) for i in range(L)]).float().unsqueeze(1)  # [L, 1, D, D]

    def int2_cache(method=None):
        return OscarCache.from_tensors(M, M, 0.9, 0.9, sink=sink, recent=recent, num_layers=L)

    monkeypatch.setattr(RotatedInt2, "make_cache", int2_cache)
    settings = NeedleSettings(lengths=(300, 400), depths=(0.3, 0.8), trials=2, new_tokens=5,
                              protocol=NeedleProtocol.PROMPT.value, batch=batch)
    filler = _filler(tokenizer, heldout_file)
    report = run_needle(loaded, _manifest(sink, recent, L), _rotations(L, D), filler, settings, baselines=())
    assert report.protocol == "prompt" and report.batch == batch
    rng, want, keys = random.Random(settings.seed), {"bf16": [], "oscar": []}, []
    previous = model.config._attn_implementation
    try:
        enable_oscar(model, compile=False)
        for length in settings.lengths:
            for depth in [d for d in settings.depths for _ in range(settings.trials)]:
                p = build_prompt(tokenizer, filler, length, depth, rng)
                keys.append(p.key)
                ids = torch.tensor([p.context + p.question])
                for name, cache in (("bf16", None), ("oscar", int2_cache())):
                    kw = {} if cache is None else {cache_argument(): cache}
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                         do_sample=False, **kw)
                    want[name].append(out[0, ids.shape[1]:].tolist())
    finally:
        model.set_attn_implementation(previous)
    bf16, oscar = report.method("bf16"), report.method("oscar")
    assert report.keys == keys  # every prompt's passkey, in the answers' order
    assert all(len({tuple(t) for t in want[n][i : i + 4]}) > 1 for n in want for i in (0, 4))  # rows tell apart
    assert bf16.answers == [tokenizer.decode(t) for t in want["bf16"]]
    assert oscar.answers == [tokenizer.decode(t) for t in want["oscar"]]
    assert [t[0] for t in want["oscar"]] == [t[0] for t in want["bf16"]]


@pytest.mark.parametrize("batch", [1, 2])
def test_real_smollm2_retrieves_and_a_broken_artifact_fails(smollm2, heldout_file, batch):
    """SmolLM2-135M at 1,024 tokens, needle at depths 0.3 and 0.7 (inside the INT2 history): BF16 answers both — also
    as one batch of two, so each answer is scored against its own prompt's passkey; an artifact whose clips flatten
    every key and value (r = 0.05) answers none, and fails the gate."""
    L, D = smollm2.info.num_layers, smollm2.info.head_dim
    settings = NeedleSettings(lengths=(1024,), depths=(0.3, 0.7), trials=1, batch=batch)
    broken = _rotations(L, D, clip=0.05)
    report = run_needle(smollm2, _manifest(64, 256, 30), broken, _filler(smollm2.tokenizer, heldout_file), settings,
                        baselines=())
    print({m.name: m.answers for m in report.methods})
    assert report.method("bf16").overall == 1.0
    assert report.method("oscar").overall == 0.0
    assert not report.passed and "needle accuracy" in report.failures[0]


def test_cli_needle_table_json_heatmap_and_bad_options(run_cli, good_artifacts, model_dir, heldout_file, tmp_path,
                                                      capsys):
    base = ("verify", good_artifacts, "--model", model_dir, "--dataset", heldout_file, "--context", "192",
            "--sequences", "1", "--generate", "0", "--baselines", "naive", "--max-kl", "9", "--min-top1", "0",
            "--max-ppl-increase", "99", "--needle", "--needle-lengths", "300", "--needle-depths", "0.5",
            "--needle-trials", "1", "--min-needle-accuracy", "0")
    code, out, err = run_cli(*base, "--json", "--plot", tmp_path / "v.png")
    assert code == 0, err
    needle = json.loads(out)["needle"]
    assert [m["name"] for m in needle["methods"]] == ["bf16", "oscar", "naive"]
    assert needle["lengths"] == [300] and needle["depths"] == [0.5] and needle["passed"]
    assert (tmp_path / "v-needle.png").stat().st_size > 1000 and (tmp_path / "v.png").is_file()
    from oscar_zoo.commands.verify import _print_needle
    from oscar_zoo.format.verification import NeedleReport

    _print_needle(NeedleReport.from_dict(needle))
    printed = capsys.readouterr().out
    assert "needle: OSCAR" in printed and "second chunk" in printed
    # paired with the reference, named by the dtype `--dtype auto` ran: BF16, or FP32 on a CPU without native bfloat16
    from oscar_zoo.models import native_cpu_bfloat16

    dtype = "BF16" if native_cpu_bfloat16() else "FP32"
    assert needle["methods"][0]["label"].startswith(dtype)
    for short, m in (("OSCAR", needle["methods"][1]), ("naive INT2", needle["methods"][2])):
        it, ref = (100 * answer_is_right(x["answers"][0], needle["keys"][0]) for x in (m, needle["methods"][0]))
        assert f"{short} at 300: {it:.1f}% vs {dtype} {ref:.1f}% over 1 prompts" in printed, printed
    _print_needle(NeedleReport.from_dict({**needle, "protocol": "prompt"}))  # says which path it measured
    assert "context and question as one prompt" in capsys.readouterr().out
    for bad in (("--needle-depths", "0.5,1.5"), ("--needle-lengths", "12"), ("--needle-trials", "0"),
                ("--min-needle-accuracy", "2"), ("--needle-lengths", "a,b"), ("--needle-batch", "0")):
        code, out, err = run_cli(*base, *bad)
        assert code == 2, (bad, out, err)


def test_needle_options_imply_needle_and_are_never_ignored(run_cli, good_artifacts, model_dir, heldout_file):
    """A --needle-* option without --needle runs the grid it describes (it was silently ignored); --needle-trials
    with --needle-quick is honoured (quick's one trial is only its default); --needle-protocol and --needle-batch are
    recorded, and an unknown protocol is a usage error."""
    base = ("verify", good_artifacts, "--model", model_dir, "--dataset", heldout_file, "--context", "192",
            "--sequences", "1", "--generate", "0", "--baselines", "none", "--max-kl", "9", "--min-top1", "0",
            "--max-ppl-increase", "99", "--min-needle-accuracy", "0", "--needle-lengths", "300", "--json")
    for extra, trials, depths, protocol in ((("--needle-depths", "0.5"), 2, [0.5], "follow-up"),
                                            (("--needle-quick", "--needle-trials", "2"), 2, [0.25, 0.75], "follow-up"),
                                            (("--needle-protocol", "prompt", "--needle-quick"), 1, [0.25, 0.75],
                                             "prompt")):
        code, out, err = run_cli(*base, *extra)
        assert code == 0, err
        needle = json.loads(out)["needle"]
        assert needle is not None and needle["lengths"] == [300], extra
        assert needle["trials"] == trials and needle["depths"] == depths and needle["protocol"] == protocol, extra
    code, out, err = run_cli(*base, "--needle-batch", "2")  # implies --needle too, and is recorded
    assert code == 0, err
    assert json.loads(out)["needle"]["batch"] == 2
    code, out, err = run_cli(*base, "--needle-protocol", "first-turn")
    assert code == 2 and "first-turn" in err
    code, out, err = run_cli(*base[:-5], "--json")  # no needle option at all: no grid
    assert code == 0, err
    assert json.loads(out)["needle"] is None
