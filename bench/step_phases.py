"""Where a DDP step's time and CPU go, on the wide model (or another task of
``hetcomm bench train``), for one mode of ``hetcomm bench train``: per rank,
the median over steps SKIP.. of forward, backward (with the hook's wait),
optimizer, the whole step, hetcomm's codec and comm time
(``stats()["last_step"]``), this process's CPU time a step (all its
threads: gloo's, hetcomm's comm thread), and its minor page faults and
voluntary context switches a step (counts, not ms); then forward and
backward alone under ``no_sync`` (no hook). Then, as the mean a step over
steps SKIP.. from the kernel's per-thread clocks (/proc's schedstat), the CPU
time of the training thread (``main``), of hetcomm's comm thread (``comm_thr``),
of the process's other threads (``others``: gloo's), and how long its threads
waited, runnable, for a core (``runq``: where it is not small, the ranks
share too few cores and the step is bound by the CPU, whatever the link). With CLIP, every step clips
the gradient at that norm after backward (hetcomm's modes through
``HookState.clip_grad_norm_``, PyTorch's hooks through torch's), timed as
``clip``. MODE may also be a floor, no training mode: ``no-comm`` (each rank keeps its own gradient: the
step's compute when the ranks share the machine's cores) or ``barrier`` (that, and one float all-reduced a
step: the least a synchronised step costs; bench/README "The floor of a step"). OPTIM: ``hetcomm bench train``'s optimizer (sgd: SGD-momentum, the default; adamw), at the
task's learning rate for it. BUCKET_MB: DDP's ``bucket_cap_mb`` (PowerSGD's hook keeps one bucket, as
``bench train`` runs it; default: DDP's, a first bucket of 1 MB). Run once per rank under torch.distributed's env:// variables
(bench/README "What the testbed's step is made of", "The language model clipped, and
clipping's sum moves with the last bucket"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit -- \\
        python bench/step_phases.py lowrank-r4 [STEPS [TASK [SKIP [CLIP|- [OPTIM [BUCKET_MB]]]]]]
"""
import os
import resource
import statistics
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from hetcomm import _C
from hetcomm.benchmarks import tasks, train

COLUMNS = ("fwd", "bwd", "clip", "opt", "step", "codec", "comm", "cpu", "faults", "vcsw", "fwd_alone", "bwd_alone",
           "main", "comm_thr", "others", "runq")
COUNTS = (COLUMNS.index("faults"), COLUMNS.index("vcsw"))  # counts a step, not seconds
FLOORS = ("no-comm", "barrier")  # not modes: the step with no gradient exchanged, and with one float a step


def _counts(before) -> tuple:
    """Minor page faults and voluntary context switches since ``before``."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return now.ru_minflt - before.ru_minflt, now.ru_nvcsw - before.ru_nvcsw


def _thread_clocks() -> dict:
    """Per thread of this process: (name, ns on a core, ns runnable waiting for one)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run_ns, wait_ns = (int(v) for v in f.read().split()[:2])
        except (OSError, ValueError):  # a thread that ended while listed; a kernel without schedstat
            continue
        out[int(tid)] = (name, run_ns, wait_ns)
    return out


def _thread_split(before: dict, after: dict, steps: int) -> list:
    """ms a step: the main thread's CPU, the comm thread's, the others', all threads' run-queue wait."""
    main_tid, split = threading.get_native_id(), [0.0, 0.0, 0.0, 0.0]
    for tid, (name, run_ns, wait_ns) in after.items():
        _, run0, wait0 = before.get(tid, (name, 0, 0))
        col = 0 if tid == main_tid else 1 if name == _C.COMM_THREAD_NAME else 2
        split[col] += run_ns - run0
        split[3] += wait_ns - wait0
    return [v / 1e6 / max(steps, 1) for v in split]


def _floor_hook(barrier: bool, bucket):
    """The floors' hook: each rank keeps its own gradient (no communication); with ``barrier``, the last
    bucket of a step also all-reduces one float, so the ranks still meet once a step."""
    if barrier and bucket.is_last():
        dist.all_reduce(torch.zeros(1))
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _plans(st: dict) -> str:
    """Each bucket's mode and algorithm at the end, lowrank's rank and rounds."""
    out = ", ".join(f"{k}: {p['mode']}@{p['algorithm']}" for k, p in sorted(st.get("plans", {}).items()))
    rank = st.get("auto", {}).get("lowrank_rank", st.get("lowrank_rank"))
    if rank is not None:
        out += f"; lowrank's rank {rank}"
    if "lowrank_rounds" in st:
        out += f"; rounds {st['lowrank_rounds']}"
    return out


def main(mode_name: str, steps: int, task_name: str, skip: int, clip: Optional[float], optim: str = "sgd",
         bucket_mb: Optional[float] = None) -> None:
    dist.init_process_group("gloo")
    torch.set_flush_denormal(True)  # as every run of hetcomm bench train (common.denormals_flushed)
    rank, world = dist.get_rank(), dist.get_world_size()
    task = tasks.TASKS[task_name]()
    if mode_name in FLOORS:
        ddp = nn.parallel.DistributedDataParallel(task.model(), **({} if bucket_mb is None else
                                                                   {"bucket_cap_mb": bucket_mb}))
        opt = train.make_optimizer(optim, ddp.parameters(), train.task_lr(task, optim))
        ddp.register_comm_hook(mode_name == "barrier", _floor_hook)
        state = None
    else:  # as bench train runs it (PowerSGD: one bucket)
        _, ddp, opt, state, _ = train.setup(task, mode_name, optim, steps, rank, bucket_mb=bucket_mb)
    rows = []
    clocks = {}
    for step in range(steps):
        if step == skip:
            clocks = _thread_clocks()
        x, y = task.batch_for(step, rank)
        t0, c0, u0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        opt.zero_grad()
        loss = task.loss(ddp(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if clip is not None and state is not None:
            state.clip_grad_norm_(ddp.parameters(), clip)
        elif clip is not None:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
        tc = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        last = state.stats()["last_step"] if state is not None else {}
        rows.append((t1 - t0, t2 - t1, tc - t2, t3 - tc, t3 - t0, last.get("codec_s", 0.0), last.get("comm_s", 0.0),
                     time.process_time() - c0, *_counts(u0)))
    split = _thread_split(clocks, _thread_clocks(), steps - skip)
    alone = []
    with ddp.no_sync():
        for step in range(20):
            x, y = task.batch_for(step, rank)
            t0 = time.perf_counter()
            loss = task.loss(ddp(x), y)
            t1 = time.perf_counter()
            loss.backward()
            alone.append((t1 - t0, time.perf_counter() - t1))
    ms = [(1 if i in COUNTS else 1000) * statistics.median(r[i] for r in rows[skip:]) for i in range(len(rows[0]))]
    ms += [1000 * statistics.median(a[i] for a in alone) for i in range(2)]
    ms += split
    gathered = [torch.zeros(len(ms), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(ms, dtype=torch.float64))
    if rank == 0:
        clipped = f", clipped at {clip}" if clip is not None else ""
        print(f"{mode_name} on {task_name} with {optim}{clipped}, ms (faults, vcsw: counts) a step, median over steps "
              f"{skip}-{steps - 1} (main, comm_thr, others, runq: the mean)")
        print("rank " + " ".join(f"{c:>9}" for c in COLUMNS))
        for r, values in enumerate(gathered):
            print(f"{r:>4} " + " ".join(f"{v:9.2f}" for v in values.tolist()))
    if state is not None:
        if rank == 0:
            print("plans at the end:", _plans(state.stats()))
        state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], int(args[1]) if len(args) > 1 else 200, args[2] if len(args) > 2 else "wide",
         int(args[3]) if len(args) > 3 else 40, float(args[4]) if len(args) > 4 and args[4] != "-" else None,
         args[5] if len(args) > 5 else "sgd", float(args[6]) if len(args) > 6 else None)
