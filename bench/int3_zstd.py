"""What a general-purpose lossless compressor takes off int3's messages: as
bench/int3_entropy.py, one process trains TASK at its fp32 rate with the
whole gradient sent as int3 with error feedback, and from step 20 on each
step's int3 payload (the three bit-plane words per 32 values, without the
bf16 scales) is compressed by zstd (levels 1 and 3) and lz4, as it travels
and with a byte a code; printed, each one's size over the payload's and its
compression time a step (one thread). Needs the zstandard and lz4 packages
(not hetcomm's dependencies: ``pip install zstandard lz4``). bench/README
"Digits with a core per rank: int3's bytes are its step":

    python bench/int3_zstd.py TASK OPTIM STEPS      # e.g. classify sgd 300
"""
import sys
import time

import torch

try:
    import lz4.block
    import zstandard
except ImportError as e:  # pragma: no cover - an optional benchmark
    sys.exit(f"bench/int3_zstd.py needs zstandard and lz4 (pip install zstandard lz4): {e}")

from int3_entropy import FROM_STEP, codes_of, train_int3  # noqa: E402


def main(task_name: str, optim: str, steps: int) -> None:
    z1, z3 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    unz = zstandard.ZstdDecompressor()
    ways = {"zstd 1, bit planes": (z1.compress, False), "zstd 3, bit planes": (z3.compress, False),
            "lz4, bit planes": (lz4.block.compress, False), "zstd 1, a byte a code": (z1.compress, True)}
    size = {k: 0 for k in ways}
    spent = {k: 0.0 for k in ways}
    raw, back = 0, 0.0

    def see(step, words, n):
        nonlocal raw, back
        if step < FROM_STEP:
            return
        planes = words.numpy().tobytes()
        codes = codes_of(words, n).to(torch.uint8).numpy().tobytes()
        raw += len(planes)
        for name, (fn, by_code) in ways.items():
            t0 = time.perf_counter()
            out = fn(codes if by_code else planes)
            spent[name] += time.perf_counter() - t0
            size[name] += len(out)
        packed = z1.compress(planes)
        t0 = time.perf_counter()
        assert unz.decompress(packed) == planes
        back += time.perf_counter() - t0

    _, model = train_int3(task_name, optim, steps, see)
    n = sum(p.numel() for p in model.parameters())
    k = steps - FROM_STEP
    print(f"{task_name} {optim}, {n} values, steps {FROM_STEP}-{steps - 1}: int3's payload {raw / k / 1e3:.1f} KB a "
          f"step (and {2 * ((n + 31) // 32) / 1e3:.1f} KB of bf16 scales at chunk 32)")
    for name in ways:
        print(f"  {name:22s} {size[name] / raw:.3f}x of the payload, {1e3 * spent[name] / k:.3f} ms a step")
    print(f"  zstd 1's decompression of the bit planes: {1e3 * back / k:.3f} ms a step")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
