"""Python entry points to hetcomm's kernels, for tests and advanced users.

All take and return torch tensors on the CPU (CUDA tensors need a CUDA build,
see :func:`hetcomm.build_info`). Gradients may be float32, float16 or
bfloat16 (the 16-bit ones are upcast; residuals are always float32).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _C
from .planner import DEFAULT_CHUNK as _CHUNKS

DEFAULT_CHUNK = _CHUNKS["onebit"]  # the sign codec's default, HookState's (hetcomm.planner.DEFAULT_CHUNK says why)
FP8_CHUNK = _CHUNKS["fp8"]
INT3_CHUNK = _CHUNKS["int3"]


def sign_encode(grad: torch.Tensor, residual: Optional[torch.Tensor] = None, divisor: float = 1.0,
                chunk: int = DEFAULT_CHUNK) -> Tuple[torch.Tensor, torch.Tensor]:
    """1-bit sign compression with error feedback.

    ``x = grad / divisor + residual``; per chunk of ``chunk`` elements (a multiple
    of 32) ``scale = mean(|x|)`` rounded to bfloat16 (nearest even); sign bits
    (1 for ``x >= 0``) packed 32 per word. ``residual`` (float32, same numel)
    becomes ``x - scale * sign(x)`` in place, with the rounded scale. Returns
    ``(words, scales)``: int32 words holding uint32 bit patterns
    (``ceil(n/32)``) and bfloat16 scales (``ceil(n/chunk)``).
    """
    return _C.sign_encode(grad, residual, float(divisor), int(chunk))


def sign_decode(words: torch.Tensor, scales: torch.Tensor, n: int, chunk: int = DEFAULT_CHUNK, alpha: float = 1.0,
                out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """Inverse of :func:`sign_encode`: ``out (+)= alpha * scale * (+1 or -1)``."""
    return _C.sign_decode(words, scales, int(n), int(chunk), float(alpha), out, bool(accumulate))


def fp8_encode(grad: torch.Tensor, residual: Optional[torch.Tensor] = None, divisor: float = 1.0,
               chunk: int = FP8_CHUNK) -> Tuple[torch.Tensor, torch.Tensor]:
    """8-bit (fp8 e4m3) compression with error feedback.

    ``x = grad / divisor + residual``; per chunk of ``chunk`` elements (a
    multiple of 32) ``scale`` = the power of two ``>= max|x| / 448`` (0 for an
    all-zero chunk), ``code = e4m3(x / scale)`` rounded to nearest even, as
    ``torch.float8_e4m3fn`` would. ``residual`` (float32, same numel) becomes
    ``x - code * scale`` in place. Per element the message misses at most
    ``max(|x| / 16, max|x| / 229376, 2**-136)`` (max over its chunk). Returns ``(codes uint8[n],
    scales float32[ceil(n/chunk)])``; a non-finite x gives a non-finite scale,
    so its whole chunk decodes non-finite.
    """
    return _C.fp8_encode(grad, residual, float(divisor), int(chunk))


def fp8_decode(codes: torch.Tensor, scales: torch.Tensor, n: int, chunk: int = FP8_CHUNK, alpha: float = 1.0,
               out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """Inverse of :func:`fp8_encode`: ``out (+)= alpha * e4m3(code) * scale``."""
    return _C.fp8_decode(codes, scales, int(n), int(chunk), float(alpha), out, bool(accumulate))


def int3_encode(grad: torch.Tensor, residual: Optional[torch.Tensor] = None, divisor: float = 1.0,
                chunk: int = INT3_CHUNK) -> Tuple[torch.Tensor, torch.Tensor]:
    """3-bit linear compression with error feedback.

    ``x = grad / divisor + residual``; per chunk of ``chunk`` elements (a
    multiple of 32) ``scale = max|x| / 3`` rounded to bfloat16 (nearest even),
    ``q = round(x / scale)`` (half to even) clamped to [-3, 3]. ``residual``
    (float32, same numel) becomes ``x - q * scale`` in place. Returns
    ``(words, scales)``: int32 words holding the codes ``q + 3`` as three bit
    planes per 32 elements (word k: bit k of each code, element j at bit j;
    ``3 * ceil(n/32)`` words) and bfloat16 scales (``ceil(n/chunk)``); a
    non-finite x gives a non-finite scale, so its whole chunk decodes
    non-finite.
    """
    return _C.int3_encode(grad, residual, float(divisor), int(chunk))


def int3_decode(words: torch.Tensor, scales: torch.Tensor, n: int, chunk: int = INT3_CHUNK, alpha: float = 1.0,
                out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """Inverse of :func:`int3_encode`: ``out (+)= alpha * q * scale``."""
    return _C.int3_decode(words, scales, int(n), int(chunk), float(alpha), out, bool(accumulate))


def topk_count(n: int, ratio: float) -> int:
    """``k = ceil(ratio * n)`` (at most n), the number of entries top-k sends."""
    return _C.topk_count(int(n), float(ratio))


def topk_encode(grad: torch.Tensor, residual: Optional[torch.Tensor] = None, divisor: float = 1.0, k: int = 1,
                exact: bool = True, denominator: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k with error feedback: ``x = grad / divisor + residual``; returns
    ``(idx int32, val float32)`` of the k largest ``|x|`` in ascending index order
    (ties go to the lowest index). ``residual`` keeps everything not sent.
    ``exact=False`` estimates the threshold from a sample (as DGC does) and
    returns about k, never more. ``denominator`` (float32, one per element,
    > 0): the k largest ``|x| / denominator`` instead, their values still ``x``'s."""
    return _C.topk_encode(grad, residual, float(divisor), int(k), bool(exact), denominator)


def scatter_add(idx: torch.Tensor, val: torch.Tensor, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out[idx] += alpha * val`` in order; returns ``out``."""
    return _C.scatter_add(idx, val, out, float(alpha))


def cast_encode(x: torch.Tensor, divisor: float = 1.0, wire: str = "float16") -> torch.Tensor:
    """``(x / divisor).to(wire)`` with round-to-nearest-even; divides before the
    cast so large values do not overflow float16. ``wire`` is 'float16' or 'bfloat16'."""
    return _C.cast_encode(x, float(divisor), wire)


def cast_decode(h: torch.Tensor, mul: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``h.float() * mul`` into ``out`` (allocated when None)."""
    return _C.cast_decode(h, float(mul), out)


def lowrank_outer(p: torch.Tensor, qt: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``p @ qt`` (float32 matrices) summed in a fixed order without FMA or
    BLAS: every rank and every device (CPU or any GPU) gives the same bits.
    The lowrank codec rebuilds each gradient matrix with it."""
    return _C.lowrank_outer(p, qt, out)


def lowrank_project(x: torch.Tensor, qt: torch.Tensor, residual: Optional[torch.Tensor] = None,
                    divisor: float = 1.0) -> torch.Tensor:
    """lowrank's first product, ``(x / divisor + residual) @ qt.T`` (x rows x
    cols, qt r x cols, residual x's shape or None; contiguous float32 on one
    device), without storing M = x / divisor + residual: on the CPU one pass
    over x and the residual (M taken as ``x * (1 / divisor) + residual``), on a
    GPU cuBLAS. Its bits are its own (not BLAS's): the ranks sum it next."""
    return _C.lowrank_project(x, residual, float(divisor), qt)


def lowrank_back_project(x: torch.Tensor, p: torch.Tensor, residual: Optional[torch.Tensor] = None,
                         divisor: float = 1.0) -> torch.Tensor:
    """lowrank's second product, ``p.T @ (x / divisor + residual)`` (p rows x
    r), as :func:`lowrank_project` takes M; on the CPU each entry sums the
    rows in order, whatever the number of threads."""
    return _C.lowrank_back_project(x, residual, float(divisor), p)


def lowrank_finish(p: torch.Tensor, qt: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                   divisor: float = 1.0, share: float = 1.0) -> None:
    """lowrank's step end, in place and in one pass: ``x`` (rows x cols
    elements) becomes :func:`lowrank_outer` (p, qt), and ``residual``, if
    given, becomes ``x / divisor + residual - share * lowrank_outer(p, qt)``
    from the old ``x``, each operation rounded to float32 (no FMA), the same
    bits on every device."""
    _C.lowrank_finish(p, qt, x, residual, divisor, share)


def take_q(q: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """lowrank's next warm start, in place: ``q`` (cols x rank, contiguous
    float32) takes the rows of ``qt`` (rank x cols, the summed Q transposed)
    as its columns, except where a row of ``qt`` is all zero (the matrix's M
    was zero on every rank): that column of ``q`` stays as it was, so the
    warm start does not die. Returns ``q``."""
    return _C.take_q(q, qt)


def momentum_fold_in(x: torch.Tensor, m: torch.Tensor, alpha: float) -> None:
    """``x += alpha * m`` in place, each element rounded as ``alpha * m`` then
    the sum (no fused multiply-add: the same bits on every device and for any
    slice). What a rank sends under momentum compression: its local momentum."""
    _C.momentum_fold_in(x, m, float(alpha))


def momentum_handoff(x: torch.Tensor, m: torch.Tensor, beta: float) -> None:
    """Momentum compression's hand-over, in place and in one pass: ``x`` (the
    new momentum) becomes ``x - beta * m`` and ``m`` the old ``x`` (contiguous
    float32 of one numel and device). What the hook gives an attached
    optimizer: its own buffer, ``beta * m + x``, then becomes the new momentum."""
    _C.momentum_handoff(x, m, float(beta))


def orthonormalize_columns(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Modified Gram-Schmidt of the columns of ``p`` (contiguous float32), in
    place on its device, dot products in float64 in a fixed order; returns
    ``p``. Every device (CPU or any GPU) gives the same bits."""
    return _C.orthonormalize_columns(p, float(eps))


def orthonormalize_blocks(flat: torch.Tensor, blocks, eps: float = 1e-8) -> torch.Tensor:
    """:func:`orthonormalize_columns` of each ``(offset, rows, cols)`` matrix
    (row-major) inside ``flat`` (contiguous 1-D float32), all at once (one
    launch on a GPU); returns ``flat``."""
    return _C.orthonormalize_blocks(flat, [tuple(int(v) for v in b) for b in blocks], float(eps))


def onebit_segment_numel(n: int, world: int, rank: int) -> int:
    """Elements of an n-element bucket that ``rank`` averages in the two-phase
    all-reduce of onebit, fp8 and int3."""
    return _C.onebit_segment_numel(int(n), int(world), int(rank))


def server_residual_numel(n: int, world: int, rank: int) -> int:
    """The size of ``rank``'s server residual in that all-reduce: its
    segment's, or 0 on one or two ranks, where the two phases are one
    exchange of whole messages and no sum is encoded a second time."""
    return _C.server_residual_numel(int(n), int(world), int(rank))
