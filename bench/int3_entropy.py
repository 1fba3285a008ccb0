"""How far int3's codes are from their entropy: one process trains a task of
``hetcomm bench train`` at its fp32 rate with the whole gradient sent as
int3 with error feedback (``hetcomm.ops``' encoder, the decoded message as
the step's gradient: one rank's int3), and counts the codes of steps 20 on.
Prints each code's share (0..6: q + 3), their order-0 entropy against the 3
bits a code travels in, the share of 32-value groups whose codes are all 0
(a group with nothing to send), and the task's final metric: what an entropy
coder of the codes could take off int3's 3.5 bits a value at most (bench/README
"int3's codes against their entropy").

    python bench/int3_entropy.py TASK OPTIM STEPS      # e.g. rnn adamw 300
"""
import sys

import torch

from hetcomm import ops
from hetcomm.benchmarks import tasks, train

FROM_STEP = 20


def codes_of(words: torch.Tensor, n: int) -> torch.Tensor:
    """The n codes (0..6) from int3's bit planes: per 32 values three words,
    word k holding bit k of the 32 codes (value j at bit j)."""
    w = words.view(-1, 3).to(torch.int64) & 0xFFFFFFFF
    bits = torch.arange(32)
    return sum(((w[:, k:k + 1] >> bits) & 1) << k for k in range(3)).reshape(-1)[:n]


def entropy(counts: torch.Tensor) -> float:
    p = counts.double() / counts.sum()
    p = p[p > 0]
    return float(-(p * p.log2()).sum())


def train_int3(task_name: str, optim: str, steps: int, see):
    """Trains TASK at its fp32 rate with the whole gradient sent as int3 with
    error feedback, calling ``see(step, words, n)`` with each step's int3
    words (n values) before they are decoded; returns (task, model)."""
    torch.manual_seed(0)
    task = tasks.TASKS[task_name]()
    model = task.model()
    opt = train.make_optimizer(optim, model.parameters(), train.task_lr(task, optim))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    residual = torch.zeros(n)
    for step in range(steps):
        x, y = task.batch_for(step, 0)
        opt.zero_grad()
        task.loss(model(x), y).backward()
        g = torch.cat([p.grad.reshape(-1) for p in params])
        words, scales = ops.int3_encode(g, residual)
        see(step, words, n)
        message = ops.int3_decode(words, scales, n)
        offset = 0
        for p in params:
            p.grad.copy_(message[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
    return task, model


def main(task_name: str, optim: str, steps: int) -> None:
    counts = torch.zeros(7, dtype=torch.int64)
    groups = zero_groups = 0

    def see(step, words, n):
        nonlocal groups, zero_groups
        if step >= FROM_STEP:
            codes = codes_of(words, n)
            counts.add_(torch.bincount(codes, minlength=7))
            full = codes[: n // 32 * 32].view(-1, 32)
            groups += full.shape[0]
            zero_groups += int((full == 3).all(1).sum())

    task, model = train_int3(task_name, optim, steps, see)
    n = sum(p.numel() for p in model.parameters())
    h = entropy(counts)
    shares = ", ".join(f"{float(v):.3f}" for v in counts.double() / counts.sum())
    print(f"{task_name} {optim}, {n} values, steps {FROM_STEP}-{steps - 1}: code shares {shares}; order-0 entropy "
          f"{h:.3f} bits a code (sent in 3), with the bf16 scale {h + 0.5:.3f} bits a value against 3.5 "
          f"({(h + 0.5) / 3.5:.2f}x); groups of 32 all 0: {zero_groups / groups:.3f}; final {task.evaluate(model)}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
