import os, sys, torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
import hetcomm
from hetcomm.benchmarks.tasks import Regress
sys.path.insert(0, "/work/main")
from tests.dist_harness import run_ranks

def train(rank, world, mode, seed, lr, opt_kind, total):
    task = Regress(); x, y = task.x, task.y
    torch.manual_seed(seed)
    model = task.model()
    if seed:
        with torch.no_grad():
            for p in model.parameters(): p.add_(0.02 * torch.randn_like(p))
    ddp = DDP(model, bucket_cap_mb=0.03)
    cls = hetcomm.optim.AdamW if opt_kind == "h" else torch.optim.AdamW
    opt = cls(ddp.parameters(), lr=lr, weight_decay=0.01)
    if mode == "fp32":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        state = hetcomm.HookState(mode, min_compress_numel=1000)
        state.attach_optimizer(opt, total_steps=total)
        ddp.register_comm_hook(state, hetcomm.hook)
    N = x.shape[0]
    for step in range(300):
        idx = torch.randint(0, N, (16,), generator=torch.Generator().manual_seed(step * 10 + rank + 1000 * seed))
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[idx]).squeeze(1), y[idx]).backward()
        opt.step()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x).squeeze(1), y).item()

if __name__ == "__main__":
    mode = sys.argv[1]; opt_kind = sys.argv[2]; total = None if sys.argv[3] == "none" else 300
    for seed in range(4):
        for lr in (3e-3,):
            l = run_ranks(train, 2, mode, seed, lr, opt_kind, total)[0]
            print(mode, opt_kind, sys.argv[3], os.environ.get("XX_UNWtopk", "") + os.environ.get("XX_UNWlowrank", ""), seed, lr, round(l, 5), flush=True)
