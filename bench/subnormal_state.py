"""Subnormal entries in an optimizer's state as fp32 training goes on, and
the optimizer's step time: TASK's model in one process, the mean of 4 ranks'
batches each step (fp32 DDP's gradient on 4 ranks), OPTIM at the task's
rate, every 300 steps the count of subnormal float32 entries in the
optimizer's state and that step's ``opt.step()`` time (one step: noisy).
FLUSH=1 sets ``torch.set_flush_denormal(True)`` first (README "CPU training
and subnormal floats"; bench/README "Subnormal momenta on the CPU"):

    python bench/subnormal_state.py wide sgd 1500 [FLUSH]
"""
import sys
import time

import torch

from hetcomm.benchmarks import tasks, train

RANKS = 4


def subnormal_entries(opt: torch.optim.Optimizer) -> int:
    tiny = torch.finfo(torch.float32).tiny
    return sum(int(((v.abs() < tiny) & (v != 0)).sum()) for state in opt.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dtype == torch.float32 and v.numel() > 1)


def main() -> None:
    task_name, optim, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    flush = len(sys.argv) > 4 and sys.argv[4] == "1"
    torch.set_num_threads(1)
    if flush:
        torch.set_flush_denormal(True)
    task = tasks.TASKS[task_name]()
    model = task.model()
    opt = train.make_optimizer(optim, model.parameters(), train.task_lr(task, optim))
    for step in range(steps):
        opt.zero_grad()
        for rank in range(RANKS):
            x, y = task.batch_for(step, rank)
            (task.loss(model(x), y) / RANKS).backward()
        t = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t
        if step % 300 == 0 or step == steps - 1:
            print(f"{task_name} {optim} flush={int(flush)} step {step}: opt.step {1000 * dt:.2f} ms, "
                  f"{subnormal_entries(opt)} subnormal entries in its state", flush=True)


if __name__ == "__main__":
    main()
