// CUDA twin of sign_cpu.cpp: one warp per chunk (at chunk 32, per 4 chunks), the same per-element math and
// the same reduction order (lane-strided partial sums, xor butterfly), so the
// scales (bf16), bits and residuals are bit-identical to the CPU's.
#include "kernels/codec_math.h"
#include "kernels/cuda_check.cuh"
#include "kernels/sign.h"

namespace hetcomm {
namespace kernels {

namespace {

// The warp's sum of each lane's partial sum, by the xor butterfly (the order
// the CPU's butterfly_sum32 reproduces); every lane gets it.
__device__ __forceinline__ float butterfly_sum(float part) {
  for (int offset = kLanes / 2; offset > 0; offset >>= 1)
    part = add_rn(part, __shfl_xor_sync(0xffffffffu, part, offset));
  return part;
}

// The warp's chunk scale from each lane's partial sum of |x|: the mean rounded
// to bf16 and stored by lane 0; every lane gets the rounded scale.
__device__ __forceinline__ float chunk_scale(const SignEncodeParams& p, const WarpChunk& w, float part) {
  part = butterfly_sum(part);
  const uint16_t bits = sign_scale_bits(part, static_cast<float>(w.len));
  if (w.lane == 0) p.scales[w.chunk] = bits;
  return bf16_to_float(bits);
}

__global__ void sign_encode_kernel(SignEncodeParams p, int64_t nchunks) {
  const WarpChunk w = warp_chunk(p.grad, p.residual, p.n, p.chunk);
  if (w.chunk >= nchunks) return;
  const float* g = w.grad;
  float* e = w.residual;

  float part = 0.0f;
  for (int64_t i = w.lane; i < w.len; i += kLanes)
    part = add_rn(part, magnitude(ef_input(g[i], p.divisor, e ? e[i] : 0.0f)));
  const float scale = chunk_scale(p, w, part);

  uint32_t* words = p.words + w.chunk * (p.chunk / kBitsPerWord);
  for (int64_t base = 0; base < w.len; base += kBitsPerWord) {
    const int64_t i = base + w.lane;
    uint32_t bit = 0;
    if (i < w.len) {
      const float x = ef_input(g[i], p.divisor, e ? e[i] : 0.0f);
      bit = sign_bit(x);
      if (e) e[i] = sign_residual(x, bit, scale);
    }
    const uint32_t word = __ballot_sync(0xffffffffu, bit);
    if (w.lane == 0) words[base / kBitsPerWord] = word;
  }
}

// Chunks of kItems * 32 elements (256, 2048): one warp per chunk as above, but
// each lane keeps its elements in registers between the two passes, so g and
// e are read once (12 bytes per element moved, not 20). Same order of sums.
// A full chunk with a residual (the common case) loads in batches of kBatch
// g and e per lane, all issued before any is used: enough bytes in flight at
// the occupancy the 64 held values leave (ncu: latency-bound otherwise).
constexpr int kBatch = 16;

template <int kItems>
__global__ void __launch_bounds__(kWarpsPerBlock * kLanes, 2)
    sign_encode_regs_kernel(SignEncodeParams p, int64_t nchunks) {
  const WarpChunk w = warp_chunk(p.grad, p.residual, p.n, p.chunk);
  if (w.chunk >= nchunks) return;
  const int len = static_cast<int>(w.len);
  const float* g = w.grad;
  float* e = w.residual;

  constexpr int kB = kItems < kBatch ? kItems : kBatch;
  static_assert(kItems % kB == 0, "a chunk's items in whole batches");
  float x[kItems];
  if (e && len == kItems * kLanes) {
#pragma unroll
    for (int jb = 0; jb < kItems; jb += kB) {
      float gv[kB], ev[kB];
#pragma unroll
      for (int t = 0; t < kB; ++t) {
        gv[t] = __ldg(g + w.lane + (jb + t) * kLanes);
        ev[t] = e[w.lane + (jb + t) * kLanes];
      }
#pragma unroll
      for (int t = 0; t < kB; ++t) x[jb + t] = ef_input(gv[t], p.divisor, ev[t]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = w.lane + j * kLanes;
      x[j] = i < len ? ef_input(g[i], p.divisor, e ? e[i] : 0.0f) : 0.0f;
    }
  }
  float part = 0.0f;
#pragma unroll
  for (int j = 0; j < kItems; ++j)
    if (w.lane + j * kLanes < len) part = add_rn(part, magnitude(x[j]));
  const float scale = chunk_scale(p, w, part);

  uint32_t* words = p.words + w.chunk * (p.chunk / kBitsPerWord);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    if (j * kLanes >= len) break;  // the same for the whole warp
    const int i = w.lane + j * kLanes;
    uint32_t bit = 0;
    if (i < len) {
      bit = sign_bit(x[j]);
      if (e) e[i] = sign_residual(x[j], bit, scale);
    }
    const uint32_t word = __ballot_sync(0xffffffffu, bit);
    if (w.lane == 0) words[j] = word;
  }
}

// onebit's chunk (one value per lane, small_chunks): the butterflies of a
// warp's chunks interleave. Lane j stores chunk j's scale and word. Same sums
// in the same order. On an H100 4 chunks beat 8 by 8-10 % and 16 by 25 %, and
// reach an elementwise kernel moving the same 12 bytes per element (read g and
// e, write e).
__global__ void __launch_bounds__(kWarpsPerBlock * kLanes) sign_encode_c32_kernel(SignEncodeParams p, int64_t nchunks) {
  const SmallChunks c = small_chunks(p.grad, p.residual, p.divisor, p.n, nchunks);
  if (c.count == 0) return;
  float part[kSmallChunks];
#pragma unroll
  for (int j = 0; j < kSmallChunks; ++j) part[j] = add_rn(0.0f, magnitude(c.x[j]));  // 0 past n
#pragma unroll
  for (int j = 0; j < kSmallChunks; ++j) part[j] = butterfly_sum(part[j]);
  uint16_t my_scale = 0;
  uint32_t my_word = 0;
#pragma unroll
  for (int j = 0; j < kSmallChunks; ++j) {
    if (j >= c.count) break;  // the same for the whole warp
    const int64_t begin = (c.first + j) * kLanes;
    const uint16_t bits = sign_scale_bits(part[j], static_cast<float>(min(static_cast<int64_t>(kLanes), p.n - begin)));
    const float scale = bf16_to_float(bits);
    const int64_t i = begin + c.lane;
    uint32_t bit = 0;
    if (i < p.n) {
      bit = sign_bit(c.x[j]);
      if (p.residual) p.residual[i] = sign_residual(c.x[j], bit, scale);
    }
    const uint32_t word = __ballot_sync(0xffffffffu, bit);
    if (c.lane == j) {
      my_scale = bits;
      my_word = word;
    }
  }
  if (c.lane < c.count) {
    p.scales[c.first + c.lane] = my_scale;
    p.words[c.first + c.lane] = my_word;  // chunk 32: one word per chunk
  }
}

// Four consecutive values a thread (decode_quads), whatever the chunk: one word
// load, one scale load and, where out is 16-byte aligned, one 16-byte store for
// the four. The first
// version ran a block per chunk: at onebit's chunk of 32, 8 of 256 threads
// worked (0.06-0.13 of a copy's bandwidth on an H100).
template <bool kVec>
__global__ void sign_decode_kernel(SignDecodeParams p) {
  decode_quads<kVec>(p.out, p.n, p.accumulate, [&](int64_t i) {
    const QuadGroup q = quad_group(i, p.chunk, p.scales);
    const uint32_t bits = p.words[q.group] >> (i % kBitsPerWord);
    const float scale = q.scale, alpha = p.alpha;
    return [=](float prev, int j) { return sign_decode(prev, (bits >> j) & 1u, scale, alpha); };
  });
}

}  // namespace

void sign_encode_cuda(const SignEncodeParams& p, void* stream) {
  const int64_t nchunks = sign_num_chunks(p.n, p.chunk);
  if (nchunks == 0) return;
  const unsigned int blocks = warp_per_chunk_blocks(nchunks);
  auto s = static_cast<cudaStream_t>(stream);
  // onebit's chunk (32), 256 and 2048: each lane's values held between the two
  // passes; other chunks read g and e twice.
  if (p.chunk == kLanes)
    sign_encode_c32_kernel<<<small_chunks_blocks(nchunks), kWarpsPerBlock * kLanes, 0, s>>>(p, nchunks);
  else if (p.chunk == 8 * kLanes)
    sign_encode_regs_kernel<8><<<blocks, kWarpsPerBlock * kLanes, 0, s>>>(p, nchunks);
  else if (p.chunk == 64 * kLanes)
    sign_encode_regs_kernel<64><<<blocks, kWarpsPerBlock * kLanes, 0, s>>>(p, nchunks);
  else
    sign_encode_kernel<<<blocks, kWarpsPerBlock * kLanes, 0, s>>>(p, nchunks);
  HC_CUDA_LAUNCH_CHECK("sign_encode");
}

void sign_decode_cuda(const SignDecodeParams& p, void* stream) {
  if (p.n == 0) return;
  const unsigned int blocks = grid_for((p.n + 3) / 4, 256);
  auto s = static_cast<cudaStream_t>(stream);
  if (reinterpret_cast<uintptr_t>(p.out) % 16 == 0)
    sign_decode_kernel<true><<<blocks, 256, 0, s>>>(p);
  else
    sign_decode_kernel<false><<<blocks, 256, 0, s>>>(p);
  HC_CUDA_LAUNCH_CHECK("sign_decode");
}

}  // namespace kernels
}  // namespace hetcomm
