"""GPU tests: the same bodies as the CPU ones, on CUDA. They skip cleanly
without a CUDA build of hetcomm and a visible GPU (decided at run time)."""


import pytest
import torch

import hetcomm
from hetcomm import ops

from . import models
from .dist_harness import run_ranks


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 33, 2049, 10**6])
def test_cuda_kernels_match_the_cpu_bit_for_bit(n):
    g = torch.randn(n) * 3
    e = torch.randn(n) * 0.1
    res_cpu, res_gpu = e.clone(), e.cuda()
    w_cpu, s_cpu = ops.sign_encode(g, res_cpu, 3.0, 2048)
    w_gpu, s_gpu = ops.sign_encode(g.cuda(), res_gpu, 3.0, 2048)
    assert torch.equal(w_gpu.cpu(), w_cpu) and torch.equal(s_gpu.cpu(), s_cpu) and torch.equal(res_gpu.cpu(), res_cpu)
    assert torch.equal(ops.sign_decode(w_gpu, s_gpu, n).cpu(), ops.sign_decode(w_cpu, s_cpu, n))
    for wire in ("float16", "bfloat16"):
        assert torch.equal(ops.cast_encode(g.cuda(), 3.0, wire).cpu(), ops.cast_encode(g, 3.0, wire))
    idx_c, val_c = ops.topk_encode(g, None, 1.0, max(1, n // 100), exact=True)
    idx_g, val_g = ops.topk_encode(g.cuda(), None, 1.0, max(1, n // 100), exact=True)
    assert torch.equal(torch.sort(idx_g.cpu()).values, idx_c) and torch.equal(val_g.cpu(), val_c)


def _two_gpus():
    if not (hetcomm.build_info()["cuda"] and torch.cuda.device_count() >= 2):
        pytest.skip("needs a CUDA build of hetcomm and two visible GPUs")


def _nccl_ddp(rank, world, mode):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    t = hetcomm._C.NcclTransport(dist.distributed_c10d._get_default_store(), "test-nccl", rank, world, rank, 60.0)
    x = torch.full((1000,), float(rank + 1), device="cuda")
    t.all_reduce_sum(x)
    model = models.mlp().cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    state = hetcomm.HookState(mode, min_compress_numel=0)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(20):
        xb, yb = models.batch(rank, step, 16)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(xb.cuda()), yb.cuda()).backward()
        opt.step()
    return {"sum": x.cpu(), "params": models.flat_params(model).cpu()}


@pytest.mark.cuda2
@pytest.mark.parametrize("mode", ["none", "fp16", "onebit", "topk"])
def test_nccl_transport_and_ddp_replicas_on_two_gpus(mode):
    _two_gpus()
    res = run_ranks(_nccl_ddp, 2, mode)
    assert torch.equal(res[0]["sum"], torch.full((1000,), 3.0))
    assert torch.equal(res[0]["params"], res[1]["params"])
