// CUDA twin of int3_cpu.cpp: one warp per chunk (four per warp at the chunk of
// 32), the same per-element math;
// the chunk's max is exact in any order and each 32's bit planes come from
// three ballots, so scales, codes and residuals are bit-identical to the CPU's.
#include "kernels/codec_math.h"
#include "kernels/cuda_check.cuh"
#include "kernels/int3.h"

namespace hetcomm {
namespace kernels {

namespace {

__global__ void int3_encode_kernel(Int3EncodeParams p, int64_t nchunks) {
  const WarpChunk w = warp_chunk(p.grad, p.residual, p.n, p.chunk);
  if (w.chunk >= nchunks) return;
  const float* g = w.grad;
  float* e = w.residual;

  const uint16_t bits = int3_scale_bits(bits_float(warp_amax_bits(w, p.divisor)));
  if (w.lane == 0) p.scales[w.chunk] = bits;
  const float scale = bf16_to_float(bits);

  uint32_t* words = p.words + 3 * (w.begin / kBitsPerWord);
  for (int64_t base = 0; base < w.len; base += kBitsPerWord) {
    const int64_t i = base + w.lane;
    uint32_t code = 0;  // absent codes are 0, as on the CPU
    if (i < w.len) {
      const float x = ef_input(g[i], p.divisor, e ? e[i] : 0.0f);
      code = int3_code(x, scale);
      if (e) e[i] = int3_residual(x, code, scale);
    }
    const uint32_t w0 = __ballot_sync(0xffffffffu, code & 1u);
    const uint32_t w1 = __ballot_sync(0xffffffffu, (code >> 1) & 1u);
    const uint32_t w2 = __ballot_sync(0xffffffffu, (code >> 2) & 1u);
    if (w.lane == 0) {
      uint32_t* out = words + 3 * (base / kBitsPerWord);
      out[0] = w0;
      out[1] = w1;
      out[2] = w2;
    }
  }
}

// onebit's chunk of 32, which int3 shares (small_chunks): g and e read once
// (the warp-per-chunk kernel above reads them twice: 0.32-0.34 of a copy's
// bandwidth on an H200). Lane 3j + k stores chunk j's word k, lane j its scale.
__global__ void __launch_bounds__(kWarpsPerBlock * kLanes) int3_encode_c32_kernel(Int3EncodeParams p, int64_t nchunks) {
  const SmallChunks c = small_chunks(p.grad, p.residual, p.divisor, p.n, nchunks);
  if (c.count == 0) return;
  uint32_t amax[kSmallChunks];
#pragma unroll
  for (int j = 0; j < kSmallChunks; ++j) amax[j] = magnitude_bits(c.x[j]);  // 0 past n
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1)
#pragma unroll
    for (int j = 0; j < kSmallChunks; ++j) amax[j] = max(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], offset));
  uint16_t my_scale = 0;
  uint32_t my_word = 0;
#pragma unroll
  for (int j = 0; j < kSmallChunks; ++j) {
    if (j >= c.count) break;  // the same for the whole warp
    const uint16_t bits = int3_scale_bits(bits_float(amax[j]));
    const float scale = bf16_to_float(bits);
    const int64_t i = (c.first + j) * kLanes + c.lane;
    uint32_t code = 0;  // absent codes are 0, as on the CPU
    if (i < p.n) {
      code = int3_code(c.x[j], scale);
      if (p.residual) p.residual[i] = int3_residual(c.x[j], code, scale);
    }
    const uint32_t w0 = __ballot_sync(0xffffffffu, code & 1u);
    const uint32_t w1 = __ballot_sync(0xffffffffu, (code >> 1) & 1u);
    const uint32_t w2 = __ballot_sync(0xffffffffu, (code >> 2) & 1u);
    if (c.lane == j) my_scale = bits;
    if (c.lane == 3 * j) my_word = w0;
    if (c.lane == 3 * j + 1) my_word = w1;
    if (c.lane == 3 * j + 2) my_word = w2;
  }
  if (c.lane < c.count) p.scales[c.first + c.lane] = my_scale;
  if (c.lane < 3 * c.count) p.words[3 * c.first + c.lane] = my_word;  // chunk 32: three words per chunk
}

// Four consecutive values a thread (decode_quads, as sign_decode): three word
// loads, one scale load and, where out is 16-byte aligned, one 16-byte store
// for the four. The first version decoded one value a thread with a 64-bit
// division for its chunk: 0.19 of a copy's bandwidth on an H200.
template <bool kVec>
__global__ void int3_decode_kernel(Int3DecodeParams p) {
  decode_quads<kVec>(p.out, p.n, p.accumulate, [&](int64_t i) {
    const QuadGroup q = quad_group(i, p.chunk, p.scales);
    const uint32_t* w = p.words + 3 * static_cast<int64_t>(q.group);
    const int shift = static_cast<int>(i % kBitsPerWord);
    const uint32_t w0 = w[0] >> shift, w1 = w[1] >> shift, w2 = w[2] >> shift;
    const float scale = q.scale, alpha = p.alpha;
    return [=](float prev, int j) { return int3_decode(prev, int3_unpack(w0, w1, w2, j), scale, alpha); };
  });
}

}  // namespace

void int3_encode_cuda(const Int3EncodeParams& p, void* stream) {
  const int64_t nchunks = int3_num_chunks(p.n, p.chunk);
  if (nchunks == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (p.chunk == kLanes)
    int3_encode_c32_kernel<<<small_chunks_blocks(nchunks), kWarpsPerBlock * kLanes, 0, s>>>(p, nchunks);
  else
    int3_encode_kernel<<<warp_per_chunk_blocks(nchunks), kWarpsPerBlock * kLanes, 0, s>>>(p, nchunks);
  HC_CUDA_LAUNCH_CHECK("int3_encode");
}

void int3_decode_cuda(const Int3DecodeParams& p, void* stream) {
  if (p.n == 0) return;
  const unsigned int blocks = grid_for((p.n + 3) / 4, 256);
  auto s = static_cast<cudaStream_t>(stream);
  if (reinterpret_cast<uintptr_t>(p.out) % 16 == 0)
    int3_decode_kernel<true><<<blocks, 256, 0, s>>>(p);
  else
    int3_decode_kernel<false><<<blocks, 256, 0, s>>>(p);
  HC_CUDA_LAUNCH_CHECK("int3_decode");
}

}  // namespace kernels
}  // namespace hetcomm
