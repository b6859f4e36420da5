"""Helpers for hub and export tests: artifact folders built from random orthogonal matrices (no calibration) and
`run_cli` (the real CLI boundary, in process)."""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch

from oscar_zoo.artifacts import Rotations, write_artifacts
from oscar_zoo.format.schema import CalibrationRecord, ClipSpec, Manifest, ModelIdentity, QuantSpec, RotationSpec

HF_TOKEN = "hf_TestTokenDoNotLeak0123456789abcdef"
MS_TOKEN = "ms-TestTokenDoNotLeak-9876543210fedcba"

def verify_report(kl: float = 0.0123, top1: float = 0.981, ppl_increase: float = 0.021,
                  passed: bool | None = None, thresholds=None) -> dict:
    """A report of the form `oscar-zoo verify --write` stores (VerifyReport), as manifest JSON, judged by `thresholds`
    (default: verify's); `passed` defaults to what its metrics say under them."""
    from oscar_zoo.format.verification import DEFAULT_THRESHOLDS, MethodResult, VerifyReport, check_thresholds

    def row(name, kind, kl, top1, ppl_increase):
        return MethodResult(name=name, label=name.upper(), kind=kind, bits_per_element=2.5, bits_per_element_k=2.5,
                            bits_per_element_v=2.5, ppl=9.0 * (1 + ppl_increase), ppl_past_windows=9.0 *
                            (1 + ppl_increase), ppl_increase=ppl_increase, kl=kl, top1=top1, layer_error=[0.1, 0.1],
                            kl_by_position=[kl])

    methods = [row("bf16", "reference", 0.0, 1.0, 0.0), row("oscar", "artifact", kl, top1, ppl_increase),
               row("naive-int2", "baseline", 1.52, 0.41, 3.2)]
    thresholds = thresholds or DEFAULT_THRESHOLDS
    failures = check_thresholds(methods[1], thresholds)
    report = VerifyReport(model="org/Tiny-Llama", revision="abc123", artifacts="art", dataset="test", context=4096,
                          sequences=2, positions_from=320, tokens_scored=7552, sink=64, recent=256, group_size=16,
                          backend="torch", device="cpu", attention="test", bin_size=64, methods=methods,
                          thresholds=thresholds, passed=not failures if passed is None else passed, failures=failures,
                          wall_seconds=1.0, versions={"oscar-zoo": "test"}, created="2026-01-01T00:00:00+00:00")
    return report.to_dict()


VERIFICATION = verify_report()


def make_manifest(model_id: str = "org/Tiny-Llama", granularity: str = "per-head", L: int = 2, H_kv: int = 2,
                  D: int = 16, verification: dict | None = VERIFICATION, model_type: str = "llama") -> Manifest:
    return Manifest(
        model=ModelIdentity(id=model_id, revision="abc123", architecture="LlamaForCausalLM", model_type=model_type,
                            num_layers=L, num_q_heads=H_kv * 3, num_kv_heads=H_kv, head_dim=D, qk_norm=False,
                            rope_theta=10000.0, config_sha256="0" * 64),
        quant=QuantSpec(group_size=D, sink=64, recent=256, flush=8),
        rotation=RotationSpec(granularity=granularity, value_target="weighted", hadamard="sylvester",
                              layer_ids=list(range(L))),
        clip=ClipSpec(mode="fixed", grid=[], k_default=0.96, v_default=0.92, objective="fixed"),
        calibration=CalibrationRecord(dataset="test", token_ids_sha256="1" * 64, tokens=1024, sequences=2,
                                      seq_len=512, heldout_tokens=0, chat_template=False, seed=0, device="cpu",
                                      dtype="float32", versions={"oscar-zoo": "test"},
                                      created="2026-01-01T00:00:00Z", wall_seconds=1.0),
        bits_per_element={"32768": 2.38, "131072": 2.28},
        verification=verification,
    )


def random_rotations(L: int, H: int, D: int, seed: int = 0, spread: float = 0.0) -> torch.Tensor:
    """[L, H, D, D] orthogonal (QR of Gaussians); `spread` > 0 makes heads small perturbations of head 0."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(L, 1, D, D, generator=g, dtype=torch.float64)
    noise = torch.randn(L, H, D, D, generator=g, dtype=torch.float64)
    A = base + spread * noise if spread else noise
    Q, R = torch.linalg.qr(A)
    return (Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)).float()


def make_rotations(manifest: Manifest, seed: int = 0, spread: float = 0.0) -> Rotations:
    m = manifest.model
    L, D = len(manifest.rotation.layer_ids), m.head_dim
    H = m.num_kv_heads if manifest.rotation.granularity.value == "per-head" else 1
    eig = torch.sort(torch.rand(L, H, D, generator=torch.Generator().manual_seed(seed + 7)), dim=-1).values
    return Rotations(
        k_rotation=random_rotations(L, H, D, seed, spread), v_rotation=random_rotations(L, H, D, seed + 1, spread),
        k_eigenvalues=eig, v_eigenvalues=eig * 2, k_clip=torch.full((L, H), 0.96), v_clip=torch.full((L, H), 0.92),
        layer_ids=torch.arange(L, dtype=torch.int32))


def make_artifacts(folder: Path, seed: int = 0, spread: float = 0.0, bind: bool = True, **kw) -> Manifest:
    """An artifact folder; a verification report in it is bound to the files written (as `verify --write` binds the
    report it stores), unless `bind` is False or it is not a report verify writes."""
    manifest = make_manifest(**kw)
    manifest = write_artifacts(folder, manifest, make_rotations(manifest, seed, spread))
    report = manifest.verification
    if bind and isinstance(report, dict) and "methods" in report and report.get("binding") is None:
        from oscar_zoo.artifacts import write_manifest
        from oscar_zoo.format.verification import binding_of

        bound = {**report, "binding": binding_of(manifest).to_dict()}
        manifest = manifest.replace(verification=bound)
        write_manifest(folder, manifest)
    return manifest


def save_tiny_llama(folder: Path, layers: int = 3, kv_heads: int = 2, head_dim: int = 16) -> Path:
    """A Llama config (no weights) of `layers` layers, 6 query / `kv_heads` KV heads of `head_dim`, saved in
    `folder` (what import-oscar and export need of a model: its geometry)."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=6,
                num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=64).save_pretrained(folder)
    return folder


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run `oscar-zoo ARGS` through cli.main (the real error boundary) and return (exit code, stdout, stderr)."""
    from oscar_zoo import cli

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["oscar-zoo", *args]
    code = 0
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                cli.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def rewrite_rotations(folder: Path, raw: bytes | None = None, **tensors: torch.Tensor) -> None:
    """Replace tensors of an artifact folder's rotations.safetensors (or its whole content, `raw`) and re-checksum the
    manifest, so that only validation, not the sha256 check, can catch what was changed."""
    import json

    from safetensors.torch import load_file, save

    from oscar_zoo.format.io import sha256_file

    path = Path(folder) / "rotations.safetensors"
    if raw is None:
        raw = save({k: v.contiguous() for k, v in {**load_file(str(path)), **tensors}.items()})
    path.write_bytes(raw)
    doc = json.loads((Path(folder) / "manifest.json").read_text())
    doc["artifacts"] = [{"path": "rotations.safetensors", "sha256": sha256_file(path), "bytes": len(raw)}]
    (Path(folder) / "manifest.json").write_text(json.dumps(doc))
