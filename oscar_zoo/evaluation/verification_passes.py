"""Verification orchestration: teacher-forced BF16 vs every method on held-out sequences, per-layer attention error on
one sequence, greedy generation through the runtime's OscarCache, thresholds → a `VerifyReport`. Library code: no
printing; long work reports through `progress(description, done, total, rate="")`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch
from torch import Tensor

from .. import __version__
from ..errors import InputError
from ..format import layout, reference
from ..format.verification import (
    DEFAULT_THRESHOLDS,
    Generation,
    MethodResult,
    Thresholds,
    VerifyReport,
    check_thresholds,
)
from ..models import LoadedModel
from . import metrics
from .baselines import Method, QuantizePack, Windows
from .registry import DEFAULT_BASELINES, Setup, build_methods
from .teacher_forcing import cache_argument, verifying

Progress = Callable[..., None]

ATTENTION_NOTE = ("teacher-forced: query i reads key j exactly iff j < sink or j > i − recent, else its INT2 "
                  "dequantization; fp32 softmax over the union (blocked SDPA, equal to "
                  "reference.windowed_attention_ref); rotated K/V (centred when the artifact is, the value mean "
                  "added back to the output) rounded to the model dtype as the cache stores them")


MAX_GENERATE = 4096  # greedy tokens at most: an early, noisy signal beside the teacher-forced verdict


def model_positions(model: torch.nn.Module) -> int | None:
    """The most positions the model takes (`max_position_embeddings`), or None when its config states none."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_positions(settings: VerifySettings, limit: int | None) -> None:
    """InputError unless the held-out sequences (`context` tokens) and the greedy continuation after the first of
    them fit the model's `limit` positions (None: the model states none); `verify` calls it as soon as the model is
    loaded, before any held-out text is read. Past its positions a model's RoPE was never trained: its numbers there
    would verify nothing."""
    if limit is None:
        return
    if settings.context > limit:
        raise InputError(f"--context {settings.context:,} exceeds the model's {limit:,} positions",
                         f"use --context up to {limit:,}")
    if settings.context + settings.generate_tokens > limit:
        raise InputError(f"--context {settings.context:,} + --generate {settings.generate_tokens:,} greedy tokens "
                         f"reach past the model's {limit:,} positions",
                         f"use --generate up to {limit - settings.context:,}, or a shorter --context")


@dataclass(frozen=True)
class VerifySettings:
    context: int = 2048
    sequences: int = 8
    baselines: tuple[str, ...] = DEFAULT_BASELINES
    backend: str = "torch"  # resolved: "torch" or "triton"
    positions_from: int | None = None  # default: sink + recent (first position whose attention reads an INT2 key)
    generate_tokens: int = 32
    bin_size: int = 64
    thresholds: Thresholds = DEFAULT_THRESHOLDS


@dataclass
class _Scores:
    nll: list[Tensor] = field(default_factory=list)
    kl: list[Tensor] = field(default_factory=list)
    agree: list[Tensor] = field(default_factory=list)

    def add(self, tm: metrics.TokenMetrics) -> None:
        self.nll.append(tm.nll)
        self.kl.append(tm.kl)
        self.agree.append(tm.agree)


def resolve_backend(name: str, device: torch.device) -> str:
    """auto → triton on a CUDA device, torch otherwise; triton on CPU needs TRITON_INTERPRET=1 (tests)."""
    if name not in ("auto", "torch", "triton"):
        raise InputError(f"unknown backend {name!r}", "use auto, triton or torch")
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_installed() else "torch"
    if name == "triton":
        if not _triton_installed():
            raise InputError("--backend triton was asked for but triton is not installed", "use --backend torch")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise InputError("--backend triton needs a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)",
                             "use --backend torch on a CPU")
    return name


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def quantizer(backend: str) -> QuantizePack:
    """The quantize/pack the runtime uses: the Triton host wrapper (kernel on CUDA / interpreter) or the reference."""
    if backend == "triton":
        from ..runtime import ops

        return ops.quantize_pack
    return reference.quantize_pack_ref


class Attender(Windows):
    """Computes one layer's attention for a method (`Method.attend`) with the runtime's quantize/pack and windows."""

    def __call__(self, method: Method, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return method.attend(layer, q, k, v, scale, self)  # fp32 [B, H_q, T, D]


def _logits(model: torch.nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, use_cache=False).logits[0, :-1]  # [T-1, V]: position t predicts token t+1


def run_verification(loaded: LoadedModel, manifest, rotations, input_ids: Tensor, settings: VerifySettings,
                     artifacts: str = "", dataset: str = "", progress: Progress | None = None) -> VerifyReport:
    """Verify `rotations` (artifacts.Rotations for `manifest`) on `input_ids` int64 [N, T] held-out sequences."""
    progress = progress or (lambda *a, **k: None)
    t0 = time.perf_counter()
    model, info = loaded.model, loaded.info
    device = next(model.parameters()).device
    q = manifest.quant
    sink, recent, L, D = q.sink, q.recent, info.num_layers, info.head_dim
    ids_all = input_ids[: settings.sequences]
    N, T = ids_all.shape
    start = sink + recent if settings.positions_from is None else settings.positions_from
    if start < 0:
        raise InputError(f"--score-from must be ≥ 0, got {start}")
    if T - 1 <= start:
        raise InputError(f"context {T} leaves no scored position at or past {start} (sink {sink} + recent {recent})",
                         f"use --context > {start + 1}")
    if sorted(int(i) for i in rotations.layer_ids) != list(range(L)):
        raise InputError(f"the artifacts cover layers {rotations.layer_ids.tolist()}, the model has {L}: verify needs "
                         "a rotation for every attention layer")
    methods = build_methods(Setup.of(manifest, rotations, model, info), settings.baselines)  # methods[0]: BF16
    quantized = [m for m in methods if m.kind != "reference"]
    attend = Attender(quantizer(settings.backend), sink, recent)

    scores = {m.name: _Scores() for m in methods}
    layer_error = {m.name: [0.0] * L for m in methods}
    passes, done = N * len(methods), 0
    progress("teacher forcing", 0, passes, rate="")
    with torch.inference_mode():
        for s in range(N):
            ids = ids_all[s : s + 1].to(device)
            targets = ids[0, 1:]

            def exact(layer, q_, k_, v_, scale, probe=(s == 0)):
                out = attend(methods[0], layer, q_, k_, v_, scale)
                if probe:  # per-layer error of every method on the same (BF16-run) inputs, queries ≥ start
                    for m in quantized:
                        o = attend(m, layer, q_, k_, v_, scale)
                        layer_error[m.name][layer] = metrics.relative_error(o[:, :, start:], out[:, :, start:])
                return out

            t_pass = time.perf_counter()
            with verifying(model, exact):
                logits = _logits(model, ids)
            ref = metrics.reference_of(logits)
            del logits
            scores[methods[0].name].add(metrics.reference_metrics(ref, targets))
            done += 1
            progress("teacher forcing", done, passes, rate=f"{(T / (time.perf_counter() - t_pass)):,.0f} tok/s")
            for m in quantized:
                t_pass = time.perf_counter()
                with verifying(model, lambda layer, q_, k_, v_, scale, m=m: attend(m, layer, q_, k_, v_, scale)):
                    logits = _logits(model, ids)
                scores[m.name].add(metrics.token_metrics(logits, targets, ref))
                del logits
                done += 1
                progress("teacher forcing", done, passes,
                         rate=f"{(T / (time.perf_counter() - t_pass)):,.0f} tok/s")
            del ref

    generations = {}
    if settings.generate_tokens > 0:
        generations = compare_generation(loaded, ids_all[:1], methods, settings.generate_tokens, progress)

    results = _results(methods, scores, layer_error, generations, start, T, settings.bin_size)
    artifact = next(r for r in results if r.kind == "artifact")
    failures = check_thresholds(artifact, settings.thresholds)
    import transformers

    versions = {"oscar-zoo": __version__, "torch": torch.__version__, "transformers": transformers.__version__}
    if settings.backend == "triton":
        import triton

        versions["triton"] = triton.__version__
    return VerifyReport(
        model=loaded.identity.id, revision=loaded.identity.revision, artifacts=artifacts, dataset=dataset, context=T,
        sequences=N, positions_from=start, tokens_scored=N * (T - 1 - start), sink=sink, recent=recent,
        group_size=layout.resolve_group_size(D, q.group_size), backend=settings.backend, device=str(device),
        attention=ATTENTION_NOTE, bin_size=settings.bin_size, methods=results, thresholds=settings.thresholds,
        passed=not failures, failures=failures, wall_seconds=round(time.perf_counter() - t0, 2), versions=versions,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def _results(methods: list[Method], scores: dict[str, _Scores], layer_error: dict[str, list[float]],
             generations: dict[str, Generation], start: int, T: int, bin_size: int) -> list[MethodResult]:
    out = []
    base_ppl = None
    for m in methods:
        sc = scores[m.name]
        nll, kl, agree = torch.stack(sc.nll), torch.stack(sc.kl), torch.stack(sc.agree)  # [N, T-1]
        ppl_past = metrics.perplexity(nll[:, start:])
        base_ppl = ppl_past if base_ppl is None else base_ppl  # methods[0] is BF16
        bk, bv = m.bits(T)
        out.append(MethodResult(
            name=m.name, label=m.label, kind=m.kind, bits_per_element=round((bk + bv) / 2, 4),
            bits_per_element_k=round(bk, 4), bits_per_element_v=round(bv, 4), ppl=metrics.perplexity(nll),
            ppl_past_windows=ppl_past, ppl_increase=ppl_past / base_ppl - 1, kl=metrics.mean(kl[:, start:]),
            top1=metrics.mean(agree[:, start:].float()), layer_error=layer_error[m.name],
            kl_by_position=metrics.binned_mean(kl, bin_size), generation=generations.get(m.name),
        ))
    return out


# ------------------------------------------------------------------------------------------------------ generation


def _greedy(model: torch.nn.Module, prompt: Tensor, new_tokens: int, pad_id: int, cache=None) -> Tensor:
    kwargs = {cache_argument(): cache} if cache is not None else {}
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, num_beams=1, pad_token_id=pad_id, **kwargs)
    return out[0, prompt.shape[1]:].cpu()


def compare_generation(loaded: LoadedModel, prompt: Tensor, methods: list[Method], new_tokens: int,
                       progress: Progress) -> dict[str, Generation]:
    """Greedy continuation of `prompt` [1, P]: BF16 (methods[0]: the model's own attention, DynamicCache) vs every
    method with a cache (`Method.make_cache`): OscarCache + the `oscar` attention (prefill exact, decode through the
    INT2 tiers), or transformers' QuantizedCache (the `oscar` attention is plain attention over what it returns)."""
    from ..runtime.attention import enable_oscar
    from ..runtime.graph import install

    model = loaded.model
    device = next(model.parameters()).device
    prompt = prompt.to(device)
    pad_id = getattr(loaded.tokenizer, "eos_token_id", None) or 0
    runnable = [m for m in methods if m.kind != "reference" and m.cache_path is not None]
    total = 1 + len(runnable)
    progress("greedy generation", 0, total, rate="")
    with torch.inference_mode():
        reference_tokens = _greedy(model, prompt, new_tokens, pad_id)
        progress("greedy generation", 1, total, rate="")
        previous = model.config._attn_implementation
        graphs = getattr(model, "_oscar_graphs", None)
        compiled_before = None if graphs is None else graphs.compiled is not None
        results = {}
        try:
            enable_oscar(model, compile=False)  # a few dozen tokens: compiling the step would cost more than it saves
            for i, m in enumerate(runnable):
                tokens = _greedy(model, prompt, new_tokens, pad_id, m.make_cache())
                same = (tokens == reference_tokens[: tokens.shape[0]])
                n = min(tokens.shape[0], reference_tokens.shape[0])
                diverged = (~same[:n]).nonzero()
                results[m.name] = Generation(path=m.cache_path, prompt_tokens=prompt.shape[1], new_tokens=n,
                                             first_divergence=int(diverged[0]) if diverged.numel() else None,
                                             matched_tokens=int(same[:n].sum()))
                progress("greedy generation", 2 + i, total, rate="")
        finally:
            model.set_attn_implementation(previous)
            if compiled_before:  # the caller's compiled step comes back
                install(model, compile=True)
    n = reference_tokens.shape[0]
    results[methods[0].name] = Generation(path=methods[0].cache_path, prompt_tokens=prompt.shape[1], new_tokens=n,
                                          first_divergence=None, matched_tokens=n)
    return results
