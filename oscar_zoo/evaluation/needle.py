"""`verify --needle`: passkey retrieval at long context through the runtime, BF16 vs the INT2 cache and baselines.

A prompt is a long filler text (held-out) with a short fact placed at a depth — "The secret passkey is 48213.
Remember it: the passkey is 48213." — followed, as a second turn, by a question ("what is the secret passkey?") whose
answer is the five digits, decoded greedily through the runtime (`oscar` attention, tiered decode). Two protocols:

- "follow-up" (the default; a question about a document already in the cache): the context is prefilled once in BF16
  (chunked); each quantized method's `OscarCache` is filed from that prefill's K/V exactly as `OscarCache.update`
  files a prompt (rotation, clip, INT2 history, BF16 windows); transformers' QuantizedCache peers get the same K/V as
  their prefill `update` (all of it quantized, the residual window empty). The question is then a second chunk: it
  reads the context through the cache's tiers, INT2 history included, so the first answer token already does.
- "prompt" (`model.generate(prompt, past_key_values=cache)`'s path): context and question are one prompt, prefilled
  through a fresh cache of each method; the prompt attends to its own exact K/V, and the answer tokens after the first
  read the tiers.

BF16 runs the same way on its DynamicCache. An answer is right when its first non-space characters are the passkey's
digits and no other digit follows.

Needles (NEEDLES, fixed here before any codec is measured on them): `passkey` (the above, verify's), `name` (a
person's name from the fixed list NAMES) and `code` (a multi-token code such as "QX-4417-ZB"), each with its own
sentence and question and an exact answer check; the key is drawn from the grid's seeded generator. The filler is any
haystack's token ids (evaluation/haystacks.py: plays, poems, docs); verify's is the held-out text.
"""

from __future__ import annotations

import itertools
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError
from ..format.verification import DEFAULT_MIN_NEEDLE_ACCURACY, NeedleMethod, NeedleProtocol, NeedleReport, needle_gate
from ..models import LoadedModel
from .baselines import DTYPE_NAMES
from .registry import Setup, build_methods
from .stats import PairedDifference, paired_difference
from .teacher_forcing import cache_argument

NEEDLE = " The secret passkey is {key}. Remember it: the passkey is {key}. "
QUESTION = "\nQuestion: what is the secret passkey? Answer: the secret passkey is"
# The name needle's keys: two-word names, ASCII, 3 to 7 tokens each with the demo model's tokenizer, none of them in
# any haystack (tests/evaluation/test_haystacks.py).
NAMES = (
    "Maria Lindqvist", "Paulo Medeiros", "Ingrid Halvorsen", "Kwame Mensah", "Priya Raghunathan", "Olusegun Adeyemi",
    "Mateo Alvarado", "Yuki Tanabe", "Amara Okonkwo", "Dmitri Volkov", "Lucia Ferrante", "Tariq Haddad",
    "Elena Markovic", "Rafael Quintero", "Nadia Petrenko", "Jonas Eberhardt", "Aditya Kulkarni", "Freya Lindholm",
    "Marcus Whitfield", "Hana Novakova", "Idris Bellamy", "Sofia Castellano", "Viktor Halloran", "Leila Farahani",
    "Oskar Brandvold", "Chiara Benedetti", "Kenji Morimoto", "Beatriz Saldanha", "Emeka Nwosu", "Greta Vanderberg",
    "Samir Khoury", "Astrid Nyberg",
)
CODE_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"  # no I or O, which read as digits


def _passkey(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _name(rng: random.Random) -> str:
    return rng.choice(NAMES)


def _code(rng: random.Random) -> str:
    """Two letters, four digits, two letters: "QX-4417-ZB" (about ten tokens)."""
    a, b = rng.choice(CODE_LETTERS), rng.choice(CODE_LETTERS)
    n = rng.randint(1000, 9999)
    c, d = rng.choice(CODE_LETTERS), rng.choice(CODE_LETTERS)
    return f"{a}{b}-{n}-{c}{d}"


def _digits_right(text: str, key: str) -> bool:
    """Exact: the first characters after any spaces are the passkey's digits, and no further digit follows."""
    found = re.match(r"\s*(\d+)", text)
    return found is not None and found.group(1) == key


def _verbatim_right(text: str, key: str) -> bool:
    """Exact: the first characters after any spaces are the key, case and all, and no letter, digit, underscore or
    hyphen follows ("Maria Lindqvist." and "QX-4417-ZB" are right; "Maria Lindqvists", "QX-4417-ZBA" are not)."""
    return re.match(r"\s*" + re.escape(key) + r"(?![\w-])", text) is not None


@dataclass(frozen=True)
class Needle:
    """A fact to hide, its question and its exact answer check; `new_tokens`: the greedy answer tokens decoded (the
    longest key's tokens after the question, and one more that must not extend it)."""

    name: str
    sentence: str  # with {key}, twice
    question: str
    draw: Callable[[random.Random], str]  # one key from the grid's seeded generator
    check: Callable[[str, str], bool]  # (answer text, key) -> right
    new_tokens: int
    key_example: str  # the shape of its keys, for check_filler's token count and the docs

    def is_right(self, text: str, key: str) -> bool:
        return self.check(text, key)


NEEDLES = {n.name: n for n in (
    Needle("passkey", NEEDLE, QUESTION, _passkey, _digits_right, 7, "48213"),
    Needle("name", " The courier who carried the sealed letter was called {key}. Remember it: the courier's name was "
           "{key}. ", "\nQuestion: what was the courier's name? Answer: the courier's name was",
           _name, _verbatim_right, 9, "Olusegun Adeyemi"),
    Needle("code", " The vault's access code is {key}. Write it down: the access code is {key}. ",
           "\nQuestion: what is the vault's access code? Answer: the vault's access code is",
           _code, _verbatim_right, 12, "QX-4417-ZB"),
)}
PASSKEY = NEEDLES["passkey"]
DEFAULT_DEPTHS = (0.2, 0.5, 0.8)
QUICK_DEPTHS = (0.25, 0.75)
# The most prompts one grid may hold (lengths × depths × trials): every prompt's answer per method and its passkey are
# kept in the report, which `--write` stores in a manifest of at most 1 MiB (about 60 bytes per answer there).
MAX_PROMPTS = 1024
PREFILL_CHUNK = 1 << 30  # one chunk: the causal SDPA path (no materialised mask; CPU flash kernel)


@dataclass(frozen=True)
class NeedlePrompt:
    context: list[int]  # filler with the needle inside, token ids
    question: list[int]
    key: str  # the passkey digits
    needle_start: int  # token index of the needle's first token in `context`
    needle_len: int


def default_lengths(max_tokens: int, quick: bool = False) -> tuple[int, ...]:
    """1024, 2048, … below `max_tokens` (the longest prompt the model can answer within its positions), then
    `max_tokens` itself; quick: 1024 and the largest of them ≤ 4096."""
    lengths = []
    n = 1024
    while n < max_tokens:
        lengths.append(n)
        n *= 2
    lengths.append(max(int(max_tokens), 256))
    if quick:
        return tuple(sorted({lengths[0], max(x for x in lengths if x <= 4096)}))
    return tuple(lengths)


def needle_named(name: str) -> Needle:
    """The registry's needle `name`; InputError naming the known ones otherwise."""
    if name not in NEEDLES:
        raise InputError(f"unknown needle {name!r}; known: {', '.join(NEEDLES)}")
    return NEEDLES[name]


def needle_of_report(sentence: str) -> Needle:
    """The needle whose sentence a report records (`NeedleReport.needle`); the passkey for any other (reports written
    before needles had names recorded the passkey's)."""
    return next((n for n in NEEDLES.values() if n.sentence.strip() == sentence.strip()), PASSKEY)


def build_prompt(tokenizer, filler: list[int], length: int, depth: float, rng: random.Random,
                 fact: Needle = PASSKEY) -> NeedlePrompt:
    """`length` tokens in all (context + question): filler tokens (any haystack's) with the needle's tokens inserted
    whole at round(depth · filler tokens), the question after. The key comes from `rng` first (the passkey: five random
    digits), then the filler window's start."""
    if not 0.0 <= depth <= 1.0:
        raise InputError(f"needle depth must be in [0, 1], got {depth}")
    key = fact.draw(rng)
    needle = tokenizer(fact.sentence.format(key=key), add_special_tokens=False).input_ids
    question = tokenizer(fact.question, add_special_tokens=False).input_ids
    n_filler = length - len(needle) - len(question)
    if n_filler < 1:
        raise InputError(f"needle length {length} is too short for the needle and the question")
    if n_filler > len(filler):
        raise InputError(f"the filler text has {len(filler):,} tokens, {n_filler:,} are needed for length {length}",
                         "pass a longer --dataset or smaller --needle-lengths")
    offset = rng.randint(0, len(filler) - n_filler)  # where in the filler this prompt's text starts
    text = filler[offset : offset + n_filler]
    pos = round(depth * n_filler)
    return NeedlePrompt(text[:pos] + needle + text[pos:], question, key, pos, len(needle))


def answer_is_right(text: str, key: str, fact: Needle = PASSKEY) -> bool:
    """The needle's exact check; the passkey's: the first characters after any spaces are its digits, and no further
    digit follows."""
    return fact.is_right(text, key)


PROTOCOLS = tuple(p.value for p in NeedleProtocol)


@dataclass
class NeedleSettings:
    lengths: tuple[int, ...]
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 2
    seed: int = 0
    new_tokens: int | None = None  # None: the needle's (the passkey's 7: " 48213." — the first non-space characters
    # decide)
    min_relative_accuracy: float = DEFAULT_MIN_NEEDLE_ACCURACY  # the artifact's overall accuracy / BF16's
    protocol: str = NeedleProtocol.FOLLOW_UP.value  # one of PROTOCOLS
    batch: int = 1  # prompts of one length run as the rows of one batch (the same prompts; round-off may differ)
    needle: str = PASSKEY.name  # one of NEEDLES

    def __post_init__(self):
        fact = needle_named(self.needle)  # an unknown needle: InputError
        if self.new_tokens is None:
            self.new_tokens = fact.new_tokens
        if self.protocol not in PROTOCOLS:  # before any model work, not after the teacher-forced run
            raise InputError(f"needle protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.batch < 1:
            raise InputError(f"needle batch must be positive, got {self.batch}")
        if self.trials < 1:
            raise InputError(f"needle trials must be positive, got {self.trials}")
        check_grid_size(self)  # lengths () (the model's defaults) are checked again once they are known


def check_lengths(settings: NeedleSettings, limit: int | None) -> None:
    """InputError unless every prompt length and its answer fit the model's `limit` positions (None: the model states
    none) and the grid holds at most MAX_PROMPTS prompts. `verify` calls it as soon as the model's config is read,
    before any held-out text or model work; `run_needle` again."""
    check_grid_size(settings)
    for length in settings.lengths:
        if limit is not None and length + settings.new_tokens > limit:
            raise InputError(f"--needle-lengths {length}: with the {settings.new_tokens} answer tokens it exceeds the "
                             f"model's {limit:,} positions",
                             f"use --needle-lengths up to {limit - settings.new_tokens}")


def check_filler(tokenizer, filler: list[int], settings: NeedleSettings) -> None:
    """InputError unless the held-out text (`filler`, token ids) is long enough for the longest prompt: checked before
    any model work (`build_prompt` checks each prompt again)."""
    fact = needle_named(settings.needle)
    fixed = len(tokenizer(fact.sentence.format(key=fact.key_example), add_special_tokens=False).input_ids) + \
        len(tokenizer(fact.question, add_special_tokens=False).input_ids)
    longest = max(settings.lengths, default=0)
    if longest - fixed > len(filler):
        raise InputError(f"--needle-lengths {longest}: the held-out text has {len(filler):,} tokens, about "
                         f"{longest - fixed:,} are needed", "pass a longer --dataset or smaller --needle-lengths")


def check_grid_size(settings: NeedleSettings) -> None:
    """InputError when the grid (lengths × depths × trials) has more than MAX_PROMPTS prompts."""
    prompts = max(len(settings.lengths), 1) * len(settings.depths) * settings.trials
    if prompts > MAX_PROMPTS:
        grid = (f"{len(settings.lengths)} lengths × " if settings.lengths else "") + \
            f"{len(settings.depths)} depths × {settings.trials} trials"
        raise InputError(f"the needle grid has {grid} = {prompts:,} prompts; at most {MAX_PROMPTS:,}",
                         "lower --needle-trials, or pass fewer --needle-lengths or --needle-depths")


def check_batch(batch: int, baselines: tuple[str, ...]) -> None:
    """InputError unless `batch` prompts per batch can run these baselines: HQQ's quantization groups (transformers'
    documented defaults, axis 0) span the rows of a batch, so one prompt's answer would depend on the others'."""
    if batch > 1 and any(b.startswith("hf-hqq") for b in baselines):
        raise InputError("--needle-batch above 1 cannot run the hf-hqq baselines: HQQ's quantization groups span the "
                         "rows of a batch", "leave --needle-batch at 1, or the hf-hqq baselines out")


def _forward(model, ids: Tensor, cache) -> Tensor:
    """Last-position logits of `ids` [B, n] run after what `cache` holds."""
    return model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_argument(): cache}).logits[:, -1]


def _answer(model, cache, question: Tensor, new_tokens: int) -> list[list[int]]:
    """`question` [B, n] (the question, or the whole prompt) as one chunk after what `cache` holds, then greedy decode
    steps; each row's generated token ids (read from the device once, at the end)."""
    logits = _forward(model, question, cache)
    out = [logits.argmax(-1, keepdim=True)[:, :0]]  # [B, 0]: no tokens asked, an empty answer per row
    for step in range(new_tokens):
        out.append(logits.argmax(-1, keepdim=True))  # [B, 1]
        if step + 1 < new_tokens:
            logits = _forward(model, out[-1], cache)
    return torch.cat(out, 1).tolist()


def _asked(model, prompts: list[NeedlePrompt], methods: list, protocol: str,
           device) -> Iterator[tuple[object, Tensor]]:
    """Per method (the reference first), one at a time (a cache is dropped before the next is filled): its cache and
    the ids still to run before the answer, the prompts (of one length) as the rows of one batch. "follow-up": the
    context prefilled once in BF16, each quantized cache filed from that prefill's K/V exactly as its `update` files a
    prompt, the question left to run; "prompt": a fresh cache each, the whole prompt left to run (its own exact K/V
    first, then the tiers: `model.generate(prompt, cache)`'s path)."""
    if protocol == NeedleProtocol.PROMPT.value:
        ids = torch.tensor([p.context + p.question for p in prompts], device=device)
        for m in methods:
            yield m.make_cache(), ids
        return
    context = torch.tensor([p.context for p in prompts], device=device)
    question = torch.tensor([p.question for p in prompts], device=device)
    bf16 = methods[0].make_cache()  # the model's own DynamicCache
    for s in range(0, context.shape[1], PREFILL_CHUNK):
        _forward(model, context[:, s : s + PREFILL_CHUNK], bf16)
    kv = [(layer.keys, layer.values) for layer in bf16.layers]  # the answer below appends to new tensors, not these
    yield bf16, question
    for m in methods[1:]:
        cache = m.make_cache()
        for idx, (k, v) in enumerate(kv):
            cache.update(k, v, idx)  # files the prompt as a prefill chunk would
        yield cache, question


def run_needle(loaded: LoadedModel, manifest, rotations, filler: list[int], settings: NeedleSettings,
               baselines: tuple[str, ...], progress: Callable[..., None] | None = None) -> NeedleReport:
    """The retrieval grid: for every (length, depth, trial) prompt, BF16 and every method with a cache to decode
    through (`Method.make_cache`); requested baselines without one (kivi) are left out."""
    from ..runtime.attention import enable_oscar

    progress = progress or (lambda *a, **k: None)
    t0 = time.perf_counter()
    model, info, tok = loaded.model, loaded.info, loaded.tokenizer
    device = next(model.parameters()).device
    q = manifest.quant
    check_lengths(settings, getattr(model.config, "max_position_embeddings", None))
    check_batch(settings.batch, baselines)
    fact = needle_named(settings.needle)
    reference, *others = build_methods(Setup.of(manifest, rotations, model, info), baselines)
    methods = [m for m in others if m.cache_path is not None]
    names = [reference.name] + [m.name for m in methods]
    right = {n: [[0] * len(settings.depths) for _ in settings.lengths] for n in names}
    answers: dict[str, list[str]] = {n: [] for n in names}
    keys: list[str] = []
    rng = random.Random(settings.seed)
    total, done = len(settings.lengths) * len(settings.depths) * settings.trials, 0
    progress("needle retrieval", 0, total, rate="")
    previous = model.config._attn_implementation
    everyone = [reference] + methods
    try:
        enable_oscar(model)  # exact attention with a DynamicCache; the runtime with an OscarCache
        with torch.inference_mode():
            for li, length in enumerate(settings.lengths):
                cells = ((di, build_prompt(tok, filler, length, depth, rng, fact)) for di, depth in
                         enumerate(settings.depths) for _ in range(settings.trials))  # the grid's order, built lazily
                while batch := list(itertools.islice(cells, settings.batch)):  # one batch of prompts held at a time
                    prompts = [p for _, p in batch]
                    keys += [p.key for p in prompts]
                    for m, (cache, ids) in zip(everyone, _asked(model, prompts, everyone, settings.protocol, device)):
                        answers[m.name] += tok.batch_decode(_answer(model, cache, ids, settings.new_tokens))
                    for n in names:
                        for (di, p), text in zip(batch, answers[n][-len(batch) :]):
                            right[n][li][di] += fact.is_right(text, p.key)
                    done += len(batch)
                    progress("needle retrieval", done, total, rate=f"{length} tokens")
    finally:
        model.set_attn_implementation(previous)
    ran = DTYPE_NAMES.get(next(model.parameters()).dtype, "BF16")
    labels = {reference.name: (f"{ran} (DynamicCache)", reference.kind)} | {m.name: (m.label, m.kind) for m in methods}
    results = [NeedleMethod(name=n, label=labels[n][0], kind=labels[n][1],
                            accuracy=[[c / settings.trials for c in row] for row in right[n]],
                            overall=sum(map(sum, right[n])) / total, answers=answers[n]) for n in names]
    return needle_report(results, settings, q.sink, q.recent, time.perf_counter() - t0, keys)


def paired_against_reference(needle: NeedleReport) -> list[tuple[str, int, PairedDifference]]:
    """Per method other than the reference and per length: its accuracy against BF16's on the same prompts, the
    difference with its 95 % interval (paired: stats.paired_difference) and the prompts only one of the two answers.
    Empty for a report without its prompts' keys (written before `needle.keys` was kept)."""
    if not needle.keys:
        return []
    per_length = len(needle.depths) * needle.trials
    fact = needle_of_report(needle.needle)

    def right(m: NeedleMethod) -> list[bool]:
        return [fact.is_right(a, k) for a, k in zip(m.answers, needle.keys)]

    ref = right(next(m for m in needle.methods if m.kind == "reference"))
    out = []
    for m in needle.methods:
        if m.kind == "reference":
            continue
        it = right(m)
        for i, length in enumerate(needle.lengths):
            cell = slice(i * per_length, (i + 1) * per_length)
            out.append((m.name, length, paired_difference(ref[cell], it[cell])))
    return out


def needle_report(results: list[NeedleMethod], settings: NeedleSettings, sink: int, recent: int,
                  wall: float, keys: list[str]) -> NeedleReport:
    """The report, with the pass rule (`report.needle_gate`): the artifact's overall accuracy ≥ min_relative_accuracy
    × BF16's, and BF16 answered at least one prompt (a grid BF16 fails entirely compares nothing: no pass)."""
    bf16 = next(r for r in results if r.kind == "reference")
    artifact = next(r for r in results if r.kind == "artifact")
    failures = needle_gate(bf16.overall, artifact.overall, settings.min_relative_accuracy, len(keys))
    fact = needle_named(settings.needle)
    return NeedleReport(lengths=list(settings.lengths), depths=list(settings.depths), trials=settings.trials,
                        seed=settings.seed, needle=fact.sentence.strip(), question=fact.question.strip(), sink=sink,
                        recent=recent, methods=results, min_relative_accuracy=settings.min_relative_accuracy,
                        passed=not failures, failures=failures, wall_seconds=round(wall, 2),
                        protocol=settings.protocol, batch=settings.batch, keys=keys)
