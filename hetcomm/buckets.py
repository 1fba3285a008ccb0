"""Per-bucket state of a HookState: error-feedback residuals, lowrank Q
matrices and layouts, keyed by bucket layout, pruned when a layout goes away."""

from __future__ import annotations

from typing import Any, Dict

import torch

from . import _C


class BucketStates:
    def __init__(self) -> None:
        self.residuals: Dict[str, torch.Tensor] = {}
        self.server_residuals: Dict[str, torch.Tensor] = {}
        self.lowrank_q: Dict[str, torch.Tensor] = {}
        self.layouts: Dict[str, torch.Tensor] = {}
        self.keys: Dict[tuple, str] = {}
        self.touched: set = set()
        self.prev_touched: set = set()

    def state_dict(self) -> Dict[str, Any]:
        return {
            "residuals": {k: t.clone() for k, t in self.residuals.items()},
            "server_residuals": {k: t.clone() for k, t in self.server_residuals.items()},
            "lowrank_q": {k: t.clone() for k, t in self.lowrank_q.items()},
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        def restore(d):
            return {str(k): t.detach().clone().float().contiguous() for k, t in d.items()}

        self.residuals = restore(sd["residuals"])
        self.server_residuals = restore(sd["server_residuals"])
        self.lowrank_q = restore(sd.get("lowrank_q", {}))
        # kept through the first steps of a resumed run (they may run in DDP's initial layout)
        self.prev_touched = set(self.residuals) | set(self.server_residuals) | set(self.lowrank_q)

    def key(self, bucket, index: int, numel: int) -> str:
        """Residuals are keyed by bucket index and the numels of the bucket's
        parameters, so DDP's bucket rebuild (or a resumed process, whose first
        step runs in DDP's initial layout) never applies a residual to other
        parameters than the ones it was made for."""
        key = self.keys.get((index, numel))
        if key is None:
            key = f"{index}:" + ",".join(str(p.numel()) for p in bucket.parameters())
            self.keys[(index, numel)] = key
        return key

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

    def lowrank_parts(self, bucket, key: str, numel: int, rank: int) -> torch.Tensor:
        """int64 [k, 4] rows (offset, rows, cols, rank) of the bucket's tensors;
        rank 0 = sent dense. A matrix is approximated only where P and Q are
        less than half its size (PowerSGD's rule)."""
        layout = self.layouts.get(key)
        if layout is not None:
            return layout
        buf = bucket.buffer()
        rows, offset = [], 0
        for g in bucket.gradients():
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

    def end_step(self) -> None:
        # Drop per-bucket state of layouts not used in this step or the one before.
        keep = self.touched | self.prev_touched
        if self.touched:
            for store in (self.residuals, self.server_residuals, self.lowrank_q):
                for key in [k for k in store if k not in keep]:
                    del store[key]
        self.prev_touched, self.touched = self.touched, set()
