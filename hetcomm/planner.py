"""How to reduce over the measured cluster: a cost model per algorithm and
wire format (time = alpha * messages + bytes * beta per stage, as in NCCL's
tuning and Thakur/Rabenseifner/Gropp) and :func:`plan`, a pure function
(topology, bucket bytes, wire format) -> the algorithm predicted to finish
first, with every alternative's prediction. ``HETCOMM_ALGO`` forces one."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import List, Optional, Union

from .topology import ALGORITHMS, ENV_ALGO, WIRE_BYTES, LinkClass, Topology

WIRES = ("none", "fp16", "bf16", "fp8", "int3", "onebit", "topk", "lowrank")
_DEFAULT_FRACTION = {"topk": 0.01, "lowrank": 0.1}

#: Elements per scale of the onebit, fp8 and int3 codecs when HookState's
#: chunk_size is None. A scale follows its chunk (fp8: the largest value,
#: onebit: the mean magnitude), so a long chunk gives its small values few
#: bits (fp8) or a scale far from their own (onebit). fp8 with 2048: the
#: 4-rank language model (SGD-momentum) blew up at its loss drop in 2 of 2
#: seeds, with 256 it reached fp32's perplexity in both (4 bytes per 256
#: values: 1.6 % more than its codes). onebit of SGD's momentum on the
#: regression task over 15 runs (5 seeds x lr x 1, 1 +- 1e-6): MSE +3.5 % of
#: fp32's with 256 (a miss; the tolerance is 2 %), +1.2-1.5 % with 64, +0.3-0.5 %
#: with 32 (float32 scales; +0.18 % with bf16 ones); the language model within
#: tolerance at each, digits at its edge at 32 and 256 alike (-0.49 / -0.62
#: points over 30 runs; bench/README.md). onebit's scales travel as bf16
#: (kernels/codec_math.h), so 32 costs 1/16 byte per element: half again
#: onebit's signs.
#: int3's scale is its chunk's largest magnitude over 3, in bf16 as onebit's: at
#: 32 (an eighth of fp8's chunk), 3.5 bits an element in all. At 128 (3.125
#: bits) the 4-rank regression with AdamW ended +3.5 % over fp32's MSE (0 of 3
#: seeds within; +1.2 % at 32) and digits with AdamW reached on 6 of 10 seeds (9
#: at 32; bench/README "Fewer bits on the LSTM with AdamW across nodes").
DEFAULT_CHUNK = {"onebit": 32, "fp8": 256, "int3": 32}
#: Bytes per element on the wire of the two-phase codecs, without the scales,
#: and bytes per scale.
_CODE_BYTES = {"onebit": 1 / 8, "fp8": 1.0, "int3": 3 / 8}
_SCALE_BYTES = {"onebit": 2, "fp8": 4, "int3": 2}


def wire_bytes_per_element(kind: str, chunk: Optional[int] = None) -> float:
    """What one fp32 element of a two-phase codec (onebit, fp8, int3) costs on the
    wire, its chunk's scale included (``chunk`` None: the codec's default)."""
    return _CODE_BYTES[kind] + _SCALE_BYTES[kind] / (chunk or DEFAULT_CHUNK[kind])


def topk_message_bytes(n_elems: float, fraction: float) -> float:
    """What one rank's top-k message of a bucket of ``n_elems`` costs
    (csrc/collectives/compressed.h): 4 bytes an entry (a 16-bit index inside
    its block of 2^16 elements, a bf16 value; 6 at ratio 1, float32 values),
    a 4-byte count per block and the total's."""
    k = min(math.ceil(fraction * n_elems), math.ceil(n_elems))
    value = 2 if k < n_elems else 4  # every value sent (ratio 1): float32, lossless
    return 4 + 4 * max(1, math.ceil(n_elems / 2 ** 16)) + 4 * math.ceil(k / 2) + value * k


@dataclass(frozen=True)
class Wire:
    """What a bucket's fp32 elements become on the wire. ``fraction``: for
    top-k the share of elements sent, for low-rank the share of the bucket's
    fp32 elements that P, Q and the dense parts make up. Written as text
    ``kind`` or ``kind:fraction`` (``"topk:0.01"``, ``"lowrank:0.1234"``)."""
    kind: str
    fraction: Optional[float] = None

    @staticmethod
    def of(wire: Union[str, "Wire"]) -> "Wire":
        if isinstance(wire, Wire):
            return wire
        kind, sep, frac = str(wire).partition(":")
        try:
            fraction = float(frac) if sep else _DEFAULT_FRACTION.get(kind)
        except ValueError:
            fraction = None
        if kind not in WIRES or (sep and (kind not in _DEFAULT_FRACTION or fraction is None or not 0 < fraction <= 1)):
            raise ValueError(f"unknown wire format {wire!r}: one of {', '.join(WIRES)} (topk and lowrank may add "
                             "':<fraction in (0, 1]>')")
        return Wire(kind, fraction)

    @property
    def dense(self) -> bool:
        """Every element sent (fp32 or a 16-bit cast): any algorithm carries it."""
        return self.kind in WIRE_BYTES

    def __str__(self) -> str:
        return self.kind if self.fraction is None else f"{self.kind}:{self.fraction:.4g}"


@dataclass(frozen=True)
class Algorithm:
    """One way to compute the sum (csrc/collectives/algorithms.h)."""
    name: str
    compressed: bool  # also carries the compressed wires (their error feedback runs flat or across nodes only)
    across_nodes: bool  # needs several nodes with the same number of ranks

    def applies(self, topo: Topology, wire: Wire) -> bool:
        if not wire.dense and not self.compressed:
            return False
        if self.across_nodes:
            per_node = topo.ranks_per_node()
            # one rank per node: a dense hierarchical sum is the flat one; a compressed one still compresses
            return bool(per_node) and topo.num_nodes > 1 and (per_node > 1 or not wire.dense)
        return True


#: The algorithms, in the order ties are broken.
ALGORITHM_TABLE = {a.name: a for a in (Algorithm("native", True, False), Algorithm("ring", False, False),
                                       Algorithm("halving_doubling", False, False), Algorithm("tree", False, False),
                                       Algorithm("hierarchical", True, True))}
assert tuple(ALGORITHM_TABLE) == ALGORITHMS


def applies(topo: Topology, algorithm: str, wire: Union[str, Wire]) -> bool:
    """Whether ``algorithm`` can carry ``wire`` on ``topo``."""
    if algorithm not in ALGORITHM_TABLE:
        raise ValueError(f"unknown algorithm {algorithm!r}: one of {', '.join(ALGORITHMS)}")
    return ALGORITHM_TABLE[algorithm].applies(topo, Wire.of(wire))


def carries(algorithm: str, wire: Union[str, Wire]) -> bool:
    """Whether ``algorithm`` can carry ``wire`` at all (whatever the topology)."""
    return Wire.of(wire).dense or ALGORITHM_TABLE[algorithm].compressed


def _stage(link: LinkClass, messages: float, nbytes: float) -> float:
    return link.alpha * messages + nbytes * link.beta


def predict(topo: Topology, nbytes: float, algorithm: str, wire: Union[str, Wire] = "none") -> Optional[float]:
    """Predicted seconds for one all-reduce of an fp32 bucket of ``nbytes``
    sent as ``wire`` (None: the algorithm does not apply)."""
    wire = Wire.of(wire)
    if not applies(topo, algorithm, wire):
        return None
    if topo.world == 1:
        return 0.0
    if wire.kind == "lowrank":
        return _predict_lowrank(topo, nbytes, algorithm, wire.fraction)
    if wire.dense:
        codec = 2 * nbytes / (topo.codec_gbps * 1e9 * 4) if wire.kind != "none" else 0.0  # casts: ~4x the 1-bit codec
        if algorithm == "hierarchical" and wire.kind != "none":  # each rank casts its shard of the node's sum
            return codec / (topo.ranks_per_node() or 1) + _hierarchical(topo, nbytes, nbytes / 4 * WIRE_BYTES[wire.kind])
        return codec + _DENSE_COST[algorithm](topo, nbytes / 4 * WIRE_BYTES[wire.kind])
    codec = 3 * nbytes / (topo.codec_gbps * 1e9)
    return _predict_compressed(topo, nbytes / 4, algorithm, wire, codec)


def _share(topo: Topology) -> int:
    """Flows on one inter-node link when every rank of a node crosses at once."""
    return (topo.ranks_per_node() or 1) if topo.num_nodes > 1 else 1


def _links(topo: Topology):
    worst = topo.worst()
    return worst, topo.links.get("intra", worst), topo.links.get("inter", worst)


def _ring(topo: Topology, b: float) -> float:
    # 2(W-1) steps of b/W bytes; every step waits for the slowest link on the ring
    w = topo.world
    return _stage(topo.worst(), 2 * (w - 1), 2 * (w - 1) / w * b)


def _ring_messages(ranks: int) -> int:
    """Rounds of hetcomm's exact ring over ``ranks``: 2(W-1), but one on two
    ranks (``allreduce_pair``: the whole vector exchanged once, the same bytes)."""
    return 1 if ranks == 2 else 2 * (ranks - 1)


def _own_ring(topo: Topology, b: float) -> float:
    w = topo.world
    return _stage(topo.worst(), _ring_messages(w), 2 * (w - 1) / w * b)


def _halving_doubling(topo: Topology, b: float) -> float:
    w, share = topo.world, _share(topo)
    p = 2 ** int(math.log2(w))
    t, mask = 0.0, p // 2
    while mask >= 1:
        crosses = topo.nodes[0] != topo.nodes[min(mask, w - 1)]
        t += 2 * _stage(topo.link(0, min(mask, w - 1)), 1, b * mask / p * (share if crosses else 1))
        mask //= 2
    if p != w:
        t += 2 * _stage(topo.worst(), 1, b)
    return t


def _tree(topo: Topology, b: float) -> float:
    return 2 * math.ceil(math.log2(topo.world)) * _stage(topo.worst(), 1, b)


def _hierarchical(topo: Topology, b: float, cast: Optional[float] = None) -> float:
    """b bytes reduce-scattered inside each node, summed across the nodes and
    gathered back; with ``cast`` (a 16-bit cast's bytes) only the reduce-scatter
    moves b, the sum across and the all-gather ``cast``."""
    per_node, nodes = topo.ranks_per_node(), topo.num_nodes
    _, intra, inter = _links(topo)
    small = b if cast is None else cast
    local = _stage(intra, per_node - 1, (per_node - 1) / per_node * b) + \
        _stage(intra, per_node - 1, (per_node - 1) / per_node * small)
    return local + _stage(inter, _ring_messages(nodes), 2 * (nodes - 1) / nodes * small / per_node * _share(topo))


#: The cost of each algorithm's dense all-reduce of b wire bytes ("native":
#: the backend's own ring).
_DENSE_COST = {"native": _ring, "ring": _own_ring, "halving_doubling": _halving_doubling, "tree": _tree,
               "hierarchical": _hierarchical}


def _predict_compressed(topo: Topology, n_elems: float, algorithm: str, wire: Wire, codec: float) -> float:
    """fp8 / int3 / onebit / topk: flat, or exact inside nodes and compressed across them."""
    share = _share(topo)

    def compressed_allreduce(ranks: int, elems: float, link: LinkClass) -> float:
        if wire.kind in _CODE_BYTES:  # all-to-all + all-gather of 1/32 (1/4) of the data, plus the scales
            per_elem = wire_bytes_per_element(wire.kind)  # (on two ranks one exchange of the whole message)
            return (_ring_messages(ranks) * link.alpha
                    + share * 2 * (ranks - 1) / ranks * elems * per_elem * link.beta)
        return (ranks - 1) * (link.alpha + share * topk_message_bytes(elems, wire.fraction) * link.beta)

    worst, intra, inter = _links(topo)
    if algorithm == "native":
        return codec + compressed_allreduce(topo.world, n_elems, worst)
    per_node = topo.ranks_per_node()
    local = 2 * _stage(intra, per_node - 1, (per_node - 1) / per_node * n_elems * 4)
    return codec / per_node + local + compressed_allreduce(topo.num_nodes, n_elems / per_node, inter)


def _predict_lowrank(topo: Topology, nbytes: float, algorithm: str, frac: float) -> float:
    """Two all-reduces (P with the dense parts, then Q) carrying `frac` of the
    bucket's bytes in all, each a ring (native) or an exact hierarchical sum
    of those factors (hierarchical: the matrices themselves never travel)."""
    sent = frac * nbytes
    if algorithm == "native":
        return 2 * _ring(topo, sent / 2)
    return 2 * _hierarchical(topo, sent / 2)


_FROM_ENV = object()


def plan(topo: Topology, nbytes: float, wire: Union[str, Wire] = "none", allowed: Optional[List[str]] = None,
         forced=_FROM_ENV) -> dict:
    """The algorithm predicted fastest for a bucket, with every prediction.
    ``forced`` (default: HETCOMM_ALGO) forces one, where it applies."""
    predictions = {a: predict(topo, nbytes, a, wire) for a in (allowed or ALGORITHMS)}
    predictions = {a: t for a, t in predictions.items() if t is not None}
    if forced is _FROM_ENV:
        forced = os.environ.get(ENV_ALGO)
    if forced:
        if forced not in ALGORITHMS:
            raise ValueError(f"{ENV_ALGO} must be one of {ALGORITHMS}, got {forced!r}")
        if forced in predictions:
            return {"algorithm": forced, "wire": str(wire), "predicted_s": predictions, "forced": True}
    best = min(predictions, key=lambda a: (predictions[a], ALGORITHMS.index(a)))
    return {"algorithm": best, "wire": str(wire), "predicted_s": predictions, "forced": False}


def plan_table(topo: Topology, wires: List[str], sizes: Optional[List[int]] = None) -> List[dict]:
    sizes = sizes or [2 ** k for k in range(12, 29, 2)]
    return [dict(plan(topo, s, w), bytes=s) for w in wires for s in sizes]


def describe(topo: Topology, wires: Optional[List[str]] = None) -> str:
    lines = [f"ranks {topo.world}, nodes {topo.num_nodes} ({topo.source}); 1-bit codec {topo.codec_gbps:.1f} GB/s"]
    for r, (n, d) in enumerate(zip(topo.nodes, topo.devices)):
        mem = f"{d['memory_gb']:.0f} GiB" if d.get("memory_gb") else "?"
        lines.append(f"  rank {r}: node {n}  device {d.get('model')}  memory {mem}  capability {d.get('capability')}")
    for cls, l in topo.links.items():
        lines.append(f"  link {cls:<5}: alpha {l.alpha * 1e6:9.1f} us  beta {1 / l.beta / 1e9:8.3f} GB/s  ({l.pairs} pairs)")
    lines.append(f"{'bytes':>12}  {'wire':<8} {'plan':<17} " + "  ".join(f"{a:>16}" for a in ALGORITHMS))
    for row in plan_table(topo, wires or ["none", "onebit"]):
        preds = "  ".join(f"{row['predicted_s'][a] * 1e3:13.3f} ms" if a in row["predicted_s"] else f"{'-':>16}"
                          for a in ALGORITHMS)
        lines.append(f"{row['bytes']:>12}  {row['wire']:<8} {row['algorithm']:<17} {preds}")
    return "\n".join(lines)
