"""Pure-torch references of hetcomm's codecs, written from the definitions
(independent of the C++ code) for the tests."""

from __future__ import annotations

import math

import torch


def ef_input(grad, residual, divisor):
    x = grad.float().reshape(-1) / divisor
    return x + residual if residual is not None else x


def chunk_mean_abs(x, chunk):
    """Per chunk of x, mean(|x|) in float32 summed in the codec's documented
    order (kernels/codec_math.h): lane l of 32 adds |x[l]|, |x[l + 32]|, ... in
    turn, then lanes i and i + o are added for o = 16, 8, 4, 2, 1; the sum is
    divided by the chunk's length."""
    n = x.numel()
    nchunks = math.ceil(n / chunk)
    a = torch.zeros(nchunks * chunk, dtype=torch.float32)
    a[:n] = x.abs()
    a = a.view(nchunks, chunk // 32, 32)
    part = torch.zeros(nchunks, 32, dtype=torch.float32)
    for j in range(chunk // 32):
        part = part + a[:, j, :]
    for o in (16, 8, 4, 2, 1):
        part = torch.cat([part[:, :o] + part[:, o:2 * o], part[:, o:]], dim=1)
    lens = torch.full((nchunks,), float(chunk))
    if nchunks:
        lens[-1] = float(n - (nchunks - 1) * chunk)
    return part[:, 0] / lens


def sign_encode(grad, residual, divisor, chunk):
    """Returns (words as int64 uint32 values, bf16 scales, new residual or None, decoded)."""
    x = ef_input(grad, residual, divisor)
    n = x.numel()
    scales = chunk_mean_abs(x, chunk).to(torch.bfloat16)  # round to nearest even, as the wire carries it
    bits = (x >= 0).long()
    pad = (-n) % 32
    bits = torch.cat([bits, torch.zeros(pad, dtype=torch.long)]).view(-1, 32)
    words = (bits << torch.arange(32)).sum(1)
    per_elem = scales.float().repeat_interleave(chunk)[:n]
    decoded = torch.where(x >= 0, per_elem, -per_elem)
    new_res = x - decoded if residual is not None else None
    return words, scales, new_res, decoded


def words_as_uint32(words_int32: torch.Tensor) -> torch.Tensor:
    return words_int32.long() & 0xFFFFFFFF


def topk(grad, residual, divisor, k, denominator=None):
    """Exact top-k by |x| (by |x| / denominator where given), ties to the lowest index; returns (idx ascending,
    val, new residual)."""
    x = ef_input(grad, residual, divisor)
    rank_by = x.abs() if denominator is None else x.abs() / denominator
    order = torch.sort(rank_by, descending=True, stable=True).indices[:k]
    idx = torch.sort(order).values
    new_res = None
    if residual is not None:
        new_res = x.clone()
        new_res[idx] = 0
    return idx, x[idx], new_res


def topk_wire(grad, residual, divisor, k, denominator=None):
    """What top-k's all-reduce sends: ``topk``'s entries with their values rounded to bf16 (round to nearest
    even, torch's cast); the residual keeps the sent entries' rounding. Returns (idx, sent values as float32, new
    residual or None)."""
    idx, val, new_res = topk(grad, residual, divisor, k, denominator)
    sent = val.to(torch.bfloat16).float()
    if new_res is not None:
        new_res[idx] = val - sent
    return idx, sent, new_res


def fp8_encode(grad, residual, divisor, chunk):
    """Returns (codes uint8, scales, new residual or None, decoded): per chunk the
    power-of-two scale >= max|x| / 448, codes by torch's own float8_e4m3fn cast."""
    x = ef_input(grad, residual, divisor)
    n = x.numel()
    codes = torch.zeros(n, dtype=torch.uint8)
    decoded = torch.zeros(n)
    scales = []
    for c in range(0, n, chunk):
        xc = x[c:c + chunk].double()
        amax = xc.abs().max().item()
        if math.isnan(amax) or math.isinf(amax):
            scale = amax
        elif amax == 0:
            scale = 0.0
        else:
            scale = max(2.0 ** math.ceil(math.log2(amax / 448)), 2.0 ** -126)
        scales.append(scale)
        q = (xc / scale if scale else torch.zeros_like(xc)).clamp(-448, 448).float().to(torch.float8_e4m3fn)
        codes[c:c + chunk] = q.view(torch.uint8)
        decoded[c:c + chunk] = (q.double() * scale).float()
    new_res = x - decoded if residual is not None else None
    return codes, torch.tensor(scales, dtype=torch.float32), new_res, decoded


def int3_encode(grad, residual, divisor, chunk):
    """Returns (words int32, scales bf16, new residual or None, decoded): per chunk the scale max|x| / 3 rounded
    to bf16 by torch's cast, q = round(x / scale) (torch.round: half to even) clamped to [-3, 3], the codes
    q + 3 as three bit planes per 32 elements (word k: bit k of each code, element j at bit j)."""
    x = ef_input(grad, residual, divisor)
    n = x.numel()
    q = torch.zeros(n)
    decoded = torch.zeros(n)
    scales = []
    for c in range(0, n, chunk):
        xc = x[c:c + chunk]
        scale = (xc.abs().max() / 3).to(torch.bfloat16)
        scales.append(scale)
        s = scale.float()
        usable = bool(s > 0) and bool(torch.isfinite(s))
        qc = torch.round(xc / s).clamp(-3, 3) if usable else torch.zeros_like(xc)
        q[c:c + chunk] = qc
        decoded[c:c + chunk] = qc * s
    codes = (q + 3).to(torch.int64)
    padded = torch.zeros(-(-n // 32) * 32, dtype=torch.int64)
    padded[:n] = codes
    planes = [((padded >> k) & 1).view(-1, 32) for k in range(3)]
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    words = torch.stack([(p * weights).sum(1) for p in planes], 1).view(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    new_res = x - decoded if residual is not None else None
    return words, torch.stack(scales) if scales else torch.zeros(0, dtype=torch.bfloat16), new_res, decoded


def two_phase_allreduce(inputs, worker_res, server_res, divisors, chunk, encode=None):
    """Two-phase all-reduce (onebit; fp8 or int3 with ``encode=fp8_encode`` / ``int3_encode``) of per-rank vectors, simulated in one
    process. Returns (output, new worker
    residuals, new server residuals, the server-side sums before the second
    compression). On one or two ranks it is one exchange: each rank's whole
    vector encoded once, the decoded vectors summed in rank order (no server
    residual is touched, the sums are the output)."""
    encode = encode or sign_encode
    world = len(inputs)
    n = inputs[0].numel()
    if world <= 2:
        new_w, out = [], torch.zeros(n)
        for src in range(world):
            _, _, nr, dec = encode(inputs[src], None if worker_res[src] is None else worker_res[src].clone(),
                                   divisors[src], chunk)
            new_w.append(nr)
            out = out + dec
        return out, new_w, list(server_res), out.clone()
    seg = max(32, math.ceil(math.ceil(n / world) / 32) * 32)
    bounds = [(min(n, r * seg), min(n, (r + 1) * seg)) for r in range(world)]
    new_w = [None if w is None else w.clone() for w in worker_res]
    # phase 1: every rank compresses every segment of its own vector
    decoded = [[None] * world for _ in range(world)]  # decoded[src][segment]
    for src in range(world):
        for r, (b, e) in enumerate(bounds):
            if e == b:
                continue
            res = None if new_w[src] is None else new_w[src][b:e]
            _, _, nr, dec = encode(inputs[src][b:e], res, divisors[src], chunk)
            if nr is not None:
                new_w[src][b:e] = nr
            decoded[src][r] = dec
    out = torch.zeros(n)
    sums = torch.zeros(n)
    new_s = [None if s is None else s.clone() for s in server_res]
    for r, (b, e) in enumerate(bounds):
        if e == b:
            continue
        acc = torch.zeros(e - b)
        for src in range(world):
            acc += decoded[src][r]
        sums[b:e] = acc
        _, _, ns, dec = encode(acc, new_s[r], 1.0, chunk)
        if ns is not None:
            new_s[r] = ns
        out[b:e] = dec
    return out, new_w, new_s, sums
