"""Quality at matched bits: OSCAR design choices and baselines, teacher-forced against BF16 on two held-out domains.

Drives the library (calibration.calibration_passes.accumulate, calibration.clip_search,
calibration.rotation_fit.fit_rotations, evaluation.baselines / verification_passes.Attender /
teacher_forcing.verifying), not the CLI. One accumulation per (budget, calibration domain) gives every rotation /
value-target / granularity variant; clip ratios come from clip_search.objectives on that calibration's held-out samples.
Every method runs over the same sequences in one loop, BF16 logits once per sequence. Results go to a JSON file
(rewritten after every sequence, so a cut-short run is still usable) and a markdown summary.

    OSCAR_ZOO_CACHE=/tmp/ozc .venv/bin/python -m benchmarks.quality_sweep --sequences 3 --context 2048 \
        --out /tmp/quality_sweep.json
    .venv/bin/python -m benchmarks.quality_sweep --summarize /tmp/quality_sweep.json   # tables from a (partial) run

Domains: (i) the ten bundled evaluation plays (EVALUATION_PLAYS, never calibrated on); (ii) English docstrings
(`inspect.getdoc`) of a fixed list of Python standard-library modules, one document per module; calibration on
domain (ii) uses a disjoint module list (DOC_CALIBRATION_MODULES), so domain (ii) evaluation is held out either way.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from oscar_zoo.artifacts import load_artifacts
from oscar_zoo.calibration import clip_search
from oscar_zoo.calibration.calibration_passes import (
    AccumulatorStore,
    CalibrationSettings,
    accumulate,
    layer_sample,
    store_key,
)
from oscar_zoo.calibration.rotation_fit import fit_rotations, spectrum_ratio
from oscar_zoo.calibration.targets import centred_target
from oscar_zoo.evaluation import metrics
from oscar_zoo.evaluation.baselines import (
    Exact,
    Kivi,
    Method,
    RotatedInt2,
    hadamard_rotation,
)
from oscar_zoo.evaluation.haystacks import module_docstrings
from oscar_zoo.evaluation.peers import PeerCache
from oscar_zoo.evaluation.registry import ARTIFACT, BASELINES, PEERS, Setup, check_baselines
from oscar_zoo.evaluation.teacher_forcing import verifying
from oscar_zoo.evaluation.verification_passes import Attender, _logits, quantizer
from oscar_zoo.format import layout, reference
from oscar_zoo.models import cache_root, load_model
from oscar_zoo.texts import EVALUATION_PLAYS, load_texts, make_sequences

DOC_CALIBRATION_MODULES = (
    "argparse", "collections", "functools", "logging", "os", "pathlib", "re", "shutil", "subprocess", "tarfile",
    "threading", "typing", "datetime", "decimal", "statistics", "textwrap", "zipfile", "email.message", "http.client",
    "urllib.parse",
)
DOC_EVALUATION_MODULES = (
    "inspect", "difflib", "random", "calendar", "configparser", "csv", "enum", "dataclasses", "contextlib",
    "tempfile", "heapq", "socket", "pdb", "fractions", "string",
)
SEED = 0
SINK, RECENT = layout.SINK, layout.RECENT


# ------------------------------------------------------------------------------------------------------------ data


def module_document(name: str) -> str:
    """One document: `haystacks.module_docstrings(name)` joined by blank lines."""
    return "\n\n".join(module_docstrings(name))


@dataclass
class Calibration:
    name: str
    tokens: int
    key: torch.Tensor  # [L, H_kv, D, D] float64
    value_weighted: torch.Tensor
    value_softmax: torch.Tensor
    heldout: dict
    seconds: float
    ran: list
    k_mean: torch.Tensor  # [L, H_kv, D] float64: the centred codec's means (pass 1)
    v_mean: torch.Tensor
    v_wmean: torch.Tensor  # key-weighted value mean (pass 2): the weighted value target about μ_V needs it


def calibrate_targets(loaded, texts: list[str], source: str, n_sequences: int, log) -> Calibration:
    """One accumulation (the CLI's cache folder, so it is shared with `oscar-zoo calibrate`): all three targets and the
    held-out samples, seq_len 512 and 2 held-out sequences as the CLI's defaults."""
    t0 = time.perf_counter()
    seqs = make_sequences(loaded.tokenizer, texts, 512, n_sequences, 2, SEED, dataset=source)
    store = AccumulatorStore(cache_root() / "calibration" / store_key(loaded, seqs))
    key, value, soft, heldout, ran, means = accumulate(loaded, seqs, CalibrationSettings(), store,
                                                       lambda *a, **k: None)
    cal = Calibration(f"{source}:{seqs.input_ids.numel()}", seqs.input_ids.numel(), key.mean().cpu(),
                      value.mean().cpu(), soft.mean().cpu(), heldout, time.perf_counter() - t0, ran,
                      *(m.mean().cpu() for m in means))
    log(f"calibration {cal.name}: {cal.seconds:.0f} s (passes run: {ran or 'none, reused'})")
    return cal


# --------------------------------------------------------------------------------------------------------- methods


def searched_clips(cal: Calibration, k_rot, v_rot, group_size: int, objective: str, means=None
                   ) -> tuple[torch.Tensor, ...]:
    """Per-(layer, rotation head) K/V ratios from clip_search on the calibration's held-out samples; `means`
    (k_mean, v_mean [L, H, D]) searches on the centred rows, as the pipeline does."""
    grid = clip_search.search_grid()
    L, D = cal.key.shape[0], cal.key.shape[-1]
    eye = torch.eye(D).expand(1, D, D)
    k_clip, v_clip = [], []
    for layer in range(L):
        kr = eye if k_rot is None else k_rot[layer]
        vr = eye if v_rot is None else v_rot[layer]
        centred = {} if means is None else {"k_mean": reference.rotate_mean(means[0][layer], kr),
                                            "v_mean": reference.rotate_mean(means[1][layer], vr)}
        kt, vt = clip_search.objectives(layer_sample(cal.heldout, layer), kr, vr, cal.key[layer], grid, group_size,
                                        objective=objective, **centred)
        k_clip.append(clip_search.pick(kt, grid))
        v_clip.append(clip_search.pick(vt, grid))
    return torch.stack(k_clip), torch.stack(v_clip)


def rotated(name: str, label: str, cal: Calibration | None, rotation: str, value_target: str = "weighted",
            clip: str = "search", objective: str = "attention", group_size: int = 0, kind: str = "variant",
            D: int = 64, centring: bool = False, centred_value_target: bool = False, centre_values: bool = True,
            search_centred: bool = True) -> RotatedInt2:
    """rotation: per-head | per-layer (U·H·P from `cal`), hp (data-free H·P), none. clip: search | fixed | none.
    centring: the codec of schema 2 (means from `cal`, clips searched on centred rows); centred_value_target: the
    weighted value target about μ_V (a covariance) instead of about 0. Diagnostics of the codec: centre_values=False
    removes the key mean only; search_centred=False keeps the clips searched on uncentred rows."""
    L = 30 if cal is None else cal.key.shape[0]
    means = None
    if centring:
        means = (cal.k_mean.float(), cal.v_mean.float())
        if rotation != "per-head":  # one rotation per layer (or H·P for all): one mean per layer, as calibrate does
            means = tuple(m.mean(1, keepdim=True) for m in means)
        if not centre_values:
            means = (means[0], torch.zeros_like(means[1]))
    if rotation in ("per-head", "per-layer"):
        k_rot, _ = fit_rotations(cal.key, rotation)
        v_target = cal.value_weighted if value_target == "weighted" else cal.value_softmax
        if centred_value_target:
            v_target = centred_target(v_target, cal.v_wmean, cal.v_mean)
        v_rot, _ = fit_rotations(v_target, rotation)
    elif rotation == "hp":
        k_rot = v_rot = hadamard_rotation(L, D)
    else:
        k_rot = v_rot = None
    H = 1 if k_rot is None else k_rot.shape[1]
    if clip == "search":
        k_clip, v_clip = searched_clips(cal, k_rot, v_rot, group_size, objective, means if search_centred else None)
    elif clip == "fixed":
        k_clip, v_clip = torch.full((L, H), layout.DEFAULT_K_CLIP), torch.full((L, H), layout.DEFAULT_V_CLIP)
    else:
        k_clip = v_clip = torch.zeros(L, H)
    if means is not None and k_rot is None:
        raise ValueError("centring needs a rotation (use hp for the data-free one)")
    m = RotatedInt2(name, label, kind, k_rot, v_rot, k_clip, v_clip, group_size, SINK, RECENT,
                    *(means if means is not None else (None, None)))
    m.head_dim = D
    return m


class KeyCentered(RotatedInt2):
    """Probe of a next step (not a codec change): the default's rotated history keys minus a per-(layer, KV head) key
    mean μ·M before clip + INT2, μ·M added back after. Equivalent to centering every cached key, which shifts each
    query's logits by the constant q·μ (softmax-invariant). μ: mean key of the calibration's held-out samples."""

    def __init__(self, base: RotatedInt2, k_mean: torch.Tensor):
        super().__init__("kcenter", "defaults + per-(layer, head) key mean removed before INT2 (probe)", "variant",
                         base.k_rotation, base.v_rotation, base.k_clip, base.v_clip, base.group_size, base.sink,
                         base.recent)
        self.head_dim = base.head_dim
        self.probe_mean = k_mean  # [L, H_kv, D] unrotated, fp32 (not `k_mean`: that would make the base codec centre)

    def prepare(self, layer, q, k, v, quantize_pack):
        kv = super().prepare(layer, q, k, v, quantize_pack)
        M_k = self.k_rotation[layer].to(k.device)  # [H, D, D]
        mu = (self.probe_mean[layer].to(k.device)[:, None, :] @ M_k)[None]  # [1, H_kv, 1, D] rotated mean
        k_clip = self.k_clip[layer].reshape(-1, 1).to(k.device)
        kv.k_hat = self._history(quantize_pack, (kv.k.float() - mu).to(kv.k.dtype), k_clip) + mu
        return kv


class LloydMax(RotatedInt2):
    """Lloyd-Max levels, measured through fake quantization: `base`'s rotations, means and clips, with four Lloyd-Max
    levels per (layer, KV head, K/V) instead of the uniform ones (`reference.fake_quant_levels`: the same float16
    scale and zero, so the same bits), fitted on the calibration's held-out rows as the runtime would store them
    (rotated, centred, clipped, in code units)."""

    def __init__(self, base: RotatedInt2, cal: Calibration):
        super().__init__("centred-lm", f"{base.name} + Lloyd-Max levels per (layer, head, K/V)", "variant",
                         base.k_rotation, base.v_rotation, base.k_clip, base.v_clip, base.group_size, base.sink,
                         base.recent, base.k_mean, base.v_mean)
        self.head_dim = base.head_dim
        self.levels = {}  # (layer, "k"|"v") -> [H, 1, 4] float32
        for layer in range(self.k_rotation.shape[0]):
            for name, M, mean, clip in (("k", self.k_rotation, self.k_mean, self.k_clip),
                                        ("v", self.v_rotation, self.v_mean, self.v_clip)):
                x = cal.heldout[f"{layer}.{name}"].float()  # [S, H_kv, T, D]
                rows = reference.rotate_centred(x, M[layer], reference.rotate_mean(mean[layer], M[layer]))
                rows = reference.clip_rows(rows, clip[layer].reshape(1, -1, 1).double())
                u = reference.code_units(rows, self.group_size).transpose(0, 1)  # [H_kv, S, T, D/G, G]
                self.levels[(layer, name)] = torch.stack([reference.fit_levels(u[h]) for h in range(u.shape[0])]
                                                         ).float().reshape(-1, 1, 4)

    def prepare(self, layer, q, k, v, quantize_pack):
        kv = super().prepare(layer, q, k, v, quantize_pack)
        T = kv.k.shape[2]
        lo, hi = min(self.sink, T), max(min(self.sink, T), T - self.recent)
        for name in ("k", "v"):
            rows = getattr(kv, name)
            clip = getattr(self, f"{name}_clip")[layer].reshape(-1, 1).to(rows.device)
            out = rows.float().clone()
            if hi > lo:
                out[:, :, lo:hi] = reference.fake_quant_levels(rows[:, :, lo:hi], clip, self.levels[(layer, name)],
                                                               self.group_size)
            setattr(kv, f"{name}_hat", out)
        return kv


class ChannelKeys(RotatedInt2):
    """Keys per channel as a probe (QUALITY.md, "Codec options"): `base`'s rotations and key bits, its history keys
    coded per channel over blocks of `block` tokens (min-max, unclipped; `needle_mechanism.per_channel`) and its values
    unclipped. At head_dim = block the scale/zero bits equal a row's, so the bits are `base`'s."""

    def __init__(self, base: RotatedInt2, block: int = 64):
        super().__init__(f"{base.name}-kchan", f"{base.label} + keys per channel / {block} tokens, values unclipped",
                         "variant", base.k_rotation, base.v_rotation, base.k_clip, torch.zeros_like(base.v_clip),
                         base.group_size, base.sink, base.recent, base.k_mean, base.v_mean, base.key_bits)
        self.head_dim, self.block = base.head_dim, block

    def prepare(self, layer, q, k, v, quantize_pack):
        from .experiments.needle_mechanism import per_channel

        kv = super().prepare(layer, q, k, v, quantize_pack)
        B, H, T, D = kv.k.shape
        lo = min(self.sink, T)
        hi = max(lo, T - self.recent)
        if hi > lo:
            bits = self.key_bits[layer] if self.key_bits else 2
            rows = kv.k[:, :, lo:hi].float().reshape(B * H, hi - lo, D)
            kv.k_hat[:, :, lo:hi] = per_channel(rows, bits, self.block).reshape(B, H, hi - lo, D)
        return kv


def kivi(name: str, group: int, D: int = 64) -> Kivi:
    m = Kivi(D, SINK, RECENT, group)
    m.name, m.kind, m.head_dim = name, "baseline", D
    m.label = f"KIVI-2-style, K per channel / {group} tokens, V per token / {m.v_group} channels, no clip"
    return m


def history_bits(m: Method) -> float:
    """Bits per element of the INT2 history alone (2 + 32/G, K and V averaged)."""
    if isinstance(m, Kivi):
        return (2 + 32 / m.group + 2 + 32 / m.v_group) / 2
    if isinstance(m, Exact):
        return 16.0
    if isinstance(m, PeerCache):
        return m.history_bits()
    key_bits = sum(m.key_bits) / len(m.key_bits) if getattr(m, "key_bits", None) else 2
    return (key_bits + 2) / 2 + 32 / layout.resolve_group_size(m.head_dim, m.group_size)


# -------------------------------------------------------------------------------------------------------- the loop


def seq_scores(tm: metrics.TokenMetrics, start: int) -> dict:
    nll = tm.nll[start:].double()
    return {"nll_sum": nll.sum().item(), "n": nll.numel(), "ppl": math.exp(nll.mean().item()),
            "kl": tm.kl[start:].double().mean().item(), "top1": tm.agree[start:].double().mean().item()}


def layer_errors(model, attend: Attender, methods: list[Method], ids: torch.Tensor, start: int) -> dict:
    """Per-layer ‖o − o_bf16‖/‖o_bf16‖ (queries ≥ start) of every method on the BF16 run's own inputs (the harness's
    probe): the error each layer's quantization causes, without accumulated drift."""
    L = model.config.num_hidden_layers
    errs = {m.name: [0.0] * L for m in methods}
    exact = Exact()

    def runner(layer, q, k, v, scale):
        out = attend(exact, layer, q, k, v, scale)
        for m in methods:
            errs[m.name][layer] = metrics.relative_error(attend(m, layer, q, k, v, scale)[:, :, start:],
                                                         out[:, :, start:])
        return out

    with torch.inference_mode(), verifying(model, runner):
        _logits(model, ids)
    return errs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=3, help="held-out sequences per domain")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--budgets", default="4096,16384", help="calibration tokens on the plays (first: the 4K variant)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="/tmp/quality_sweep.json")
    ap.add_argument("--methods", help="comma-separated subset of methods (BF16 and oscar always run); "
                    "skips the per-layer diagnostics")
    ap.add_argument("--layer-probe", action="store_true", help="per-layer diagnostics even with --methods")
    ap.add_argument("--smoke", action="store_true", help="fixed clips instead of searches (a quick check of the loop)")
    ap.add_argument("--summarize", help="print the markdown tables of an existing result file and exit")
    ap.add_argument("--channel-keys", action="store_true",
                    help="with --artifact: also NAME-kchan, its keys per channel over 64-token blocks and its values "
                         "unclipped (the keys-per-channel probe)")
    ap.add_argument("--artifact", action="append", default=[], metavar="NAME=FOLDER",
                    help="also verify the OSCAR method of an artifact folder (its rotations, clips and key bits) as "
                         "method NAME; repeatable")
    ap.add_argument("--reference", default="oscar", help="the method the paired columns compare with (summary)")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(json.loads(Path(args.summarize).read_text()), args.reference))
        return

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.0f} s] {msg}", flush=True)

    loaded = load_model("demo", device="cpu")
    model, info = loaded.model, loaded.info
    L, D = info.num_layers, info.head_dim
    log(f"model {loaded.identity.id}: L={L}, H_q={info.num_q_heads}, H_kv={info.num_kv_heads}, D={D}")

    # ---- calibrations: plays at two budgets, docstrings (domain ii, disjoint modules) at the larger one
    small, large = (int(b) for b in args.budgets.split(","))
    plays, plays_src = load_texts(None)
    doc_cal = [module_document(m) for m in DOC_CALIBRATION_MODULES]
    cal_large = calibrate_targets(loaded, plays, plays_src, large // 512, log)
    keep = None if not args.methods else set(args.methods.split(",")) | {"oscar"}
    done_cals = [cal_large]

    def lazy(make):  # the 4K-plays and docstring calibrations only when a method asks for them
        if keep is not None and not any(n in keep for n in ("cal-4k", "cal-docs")):
            return None
        done_cals.append(make())
        return done_cals[-1]

    cal_small = lazy(lambda: calibrate_targets(loaded, plays, plays_src, small // 512, log))
    cal_docs = lazy(lambda: calibrate_targets(loaded, doc_cal, "stdlib-docstrings:calibration-modules",
                                              large // 512, log))

    # ---- methods (teacher-forced) and diagnostics-only variants (per-layer attention error)
    k16 = f"{large // 1024}K"
    methods: list[Method] = [Exact()]
    methods[0].head_dim = D
    specs = [
        ("oscar", f"OSCAR default: per-head U·H·P, weighted V target, searched clips (attention), G=D, {k16} plays",
         cal_large, {"rotation": "per-head"}, "default"),
        ("per-layer", "per-layer U·H·P (mean of head targets), weighted, searched", cal_large,
         {"rotation": "per-layer"}, "variant"),
        ("softmax-v", "per-head U·H·P, softmax V target, searched", cal_large,
         {"rotation": "per-head", "value_target": "softmax"}, "variant"),
        ("hp-search", "H·P (data-free rotation), searched clips (attention objective)", cal_large,
         {"rotation": "hp"}, "variant"),
        ("fixed-clip", "per-head U·H·P, fixed clips 0.96/0.92", cal_large,
         {"rotation": "per-head", "clip": "fixed"}, "variant"),
        ("recon-clip", "per-head U·H·P, clips searched on reconstruction MSE", cal_large,
         {"rotation": "per-head", "objective": "reconstruction"}, "variant"),
        ("cal-4k", f"per-head default, calibrated on {small // 1024}K plays tokens", cal_small,
         {"rotation": "per-head"}, "variant"),
        ("cal-docs", f"per-head default, calibrated on {k16} docstring tokens (domain ii modules disjoint)", cal_docs,
         {"rotation": "per-head"}, "variant"),
        # combinations added after the first run pointed at H·P and the reconstruction objective (run with --methods)
        ("hp-recon", "H·P (data-free rotation), clips searched on reconstruction MSE", cal_large,
         {"rotation": "hp", "objective": "reconstruction"}, "variant"),
        ("softmax-recon", "per-head U·H·P, softmax V target, clips searched on reconstruction MSE", cal_large,
         {"rotation": "per-head", "value_target": "softmax", "objective": "reconstruction"}, "variant"),
        ("none-search", "no rotation, searched clips (attention objective)", cal_large, {"rotation": "none"},
         "variant"),
        # the centred codec: K/V means removed before INT2, clips searched on the centred rows
        ("centred", f"codec v2, calibrate --centring mean (not the default): per-head U·H·P, weighted V target, "
         f"per-(layer, head) K/V means removed, clips searched on centred rows, {k16} plays", cal_large,
         {"rotation": "per-head", "centring": True}, "variant"),
        ("centred-cov", "codec v2 with the weighted value target taken about μ_V (a covariance)", cal_large,
         {"rotation": "per-head", "centring": True, "centred_value_target": True}, "variant"),
        ("hp-centred", "H·P (data-free rotation) + per-layer K/V means, clips searched on centred rows", cal_large,
         {"rotation": "hp", "centring": True}, "variant"),
        ("centred-k", "codec v2 diagnostic: the key mean removed, values uncentred, clips searched on those rows",
         cal_large, {"rotation": "per-head", "centring": True, "centre_values": False}, "variant"),
        ("centred-oldclips", "codec v2 diagnostic: K/V means removed, the uncentred default's clips (not re-searched)",
         cal_large, {"rotation": "per-head", "centring": True, "search_centred": False}, "variant"),
        ("naive", "naive INT2: no rotation, no clip", None, {"rotation": "none", "clip": "none"}, "baseline"),
        ("clip-only", "clip-only INT2: no rotation, clips 0.96/0.92", None, {"rotation": "none", "clip": "fixed"},
         "baseline"),
        ("hadamard", "Hadamard-only INT2: H·P, clips 0.96/0.92 (QuaRot-like)", None,
         {"rotation": "hp", "clip": "fixed"}, "baseline"),
    ]
    # Diagnostics only (pruned from teacher forcing for time; no searched clips: a clip search costs ~110 s per
    # variant on 2 shared cores). G=32 costs 3.0 bits in the history, above the 2.5-bit budget of the defaults.
    diag_specs = [
        ("no-clip", "per-head U·H·P, no clip", cal_large, {"rotation": "per-head", "clip": "none"}, "variant"),
        ("g32-fixed", "per-head U·H·P, G=32 (bit-reversal P active), clips 0.96/0.92", cal_large,
         {"rotation": "per-head", "clip": "fixed", "group_size": 32}, "variant"),
        ("hadamard-g32", "Hadamard-only, G=32, clips 0.96/0.92", None,
         {"rotation": "hp", "clip": "fixed", "group_size": 32}, "baseline"),
    ]
    t0 = time.perf_counter()
    if keep:
        specs = [sp for sp in specs if sp[0] in keep]
        diag_specs = []
    for name, label, cal, kw, kind in specs:
        if args.smoke and kw.get("clip", "search") == "search":
            kw = {**kw, "clip": "fixed"}
        methods.append(rotated(name, label, cal, kind=kind, D=D, **kw))
        log(f"method {name} ready")
    methods += [m for m in (kivi("kivi-32", 32, D), kivi("kivi-64", 64, D)) if keep is None or m.name in keep]
    # transformers' QuantizedCache (its defaults, only nbits set): only when asked for (extra `peers`)
    peers = tuple(n for n in PEERS if keep is not None and n in keep)
    check_baselines(peers)
    methods += [BASELINES[n].build(Setup(None, L, D, 0, SINK, RECENT, [2] * L, config=model.config)) for n in peers]
    centred = next((m for m in methods if m.name == "centred"), None)
    if centred is not None and (keep is None or "centred-lm" in keep):
        methods.append(LloydMax(centred, cal_large))
    if keep is None or "kcenter" in keep:  # added after run B: the next-step probe of QUALITY.md
        k_mean = torch.stack([cal_large.heldout[f"{layer}.k"].float().mean(dim=(0, 2)) for layer in range(L)])
        methods.append(KeyCentered(methods[1], k_mean))
    for spec in args.artifact:  # artifact folders, exactly as `verify` builds their OSCAR method
        name, folder = spec.split("=", 1)
        manifest, rot = load_artifacts(Path(folder))
        m = ARTIFACT.build(Setup(rot, L, D, manifest.quant.group_size, SINK, RECENT, manifest.key_bits))
        m.name, m.kind, m.label = name, "variant", f"{m.label} [{folder}]"
        methods.append(m)
        if args.channel_keys:
            methods.append(ChannelKeys(m))
    diag_methods = [rotated(name, label, cal, kind=kind, D=D, **kw) for name, label, cal, kw, kind in diag_specs]
    log(f"rotations and clip searches: {time.perf_counter() - t0:.0f} s")

    # ---- held-out sequences of both domains
    eval_plays, src_i = load_texts(None, plays=EVALUATION_PLAYS)
    dom_plays = make_sequences(loaded.tokenizer, eval_plays, args.context, args.sequences, 0, SEED, dataset=src_i)
    doc_eval = [module_document(m) for m in DOC_EVALUATION_MODULES]
    dom_docs = make_sequences(loaded.tokenizer, doc_eval, args.context, args.sequences, 0, SEED,
                              dataset="stdlib-docstrings:evaluation-modules")
    domains = {"plays": dom_plays.input_ids, "docstrings": dom_docs.input_ids}
    start = SINK + RECENT

    result = {
        "command": " ".join(["python"] + sys.argv), "seed": SEED, "context": args.context,
        "sequences": args.sequences, "positions_from": start, "sink": SINK, "recent": RECENT,
        "python": platform.python_version(), "torch": torch.__version__, "threads": args.threads,
        "model": loaded.identity.id, "doc_calibration_modules": DOC_CALIBRATION_MODULES,
        "doc_evaluation_modules": DOC_EVALUATION_MODULES, "evaluation_plays": EVALUATION_PLAYS,
        "domain_sha256": {"plays": dom_plays.sha256, "docstrings": dom_docs.sha256},
        "calibrations": {c.name: {"tokens": c.tokens, "seconds": round(c.seconds, 1), "passes_run": c.ran}
                         for c in done_cals},
        "methods": {m.name: {"label": m.label, "kind": m.kind, "bits_2k": sum(m.bits(2048)) / 2,
                             "bits_32k": sum(m.bits(32768)) / 2, "history_bits": history_bits(m)}
                    for m in methods + diag_methods},
        "clips": {m.name: {"k_mean": m.k_clip.mean().item(), "v_mean": m.v_clip.mean().item(),
                           "k_per_layer": m.k_clip.mean(-1).tolist(), "v_per_layer": m.v_clip.mean(-1).tolist()}
                  for m in methods[1:] + diag_methods if isinstance(m, RotatedInt2)},
        "spectrum": {"key_per_layer": spectrum_ratio(fit_rotations(cal_large.key, "per-head")[1]).mean(-1).tolist(),
                     "key_per_layer_shared": spectrum_ratio(fit_rotations(cal_large.key, "per-layer")[1])[:, 0]
                     .tolist(),
                     "value_per_layer": spectrum_ratio(fit_rotations(cal_large.value_weighted, "per-head")[1])
                     .mean(-1).tolist()},
        "scores": {d: {m.name: [] for m in methods} for d in domains},
        "layer_error": None, "wall_seconds": None, "complete": False,
    }
    out_path = Path(args.out)

    def save() -> None:
        result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
        out_path.write_text(json.dumps(result, indent=1))

    save()
    attend = Attender(quantizer("torch"), SINK, RECENT)
    with torch.inference_mode():
        for s in range(args.sequences):
            for dname, ids_all in domains.items():
                ids = ids_all[s : s + 1]
                targets = ids[0, 1:]
                t_seq = time.perf_counter()
                ref = None
                for m in methods:
                    with verifying(model, lambda layer, q, k, v, scale, m=m: attend(m, layer, q, k, v, scale)):
                        logits = _logits(model, ids)
                    tm = metrics.token_metrics(logits, targets, ref)
                    if ref is None:
                        ref = metrics.reference_of(logits)
                    result["scores"][dname][m.name].append(seq_scores(tm, start))
                save()
                base = result["scores"][dname]["bf16"][-1]["ppl"]
                o = result["scores"][dname]["oscar"][-1]
                log(f"{dname} seq {s}: {time.perf_counter() - t_seq:.0f} s; BF16 ppl {base:.2f}, OSCAR "
                    f"{o['ppl'] / base - 1:+.1%} KL {o['kl']:.4f}")
            if s == 0 and (keep is None or args.layer_probe):
                t0 = time.perf_counter()
                result["layer_error"] = layer_errors(model, attend, methods[1:] + diag_methods,
                                                     domains["plays"][:1], start)
                save()
                log(f"per-layer attention errors: {time.perf_counter() - t0:.0f} s")
    result["complete"] = True
    save()
    log(f"total {result['wall_seconds']} s")
    print(summarize(result, args.reference))


# ------------------------------------------------------------------------------------------------------- summary


def _stats(xs: list[float]) -> tuple[float, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    return t.mean().item(), (t.std().item() if len(xs) > 1 else float("nan"))


def summarize(result: dict, reference: str = "oscar") -> str:
    lines = []
    meth = result["methods"]
    for dname, by_method in result["scores"].items():
        base = by_method["bf16"]
        n = len(base)
        if not n:
            continue
        lines.append(f"\n### {dname} ({n} × {result['context']} tokens, positions ≥ {result['positions_from']})\n")
        lines.append("| method | hist bits | bits @2K | Δ PPL (mean ± sd) | pooled Δ PPL | KL (mean ± sd) | top-1 | "
                     f"Δ PPL − {reference}'s: mean ± sd (min) | KL − {reference}'s: mean ± sd (min) |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        oscar = by_method.get(reference, [])[:n]
        base_pooled = math.exp(sum(b["nll_sum"] for b in base) / sum(b["n"] for b in base))
        for name, rows in by_method.items():
            rows = rows[:n]
            if len(rows) < n:
                continue
            dppl = [r["ppl"] / b["ppl"] - 1 for r, b in zip(rows, base)]
            pooled = math.exp(sum(r["nll_sum"] for r in rows) / sum(r["n"] for r in rows)) / base_pooled - 1
            kl = [r["kl"] for r in rows]
            top1 = _stats([r["top1"] for r in rows])[0]
            dm, ds = _stats(dppl)
            km, ks = _stats(kl)
            gap = gap_kl = ""
            if name not in ("bf16", reference) and len(oscar) == n:  # paired per sequence: > 0: the reference wins
                diffs = [r["ppl"] / b["ppl"] - o["ppl"] / b["ppl"] for r, o, b in zip(rows, oscar, base)]
                gm, gs = _stats(diffs)
                gap = f"{gm:+.1%} ± {gs:.1%} ({min(diffs):+.1%})"
                dkl = [r["kl"] - o["kl"] for r, o in zip(rows, oscar)]
                gm, gs = _stats(dkl)
                gap_kl = f"{gm:+.4f} ± {gs:.4f} ({min(dkl):+.4f})"
            m = meth[name]
            lines.append(f"| {name} | {m['history_bits']:.2f} | {m['bits_2k']:.2f} | {dm:+.1%} ± {ds:.1%} | "
                         f"{pooled:+.1%} | {km:.4f} ± {ks:.4f} | {top1:.1%} | {gap} | {gap_kl} |")
    if result.get("layer_error"):
        errs = result["layer_error"]
        names = list(errs)
        lines.append("\n### per-layer attention-output error (plays seq 0, BF16 inputs, queries ≥ 320)\n")
        lines.append("| layer | λmax/λmean K (per-head mean) | shared | " + " | ".join(names) + " |")
        lines.append("|---" * (3 + len(names)) + "|")
        spec = result["spectrum"]
        for layer in range(len(errs[names[0]])):
            lines.append(f"| {layer} | {spec['key_per_layer'][layer]:.1f} | "
                         f"{spec['key_per_layer_shared'][layer]:.1f} | "
                         + " | ".join(f"{errs[n][layer]:.3f}" for n in names) + " |")
        lines.append("| mean | | | " + " | ".join(f"{sum(errs[n]) / len(errs[n]):.3f}" for n in names) + " |")
    lines.append(f"\nwall {result['wall_seconds']} s, complete: {result['complete']}; command: `{result['command']}`")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
