"""What a reading of lowrank's share costs a step under ``compression="auto"``:
TASK with OPTIM (``hetcomm bench train``'s, at the task's rate) for STEPS
steps, REPS fresh runs; rank 0 prints the mean ms of the guard's reading
steps from step 35 on (``LowrankShare.due``) and of the 1-4 steps after each
that read nothing, and their difference. Run once per rank under
torch.distributed's env:// variables (bench/README "The guard's reading
during the exchange"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit --sched batch -- \\
        python bench/reading_steps.py rnn adamw 230 2
"""
import statistics
import sys

import torch.distributed as dist

from hetcomm import lowrank_share
from hetcomm.benchmarks import common, tasks, train

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    task_name, optim, steps, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    reading, after = [], []
    for _ in range(reps):
        task = tasks.TASKS[task_name]()
        _, ddp, opt, state, _ = train.setup(task, "auto", optim, steps, rank)
        times = common.timed_steps(ddp, opt, task, rank, steps)
        due = [s for s in range(35, steps - 5) if lowrank_share.LowrankShare.due(s)]
        reading += [times[s] for s in due]
        after += [times[s + k] for s in due for k in (1, 2, 3, 4) if not lowrank_share.LowrankShare.due(s + k)]
        state.close()
    if rank == 0:
        r, a = 1000 * statistics.mean(reading), 1000 * statistics.mean(after)
        print(f"reading steps {r:.2f} ms (n {len(reading)}), neighbours {a:.2f} ms (n {len(after)}): {r - a:+.2f}")
    dist.destroy_process_group()
