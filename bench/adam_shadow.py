"""What a gradient wire does to Adam's step: one process trains the
language model of ``hetcomm bench train`` on fp32 DDP's trajectory (two
simulated ranks, their gradients averaged, torch's AdamW at the task's
rate), and next to it keeps Adam's two moments of the wire's message: each
rank's gradient encoded with its own error feedback (``hetcomm.ops``'s
int3 or fp8 encoder, as the hook's one exchange on two ranks) and the
decoded values summed. Every EVERY steps it prints the size of that shadow
update against fp32's (Adam's m / sqrt(v), bias-corrected), their cosine,
the message's error against the true mean gradient, and sqrt(v)'s growth
by quartile of fp32's sqrt(v). The wire's error adds to v, so a shadow
update under 1 is a smaller step at the same learning rate (bench/README
"int3 under a decaying rate").

    python bench/adam_shadow.py [int3|fp8] [STEPS [EVERY]]
"""
import sys

import torch

from hetcomm import ops
from hetcomm.benchmarks.tasks import LanguageModel

BETAS, EPS = (0.9, 0.999), 1e-8


def _message(grads, residuals, codec: str) -> torch.Tensor:
    """The hook's two-rank message: each rank's gradient / 2 plus its
    residual encoded (the residual updated in place), decoded and summed."""
    n = grads[0].numel()
    out = torch.zeros(n)
    encode, decode = (ops.int3_encode, ops.int3_decode) if codec == "int3" else (ops.fp8_encode, ops.fp8_decode)
    for g, r in zip(grads, residuals):
        codes, scales = encode(g, r, float(len(grads)))
        decode(codes, scales, n, out=out, accumulate=True)
    return out


def _adam_direction(m, v, step):
    return (m / (1 - BETAS[0] ** step)) / ((v / (1 - BETAS[1] ** step)).sqrt() + EPS)


def shadow(codec: str = "int3", steps: int = 300, every: int = 25):
    """Yields (step, update size against fp32's, cosine, message error /
    gradient norm, [sqrt(v) growth per quartile of fp32's sqrt(v)]) every
    ``every`` steps and at the last."""
    if codec not in ("int3", "fp8"):
        raise ValueError(f"codec must be int3 or fp8, got {codec!r}")
    torch.manual_seed(0)
    task = LanguageModel()
    net = task.model()
    params = list(net.parameters())
    n = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=task.lr["adamw"], betas=BETAS, eps=EPS, weight_decay=0.0)
    residuals = [torch.zeros(n), torch.zeros(n)]
    m, v, m_w, v_w = (torch.zeros(n) for _ in range(4))
    for step in range(1, steps + 1):
        grads = []
        for rank in range(2):
            net.zero_grad()
            x, y = task.batch_for(step - 1, rank)
            task.loss(net(x), y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        g = (grads[0] + grads[1]) / 2
        msg = _message(grads, residuals, codec)
        for mom, var, x in ((m, v, g), (m_w, v_w, msg)):
            mom.mul_(BETAS[0]).add_(x, alpha=1 - BETAS[0])
            var.mul_(BETAS[1]).addcmul_(x, x, value=1 - BETAS[1])
        if step % every == 0 or step == steps:
            u, u_w = _adam_direction(m, v, step), _adam_direction(m_w, v_w, step)
            root = v.sqrt()
            edges = torch.quantile(root[torch.randperm(n)[:100_000]], torch.tensor([0.25, 0.5, 0.75]))
            bins = torch.bucketize(root, edges)
            growth = [float((v_w[bins == q].mean() / v[bins == q].mean()).sqrt()) for q in range(4)]
            yield (step, float(u_w.norm() / u.norm()), float(u_w @ u / u_w.norm() / u.norm()),
                   float((msg - g).norm() / g.norm()), growth)
        for p, piece in zip(params, torch.split(g, [p.numel() for p in params])):
            p.grad = piece.view_as(p).clone()
        opt.step()


def main(codec: str = "int3", steps: int = 300, every: int = 25) -> None:
    print(f"# {codec}: shadow Adam of the wire's message on fp32's trajectory, LM, 2 simulated ranks")
    print("step  |update| ratio  cosine  |message - g| / |g|  sqrt(v) growth by quartile of fp32's sqrt(v)")
    for step, size, cosine, error, growth in shadow(codec, steps, every):
        print(f"{step:4d}  {size:14.3f}  {cosine:6.3f}  {error:19.3f}  " + " ".join(f"{x:.3f}" for x in growth),
              flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "int3", int(args[1]) if len(args) > 1 else 300, int(args[2]) if len(args) > 2 else 25)
