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

Within a run, a bucket first seen after buckets of another layout held its
parameters (DDP's rebuild after step 0, with ``start_iter=0``) *adopts* what
those buckets' error feedback still owed for its parameters, as a carry
(:meth:`BucketStates.adopt`): nothing held back is lost to the rebuild.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import _C
from .bucket_debts import BucketDebts
from .bucket_keys import Signature, key_of, overlapping, sig_of
from .lowrank_layout import matrix_layout, q_at, q_blocks, q_generator

__all__ = ["Bucket", "BucketStates", "ParamIndex", "Signature", "from_grad_bucket", "key_of", "overlapping", "sig_of"]

log = logging.getLogger("hetcomm")

#: the resumed steps that may run in DDP's initial buckets, each replayed in the saved layout: DDP rebuilds its
#: buckets in its second step's forward, with ``static_graph=True`` in its third's
REPLAY_STEPS = 2


class Bucket:
    """What the hook needs of a bucket: DDP's GradBucket, or a regrouped one.
    ``grads``, views of ``buffer`` one per parameter in order, may be given as
    the callable that makes them (DDP's ``GradBucket.gradients``, which makes
    new views at every call: about a tenth of the hook's own CPU a bucket),
    called at the first use: most steps of most buckets use none."""

    __slots__ = ("index", "buffer", "sig", "last", "_grads")

    def __init__(self, index: int, buffer: torch.Tensor,
                 grads: Union[List[torch.Tensor], Callable[[], Sequence[torch.Tensor]]], sig: Signature,
                 last: bool) -> None:
        self.index, self.buffer, self.sig, self.last, self._grads = index, buffer, sig, last, grads

    @property
    def grads(self) -> List[torch.Tensor]:
        if callable(self._grads):
            self._grads = list(self._grads())
        return self._grads


class ParamIndex:
    """Stable numbers for the parameters of one DDP model, assigned in the
    order the hook first sees them, frozen after the first complete step: a
    parameter seen after that belongs to another model."""

    def __init__(self) -> None:
        self._by_id: Dict[int, Tuple[Any, int]] = {}
        self._refs: List[Any] = []  # weak references, by number
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
        self._refs.append(self._by_id[id(p)][0])
        self.shapes.append(tuple(p.shape))
        return n

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the numbered parameters."""
        entry = self._by_id.get(id(p))
        return entry is not None and entry[0]() is p

    def param(self, n: int) -> Optional[torch.Tensor]:
        """The parameter numbered ``n`` (None once it is gone)."""
        return self._refs[n]() if 0 <= n < len(self._refs) else None

    def signature(self, params: Sequence[torch.Tensor]) -> Signature:
        return tuple(self.number(p) for p in params)


def from_grad_bucket(bucket, params: ParamIndex, buffer: torch.Tensor) -> Bucket:
    """The hook's Bucket of DDP's GradBucket ``bucket`` (``buffer``: its
    ``buffer()``, which the hook has read); its gradients' views made when
    first asked for."""
    return Bucket(bucket.index(), buffer, bucket.gradients, params.signature(bucket.parameters()), bucket.is_last())


class BucketStates(BucketDebts):
    def __init__(self) -> None:
        self.params = ParamIndex()
        self.residuals: Dict[str, torch.Tensor] = {}
        self.server_residuals: Dict[str, torch.Tensor] = {}
        self.lowrank_q: Dict[str, torch.Tensor] = {}
        self.momentum: Dict[str, torch.Tensor] = {}  # optimizer momentum per bucket (HookState.attach_optimizer)
        #: what an earlier plan's residuals still owe, added at the bucket's next reduction
        self.carry: Dict[str, torch.Tensor] = {}
        #: per carry handed to a reduction: the engine's carry-hold count at the start of that step
        self._carry_sent: Dict[str, int] = {}
        self._holds = 0  # the engine's carry-hold count at the start of this step
        #: the plan (wire format, hierarchical?) each bucket's residuals belong to
        self.plan_of: Dict[str, Tuple[str, bool]] = {}
        #: lowrank's layout of each bucket and the rank it was made at: (rank, layout)
        self.layouts: Dict[str, Tuple[int, torch.Tensor]] = {}
        #: a restored state's rank of each bucket's Q, until the bucket's first layout (lowrank_parts)
        self._q_ranks: Dict[str, int] = {}
        #: top-k under an attached Adam: (variance versions, its update's denominator), derived (not saved)
        self.denominators: Dict[str, Tuple[tuple, torch.Tensor]] = {}
        #: HookState.clip_grad_norm_'s sketch: each bucket's random signs (+-1.0), derived from its key (not saved)
        self.sketch_signs: Dict[str, torch.Tensor] = {}
        #: signatures of the buckets of the last complete step, in order
        self.step_layout: List[Signature] = []
        self._current: List[Signature] = []
        self.touched: set = set()
        self.prev_touched: set = set()
        #: a restored state's layout, replayed at the first steps that differ from it (DDP's initial buckets: one
        #: step, two under ``static_graph=True``, which rebuilds them in its third step's forward)
        self.replay_layout: Optional[List[Signature]] = None
        self.replays_left = 0
        self._saved_shapes: Optional[List[Tuple[int, ...]]] = None
        #: what a bucket of an earlier layout owed, per parameter number, until a bucket of this step adopts it
        self._loose: Dict[int, torch.Tensor] = {}
        #: buckets whose adoption found every earlier layout's owners released (BucketDebts.adopt): kept until a
        #: bucket sharing one of their parameters searches, a release or a load
        self._adopted: set = set()

    def state_dict(self) -> Dict[str, Any]:
        return {
            "param_shapes": [list(s) for s in self.params.shapes],
            "bucket_layout": [list(sig) for sig in self.step_layout],
            "residuals": {k: t.clone() for k, t in self.residuals.items()},
            "server_residuals": {k: t.clone() for k, t in self.server_residuals.items()},
            "lowrank_q": {k: t.clone() for k, t in self.lowrank_q.items()},
            "momentum": {k: t.clone() for k, t in self.momentum.items()},
            "carry": {k: t.clone() for k, t in self.carry.items()},
            "plans": {k: [m, h] for k, (m, h) in self.plan_of.items()},
            "lowrank_ranks": {k: r for k, (r, _) in self.layouts.items() if k in self.lowrank_q},
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """The first step after it meets the saved layout (replayed) whenever
        one was saved, whether or not a tensor was: a bucket with no state of
        its own (mode ``none``, a cast, auto's decisions) is then still summed
        as the saved run summed it, which on 3 or more ranks is what makes the
        resumed sum the straight run's to the bit (gloo's ring adds each value
        in an order set by its offset in the bucket)."""
        def restore(d):
            return {str(k): t.detach().clone().float().contiguous() for k, t in d.items()}

        self.residuals = restore(sd.get("residuals", {}))  # what sd lacks starts afresh
        self.server_residuals = restore(sd.get("server_residuals", {}))
        self.lowrank_q = restore(sd.get("lowrank_q", {}))
        self.momentum = restore(sd.get("momentum", {}))
        self.carry, self._carry_sent = restore(sd.get("carry", {})), {}
        self._loose, self._adopted = {}, set()
        self.plan_of = {str(k): (str(m), bool(h)) for k, (m, h) in sd.get("plans", {}).items()}
        self.layouts, self.denominators, self.sketch_signs = {}, {}, {}
        self._q_ranks = {str(k): int(r) for k, r in sd.get("lowrank_ranks", {}).items()}
        layout = [tuple(int(i) for i in sig) for sig in sd.get("bucket_layout", [])]
        self.step_layout = layout
        self.replay_layout, self.replays_left = layout or None, REPLAY_STEPS
        self._saved_shapes = [tuple(s) for s in sd.get("param_shapes", [])]
        # kept through the first steps of a resumed run
        self.prev_touched = set(self.residuals) | set(self.server_residuals) | set(self.lowrank_q) | \
            set(self.momentum) | set(self.carry)

    def saved_shapes(self) -> List[Tuple[int, ...]]:
        """The parameter shapes of the model a restored state was saved with
        ([] when none is to be checked)."""
        return list(self._saved_shapes or [])

    def check_saved_shapes(self) -> None:
        """After the first step numbered the parameters: they must be the ones
        the restored state was saved with."""
        saved, self._saved_shapes = self._saved_shapes, None
        if saved and saved != self.params.shapes:
            raise ValueError(
                f"hetcomm: the restored HookState was saved for a model with {len(saved)} parameters of shapes "
                f"{saved[:4]}..., this DDP model has {len(self.params.shapes)} of shapes {self.params.shapes[:4]}...: "
                "load the state saved with this model, or, where its trainable parameters changed (layers unfrozen "
                "or frozen), load_state_dict(sd, strict=False): the step count and warm-up carry on, error "
                "feedback starts afresh")

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

    def state_for(self, plan, key: str, numel: int, device: torch.device, *, error_feedback: bool, world: int,
                  rank: int, node_of: Sequence[int]):
        """(worker residual, server residual, carry) for a bucket reduced by
        ``plan`` (a :class:`hetcomm.plan.BucketPlan`). When the bucket's
        compressed plan changed, the old plan's residuals are folded into the
        carry first (placed where they belong in the bucket: they are parts of
        this rank's contribution to the sum) and dropped; lowrank's Q stays."""
        new = plan.state_class if error_feedback else None
        old = self.plan_of.get(key)
        if old is not None and plan.interim:
            self.touched.add(key)  # an exact step: the state waits for the next compressed one
        elif old is not None and old != new:
            self._fold(key, numel, old, device, world, rank, node_of)
        residual = server = None
        if new is not None:
            self.plan_of[key] = new
            self.touched.add(key)
            mode, hierarchical = new
            n, peers, me = numel, world, rank
            if hierarchical and mode != "lowrank":  # this rank's shard of the node's sum, across the nodes
                order = list(dict.fromkeys(node_of))
                n, peers, me = _C.hierarchical_shard_numel(numel, list(node_of), rank), len(order), \
                    order.index(node_of[rank])
            if mode == "lowrank" or (mode in ("onebit", "fp8", "int3") and not hierarchical):
                self._carry_into_residual(key, n, device)
            residual = self.residual(self.residuals, key, n, device)
            if mode in ("onebit", "fp8", "int3"):  # two-phase codecs: among three or more peers this rank sums a segment
                size = _C.server_residual_numel(n, peers, me)
                if size:
                    server = self.residual(self.server_residuals, key, size, device)
                elif key in self.server_residuals:  # restored from where two peers still encoded sums twice
                    off = _C.state_offsets(numel, world, rank, list(node_of) if hierarchical else [], hierarchical)[1]
                    self._owe(key, numel, self.server_residuals.pop(key), off, device)
        return residual, server, self._pending_carry(key, device)

    def _size(self, n: int) -> int:
        return math.prod(self.params.shapes[n])

    def _numel_of(self, sig: Signature) -> int:
        return sum(self._size(n) for n in sig)

    def _stores(self):
        return (self.residuals, self.server_residuals, self.lowrank_q, self.momentum, self.carry, self.plan_of,
                self.layouts, self.denominators, self.sketch_signs)

    def scale_error_feedback(self, factor_of: Callable[[Sequence[torch.Tensor]], Optional[float]]) -> int:
        """Multiplies what error feedback holds back for each bucket (worker
        and server residuals, carries) by ``factor_of(its parameters)``; None
        leaves the bucket's as it is. The compressed momentum and lowrank's Q
        are not error feedback and stay. Returns the buckets left as they were."""
        factors: Dict[str, Optional[float]] = {}
        for store in (self.residuals, self.server_residuals, self.carry):
            for key, t in store.items():
                if key not in factors:
                    factors[key] = factor_of([self.params.param(n) for n in sig_of(key)])
                if factors[key] is not None:
                    t.mul_(factors[key])
        return sum(f is None for f in factors.values())

    def scale_momentum(self, factor: float) -> None:
        """Multiplies every bucket's compressed momentum by ``factor``."""
        for t in self.momentum.values():
            t.mul_(factor)

    def begin_step(self, carry_holds: int) -> None:
        """Before the step's first bucket (the last step's reductions are done):
        the engine's count of reductions that held a carry back."""
        self._holds = carry_holds

    def _pending_carry(self, key: str, device: torch.device) -> Optional[torch.Tensor]:
        """The bucket's carry until a reduction has added it (and zeroed it).
        Whether it did is decided from what every rank saw alike: no reduction
        held a carry back since it was handed over (a non-finite step holds it
        on every rank). A carry's own contents differ between ranks (one may be
        all zero) and must not decide: the reducer's non-finite check runs only
        with a carry, so the ranks would run different collectives."""
        c = self.carry.get(key)
        if c is None:
            return None
        self.touched.add(key)
        if self._carry_sent.get(key) == self._holds:
            del self.carry[key]
            del self._carry_sent[key]
            return None
        if c.device != device:
            c = self.carry[key] = c.to(device)
        self._carry_sent[key] = self._holds
        return c

    def lowrank_parts(self, bucket: Bucket, key: str, rank: int) -> torch.Tensor:
        """int64 [k, 4] rows (offset, rows, cols, rank) of the bucket's tensors
        at ``rank``, cached per bucket; rank 0 = sent dense. Asked at another
        rank than before (lowrank's chosen rank, :class:`RankLadder`; auto's
        candidate after its first reading), the bucket's Q keeps its first
        columns, also when the rank was the saved state's."""
        cached = self.layouts.get(key)
        if cached is not None and cached[0] == rank:
            return cached[1]
        layout = matrix_layout(bucket, rank)
        saved = self._q_ranks.pop(key, rank)
        if cached is None and saved != rank:  # a resumed run whose first layout is at another rank than its Q
            cached = (saved, matrix_layout(bucket, saved))
        q = self.lowrank_q.get(key)
        if cached is not None and q is not None:
            self.lowrank_q[key] = q_at(q, cached[1], layout, key)
        self.layouts[key] = (rank, layout)
        return layout

    def lowrank_q_state(self, key: str, layout: torch.Tensor,
                        device: torch.device = torch.device("cpu")) -> torch.Tensor:
        self.touched.add(key)
        q = self.lowrank_q.get(key)
        n = _C.lowrank_q_numel(layout)
        if q is None or q.numel() != n:
            # The same random start on every rank (the key is the same everywhere), each matrix's Q
            # orthonormal, as every later step's (see LowrankStep::finish)
            q = torch.randn(n, generator=q_generator(key), dtype=torch.float32, device="cpu")
            _C.orthonormalize_blocks(q, q_blocks(layout), 0.0)
            q = self.lowrank_q[key] = q.to(device)
        elif q.device != device:  # restored from a checkpoint on another device
            q = self.lowrank_q[key] = q.to(device)
        return q

    def add_to_step(self, sig: Signature) -> None:
        self._current.append(sig)

    def end_step(self) -> None:
        self.params.frozen = True
        if self._loose:
            log.warning("hetcomm: what error feedback owed %d parameter(s) found no bucket in this step and is "
                        "dropped", len(self._loose))
            self._loose = {}
        self.step_layout, self._current = self._current, []
        # Drop per-bucket state of layouts not used in this step or the one before.
        keep = self.touched | self.prev_touched
        if self.touched:
            for store in (self.residuals, self.server_residuals, self.lowrank_q, self.momentum, self.carry,
                          self.plan_of, self.denominators, self.sketch_signs):
                for key in [k for k in store if k not in keep]:
                    del store[key]
        self.prev_touched, self.touched = self.touched, set()

