"""`rotate_op.rotate_rows` (the decode step's rotate / centre / file launch) against float64 products: the rotation
applied as x·M (not Mᵀ), the right head's M and μ under GQA, one rounding to the output dtype, and the tier write at
exactly the slot the device holds, nothing else touched."""

import pytest
import torch

from oscar_zoo.runtime import rotate_op


def _orthogonal(h, d, g):
    q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))
    return q


def _bound(x64, M64, y64, out_dtype):
    """Allowed |kernel − y64| for y64 = x·M (− μ) in float64: half an ulp of the output dtype at y64 (one rounding)
    plus the float32 dot's error bound (D·2⁻²⁴ of Σ|x||M|, the float32 copy of M and the centring included)."""
    fp32 = 4 * x64.shape[-1] * 2.0**-24 * ((x64.abs() @ M64.abs()) if M64 is not None else x64.abs()) + 2.0**-22
    ulp = torch.finfo(out_dtype).eps * y64.abs().clamp_min(torch.finfo(out_dtype).tiny)
    return ulp / 2 * 1.01 + fp32


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B, H, H_M, out_dtype", [(1, 8, 2, torch.float32), (3, 4, 4, torch.bfloat16),
                                                  (17, 2, 1, torch.bfloat16)])  # fmt: skip
def test_rotate_rows_against_float64(device, D, B, H, H_M, out_dtype):
    """q (float32 out, query heads sharing their KV head's M), k (bf16 out, one M per head), and a batch over one
    program (17 rows: three programs per head and column block, the last with one row)."""
    g = torch.Generator().manual_seed(D + B)
    x = torch.randn(B, H, D, generator=g).to(torch.bfloat16)
    M = _orthogonal(H_M, D, g)
    mean = torch.randn(H_M, D, generator=g, dtype=torch.float64) * 0.3
    out = rotate_op.rotate_rows(x.to(device), M.float().to(device), mean.float().to(device), out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (B, H, D)
    group = H // H_M
    x64 = x.double()
    for h in range(H):
        want = x64[:, h] @ M[h // group] - mean[h // group]
        err = (out[:, h].cpu().double() - want).abs()
        bound = _bound(x64[:, h], M[h // group], want, out_dtype)
        assert (err <= bound).all(), f"head {h}: {(err > bound).sum()} elements beyond the bound"
    # a transposed rotation is far outside the bound
    wrong = x64[:, 0] @ M[0].T - mean[0]
    assert ((out[:, 0].cpu().double() - wrong).abs() > _bound(x64[:, 0], M[0], wrong, out_dtype)).any()


def test_rotate_rows_writes_only_the_slot(device):
    """Row b lands at dest[b, :, slot[b]] in dest's dtype (each batch row at its own slot: the rows of a padded batch
    have their own recent lengths); every other row of dest is unchanged; the output equals the written row (one
    rounding, the same for both)."""
    g = torch.Generator().manual_seed(1)
    B, H, T, D = 2, 4, 11, 64
    x = torch.randn(B, H, D, generator=g).to(torch.bfloat16)
    M = _orthogonal(H, D, g).float()
    mean = torch.randn(H, D, generator=g) * 0.2
    dest = torch.randn(B, H, T, D, generator=g).to(torch.bfloat16)
    before = dest.clone()
    slot = torch.tensor([7, 2], dtype=torch.int32)
    d_dest = dest.to(device)
    out = rotate_op.rotate_rows(x.to(device), M.to(device), mean.to(device), dest=d_dest, slot=slot.to(device))
    got = d_dest.cpu()
    for b, t in enumerate(slot.tolist()):
        keep = torch.ones(T, dtype=torch.bool)
        keep[t] = False
        assert torch.equal(got[b, :, keep], before[b, :, keep])
        assert torch.equal(got[b, :, t], out[b].cpu())
    for h in range(H):
        want = x[:, h].double() @ M[h].double() - mean[h].double()
        bound = _bound(x[:, h].double(), M[h].double(), want, torch.bfloat16)
        assert ((out[:, h].cpu().double() - want).abs() <= bound).all()


def test_rotate_rows_centre_only_and_identity(device):
    """No M (a folded value rotation): x − μ, rounded once; neither M nor μ: x itself comes back and only the write
    runs; a transposed view of M (M_Vᵀ for the output) is read through its strides."""
    g = torch.Generator().manual_seed(2)
    B, H, T, D = 1, 3, 5, 128
    x = torch.randn(B, H, D, generator=g).to(torch.bfloat16)
    mean = torch.randn(1, D, generator=g)
    out = rotate_op.rotate_rows(x.to(device), None, mean.to(device))
    assert torch.equal(out.cpu(), (x.float() - mean).to(torch.bfloat16))
    dest = torch.zeros(B, H, T, D, dtype=torch.bfloat16, device=device)
    xd = x.to(device)
    same = rotate_op.rotate_rows(xd, None, None, dest=dest, slot=torch.tensor([4], device=device))
    assert same is xd and torch.equal(dest[:, :, 4].cpu(), x) and not dest[:, :, :4].any()
    M = _orthogonal(1, D, g)
    out_t = rotate_op.rotate_rows(x.float().to(device), M.float().to(device).transpose(-1, -2), None)
    want = x.double() @ M[0].T
    assert ((out_t.cpu().double() - want).abs() <= _bound(x.double(), M[0].T, want, torch.float32)).all()


def test_rotate_rows_refuses_bad_shapes():
    x = torch.zeros(1, 6, 64)
    with pytest.raises(ValueError, match="does not divide"):
        rotate_op.rotate_rows(x, torch.zeros(4, 64, 64))
    with pytest.raises(ValueError, match="mean_rot"):
        rotate_op.rotate_rows(x, None, torch.zeros(4, 64))
    with pytest.raises(ValueError, match="dest"):
        rotate_op.rotate_rows(x, None, None, dest=torch.zeros(1, 6, 3, 32), slot=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="slot"):  # one slot per batch row
        rotate_op.rotate_rows(x, None, None, dest=torch.zeros(1, 6, 3, 64), slot=torch.zeros(2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize(("H", "H_M", "centred"), [(8, 8, True), (32, 1, False), (8, 8, False), (4, 1, True)])
def test_rotate_chunk_split_gemm_against_float64(H, H_M, centred):
    """`rotate_op.rotate_chunk` on a GPU in bfloat16 (a prompt chunk's q, k, v and output: one GEMM of [x, x, 1] against
    M and −μ·M each split into two bfloat16 parts): every element within one bfloat16 step of x·M − μ·M computed in
    float64 and rounded once, plus the split's own bound (each part's remainder ≤ 2⁻¹⁶ of the entry, so ≤ 2⁻¹⁶·Σ|x||M|
    + 2⁻¹⁶|μ·M| before rounding, doubled for the float32 accumulation); at most 1 % of them not equal to that rounding;
    Mᵀ in place of M, or μ with the wrong sign, is far outside."""
    g = torch.Generator().manual_seed(H + H_M)
    D, T = 128, 1500
    x = (torch.randn(2, H, T, D, generator=g, dtype=torch.float64) * 3).bfloat16()
    M = _orthogonal(H_M, D, g)
    mean = torch.randn(H_M if centred else 1, D, generator=g, dtype=torch.float64) * 5 if centred else None
    got = rotate_op.rotate_chunk(x.cuda(), M.float().cuda(), None if mean is None else mean.float().cuda()).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == x.shape

    def want(M, mean):
        y = torch.matmul(x.double(), M)
        return y if mean is None else y - mean.unsqueeze(-2)

    y64 = want(M, mean)
    rounded = y64.bfloat16().double()
    diff = (got.double() - rounded).abs()
    split = (x.double().abs() @ M.abs() + (0 if mean is None else mean.abs().unsqueeze(-2))) * 2.0**-15
    assert (diff <= rounded.abs() * 2.0**-7 + split).all()
    assert (diff > 0).double().mean() < 0.01
    wrong = [want(M.transpose(-1, -2), mean)] + ([want(M, -mean)] if mean is not None else [])
    for y in wrong:
        assert ((got.double() - y).abs() > 0.1).double().mean() > 0.5
