"""`hetcomm bench allreduce`: nccl-tests style. One row per size x algorithm x
wire format, printed as it finishes: time, algbw (bytes / time), busbw (algbw *
2(W-1)/W), the planner's predicted time next to the measured one, and with
``--check 1`` (the default) how right the result is. Every rank sums its own
random input (seeded, so each rank can rebuild all of them) and the result is
compared with a float64 sum of the same inputs:

- ``max_err``: max |result - exact| / max |exact| of one call. Dense wires are
  within rounding; fp8, 1-bit and top-k are lossy by design and show how lossy.
- ``#wrong``: elements outside the wire's bound. Dense wires: the floating-point
  bound of a W-term sum in the wire's precision, 2 W u sum_r |x_r| (u = 2^-24
  fp32, 2^-11 fp16, 2^-8 bf16). fp8, 1-bit and top-k: error feedback's invariant,
  checked over 3 calls from zero state: the results plus what every rank still
  holds in its residuals (worker and server, placed where they belong) equal
  3 x the exact sum within fp32 rounding. Nothing is lost, only delayed.

Run it on loopback or inside the testbed (``hetcomm testbed ... -- hetcomm bench allreduce``).
``--device cuda``: one GPU per rank, hetcomm on its own NCCL communicator,
next to torch.distributed's NCCL all-reduce (algorithm "torch")."""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _C, ops, options, planner, topology
from ..launch import run_distributed
from . import common

ALGOS = list(topology.ALGORITHMS)
WIRES = ["none", "fp16", "onebit"]
WIRE_CHOICES = ("none", "fp16", "bf16", "fp8", "int3", "onebit", "topk")  # every wire but lowrank (a DDP bucket's layout)


def reduce_once(t, x: torch.Tensor, algo: str, wire: str, topo: topology.Topology, state: Dict,
                topk_ratio: float = 0.01, pieces: int = 0) -> None:
    """x (fp32) becomes the sum over ranks, by `algo` with the `wire` format;
    a compressed wire's error feedback lives in ``state`` (:func:`wire_state`);
    ``pieces``: of the onebit / fp8 exchange, flat or across nodes (0: by the size)."""
    order, nodes = topo.ring_order(), topo.node_ids
    if wire in ("fp16", "bf16") and algo == "hierarchical":  # float32 inside the nodes, as HookState's buckets
        t.allreduce(x, algo, node_of=nodes, inter=wire)
    elif wire in ("fp16", "bf16"):
        h = ops.cast_encode(x, 1.0, "float16" if wire == "fp16" else "bfloat16")
        t.allreduce(h, algo, order=order if algo == "ring" else [], node_of=nodes)
        ops.cast_decode(h, 1.0, x)
    elif wire == "none":
        t.allreduce(x, algo, order=order if algo == "ring" else [], node_of=nodes)
    elif algo == "native":
        if wire == "onebit":
            t.allreduce_onebit(x, 1.0, options.chunk_for(None, wire), state["w"], state["s"], pieces=pieces)
        elif wire == "fp8":
            t.allreduce_fp8(x, 1.0, options.chunk_for(None, wire), state["w"], state["s"], pieces=pieces)
        elif wire == "int3":
            t.allreduce_int3(x, 1.0, options.chunk_for(None, wire), state["w"], state["s"], pieces=pieces)
        else:
            t.allreduce_topk(x, 1.0, topk_ratio, True, state["w"])
    else:  # hierarchical, compressed across nodes
        t.allreduce(x, "hierarchical", node_of=nodes, inter=wire, residual=state["w"], server_residual=state["s"],
                    chunk=options.chunk_for(None, wire), topk_ratio=topk_ratio, pieces=pieces)


def wire_state(n: int, algo: str, wire: str, topo: topology.Topology, rank: int, device: torch.device) -> Dict:
    """Zeroed error-feedback state of an n-element sum by `algo` and `wire`:
    the worker residual "w" (this rank's shard: across nodes, one node's) and
    the server residual "s" (this rank's segment of it)."""
    if algo == "hierarchical" and not planner.Wire.of(wire).dense:
        shard = _C.hierarchical_shard_numel(n, topo.node_ids, rank)
        peers, me = topo.num_nodes, topo.node_ids[rank]
    else:
        shard, peers, me = n, topo.world, rank
    return {"w": torch.zeros(shard, device=device),
            "s": torch.zeros(ops.server_residual_numel(shard, peers, me), device=device)}


def _transport(rank: int, world: int, device: torch.device):
    if device.type == "cuda":
        store = dist.distributed_c10d._get_default_store()
        return _C.NcclTransport(store, "hetcomm/bench/allreduce", rank, world, device.index, 600.0)
    return _C.ProcessGroupTransport(dist.group.WORLD)


CHECK_CALLS = 3  # calls from zero state in a compressed wire's invariant check
UNIT_ROUNDOFF = {"none": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
COLUMNS = [("bytes", "size(B)", "d"), ("algorithm", "algorithm", "s", 16), ("wire", "wire", "s"),
           ("pieces", "pieces", "s"),
           ("time_us", "time(us)", ".1f"), ("algbw_GBps", "algbw(GB/s)", ".3f"), ("busbw_GBps", "busbw(GB/s)", ".3f"),
           ("max_err", "max_err", ".2e"), ("wrong", "#wrong", "d"), ("predicted_us", "predicted(us)", ".1f"),
           ("planned", "planned", "s", 16)]


def _input(n: int, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s random input at message size ``size`` (seeded: any rank can rebuild it)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(size * 1009 + rank))


def _inputs(n: int, size: int, world: int, rank: int):
    """This rank's random input, the float64 sum of every rank's and the sum
    of their magnitudes (every rank's input rebuilt from its seed)."""
    exact = torch.zeros(n, dtype=torch.float64)
    magnitude = torch.zeros(n, dtype=torch.float64)
    mine = None
    for r in range(world):
        x = _input(n, size, r)
        exact += x
        magnitude += x.abs()
        if r == rank:
            mine = x
    return mine, exact, magnitude


def _state_sum(state: Dict, n: int, algo: str, topo: topology.Topology, rank: int, world: int,
               device: torch.device) -> torch.Tensor:
    """What all ranks' residuals (worker and server) still owe the sum, placed
    where they belong in it (float64, on the CPU)."""
    hierarchical = algo == "hierarchical"
    worker_off, server_off = _C.state_offsets(n, world, rank, list(topo.node_ids) if hierarchical else [],
                                              hierarchical)
    owed = torch.zeros(n, device=device)
    owed.narrow(0, worker_off, state["w"].numel()).add_(state["w"])
    owed.narrow(0, server_off, state["s"].numel()).add_(state["s"])
    dist.all_reduce(owed)
    return owed.double().cpu()


def _check(run, base: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, wire: str, state: Dict,
           owed) -> tuple:
    """(max_err of one call, #wrong) as the module's docstring defines them."""
    scale = float(exact.abs().max())
    x = base.clone()
    run(x)
    first = x.double().cpu()
    max_err = float((first - exact).abs().max()) / scale
    if wire in UNIT_ROUNDOFF:
        world = dist.get_world_size()
        bound = 2 * world * UNIT_ROUNDOFF[wire] * magnitude + world * 2.0 ** -24  # + fp16's subnormal spacing
        return max_err, int(((first - exact).abs() > bound).sum())
    delivered = first
    for _ in range(CHECK_CALLS - 1):
        x.copy_(base)
        run(x)
        delivered += x.double().cpu()
    gap = (delivered + owed() - CHECK_CALLS * exact).abs()
    return max_err, int((gap > 1e-5 * CHECK_CALLS * float(magnitude.max())).sum())


def _worker(rank: int, world: int, sizes: List[int], algos: List[str], wires: List[str], iters: int, warmup: int,
            check: bool, device_type: str = "cpu", pieces: Sequence[int] = (0,)) -> List[dict]:
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    topo = topology.detect(use_cache=False, device=device)  # a benchmark measures the links it runs on
    t = _transport(rank, world, device)
    table = common.Table(COLUMNS)
    if rank == 0:
        print(f"# hetcomm bench allreduce: {world} ranks on {device.type}, {iters} iterations after {warmup} "
              "warm-up; busbw = algbw * 2(W-1)/W; max_err = max |result - exact| / max |exact| of one call; "
              "#wrong = elements outside the wire's bound (-1: not checked); planned = the planner's choice",
              flush=True)
        table.header()
    rows = []
    for size in sizes:
        n = max(1, size // 4)
        if check:
            base, exact, magnitude = _inputs(n, size, world, rank)
            base = base.to(device)
        else:
            base = _input(n, size, rank).to(device)
        for wire in wires:
            for algo, piece in [(a, p) for a in (["torch"] if device.type == "cuda" and wire == "none" else []) + algos
                                for p in (pieces if a in ("native", "hierarchical") and wire in ("onebit", "fp8", "int3")
                                          else [None])]:
                if not planner.applies(topo, algo, wire):
                    continue
                state = wire_state(n, algo, wire, topo, rank, device)

                def run(x):
                    if algo == "torch":
                        dist.all_reduce(x)
                    else:
                        reduce_once(t, x, algo, wire, topo, state, pieces=piece or 0)

                max_err, wrong = float("nan"), -1
                if check:
                    max_err, wrong = _check(run, base, exact, magnitude, wire, state,
                                            lambda: _state_sum(state, n, algo, topo, rank, world, device))
                x = base.clone()
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
                sec = float(elapsed)
                algbw = size / sec / 1e9
                row = {"bytes": size, "algorithm": algo, "wire": wire,
                       "pieces": "-" if piece is None else str(piece or "auto"), "time_us": sec * 1e6,
                       "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (world - 1) / world,
                       "max_err": max_err, "wrong": wrong,
                       "predicted_us": 0.0 if algo == "torch" else (planner.predict(topo, size, algo, wire) or 0) * 1e6,
                       "planned": planner.plan(topo, size, wire)["algorithm"]}
                rows.append(row)
                if rank == 0:
                    table.row(row)
    topo_summary = {"nodes": topo.num_nodes, "node_of_rank": list(topo.node_ids), "source": topo.source}
    return (rows, topo_summary) if rank == 0 else ([], None)


def main(sizes: List[int], algos: Optional[List[str]], wires: Optional[List[str]], iters: int, warmup: int,
         check: bool, ranks: int, json_path: Optional[str], device: str = "cpu",
         png_path: Optional[str] = None, pieces: Sequence[int] = (0,)) -> List[dict]:
    algos = algos or ALGOS
    wires = wires or WIRES
    for a in algos:
        if a not in ALGOS:
            raise SystemExit(f"hetcomm bench allreduce: unknown algorithm {a!r}; choose from {', '.join(ALGOS)}")
    for w in wires:
        if w not in WIRE_CHOICES:
            raise SystemExit(f"hetcomm bench allreduce: unknown wire format {w!r}")
    results = run_distributed(_worker, ranks, sizes, algos, wires, iters, warmup, check, device, list(pieces),
                              backend="nccl" if device == "cuda" else "gloo")
    if results is None:  # a non-zero rank under torchrun / the testbed
        return []
    rows, topo_summary = results
    world = int(os.environ.get("WORLD_SIZE", ranks))
    # nccl-tests' footer
    print(f"# Out of bounds values : {sum(max(r['wrong'], 0) for r in rows)} "
          f"{'OK' if all(r['wrong'] <= 0 for r in rows) else 'FAILED'}" + ("" if check else " (not checked)"))
    print(f"# Avg bus bandwidth    : {sum(r['busbw_GBps'] for r in rows) / max(len(rows), 1):.4g} GB/s")
    common.write_json(json_path, {"rows": rows}, common.metadata(
        world, device=device, iters=iters, warmup=warmup, topology=topo_summary,
        units={"bytes": "B", "time_us": "microseconds", "algbw_GBps": "GB/s", "busbw_GBps": "GB/s",
               "max_err": "relative to max |exact sum|", "predicted_us": "microseconds"}))
    if png_path and plot(rows, png_path, world):
        print(f"# busbw vs size: {png_path}")
    return rows


def plot(rows: List[dict], path: str, world: int) -> bool:
    """busbw against message size, one line per algorithm and wire (matplotlib)."""
    plt = common.pyplot("bench allreduce")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    wires = list(dict.fromkeys(r["wire"] for r in rows))
    styles, markers = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))], "osD^v"
    for key in dict.fromkeys((r["algorithm"], r["wire"], r["pieces"]) for r in rows):  # colour: algorithm; line: wire
        pts = [r for r in rows if (r["algorithm"], r["wire"], r["pieces"]) == key]
        w = wires.index(key[1]) % len(styles)
        pieces = "" if key[2] == "-" else f" ({key[2]} pieces)"
        ax.plot([r["bytes"] for r in pts], [r["busbw_GBps"] for r in pts], color=f"C{algos.index(key[0]) % 10}",
                linestyle=styles[w], marker=markers[w], label=f"{key[0]} / {key[1]}{pieces}")
    ax.set_xscale("log", base=2)
    common.finish_axis(ax, f"hetcomm bench allreduce, {world} ranks", "message size (bytes of fp32)",
                       "bus bandwidth (GB/s)")
    return common.save_figure(plt, fig, path, dpi=120)
