"""`hetcomm bench allreduce`: nccl-tests style. One row per size x algorithm x
wire format: time, algbw (bytes / time), busbw (algbw * 2(W-1)/W), #wrong
(elements that differ from the closed-form sum; -1 = lossy, not checked), and
the planner's predicted time next to the measured one. Run it on loopback or
inside the testbed (``hetcomm testbed ... -- hetcomm bench allreduce``).
``--device cuda``: one GPU per rank, hetcomm on its own NCCL communicator,
next to torch.distributed's NCCL all-reduce (algorithm "torch")."""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import _C, ops, planner, topology
from ..testbed import run_distributed
from . import common

ALGOS = list(topology.ALGORITHMS)
WIRES = ["none", "fp16", "onebit"]


def _one(t, x: torch.Tensor, algo: str, wire: str, topo: topology.Topology, state: Dict) -> None:
    """x (fp32) becomes the sum over ranks, by `algo` with the `wire` format."""
    order, nodes = topo.ring_order(), topo.node_ids
    if wire in ("fp16", "bf16"):
        h = ops.cast_encode(x, 1.0, "float16" if wire == "fp16" else "bfloat16")
        t.allreduce(h, algo, order=order if algo == "ring" else [], node_of=nodes)
        ops.cast_decode(h, 1.0, x)
    elif wire == "none":
        t.allreduce(x, algo, order=order if algo == "ring" else [], node_of=nodes)
    elif algo == "native":
        if wire == "onebit":
            t.allreduce_onebit(x, 1.0, 2048, state["w"], state["s"])
        else:
            t.allreduce_topk(x, 1.0, 0.01, True, state["w"])
    else:  # hierarchical, compressed across nodes
        t.allreduce(x, "hierarchical", node_of=nodes, inter=wire, residual=state["w"], server_residual=state["s"])


def _applicable(topo: topology.Topology, algo: str, wire: str) -> bool:
    if wire in ("onebit", "topk") and algo not in ("native", "hierarchical"):
        return False
    if algo == "hierarchical":
        per = topo.ranks_per_node()
        return bool(per) and topo.num_nodes > 1 and per > 1
    return True


def _transport(rank: int, world: int, device: torch.device):
    if device.type == "cuda":
        store = dist.distributed_c10d._get_default_store()
        return _C.NcclTransport(store, "hetcomm/bench/allreduce", rank, world, device.index, 600.0)
    return _C.ProcessGroupTransport(dist.group.WORLD)


def _worker(rank: int, world: int, sizes: List[int], algos: List[str], wires: List[str], iters: int, warmup: int,
            check: bool, device_type: str = "cpu") -> List[dict]:
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    topo = topology.detect(use_cache=False, device=device)  # a benchmark measures the links it runs on
    t = _transport(rank, world, device)
    rows = []
    for size in sizes:
        n = max(1, size // 4)
        base = torch.full((n,), float(rank + 1), device=device)
        expect = world * (world + 1) / 2
        for wire in wires:
            for algo in (["torch"] if device.type == "cuda" and wire == "none" else []) + algos:
                if not _applicable(topo, algo, wire):
                    continue
                if algo == "hierarchical" and wire in ("onebit", "topk"):
                    shard = _C.hierarchical_shard_numel(n, topo.node_ids, rank)
                    peers, me = topo.num_nodes, topo.node_ids[rank]
                else:
                    shard, peers, me = n, world, rank
                state = {"w": torch.zeros(shard, device=device),
                         "s": torch.zeros(ops.onebit_segment_numel(shard, peers, me), device=device)}

                def run(x):
                    if algo == "torch":
                        dist.all_reduce(x)
                    else:
                        _one(t, x, algo, wire, topo, state)

                x = base.clone()
                wrong = -1
                if check and wire != "topk":
                    run(x)
                    wrong = int((x != expect).sum())
                for _ in range(warmup):
                    x.copy_(base)
                    run(x)
                common.sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    x.copy_(base)
                    run(x)
                common.sync(device)
                elapsed = torch.tensor([(time.perf_counter() - t0) / iters], device=device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                wrong_t = torch.tensor([max(wrong, 0)], device=device)
                dist.all_reduce(wrong_t)
                sec = float(elapsed)
                algbw = size / sec / 1e9
                rows.append({"bytes": size, "algorithm": algo, "wire": wire, "time_us": sec * 1e6,
                             "algbw": algbw, "busbw": algbw * 2 * (world - 1) / world,
                             "wrong": int(wrong_t) if wrong >= 0 else -1,
                             "predicted_us": 0.0 if algo == "torch" else (planner.predict(
                                 topo, size, algo, "topk:0.01" if wire == "topk" else wire) or 0) * 1e6,
                             "planned": planner.plan(topo, size, "topk:0.01" if wire == "topk" else wire)["algorithm"]})
    return rows if rank == 0 else []


def main(sizes: List[int], algos: Optional[List[str]], wires: Optional[List[str]], iters: int, warmup: int,
         check: bool, ranks: int, json_path: Optional[str], device: str = "cpu") -> List[dict]:
    algos = algos or ALGOS
    wires = wires or WIRES
    for a in algos:
        if a not in ALGOS:
            raise SystemExit(f"hetcomm bench allreduce: unknown algorithm {a!r}; choose from {', '.join(ALGOS)}")
    for w in wires:
        if w not in ("none", "fp16", "bf16", "onebit", "topk"):
            raise SystemExit(f"hetcomm bench allreduce: unknown wire format {w!r}")
    results = run_distributed(_worker, ranks, sizes, algos, wires, iters, warmup, check, device,
                              backend="nccl" if device == "cuda" else "gloo")
    if results is None:  # a non-zero rank under torchrun / the testbed
        return []
    rows = results
    world = int(os.environ.get("WORLD_SIZE", ranks))
    print(f"# hetcomm bench allreduce: {world} ranks on {device}, {iters} iterations after {warmup} warm-up; "
          "busbw = algbw * 2(W-1)/W; #wrong -1 = lossy, not checked; planned = the planner's choice")
    common.print_table(rows, [("bytes", "size(B)", "d"), ("algorithm", "algorithm", "s"), ("wire", "wire", "s"),
                              ("time_us", "time(us)", ".1f"), ("algbw", "algbw(GB/s)", ".3f"),
                              ("busbw", "busbw(GB/s)", ".3f"), ("wrong", "#wrong", "d"),
                              ("predicted_us", "predicted(us)", ".1f"), ("planned", "planned", "s")])
    common.write_json(json_path, {"world": world, "rows": rows})
    return rows
