"""`hetcomm bench compress`: codec kernel throughput (GB/s of fp32 input
processed) against a pure-torch implementation of the same codec and a copy
of the same bytes, measured in the same run. #wrong counts elements where
hetcomm's output differs from the torch implementation's.

``of copy`` compares memory traffic: the bytes a codec must read and write at
the least (TRAFFIC, per fp32 input element) per second, over a copy_ of the
input's bytes (read + write) per second at the same size. 1.0 = the codec
moves its bytes as fast as a plain copy does."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .. import ops
from . import common

CHUNK = 2048  # every size is a multiple of this
# each codec at HookState's default
SIGN_CHUNK, FP8_CHUNK, INT3_CHUNK = ops.DEFAULT_CHUNK, ops.FP8_CHUNK, ops.INT3_CHUNK
RATIO = 0.01
# Least bytes read + written per fp32 input element: sign + EF reads g and e,
# writes e, 1 bit and a 2-byte scale per 32 (fp8: 1 byte and a 4-byte scale
# per 256, left out; int3: 3 bits and a 2-byte scale per 32); top-k + EF the
# same but no bits (k indices and values are a rounding error at 1 %); casts
# read 4 and write 2 (or the reverse); the low-rank rebuild writes the matrix
# (its factors are small).
TRAFFIC = {"sign_encode+ef": 12 + 1 / 8 + 2 / SIGN_CHUNK, "sign_decode": 4 + 1 / 8 + 2 / SIGN_CHUNK, "fp8_encode+ef": 13,
           "fp8_decode": 5, "int3_encode+ef": 12 + 3 / 8 + 2 / INT3_CHUNK, "int3_decode": 4 + 3 / 8 + 2 / INT3_CHUNK,
           "topk_exact+ef": 12, "topk_sampled+ef": 12, "cast_fp16": 6, "cast_bf16": 6, "uncast_fp16": 6,
           "lowrank_outer_r4": 4}


# ---- pure-torch implementations of each codec (vectorised, the fair baseline) ----
def torch_sign_encode(g: torch.Tensor, e: torch.Tensor):
    x = g + e
    scales = x.view(-1, SIGN_CHUNK).abs().mean(1).bfloat16()
    bits = (x >= 0).view(-1, 32).to(torch.int64)
    words = (bits << torch.arange(32, device=g.device)).sum(1).to(torch.int32)  # wraps to the uint32 bit pattern
    e.copy_(x - torch.where(x >= 0, 1.0, -1.0) * scales.float().repeat_interleave(SIGN_CHUNK))
    return words, scales


def torch_sign_decode(words: torch.Tensor, scales: torch.Tensor, n: int):
    bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32, device=words.device)) & 1
    return torch.where(bits.view(-1)[:n] == 1, 1.0, -1.0) * scales.float().repeat_interleave(SIGN_CHUNK)[:n]


def torch_fp8_encode(g: torch.Tensor, e: torch.Tensor):
    x = g + e
    amax = x.view(-1, FP8_CHUNK).abs().amax(1)
    scales = torch.exp2(torch.ceil(torch.log2(amax / 448))).clamp_min(2.0 ** -126).where(amax > 0, 0.0)
    s = scales.repeat_interleave(FP8_CHUNK)
    codes = (x / s.where(s > 0, 1.0)).to(torch.float8_e4m3fn)
    e.copy_(x - codes.float() * s)
    return codes.view(torch.uint8), scales


def torch_fp8_decode(codes: torch.Tensor, scales: torch.Tensor, n: int):
    return codes.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(FP8_CHUNK)[:n]


def torch_int3_encode(g: torch.Tensor, e: torch.Tensor):
    x = (g + e).view(-1, INT3_CHUNK)
    amax = x.abs().amax(1)
    # divided by a tensor of 3s: torch's CUDA division by a scalar multiplies by
    # its reciprocal, which is not correctly rounded (a chunk in ~10^6 gets
    # another bf16 scale)
    scales = (amax / torch.full_like(amax, 3.0)).bfloat16()
    s = scales.float().unsqueeze(1)
    usable = (s > 0) & torch.isfinite(s)
    q = torch.where(usable, torch.round(x / s.where(usable, 1.0)).clamp(-3, 3), 0.0)
    codes = (q + 3).to(torch.int64).view(-1, 32)
    shifts = torch.arange(32, device=g.device)
    planes = [(((codes >> k) & 1) << shifts).sum(1) for k in range(3)]  # word k: bit k of each 32 codes
    e.copy_((x - q * s).view(-1))
    return torch.stack(planes, 1).view(-1).to(torch.int32), scales  # wraps to the uint32 bit pattern


def torch_int3_decode(words: torch.Tensor, scales: torch.Tensor, n: int):
    bits = (words.view(-1, 3, 1) >> torch.arange(32, dtype=torch.int32, device=words.device)) & 1
    codes = bits[:, 0] + 2 * bits[:, 1] + 4 * bits[:, 2]
    return (codes.view(-1)[:n] - 3).float() * scales.float().repeat_interleave(INT3_CHUNK)[:n]


def torch_topk(g: torch.Tensor, e: torch.Tensor, k: int):
    x = e.add_(g)
    idx = torch.topk(x.abs(), k, sorted=False).indices
    val = x[idx]
    x[idx] = 0
    return idx, val


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.cpu().view(torch.int16) != b.cpu().view(torch.int16)).sum())


def _codecs(n: int, device: str = "cpu"):
    """name -> (hetcomm fn, torch fn, check(hetcomm result, torch result) -> #wrong)."""
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(n, generator=gen).to(device)
    e0 = (torch.randn(n, generator=gen) * 0.1).to(device)
    e_a, e_b = e0.clone(), e0.clone()
    words, scales = ops.sign_encode(g, e0.clone(), 1.0, SIGN_CHUNK)
    codes, fp8_scales = ops.fp8_encode(g, e0.clone(), 1.0, FP8_CHUNK)
    i3_words, i3_scales = ops.int3_encode(g, e0.clone(), 1.0, INT3_CHUNK)
    k = ops.topk_count(n, RATIO)
    h16 = (g / 3).half()
    out = torch.empty(n, device=device)
    cols = 1024  # n is a multiple of CHUNK: an (n / 1024) x 1024 gradient matrix rebuilt from rank-4 factors
    p, qt = torch.randn(n // cols, 4, generator=gen).to(device), torch.randn(4, cols, generator=gen).to(device)

    def sign_wrong(a, b):
        return int((a[0] != b[0]).sum())

    return {
        "sign_encode+ef": (lambda: ops.sign_encode(g, e_a, 1.0, SIGN_CHUNK), lambda: torch_sign_encode(g, e_b),
                           sign_wrong, True),
        "sign_decode": (lambda: ops.sign_decode(words, scales, n, SIGN_CHUNK, out=out),
                        lambda: torch_sign_decode(words, scales, n),
                        lambda a, b: int((~torch.isclose(a, b)).sum()), False),
        "fp8_encode+ef": (lambda: ops.fp8_encode(g, e_a, 1.0, FP8_CHUNK), lambda: torch_fp8_encode(g, e_b),
                          lambda a, b: int((a[0] != b[0]).sum()), True),
        "fp8_decode": (lambda: ops.fp8_decode(codes, fp8_scales, n, FP8_CHUNK, out=out),
                       lambda: torch_fp8_decode(codes, fp8_scales, n), lambda a, b: int((a != b).sum()), False),
        "int3_encode+ef": (lambda: ops.int3_encode(g, e_a, 1.0, INT3_CHUNK), lambda: torch_int3_encode(g, e_b),
                           lambda a, b: int((a[0] != b[0]).sum()) + int((a[1] != b[1]).sum()), True),
        "int3_decode": (lambda: ops.int3_decode(i3_words, i3_scales, n, INT3_CHUNK, out=out),
                        lambda: torch_int3_decode(i3_words, i3_scales, n), lambda a, b: int((a != b).sum()), False),
        "topk_exact+ef": (lambda: ops.topk_encode(g, e_a, 1.0, k, True), lambda: torch_topk(g, e_b, k),
                          None, True),
        "topk_sampled+ef": (lambda: ops.topk_encode(g, e_a, 1.0, k, False), lambda: torch_topk(g, e_b, k),
                            None, True),
        # checked against the CPU's division: torch's CUDA division by a scalar
        # multiplies by its reciprocal, which is not correctly rounded
        "cast_fp16": (lambda: ops.cast_encode(g, 3.0, "float16"), lambda: (g / 3.0).half(),
                      lambda a, b: _bits_differ(a, (g.cpu() / 3.0).half()), False),
        "cast_bf16": (lambda: ops.cast_encode(g, 3.0, "bfloat16"), lambda: (g / 3.0).bfloat16(),
                      lambda a, b: _bits_differ(a, (g.cpu() / 3.0).bfloat16()), False),
        "uncast_fp16": (lambda: ops.cast_decode(h16, 1.0, out), lambda: h16.float(),
                        lambda a, b: int((a != b).sum()), False),
        "lowrank_outer_r4": (lambda: ops.lowrank_outer(p, qt), lambda: p @ qt,
                             lambda a, b: int((~torch.isclose(a, b, rtol=1e-5, atol=1e-5)).sum()), False),
    }, (e0, e_a, e_b)


def run(sizes: List[int], iters: int = 10, warmup: int = 2, device: str = "cpu") -> Dict:
    membw = common.memory_bandwidth(device=device)
    rows = []
    for nbytes in sizes:
        n = max(CHUNK, nbytes // 4 // CHUNK * CHUNK)
        copy_gbps = common.memory_bandwidth(4 * n, iters, device)  # the same bytes, read + written
        codecs, (e0, e_a, e_b) = _codecs(n, device)
        for name, (ours, theirs, check, uses_residual) in codecs.items():
            wrong = -1
            if check is not None:
                if uses_residual:
                    e_a.copy_(e0)
                    e_b.copy_(e0)
                wrong = check(ours(), theirs())
            t_ours = common.median_time(ours, iters, warmup, device)
            t_torch = common.median_time(theirs, iters, warmup, device)
            gbps = n * 4 / t_ours / 1e9
            traffic = TRAFFIC[name] * n / t_ours / 1e9
            rows.append({"bytes": n * 4, "codec": name, "time_us": t_ours * 1e6, "gbps": gbps,
                         "torch_gbps": n * 4 / t_torch / 1e9, "speedup": t_torch / t_ours,
                         "of_membw": gbps / membw, "traffic_gbps": traffic, "copy_gbps": copy_gbps,
                         "of_copy": traffic / copy_gbps, "wrong": wrong})
    return {"memory_bandwidth_gbps": membw, "threads": torch.get_num_threads(), "device": device, "rows": rows}


def main(sizes: List[int], iters: int = 10, warmup: int = 2, json_path: Optional[str] = None,
         threads: Optional[int] = None, device: str = "cpu") -> Dict:
    if threads:
        torch.set_num_threads(threads)
    res = run(sizes, iters, warmup, device)
    print(f"# hetcomm bench compress on {device}: {res['threads']} thread(s); memory bandwidth (copy_, read+write) "
          f"{res['memory_bandwidth_gbps']:.1f} GB/s; chunk {SIGN_CHUNK} (sign), {FP8_CHUNK} (fp8), {INT3_CHUNK} (int3), "
          f"top-k ratio {RATIO}; "
          "#wrong -1 = not checked (top-k ties and order may differ from torch.topk)")
    common.print_table(res["rows"], [("bytes", "size(B)", "d"), ("codec", "codec", "s"), ("time_us", "time(us)", ".1f"),
                                     ("gbps", "GB/s", ".2f"), ("torch_gbps", "torch GB/s", ".2f"),
                                     ("speedup", "vs torch", ".2f"), ("of_membw", "of membw", ".2f"),
                                     ("traffic_gbps", "traffic GB/s", ".1f"), ("copy_gbps", "copy GB/s", ".1f"),
                                     ("of_copy", "of copy", ".2f"), ("wrong", "#wrong", "d")])
    common.write_json(json_path, res, common.metadata(1, device=device, iters=iters, warmup=warmup,
                                                      units={"gbps": "GB/s of fp32 input", "time_us": "microseconds",
                                                             "traffic_gbps": "GB/s read + written (TRAFFIC)",
                                                             "copy_gbps": "GB/s read + written by copy_"}))
    return res
