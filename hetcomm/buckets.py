"""Per-bucket state of a HookState, keyed by what each bucket *is*.

A bucket is the ordered list of the parameters it holds. Parameters get stable
numbers (:class:`ParamIndex`: the order of their first appearance, i.e. DDP's
first step, whose bucket layout is a function of the model alone, so every
process of the same model numbers them alike). A bucket's signature is the
tuple of its parameter numbers; error-feedback residuals, server residuals,
lowrank Q matrices and layouts are keyed by it, never by a bucket position.

A state saved in one layout and resumed in another (a fresh DDP's first step
runs in its initial layout, later steps in the rebuilt one) is *replayed*: the
step's gradients are regrouped into the saved buckets and reduced as the
original run would have (see ``HookState._replay``).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _C

Signature = Tuple[int, ...]


def key_of(sig: Signature) -> str:
    """The state_dict key of a bucket signature: its parameter numbers."""
    return ",".join(map(str, sig))


class Bucket(NamedTuple):
    """What the hook needs of a bucket: DDP's GradBucket, or a regrouped one."""
    index: int
    buffer: torch.Tensor          # flat, reduced in place
    grads: List[torch.Tensor]     # views of buffer, one per parameter, in order
    sig: Signature
    last: bool


class ParamIndex:
    """Stable numbers for the parameters of one DDP model, assigned in the
    order the hook first sees them, frozen after the first complete step: a
    parameter seen after that belongs to another model."""

    def __init__(self) -> None:
        self._by_id: Dict[int, Tuple[Any, int]] = {}
        self.shapes: List[Tuple[int, ...]] = []
        self.frozen = False

    def number(self, p: torch.Tensor) -> int:
        entry = self._by_id.get(id(p))
        if entry is not None and entry[0]() is p:
            return entry[1]
        if self.frozen:
            raise RuntimeError(
                "hetcomm: this HookState received a bucket with parameters it has not seen in its first step: one "
                "HookState serves one DDP model (its residuals and step counter are per model). Create a HookState "
                "per DDP model")
        n = len(self.shapes)
        self._by_id[id(p)] = (weakref.ref(p), n)
        self.shapes.append(tuple(p.shape))
        return n

    def signature(self, params: Sequence[torch.Tensor]) -> Signature:
        return tuple(self.number(p) for p in params)


def from_grad_bucket(bucket, params: ParamIndex) -> Bucket:
    return Bucket(bucket.index(), bucket.buffer(), list(bucket.gradients()), params.signature(bucket.parameters()),
                  bucket.is_last())


class BucketStates:
    def __init__(self) -> None:
        self.params = ParamIndex()
        self.residuals: Dict[str, torch.Tensor] = {}
        self.server_residuals: Dict[str, torch.Tensor] = {}
        self.lowrank_q: Dict[str, torch.Tensor] = {}
        self.momentum: Dict[str, torch.Tensor] = {}  # optimizer momentum per bucket (HookState.attach_optimizer)
        self.layouts: Dict[str, torch.Tensor] = {}
        #: signatures of the buckets of the last complete step, in order
        self.step_layout: List[Signature] = []
        self._current: List[Signature] = []
        self.touched: set = set()
        self.prev_touched: set = set()
        #: a restored state's layout, replayed at the first step that differs from it
        self.replay_layout: Optional[List[Signature]] = None
        self._saved_shapes: Optional[List[Tuple[int, ...]]] = None

    def has_state(self) -> bool:
        return bool(self.residuals or self.server_residuals or self.lowrank_q or self.momentum)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "param_shapes": [list(s) for s in self.params.shapes],
            "bucket_layout": [list(sig) for sig in self.step_layout],
            "residuals": {k: t.clone() for k, t in self.residuals.items()},
            "server_residuals": {k: t.clone() for k, t in self.server_residuals.items()},
            "lowrank_q": {k: t.clone() for k, t in self.lowrank_q.items()},
            "momentum": {k: t.clone() for k, t in self.momentum.items()},
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        def restore(d):
            return {str(k): t.detach().clone().float().contiguous() for k, t in d.items()}

        self.residuals = restore(sd["residuals"])
        self.server_residuals = restore(sd["server_residuals"])
        self.lowrank_q = restore(sd.get("lowrank_q", {}))
        self.momentum = restore(sd.get("momentum", {}))
        self.layouts = {}
        layout = [tuple(int(i) for i in sig) for sig in sd.get("bucket_layout", [])]
        self.step_layout = layout
        self.replay_layout = layout if layout and self.has_state() else None
        self._saved_shapes = [tuple(s) for s in sd.get("param_shapes", [])]
        # kept through the first steps of a resumed run
        self.prev_touched = set(self.residuals) | set(self.server_residuals) | set(self.lowrank_q) | set(self.momentum)

    def check_saved_shapes(self) -> None:
        """After the first step numbered the parameters: they must be the ones
        the restored state was saved with."""
        saved, self._saved_shapes = self._saved_shapes, None
        if saved and saved != self.params.shapes:
            raise ValueError(
                f"hetcomm: the restored HookState was saved for a model with {len(saved)} parameters of shapes "
                f"{saved[:4]}..., this DDP model has {len(self.params.shapes)} of shapes {self.params.shapes[:4]}...: "
                "load the state saved with this model")

    def residual(self, store: Dict[str, torch.Tensor], key: str, numel: int,
                 device: torch.device = torch.device("cpu")) -> torch.Tensor:
        self.touched.add(key)
        r = store.get(key)
        if r is None or r.numel() != numel:
            r = torch.zeros(numel, dtype=torch.float32, device=device)
            store[key] = r
        elif r.device != device:  # restored from a checkpoint on another device
            r = store[key] = r.to(device)
        return r

    def lowrank_parts(self, bucket: Bucket, key: str, rank: int) -> torch.Tensor:
        """int64 [k, 4] rows (offset, rows, cols, rank) of the bucket's tensors;
        rank 0 = sent dense. A matrix is approximated only where P and Q are
        less than half its size (PowerSGD's rule)."""
        layout = self.layouts.get(key)
        if layout is not None:
            return layout
        buf, numel = bucket.buffer, bucket.buffer.numel()
        rows, offset = [], 0
        for g in bucket.grads:
            n = g.numel()
            off = (g.data_ptr() - buf.data_ptr()) // buf.element_size() if g.numel() else offset
            if g.dim() >= 2:
                r_rows, cols = g.shape[0], n // g.shape[0]
                r = min(rank, r_rows, cols)
                if r_rows * cols > 2 * (r_rows + cols) * r:
                    rows.append([off, r_rows, cols, r])
                    offset += n
                    continue
            rows.append([off, 1, n, 0])
            offset += n
        spans = sorted((o, c * rr) for o, rr, c, _ in rows)
        contiguous = all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
        if offset != numel or not contiguous or not spans or spans[0][0] != 0:
            rows = [[0, 1, numel, 0]]  # unknown layout: send it all dense
        layout = torch.tensor(rows, dtype=torch.int64)
        self.layouts[key] = layout
        return layout

    def lowrank_q_state(self, key: str, layout: torch.Tensor,
                        device: torch.device = torch.device("cpu")) -> torch.Tensor:
        self.touched.add(key)
        q = self.lowrank_q.get(key)
        n = _C.lowrank_q_numel(layout)
        if q is None or q.numel() != n:
            # The same random start on every rank (the key is the same everywhere).
            gen = torch.Generator().manual_seed(sum(key.encode()) + 7919 * len(key))
            q = self.lowrank_q[key] = torch.randn(n, generator=gen).to(device)
        elif q.device != device:  # restored from a checkpoint on another device
            q = self.lowrank_q[key] = q.to(device)
        return q

    def add_to_step(self, sig: Signature) -> None:
        self._current.append(sig)

    def end_step(self) -> None:
        self.params.frozen = True
        self.step_layout, self._current = self._current, []
        # Drop per-bucket state of layouts not used in this step or the one before.
        keep = self.touched | self.prev_touched
        if self.touched:
            for store in (self.residuals, self.server_residuals, self.lowrank_q, self.momentum):
                for key in [k for k in store if k not in keep]:
                    del store[key]
        self.prev_touched, self.touched = self.touched, set()
