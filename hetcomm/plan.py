"""Per-bucket plans: what each bucket sends, how, and why, decided in one place.

A :class:`BucketPlan` is the whole decision for one bucket in one step (wire
format, algorithm, whether the step runs exactly while the bucket's compressed
state waits). :class:`Planner` makes it: for a fixed ``compression`` from the
options and the cost model of :mod:`hetcomm.planner`; for
``compression="auto"`` :class:`hetcomm.autoplan.AutoPlanner`.

A bucket's error-feedback state belongs to the plan that made it: when a
bucket's compressed plan changes, what its residuals still owe is folded into
a *carry* that the next step's reduction adds (see
:meth:`hetcomm.buckets.BucketStates.state_for`), so nothing is dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from . import planner

log = logging.getLogger("hetcomm")

DENSE = ("none", "fp16", "bf16")
COMPRESSED = ("fp8", "int3", "onebit", "topk", "lowrank")
AUTO_MODES = DENSE + COMPRESSED
# DDP rebuilds its buckets in step 1's forward (static_graph=True: step 2's): auto's trial starts at step 1 at the
# earliest, and starts again in buckets rebuilt after it began (AutoPlanner._drop_replaced); what error feedback owed
# the old buckets is adopted by the new (BucketStates.adopt)
MIN_START_ITER = 1
WARMUP_FROM = 2  # attach_optimizer's warm-up in fp8 from step 2 (step 1 exact), as every warm-up was measured


@dataclass(frozen=True)
class BucketPlan:
    """One bucket's reduction in one step."""
    mode: str            # wire format this step: none, fp16, bf16, fp8, int3, onebit, topk, lowrank
    algorithm: str       # native, ring, halving_doubling, tree, hierarchical
    why: str             # fixed, across nodes, predicted, HETCOMM_ALGO, trial, measured, warm-up, exact step, small bucket
    interim: bool = False  # an exact step of a compressed bucket: its error-feedback state waits, untouched
    predicted_s: Optional[float] = None

    @property
    def compressed(self) -> bool:
        return self.mode in COMPRESSED

    @property
    def warmup(self) -> bool:
        """A warm-up step through attach_optimizer's warmup_compression: the
        gradient compressed, not the momentum."""
        return self.why == "warm-up" and self.compressed

    @property
    def state_class(self) -> Optional[Tuple[str, bool]]:
        """What shape the bucket's error-feedback state has under this plan."""
        return (self.mode, self.algorithm == "hierarchical") if self.compressed else None


def wire_of(mode: str, topk_ratio: float, lowrank_fraction: Optional[float] = None) -> planner.Wire:
    """The cost model's wire format of a mode."""
    if mode == "topk":
        return planner.Wire("topk", topk_ratio)
    if mode == "lowrank":
        return planner.Wire("lowrank", round(lowrank_fraction, 4))
    return planner.Wire(mode)


#: ``pack=None`` packs fp8 and int3 across nodes whose link is slower than this, or unmeasured. zstd level 1 took
#: int3's 422 KB a step of the wide MLP to 0.64-0.68x in 0.8-0.9 ms on a 2-core Xeon, 0.3-0.4 ms to undo: a third
#: of the bytes saved pays for the host's time below about 0.9 Gbit/s. On the testbed at 100 Mbit (bench/README
#: "int3's messages packed", "fp8's messages packed", "The testbed's burst"): packed int3 took 0.84x raw int3's
#: step on digits with a rank a node; with two a node (the hierarchy's shards across the link, 0.88x the bytes)
#: 1.01x and 0.92x (SGD-m, AdamW) on a link of 1 ms of burst, 1.10-1.12x under the old 4 ms one, whose free 50 KB
#: a step hid the bytes saved; packed fp8 took 0.36-0.45x raw fp8's step on digits with a rank a node, 0.73-0.91x
#: with two (0.62x its bytes across), 0.90x on the wide MLP, and the LSTM's (0.93x the bytes) within its noise.
PACK_BELOW_GBIT = 0.5
#: the codecs whose messages can be packed (collectives/packing.h)
PACKABLE = ("onebit", "fp8", "int3")


def _host_nodes_link_gbit(topo) -> Tuple[bool, Optional[float]]:
    """What the wire rules below read of topology ``topo``: whether it has
    several nodes with every rank on the host (GPU buckets: not measured),
    and the link between the nodes in Gbit/s as measured (None: unmeasured)."""
    if topo is None or topo.num_nodes < 2:
        return False, None
    if not all(str(d.get("model", "")).startswith("cpu") for d in topo.devices):
        return False, None
    inter = topo.links.get("inter")
    return True, (8e-9 / inter.beta if inter is not None and inter.beta > 0 else None)


def packed_by_default(topo) -> Tuple[str, ...]:
    """The modes ``pack=None`` packs on topology ``topo``, read once when it is
    known (the same on every rank): fp8 and int3 on several nodes, every rank
    on the host, a link between them under :data:`PACK_BELOW_GBIT` or
    unmeasured."""
    host_nodes, gbit = _host_nodes_link_gbit(topo)
    if not host_nodes or (gbit is not None and gbit >= PACK_BELOW_GBIT):
        return ()
    return ("fp8", "int3")


def packs(s, p: BucketPlan) -> bool:
    """Whether bucket plan ``p``'s messages travel zstd-packed under HookState
    ``s``'s ``pack``; decided from what every rank knows alike (the option,
    the plan, and ``s._packed_modes``: :func:`packed_by_default` of its
    topology), so the ranks agree."""
    if p.mode not in PACKABLE or s.pack is False:
        return False
    return bool(s.pack) or p.mode in s._packed_modes


#: ``lowrank_wire=None`` sends lowrank's factors in fp8 across a link between nodes measured under this many
#: Mbit/s (bf16 elsewhere). On the 2 x 2 testbed (bench/README "lowrank's factors in fp8 across a slow link") fp8's
#: step was 0.53-0.69x bf16's at 10 Mbit, 0.72-0.87x at 30, 0.77-0.89x at 50 and 1.0-1.06x at 100 (digits, the wide
#: model), where bf16's bytes a round fit in the link's burst and fp8's codec and float32 intra-node sums cost CPU;
#: its steps to fp32's accuracy were bf16's on digits and the regression and up to about a tenth more on the wide
#: model: so fp8 where its step wins by more than that (30 Mbit and below), not at 50.
FP8_FACTORS_BELOW_MBIT = 40.0


def lowrank_wire_by_default(topo) -> str:
    """The wire ``lowrank_wire=None`` gives lowrank's factors on topology
    ``topo``, read once when it is known (the same on every rank): fp8 on
    several nodes, every rank on the host, whose link between them measured
    under :data:`FP8_FACTORS_BELOW_MBIT` (compression="auto" measures it; a
    fixed mode's topology leaves it unmeasured); bf16 otherwise."""
    host_nodes, gbit = _host_nodes_link_gbit(topo)
    return "fp8" if host_nodes and gbit is not None and 1000 * gbit < FP8_FACTORS_BELOW_MBIT else "bf16"


def lowrank_wire_of(s) -> str:
    """The wire of HookState ``s``'s lowrank factors: the option, else its
    rule on the topology (:func:`lowrank_wire_by_default`)."""
    return s.lowrank_wire or s._lowrank_wire_default


#: the bytes a factor's element costs on lowrank's wire, over float32's (fp8: a byte and a float32 scale per 256)
LOWRANK_WIRE_SHARE = {"fp32": 1.0, "bf16": 0.5, "fp8": (1 + 4 / 256) / 4}


def lowrank_fraction(layout, numel: int, wire: str = "fp32") -> float:
    """The fraction of a bucket's fp32 bytes that lowrank's P, Q and dense parts
    carry (``wire``: HookState's ``lowrank_wire``; bf16 sends half the bytes,
    fp8 about a quarter)."""
    elements = sum((rows + cols) * k if k else rows * cols for _, rows, cols, k in layout.tolist())
    return elements * LOWRANK_WIRE_SHARE[wire] / max(numel, 1)


class Planner:
    """Decides every bucket's :class:`BucketPlan` for one HookState."""

    def __init__(self, state) -> None:
        from .autoplan import AutoPlanner  # (it builds on this module)

        self.s = state
        self._algo: Dict[Tuple[int, str], Tuple[str, Optional[float]]] = {}
        self.auto = AutoPlanner(self)  # compression="auto"

    # ---- fixed modes -------------------------------------------------------------
    def algorithm(self, numel: int, wire: planner.Wire) -> Tuple[str, str, Optional[float]]:
        """(algorithm, why, predicted seconds) for a bucket of ``numel`` fp32
        elements sent as ``wire``: the option, or the cost model's choice."""
        s = self.s
        if s.algorithm != "auto":
            if s._across_nodes and (not wire.dense or numel >= s.min_compress_numel):
                # the default for a compressed mode or a 16-bit cast on several nodes, a compressed mode's dense
                # steps of the buckets it compresses too (an attached Adam's exact steps, an exact warm-up): gloo's
                # ring puts 1.5x the bucket on each way of the link between two nodes of two ranks, the hierarchy 1x
                # (the LSTM's fp32 step on the 2 x 2 testbed at 100 Mbit 118-126 ms against 156-160). A small
                # bucket stays on the group's own.
                return "hierarchical", "across nodes", None
            if not planner.carries(s.algorithm, wire):
                return "native", "fixed", None  # the codecs run flat or across nodes only
            return s.algorithm, "fixed", None
        key = (numel, str(wire))
        if key not in self._algo:
            choice = planner.plan(s.topology, numel * 4, wire, forced=s._forced_algo)
            predicted = (choice.get("predicted_s") or {}).get(choice["algorithm"])
            self._algo[key] = (choice["algorithm"], predicted)
            log.info("hetcomm: plan for %d-element buckets, wire %s: %s%s%s", numel, wire, choice["algorithm"],
                     " (HETCOMM_ALGO)" if s._forced_algo else "",
                     f", predicted {1000 * predicted:.3g} ms" if isinstance(predicted, float) else "")
        algo, predicted = self._algo[key]
        return algo, "HETCOMM_ALGO" if s._forced_algo else "predicted", predicted

    def plan(self, numel: int, key: str, index: int, step: int, layout_of) -> BucketPlan:
        """The plan of one bucket (``index`` in this step, state key ``key``,
        ``step`` its parameters' own step: hetcomm.own_steps).
        ``layout_of()`` gives lowrank's layout of the bucket (``layout_of(r)``: at rank r)."""
        s = self.s
        mode = s.resolved_compression
        if mode in DENSE:
            return self._dense(numel, mode, "fixed")
        if numel < s.min_compress_numel:
            return self._dense(numel, "none", "small bucket")
        at = self.schedule(step)
        if at == "w":
            wire = s._warmup_compression
            algo, _, predicted = self.algorithm(numel, self._wire(wire, numel, layout_of))
            return BucketPlan(wire, algo, "warm-up", predicted_s=predicted)
        if at == "x":
            return self._dense(numel, "none", "warm-up" if step < s.start_iter else "exact step", interim=True)
        if mode == "auto":
            return self.auto.plan(numel, key, index, layout_of)
        algo, why, predicted = self.algorithm(numel, self._wire(mode, numel, layout_of))
        return BucketPlan(mode, algo, why, predicted_s=predicted)

    def schedule(self, step: int) -> str:
        """What the schedule makes of a compressed bucket at (its own) step
        ``step``: "c" compressed, "w" the warm-up's wire, "x" exact."""
        s = self.s
        if s._compressed_at(step):
            return "c"
        return "w" if WARMUP_FROM <= step < s.start_iter and s._warmup_compression != "none" else "x"

    def _wire(self, mode: str, numel: int, layout_of) -> planner.Wire:
        fraction = lowrank_fraction(layout_of(), numel, lowrank_wire_of(self.s)) if mode == "lowrank" else None
        return wire_of(mode, self.s.topk_ratio, fraction)

    def _dense(self, numel: int, mode: str, why: str, interim: bool = False) -> BucketPlan:
        algo, how, predicted = self.algorithm(numel, planner.Wire(mode))
        return BucketPlan(mode, algo, why if why != "fixed" else how, interim, predicted)
