"""lowrank's view of a bucket: which of its tensors are matrices it
approximates at a rank (PowerSGD's rule), and each bucket's Q: its random
start, the same on every rank, and its columns kept when the rank changes
(:class:`hetcomm.lowrank_ladder.RankLadder`)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from . import _C
from .bucket_keys import offset_in
from .lowrank_share import compressed_at


def matrix_layout(bucket, rank: int) -> torch.Tensor:
    """int64 [k, 4] rows (offset, rows, cols, rank) of the tensors of
    ``bucket`` (a :class:`hetcomm.buckets.Bucket`: its buffer and gradients):
    a matrix is approximated at ``rank`` only where P and Q are less than half
    its size (PowerSGD's rule), else sent dense (rank 0)."""
    buf, numel = bucket.buffer, bucket.buffer.numel()
    rows, offset = [], 0
    for g in bucket.grads:
        n = g.numel()
        if n == 0:  # an empty parameter (a dimension of 0) has no place in the buffer
            continue
        off = offset_in(g, buf)
        if g.dim() >= 2:
            r_rows, cols = g.shape[0], n // g.shape[0]
            if compressed_at(r_rows, cols, rank):
                rows.append([off, r_rows, cols, min(rank, r_rows, cols)])
                offset += n
                continue
        rows.append([off, 1, n, 0])
        offset += n
    spans = sorted((o, c * rr) for o, rr, c, _ in rows)
    contiguous = all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
    if offset != numel or not contiguous or not spans or spans[0][0] != 0:
        rows = [[0, 1, numel, 0]]  # unknown layout: send it all dense
    return torch.tensor(rows, dtype=torch.int64)


def q_generator(key: str) -> torch.Generator:
    """A bucket's random stream for Q's columns: the same on every rank (the key is)."""
    return torch.Generator().manual_seed(sum(key.encode()) + 7919 * len(key))


def q_blocks(layout: torch.Tensor) -> List[Tuple[int, int, int]]:
    """Each approximated matrix's Q inside the flat Q: (offset, cols, rank)."""
    blocks, offset = [], 0
    for _, _, cols, rank in layout.tolist():
        if rank:
            blocks.append((offset, cols, rank))
            offset += cols * rank
    return blocks


def q_slots(grads, layout: torch.Tensor, q: torch.Tensor) -> Dict[int, List[Tuple[torch.Tensor, int, int]]]:
    """Position in a bucket's ``grads`` -> its matrix's part of the flat Q
    ``q`` of ``layout`` (:func:`matrix_layout`'s), as (q, offset, numel), for
    the tensors approximated at a rank (each matrix's Q is its own: P = M Q,
    orthonormalised per matrix, Q = M^T P); none where the layout is not one
    row per tensor (sent dense)."""
    at = [i for i, g in enumerate(grads) if g.numel()]
    rows = layout.tolist()
    if len(rows) != len(at):
        return {}
    approximated = [i for i, (_, _, _, rank) in zip(at, rows) if rank]
    return {i: [(q, offset, cols * rank)] for i, (offset, cols, rank) in zip(approximated, q_blocks(layout))}


def q_at(q: torch.Tensor, old: torch.Tensor, new: torch.Tensor, key: str) -> torch.Tensor:
    """The bucket's Q (cols x rank per matrix, flat) for the layout ``new``
    from the one it has for ``old``: a matrix keeps its first min(old, new)
    columns, more are drawn from the bucket's random stream, then each
    matrix's Q is orthonormal (the same bits on every rank: Q is)."""
    device, q = q.device, q.detach().cpu()
    gen = q_generator(key)
    out = torch.empty(_C.lowrank_q_numel(new), dtype=torch.float32, device="cpu")
    olds = old.tolist() if len(old) == len(new) else [[-1, 0, 0, 0]] * len(new)  # (another split: nothing kept)
    at_old, at_new = 0, 0
    for (o_off, _, o_cols, o_rank), (n_off, _, n_cols, n_rank) in zip(olds, new.tolist()):
        keep = min(o_rank, n_rank) if (o_off, o_cols) == (n_off, n_cols) else 0
        if n_rank:
            block = torch.randn(n_cols, n_rank, generator=gen, dtype=torch.float32, device="cpu")
            if keep:
                block[:, :keep] = q.narrow(0, at_old, o_cols * o_rank).view(o_cols, o_rank)[:, :keep]
            out.narrow(0, at_new, n_cols * n_rank).copy_(block.reshape(-1))
            at_new += n_cols * n_rank
        at_old += o_cols * o_rank
    _C.orthonormalize_blocks(out, q_blocks(new), 0.0)
    return out.to(device)
