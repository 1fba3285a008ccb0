"""Each MODE of `hetcomm bench train` (its hook and DDP's layout as `bench train` makes
them) for STEPS steps of TASK, the modes in turns and then in reverse, REPS
times: the mean and median ms a step of steps 40 on, and the plans each
hetcomm run ended on; with SEGMENTS (``A-B,C-D,...``) also each mode's ms a
step in each segment of steps, the mean over its runs of each run's mean
there (where a mode's start, readings and re-checks fall); run once per rank
under torch.distributed's env:// variables (bench/README "lowrank's rounds,
fixed for a run; a re-check's steps after a switch"; "The probe's large
message, repeated for its time; ...; what auto pays over int3, step by step"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit --sched batch -- \\
        python bench/modes_in_turns.py classify sgd 240 2 int3,int3@native,lowrank-r4,fp8,torch-powersgd
    ... -- python bench/modes_in_turns.py classify adamw 300 3 int3,auto 1-20,20-40,40-60,60-100,100-125,125-160
"""
import statistics
import sys

import torch
import torch.distributed as dist

from hetcomm.benchmarks import common, tasks, train

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_flush_denormal(True)  # as every run of hetcomm bench train (common.denormals_flushed)
    rank = dist.get_rank()
    task_name, optim, steps, reps, modes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5].split(",")
    segments = [tuple(int(x) for x in s.split("-")) for s in sys.argv[6].split(",")] if len(sys.argv) > 6 else []
    means = {m: [] for m in modes}
    times_of = {m: [] for m in modes}
    for mode in (modes + modes[::-1]) * reps:
        task = tasks.TASKS[task_name]()
        _, ddp, opt, state, _ = train.setup(task, mode, optim, steps, rank)
        times = common.timed_steps(ddp, opt, task, rank, steps)
        means[mode].append(1000 * statistics.mean(times[40:]))
        times_of[mode].append(times)
        if rank == 0:
            st = state.stats() if state else {}
            plans = {k: (p["mode"], p["algorithm"]) for k, p in st["plans"].items()} if state else ""
            total = st.get("total", {})
            sent = (f" sent {total['bytes_sent'] / steps / 1e3:.1f} KB a step, across nodes "
                    f"{total['bytes_sent_across_nodes'] / steps / 1e3:.1f}") if state else ""
            wire = f" lowrank_wire {st['lowrank_wire']}" if "lowrank_wire" in st else ""
            print(f"{mode}: mean {means[mode][-1]:.2f} median {1000 * statistics.median(times[40:]):.2f} ms{sent} "
                  f"{plans}{wire}", flush=True)
        if state is not None:
            state.close()
    if rank == 0:
        for m, v in means.items():
            print(f"{m:24s} mean of the runs' means {statistics.mean(v):.2f} ms  (runs: {[round(x, 2) for x in v]})")
        for m, runs in times_of.items():
            if segments:
                print(f"{m:24s} ms a step in steps " + common.segment_ms(runs, segments))
    dist.destroy_process_group()
