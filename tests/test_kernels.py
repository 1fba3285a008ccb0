"""Kernels against the pure-torch references in tests/reference.py."""

import math

import pytest
import torch

import hetcomm
from hetcomm import ops

from . import reference as ref

SIZES = [1, 31, 33, 2049, 10**6]


def _data(n, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed + n)
    return torch.randn(n, generator=g).mul_(3).to(dtype).to(device)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk", [32, 2048])
def test_sign_encode_matches_reference(device, n, dtype, chunk):
    g = _data(n, dtype, device=device)
    e = _data(n, seed=7, device=device) * 0.1
    divisor = 3.0
    want_words, want_scales, want_res, want_dec = ref.sign_encode(g.cpu(), e.cpu(), divisor, chunk)
    res = e.clone()
    words, scales = ops.sign_encode(g, res, divisor, chunk)
    assert words.dtype == torch.int32 and words.numel() == (n + 31) // 32
    assert torch.equal(ref.words_as_uint32(words.cpu()), want_words)
    # The scales are the chunk means in the documented order, rounded to bf16: bit for bit, and
    # within bf16's half ulp (at most 2^-8 relative) of the exact mean.
    assert scales.dtype == torch.bfloat16 and torch.equal(scales.cpu(), want_scales)
    x64 = g.cpu().double() / divisor + e.cpu().double()
    means = torch.stack([x64[c:c + chunk].abs().mean() for c in range(0, n, chunk)])
    torch.testing.assert_close(scales.cpu().double(), means, rtol=2.0 ** -8 * 1.001, atol=0)
    dec = ops.sign_decode(words, scales, n, chunk)
    assert torch.equal(dec.cpu(), want_dec) and torch.equal(res.cpu(), want_res)
    # The exact invariant of error feedback: what was sent + what is kept == g/d + e.
    x = g.float() / divisor + e
    torch.testing.assert_close(dec + res, x, rtol=0, atol=4 * torch.finfo(torch.float32).eps * x.abs().max().item())


def test_sign_encode_without_residual_and_decode_accumulate(device):
    n, chunk = 5000, 64
    g = _data(n, device=device)
    words, scales = ops.sign_encode(g, None, 2.0, chunk)
    want_words, want_scales, _, want_dec = ref.sign_encode(g.cpu(), None, 2.0, chunk)
    assert torch.equal(ref.words_as_uint32(words.cpu()), want_words)
    out = torch.ones(n, device=device)
    ops.sign_decode(words, scales, n, chunk, alpha=0.5, out=out, accumulate=True)
    torch.testing.assert_close(out.cpu(), 1 + 0.5 * want_dec, rtol=1e-6, atol=1e-6)


def test_sign_zero_and_negative_zero_encode_as_plus(device):
    g = torch.tensor([0.0, -0.0, -1.0, 1.0], device=device)
    words, scales = ops.sign_encode(g, None, 1.0, 32)
    assert ref.words_as_uint32(words.cpu()).item() == 0b1011
    assert scales.item() == pytest.approx(0.5)


@pytest.mark.parametrize("bad", [dict(chunk=48), dict(chunk=0), dict(divisor=0.0), dict(divisor=float("nan"))])
def test_sign_encode_rejects_bad_arguments(bad):
    kwargs = dict(chunk=64, divisor=1.0)
    kwargs.update(bad)
    with pytest.raises(ValueError, match="chunk|divisor"):
        ops.sign_encode(torch.randn(100), None, **kwargs)


def test_kernels_reject_bad_tensors():
    with pytest.raises(TypeError, match="grad must be a floating-point"):
        ops.sign_encode(torch.arange(10))
    with pytest.raises(ValueError, match="residual must have the gradient's numel"):
        ops.sign_encode(torch.randn(10), torch.zeros(9))
    with pytest.raises(TypeError, match="residual must be float32"):
        ops.topk_encode(torch.randn(10), torch.zeros(10, dtype=torch.float64), k=2)
    with pytest.raises(ValueError, match="idx must lie in"):
        ops.scatter_add(torch.tensor([0, 10], dtype=torch.int32), torch.ones(2), torch.zeros(10))
    with pytest.raises(ValueError, match="wire must be"):
        ops.cast_encode(torch.randn(3), 1.0, "int8")
    with pytest.raises(ValueError, match="words must hold"):
        ops.sign_decode(torch.zeros(1, dtype=torch.int32), torch.ones(1), 64, 64)
    # the sizes are checked before anything is computed from them (a chunk of 0 once divided by zero)
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 32, got 0"):
        ops.sign_decode(torch.zeros(0, dtype=torch.int32), torch.zeros(0), 0, 0)
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 32, got 0"):
        hetcomm._C.fp8_decode(torch.zeros(0, dtype=torch.uint8), torch.zeros(0), 0, 0, 1.0, None, False)
    with pytest.raises(ValueError, match="n must be >= 0"):
        ops.sign_decode(torch.zeros(1, dtype=torch.int32), torch.ones(1), -5, 64)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ratio", [0.01, 0.3])
def test_topk_exact_matches_reference(device, n, ratio):
    g = _data(n, device=device)
    e = _data(n, seed=3, device=device) * 0.5
    k = ops.topk_count(n, ratio)
    assert k == min(n, math.ceil(ratio * n))
    want_idx, want_val, want_res = ref.topk(g.cpu(), e.cpu(), 2.0, k)
    res = e.clone()
    idx, val = ops.topk_encode(g, res, 2.0, k, exact=True)
    assert idx.numel() == k
    assert torch.equal(idx.cpu().long(), want_idx)
    assert torch.equal(val.cpu(), want_val)
    assert torch.equal(res.cpu(), want_res)
    # every sent magnitude >= every kept one
    if k < n:
        assert val.abs().min() >= res.abs().max()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_topk_by_the_update_ranks_by_magnitude_over_denominator_and_sends_the_values(device, n, with_residual):
    g = _data(n, device=device)
    e = _data(n, seed=3, device=device) * 0.5 if with_residual else None
    d = (torch.rand(n, generator=torch.Generator().manual_seed(5)) + 0.05).to(device)
    k = ops.topk_count(n, 0.05)
    want_idx, want_val, want_res = ref.topk(g.cpu(), None if e is None else e.cpu(), 2.0, k, denominator=d.cpu())
    res = None if e is None else e.clone()
    idx, val = ops.topk_encode(g, res, 2.0, k, exact=True, denominator=d)
    assert torch.equal(idx.cpu().long(), want_idx)
    assert torch.equal(val.cpu(), want_val)
    if e is not None:
        assert torch.equal(res.cpu(), want_res)
    # the denominator changes the choice (not only |x|'s largest), and a uniform one does not
    plain = ref.topk(g.cpu(), None if e is None else e.cpu(), 2.0, k)[0]
    if k < n:
        assert not torch.equal(idx.cpu().long(), plain)
    idx1, _ = ops.topk_encode(g, None if e is None else e.clone(), 2.0, k, exact=True,
                              denominator=torch.full((n,), 3.0, device=device))
    assert torch.equal(idx1.cpu().long(), plain)
    # sampled: a top set by |x| / d, about k
    res = torch.zeros(n, device=device)
    idx, val = ops.topk_encode(g, res, 1.0, k, exact=False, denominator=d)
    assert 0.8 * k <= idx.numel() <= k
    assert (val.abs() / d[idx.long()]).min() >= (res.abs() / d).max()


def test_topk_denominator_is_checked():
    with pytest.raises(ValueError, match="denominator must hold grad's numel = 10 elements, got 9"):
        ops.topk_encode(torch.randn(10), None, k=2, denominator=torch.ones(9))
    with pytest.raises(TypeError, match="denominator must be float32"):
        ops.topk_encode(torch.randn(10), None, k=2, denominator=torch.ones(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="denominator must be contiguous"):
        ops.topk_encode(torch.randn(10), None, k=2, denominator=torch.ones(20)[::2])


def test_topk_ties_go_to_lowest_index(device):
    g = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0], device=device)
    idx, val = ops.topk_encode(g, None, 1.0, 3, exact=True)
    assert idx.cpu().tolist() == [1, 2, 4]
    assert val.cpu().tolist() == [-2.0, 2.0, -2.0]


def test_topk_orders_nan_above_infinity_and_signed_zeros_as_ties(device):
    g = torch.tensor([float("nan"), 1.0, float("-inf"), -0.0, 0.0, 2.0], device=device)
    assert ops.topk_encode(g, None, 1.0, 3, exact=True)[0].cpu().tolist() == [0, 2, 5]
    assert ops.topk_encode(g, None, 1.0, 5, exact=True)[0].cpu().tolist() == [0, 1, 2, 3, 5]


@pytest.mark.parametrize("n,ratio", [(10**6, 0.01), (10**6, 0.001), (200_000, 0.05), (2049, 0.1)])
def test_topk_sampled_returns_about_k_of_the_largest(device, n, ratio):
    g = _data(n, device=device)
    k = ops.topk_count(n, ratio)
    res = torch.zeros(n, device=device)
    idx, val = ops.topk_encode(g, res, 1.0, k, exact=False)
    assert 0.8 * k <= idx.numel() <= k
    assert torch.all(idx[1:] > idx[:-1])  # ascending, unique
    # it is a top set: nothing kept is larger than anything sent
    assert val.abs().min() >= res.abs().max()
    torch.testing.assert_close(res[idx.long()], torch.zeros_like(val))
    torch.testing.assert_close(g[idx.long()], val)


def test_scatter_add(device):
    out = torch.arange(6, dtype=torch.float32, device=device)
    idx = torch.tensor([5, 0, 2], dtype=torch.int32, device=device)
    ops.scatter_add(idx, torch.tensor([1.0, 2.0, 3.0], device=device), out, alpha=2.0)
    assert out.cpu().tolist() == [4.0, 1.0, 8.0, 3.0, 4.0, 7.0]


SPECIALS = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 6e-5, 6.1e-5, 65504.0, 65519.0, 65520.0, 1e6, -1e6,
                         float("inf"), float("-inf"), 3.0e38, 1.17e-38, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -24])


@pytest.mark.parametrize("wire,dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
@pytest.mark.parametrize("n", SIZES)
def test_cast_encode_bit_exact_vs_torch(device, wire, dtype, n):
    x = _data(n, device=device) * 1000
    for divisor in (1.0, 3.0, 1e-3):
        got = ops.cast_encode(x, divisor, wire)
        want = (x.cpu() / divisor).to(dtype)
        assert got.dtype == dtype
        assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
        back = ops.cast_decode(got, 2.0)
        assert torch.equal(back.cpu(), want.float() * 2.0)


@pytest.mark.parametrize("wire,dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_cast_special_values(device, wire, dtype):
    x = torch.cat([SPECIALS, -SPECIALS, torch.tensor([float("nan")])]).to(device)
    got = ops.cast_encode(x, 1.0, wire).cpu()
    want = x.cpu().to(dtype)
    assert torch.equal(got[:-1].view(torch.int16), want[:-1].view(torch.int16))
    assert torch.isnan(got[-1].float())
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    dec = ops.cast_decode(every.to(device)).cpu()
    finite = ~torch.isnan(every.float())
    assert torch.equal(dec[finite], every.float()[finite])
    assert torch.isnan(dec[~finite]).all()


def test_build_info():
    info = hetcomm.build_info()
    assert set(info) >= {"cuda", "cuda_compiled", "cuda_archs", "nccl_version", "torch_version"}
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    if info["cuda_compiled"]:  # for the three generations with a CUDA torch; a compile check (a CPU torch): the oldest
        assert info["cuda_archs"] == ("75,80,90" if torch.version.cuda else "75"), info


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("beta", [0.0, 0.9, 0.999])
def test_momentum_handoff_is_the_new_momentum_minus_beta_times_the_old(device, n, beta):
    m_new, m_old = _data(n, seed=1), _data(n, seed=2) * 1e3
    # Reference: beta * m_old rounded to float32, then subtracted (torch's
    # elementwise mul and sub each round; no fused multiply-add).
    want = m_new - torch.tensor(beta, dtype=torch.float32) * m_old
    x, m = m_new.clone().to(device), m_old.clone().to(device)
    ops.momentum_handoff(x, m, beta)
    assert torch.equal(x.cpu(), want) and torch.equal(m.cpu(), m_new)
    # what the optimizer then does with it: beta * buf + x is the new momentum (up to rounding)
    assert torch.allclose(beta * m_old + want, m_new, rtol=1e-5, atol=1e-3 * (1 + 1e3 * beta))


@pytest.mark.parametrize("n", SIZES)
def test_momentum_fold_in_rounds_the_product_then_the_sum(device, n):
    x, m = _data(n, seed=3), _data(n, seed=4) * 1e-3
    want = x + torch.tensor(0.45, dtype=torch.float32) * m  # two roundings, as torch's elementwise ops
    got = x.clone().to(device)
    ops.momentum_fold_in(got, m.to(device), 0.45)
    assert torch.equal(got.cpu(), want)
    # the same bits for any slicing (the two phases fold in piece by piece)
    pieces = x.clone().to(device)
    for a, b in ((0, n // 3), (n // 3, n)):
        part = pieces[a:b]
        ops.momentum_fold_in(part, m[a:b].to(device), 0.45)
    assert torch.equal(pieces.cpu(), want)


def test_momentum_handoff_rejects_bad_arguments():
    with pytest.raises(ValueError, match="m must hold x's numel = 4 elements, got 3"):
        ops.momentum_handoff(torch.zeros(4), torch.zeros(3), 0.9)
    with pytest.raises(TypeError, match="x must be float32, got float64"):
        ops.momentum_handoff(torch.zeros(4, dtype=torch.float64), torch.zeros(4), 0.9)
    with pytest.raises(TypeError, match="m must be float32"):
        ops.momentum_handoff(torch.zeros(4), torch.zeros(4, dtype=torch.float16), 0.9)
    with pytest.raises(ValueError, match="x must be contiguous"):
        ops.momentum_handoff(torch.zeros(4, 2).t(), torch.zeros(8), 0.9)
    with pytest.raises(ValueError, match="beta must be in \\[0, 1\\), got 1"):
        ops.momentum_handoff(torch.zeros(4), torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match="m must hold x's numel = 4 elements, got 5"):
        ops.momentum_fold_in(torch.zeros(4), torch.zeros(5), 0.5)
    with pytest.raises(ValueError, match="alpha must be finite, got inf"):
        ops.momentum_fold_in(torch.zeros(4), torch.zeros(4), float("inf"))


@pytest.mark.parametrize("rows,cols,r", [(1, 1, 1), (33, 7, 3), (300, 517, 4), (64, 2049, 8)])
def test_lowrank_outer_is_the_fixed_order_sum(device, rows, cols, r):
    gen = torch.Generator().manual_seed(rows * cols + r)
    p, qt = torch.randn(rows, r, generator=gen), torch.randn(r, cols, generator=gen) * 1e3
    # Reference: products added in order k = 0, 1, ..., each operation rounded
    # to float32 (torch's elementwise ops do not fuse).
    want = torch.zeros(rows, cols)
    for k in range(r):
        want = want + p[:, k:k + 1] * qt[k:k + 1, :]
    got = ops.lowrank_outer(p.to(device), qt.to(device))
    assert got.shape == (rows, cols) and torch.equal(got.cpu(), want)
    out = torch.full((rows, cols), float("nan"), device=device)
    assert ops.lowrank_outer(p.to(device), qt.to(device), out) is out and torch.equal(out.cpu(), want)


def test_lowrank_outer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="matching r"):
        ops.lowrank_outer(torch.zeros(3, 2), torch.zeros(3, 4))
    with pytest.raises(TypeError, match="float32"):
        ops.lowrank_outer(torch.zeros(3, 2, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows \\* cols"):
        ops.lowrank_outer(torch.zeros(3, 2), torch.zeros(2, 4), torch.zeros(11))


@pytest.mark.parametrize("rows,cols,r", [(1, 1, 1), (33, 7, 3), (300, 517, 4), (64, 2049, 8)])
def test_lowrank_finish_is_the_outer_product_and_the_residual_in_one_pass(device, rows, cols, r):
    gen = torch.Generator().manual_seed(rows + cols * r)
    p, qt = torch.randn(rows, r, generator=gen), torch.randn(r, cols, generator=gen)
    x, res = torch.randn(rows, cols, generator=gen) * 3, torch.randn(rows, cols, generator=gen) * 1e-2
    divisor, share = 3.0, 0.3
    out = ops.lowrank_outer(p, qt)
    # Reference: torch's elementwise float32 ops on the CPU, each rounded (no fusing): M = x / divisor + residual,
    # then M - share * out
    want_res = (x / divisor + res) - share * out
    xd, rd = x.clone().to(device), res.clone().to(device)
    ops.lowrank_finish(p.to(device), qt.to(device), xd, rd, divisor, share)
    assert torch.equal(xd.cpu(), out) and torch.equal(rd.cpu(), want_res)
    xd = x.clone().to(device)  # no error feedback: x alone
    ops.lowrank_finish(p.to(device), qt.to(device), xd, None, divisor, share)
    assert torch.equal(xd.cpu(), out)


@pytest.mark.parametrize("rows,cols,r", [(1, 1, 1), (33, 7, 3), (300, 517, 4), (65, 1024, 5), (64, 2049, 16)])
def test_lowrank_products_are_the_products_of_m_without_storing_it(device, rows, cols, r):
    gen = torch.Generator().manual_seed(rows * r + cols)
    x, res = torch.randn(rows, cols, generator=gen) * 3, torch.randn(rows, cols, generator=gen)
    qt, p = torch.randn(r, cols, generator=gen), torch.randn(rows, r, generator=gen)
    divisor = 3.0
    for residual in (res, None):
        # Reference: the products in float64 of M as the CPU forms it, x * (1 / divisor) (+ residual) in float32
        m = x * torch.tensor(1 / divisor, dtype=torch.float32) + (residual if residual is not None else 0.0)
        want_p, want_qt = m.double() @ qt.double().t(), p.double().t() @ m.double()
        on = (lambda t: None if t is None else t.to(device))
        got_p = ops.lowrank_project(x.to(device), qt.to(device), on(residual), divisor).cpu()
        got_qt = ops.lowrank_back_project(x.to(device), p.to(device), on(residual), divisor).cpu()
        assert got_p.shape == (rows, r) and got_qt.shape == (r, cols)
        # float32 sums of cols (P) and rows (Q^T) products in any order: within the classic bound n u sum|term|
        # (u = 2^-24), where one term of average size left out or counted twice would be 1 / n of sum|term|
        bound_p = (cols + 1) * 2.0 ** -24 * (m.abs().double() @ qt.abs().double().t())
        bound_qt = (rows + 1) * 2.0 ** -24 * (p.abs().double().t() @ m.abs().double())
        assert ((got_p.double() - want_p).abs() <= bound_p).all()
        assert ((got_qt.double() - want_qt).abs() <= bound_qt).all()


def test_lowrank_products_on_the_cpu_are_the_same_bits_on_any_number_of_threads():
    gen = torch.Generator().manual_seed(5)
    x, res = torch.randn(129, 1031, generator=gen), torch.randn(129, 1031, generator=gen)
    qt, p = torch.randn(6, 1031, generator=gen), torch.randn(129, 6, generator=gen)
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)  # other row ranges (P) and column pieces (Q^T) a thread
            got.append((ops.lowrank_project(x, qt, res, 2.0), ops.lowrank_back_project(x, p, res, 2.0)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, got[0][0]) and torch.equal(b, got[0][1]) for a, b in got)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 66])
def test_lowrank_back_project_on_the_cpu_sums_each_entry_over_the_rows_in_order(rows):
    # Q^T's entry (k, j) on the CPU is ((0 + p[0,k] M[0,j]) + p[1,k] M[1,j]) + ..., each operation rounded to
    # float32, whether its rows run four, two or one a pass: the reference adds one row at a time in torch
    gen = torch.Generator().manual_seed(rows)
    cols, r, divisor = 37, 6, 3.0
    x, res = torch.randn(rows, cols, generator=gen), torch.randn(rows, cols, generator=gen)
    p = torch.randn(rows, r, generator=gen)
    x[0, :3] = torch.tensor([float("inf"), -0.0, 0.0])  # an infinite M and signed zeros keep their row's order too
    p[0, 0] = -0.0
    inv = torch.tensor(1.0 / divisor, dtype=torch.float32)
    for residual in (res, None):
        m = x * inv + residual if residual is not None else x * inv
        want = torch.zeros(r, cols)
        for i in range(rows):
            want = want + p[i].unsqueeze(1) * m[i].unsqueeze(0)
        got = ops.lowrank_back_project(x, p, residual, divisor)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # (-0 times inf is a NaN)
        numbers = ~want.isnan()
        assert torch.equal(torch.signbit(got[numbers]), torch.signbit(want[numbers]))


def test_lowrank_products_reject_bad_arguments():
    x, qt, p = torch.zeros(3, 4), torch.zeros(2, 4), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="qt must be r x cols \\(4\\)"):
        ops.lowrank_project(x, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="p must be rows \\(3\\) x r"):
        ops.lowrank_back_project(x, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="x must be a contiguous float32 matrix"):
        ops.lowrank_project(x.t(), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="residual must be a contiguous float32 tensor of x's numel"):
        ops.lowrank_project(x, qt, torch.zeros(11))
    with pytest.raises(ValueError, match="p must be a contiguous float32 matrix"):
        ops.lowrank_back_project(x, p.double())
    with pytest.raises(ValueError, match="divisor must be finite and > 0"):
        ops.lowrank_back_project(x, p, None, 0.0)


@pytest.mark.parametrize("cols,rank", [(1, 1), (7, 3), (517, 4)])
def test_take_q_keeps_the_columns_whose_new_value_is_zero(device, cols, rank):
    gen = torch.Generator().manual_seed(cols * rank)
    q, qt = torch.randn(cols, rank, generator=gen), torch.randn(rank, cols, generator=gen)
    qt[rank // 2] = 0.0  # a column whose summed P^T M was zero
    if rank > 2:
        qt[0, : cols // 2] = 0.0  # partly zero: taken
    want = torch.where(qt.ne(0).any(dim=1)[None, :], qt.t(), q)  # reference: torch on the CPU
    got = ops.take_q(q.clone().to(device), qt.to(device))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want[:, rank // 2], q[:, rank // 2]) and (rank == 1 or not torch.equal(want, q))


def test_take_q_rejects_bad_arguments():
    with pytest.raises(ValueError, match="take_q needs q \\(cols x rank\\) and qt \\(rank x cols\\)"):
        ops.take_q(torch.zeros(4, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="contiguous float32"):
        ops.take_q(torch.zeros(4, 2, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))


def test_lowrank_finish_rejects_bad_arguments():
    p, qt = torch.zeros(3, 2), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="matching r"):
        ops.lowrank_finish(p, torch.zeros(3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="rows \\* cols = 12"):
        ops.lowrank_finish(p, qt, torch.zeros(11))
    with pytest.raises(ValueError, match="rows \\* cols = 12"):
        ops.lowrank_finish(p, qt, torch.zeros(12), torch.zeros(12, dtype=torch.float64))
    with pytest.raises(ValueError, match="divisor must be finite and > 0"):
        ops.lowrank_finish(p, qt, torch.zeros(12), None, 0.0)


@pytest.mark.parametrize("rows,cols", [(5, 1), (100, 4), (2049, 8)])
def test_orthonormalize_columns_against_qr(device, rows, cols):
    gen = torch.Generator().manual_seed(rows + cols)
    p = torch.randn(rows, cols, generator=gen)
    q = ops.orthonormalize_columns(p.clone().to(device)).cpu()
    # Same span and orthonormal: Q = P R^-1 with R upper triangular; Q^T Q = I.
    torch.testing.assert_close(q.T @ q, torch.eye(cols), rtol=0, atol=1e-5)
    qr_q, qr_r = torch.linalg.qr(p.double())
    signs = torch.sign(torch.diagonal(qr_r)).float()  # our R has a positive diagonal
    torch.testing.assert_close(q, qr_q.float() * signs, rtol=0, atol=1e-4)
    assert torch.equal(q, ops.orthonormalize_columns(p.clone()))  # every device: the same bits


def test_orthonormalize_columns_with_no_epsilon_normalizes_exactly_and_keeps_a_zero_column(device):
    # lowrank's steps use eps 0: a column of norm 1e-12 comes out of norm 1 (an eps of 1e-8 would leave it at
    # 1e-4), and a zero column (a matrix whose gradient is zero) stays zero instead of turning NaN.
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(50, 3, generator=gen)
    p[:, 1] *= 1e-12
    p[:, 2] = 0.0
    q = ops.orthonormalize_columns(p.clone().to(device), 0.0).cpu()
    torch.testing.assert_close(q[:, :2].T @ q[:, :2], torch.eye(2), rtol=0, atol=1e-5)
    assert torch.equal(q[:, 2], torch.zeros(50))
    assert ops.orthonormalize_columns(p.clone(), 1e-8)[:, 1].norm() < 1e-3  # what the epsilon did


def test_orthonormalize_blocks_is_each_matrix_alone_and_leaves_the_gaps(device):
    # 70 matrices: more than one launch on a GPU (64 per launch); empty ones, a single row, gaps between them
    gen = torch.Generator().manual_seed(5)
    shapes = [(int(torch.randint(0, 600, (1,), generator=gen)), int(torch.randint(0, 5, (1,), generator=gen)))
              for _ in range(68)] + [(1, 3), (3000, 2)]
    blocks, offset = [], 0
    for rows, cols in shapes:
        offset += 3  # a gap
        blocks.append((offset, rows, cols))
        offset += rows * cols
    flat = torch.randn(offset + 3, generator=gen)
    want = flat.clone()
    for o, rows, cols in blocks:
        ops.orthonormalize_columns(want.narrow(0, o, rows * cols).view(rows, cols), 0.0)
    got = flat.clone().to(device)
    assert ops.orthonormalize_blocks(got, blocks, 0.0) is got
    assert torch.equal(got.cpu(), want)  # the same bits on every device, the gaps untouched
    assert not torch.equal(want, flat)


def test_orthonormalize_blocks_rejects_blocks_outside_or_overlapping():
    with pytest.raises(ValueError, match="lies outside flat's 10 elements"):
        ops.orthonormalize_blocks(torch.zeros(10), [(5, 3, 2)])
    with pytest.raises(ValueError, match="must not overlap"):
        ops.orthonormalize_blocks(torch.zeros(10), [(0, 2, 2), (3, 1, 2)])
    with pytest.raises(ValueError, match="contiguous 1-D float32"):
        ops.orthonormalize_blocks(torch.zeros(2, 5), [(0, 1, 1)])


# ---- fp8 (e4m3, power-of-two scale per chunk) ----------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk,magnitude", [(32, 1.0), (2048, 1e-3), (256, 1e30), (64, 1e-38)])
def test_fp8_encode_matches_torch_float8(device, n, chunk, magnitude):
    # Codes, scales and residuals bit for bit against torch's float8_e4m3fn cast;
    # values spread over many binades so subnormal codes, rounding ties and
    # tiny/huge scales all occur.
    g = torch.Generator().manual_seed(n)
    grad = (torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g)) * magnitude).to(device)
    e = (torch.randn(n, generator=g) * 0.1 * magnitude).to(device)
    want_codes, want_scales, want_res, want_dec = ref.fp8_encode(grad.cpu(), e.cpu(), 3.0, chunk)
    res = e.clone()
    codes, scales = ops.fp8_encode(grad, res, 3.0, chunk)
    assert codes.dtype == torch.uint8 and codes.numel() == n and scales.numel() == math.ceil(n / chunk)
    assert torch.equal(codes.cpu(), want_codes) and torch.equal(scales.cpu(), want_scales)
    assert torch.equal(res.cpu(), want_res)
    dec = ops.fp8_decode(codes, scales, n, chunk)
    assert torch.equal(dec.cpu(), want_dec)
    # Error feedback's invariant holds exactly (power-of-two scales: x / s and q * s are exact) ...
    x = grad.cpu() / 3.0 + e.cpu()
    assert torch.equal((dec + res).cpu(), x)
    # ... and the documented bound per element: max(|x| / 16, max|x| of its chunk / 229376, 2^-136).
    amax = torch.stack([c.abs().max() for c in x.split(chunk)]).repeat_interleave(chunk)[:n]
    bound = torch.maximum(torch.maximum(x.abs() / 16, amax / 229376), torch.tensor(2.0 ** -136))
    assert torch.all((dec.cpu() - x).abs() <= bound)


def test_fp8_special_values_and_accumulate(device):
    # zeros stay zeros (scale 0), every finite code decodes to torch's value,
    # NaN / inf make their chunk non-finite and leave the others alone
    codes, scales = ops.fp8_encode(torch.zeros(64, device=device), None, 1.0, 32)
    assert codes.abs().sum().item() == 0 and scales.abs().sum().item() == 0
    every = torch.arange(256, dtype=torch.uint8)
    want = every.view(torch.float8_e4m3fn).float()
    got = ops.fp8_decode(every.to(device), torch.ones(1, device=device), 256, 256).cpu()
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite]) and got[~finite].isnan().all()
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = torch.randn(96, device=device)
        g[40] = bad
        res = torch.zeros(96, device=device)
        codes, scales = ops.fp8_encode(g, res, 1.0, 32)
        dec = ops.fp8_decode(codes, scales, 96, 32).cpu()
        assert not dec[32:64].isfinite().any() and dec[:32].isfinite().all() and dec[64:].isfinite().all()
    out = torch.ones(100, device=device)
    g = torch.randn(100, device=device)
    codes, scales = ops.fp8_encode(g, None, 2.0, 64)
    ops.fp8_decode(codes, scales, 100, 64, alpha=0.5, out=out, accumulate=True)
    assert torch.equal(out.cpu(), 1 + 0.5 * ref.fp8_encode(g.cpu(), None, 2.0, 64)[3])


def test_fp8_rejects_bad_arguments():
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 32"):
        ops.fp8_encode(torch.randn(100), None, 1.0, 48)
    with pytest.raises(ValueError, match="divisor must be finite"):
        ops.fp8_encode(torch.randn(100), None, 0.0)
    with pytest.raises(ValueError, match="residual must have the gradient's numel"):
        ops.fp8_encode(torch.randn(100), torch.zeros(99))
    with pytest.raises(TypeError, match="grad must be a floating-point"):
        ops.fp8_encode(torch.arange(10))
    with pytest.raises(ValueError, match=r"scales must hold ceil\(n/chunk\) = 2"):
        ops.fp8_decode(torch.zeros(64, dtype=torch.uint8), torch.ones(1), 64, 32)
    with pytest.raises(ValueError, match="codes must hold n = 64"):
        ops.fp8_decode(torch.zeros(63, dtype=torch.uint8), torch.ones(2), 64, 32)
    with pytest.raises(TypeError, match="codes must be uint8"):
        ops.fp8_decode(torch.zeros(64, dtype=torch.int8), torch.ones(2), 64, 32)
    with pytest.raises(ValueError, match="accumulate=True needs an out tensor"):
        ops.fp8_decode(torch.zeros(64, dtype=torch.uint8), torch.ones(2), 64, 32, accumulate=True)


# ---- int3 (3-bit linear, bf16 scale per chunk) -----------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk,magnitude", [(32, 1.0), (256, 1e-3), (64, 1e30), (32, 1e-38)])
def test_int3_encode_matches_the_reference(device, n, chunk, magnitude):
    # Words, scales, residuals and decoded values bit for bit against the
    # pure-torch reference (torch's bf16 cast, division and round half to even);
    # values over many binades, so most of a chunk rounds to 0 and waits.
    g = torch.Generator().manual_seed(n + chunk)
    grad = (torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g)) * magnitude).to(device)
    e = (torch.randn(n, generator=g) * 0.1 * magnitude).to(device)
    want_words, want_scales, want_res, want_dec = ref.int3_encode(grad.cpu(), e.cpu(), 3.0, chunk)
    res = e.clone()
    words, scales = ops.int3_encode(grad, res, 3.0, chunk)
    assert words.dtype == torch.int32 and words.numel() == 3 * math.ceil(n / 32)
    assert scales.dtype == torch.bfloat16 and scales.numel() == math.ceil(n / chunk)
    assert torch.equal(words.cpu(), want_words) and torch.equal(scales.cpu(), want_scales)
    assert torch.equal(res.cpu(), want_res)
    dec = ops.int3_decode(words, scales, n, chunk)
    assert torch.equal(dec.cpu(), want_dec)
    # Error feedback's invariant (decoded + residual = x, within the subtraction's rounding) and the
    # bound per element: |x - decoded| <= scale / 2, or |x| - 3 scale where x / scale passed 3 (the bf16 scale
    # may round down: by at most 2^-8 of amax / 3, or bf16's least subnormal 2^-133).
    x = grad.cpu() / 3.0 + e.cpu()
    torch.testing.assert_close(dec.cpu() + res.cpu(), x, rtol=2 ** -23, atol=0)
    s = scales.cpu().float().repeat_interleave(chunk)[:n]
    assert torch.all((dec.cpu() - x).abs() <= torch.maximum(s / 2, x.abs() - 3 * s) * (1 + 2 ** -20))
    assert torch.all((x.abs() - 3 * s) <= x.abs() * 2 ** -7 + 3 * 2 ** -133)


def test_int3_special_values_and_accumulate(device):
    # zeros stay zeros; every code decodes to (code - 3) * scale; NaN / inf make
    # their chunk non-finite and leave the others alone; a chunk whose largest
    # value is under a sixth of another chunk's keeps its own scale
    words, scales = ops.int3_encode(torch.zeros(64, device=device), None, 1.0, 32)
    assert words.cpu().tolist() == [-1, -1, 0] * 2 and not scales.cpu().float().any()  # code 3 (binary 011): 0
    dec = ops.int3_decode(words, scales, 64, 32).cpu()
    assert torch.equal(dec, torch.zeros(64))
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = torch.randn(96, device=device)
        g[40] = bad
        res = torch.zeros(96, device=device)
        words, scales = ops.int3_encode(g, res, 1.0, 32)
        dec = ops.int3_decode(words, scales, 96, 32).cpu()
        assert not dec[32:64].isfinite().any() and dec[:32].isfinite().all() and dec[64:].isfinite().all()
    g = torch.tensor([3.0, -3.0, 1.5, 0.5, -0.5, 2.5, 1.0, 0.0] * 4)  # amax 3: scale 1, ties to even
    words, scales = ops.int3_encode(g.to(device), None, 1.0, 32)
    assert scales.cpu().float().tolist() == [1.0]
    assert ops.int3_decode(words, scales, 32, 32).cpu().tolist() == [3.0, -3.0, 2.0, 0.0, -0.0, 2.0, 1.0, 0.0] * 4
    out = torch.ones(100, device=device)
    g = torch.randn(100, device=device)
    words, scales = ops.int3_encode(g, None, 2.0, 64)
    ops.int3_decode(words, scales, 100, 64, alpha=0.5, out=out, accumulate=True)
    assert torch.equal(out.cpu(), 1 + 0.5 * ref.int3_encode(g.cpu(), None, 2.0, 64)[3])


def test_int3_rejects_bad_arguments():
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 32"):
        ops.int3_encode(torch.randn(100), None, 1.0, 48)
    with pytest.raises(ValueError, match="divisor must be finite"):
        ops.int3_encode(torch.randn(100), None, 0.0)
    with pytest.raises(ValueError, match="residual must have the gradient's numel"):
        ops.int3_encode(torch.randn(100), torch.zeros(99))
    with pytest.raises(TypeError, match="grad must be a floating-point"):
        ops.int3_encode(torch.arange(10))
    with pytest.raises(ValueError, match=r"words must hold 3 \* ceil\(n/32\) = 9"):
        ops.int3_decode(torch.zeros(6, dtype=torch.int32), torch.ones(3, dtype=torch.bfloat16), 65, 32)
    with pytest.raises(ValueError, match=r"scales must hold ceil\(n/chunk\) = 2"):
        ops.int3_decode(torch.zeros(6, dtype=torch.int32), torch.ones(1, dtype=torch.bfloat16), 64, 32)
    with pytest.raises(TypeError, match="scales must be bfloat16"):
        ops.int3_decode(torch.zeros(6, dtype=torch.int32), torch.ones(2), 64, 32)
