"""One call of each codec on 64 MiB of fp32, for Nsight Compute:
    ncu --section SpeedOfLight --section Occupancy python bench/gpu/profile_codecs.py
(bench/gpu/run.sh's "profile" stage)."""

import torch

from hetcomm import ops

n = 16 << 20
g = torch.randn(n, device="cuda")
e = torch.randn(n, device="cuda") * 0.1
out = torch.empty(n, device="cuda")
for _ in range(2):  # the second call is the one to read (caches, clocks warm)
    words, scales = ops.sign_encode(g, e, 1.0, ops.DEFAULT_CHUNK)
    ops.sign_decode(words, scales, n, ops.DEFAULT_CHUNK, out=out)
    codes, fp8_scales = ops.fp8_encode(g, e, 1.0, ops.FP8_CHUNK)
    ops.fp8_decode(codes, fp8_scales, n, ops.FP8_CHUNK, out=out)
    planes, int3_scales = ops.int3_encode(g, e, 1.0, ops.INT3_CHUNK)
    ops.int3_decode(planes, int3_scales, n, ops.INT3_CHUNK, out=out)
    h = ops.cast_encode(g, 3.0, "float16")
    ops.cast_decode(h, 1.0, out)
    ops.topk_encode(g, e, 1.0, ops.topk_count(n, 0.01), False)
    ops.lowrank_outer(torch.randn(n // 1024, 4, device="cuda"), torch.randn(4, 1024, device="cuda"))
torch.cuda.synchronize()
