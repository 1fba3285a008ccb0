// Launch helpers for the torch-free CUDA kernels (checks: csrc/checks.h).
#pragma once

#include <cuda_runtime.h>

#include "checks.h"
#include "kernels/codec_math.h"

namespace hetcomm {
namespace kernels {

inline unsigned int grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 65535 * 32 ? (blocks > 0 ? blocks : 1) : 65535 * 32);
}

// The chunked codecs (sign, fp8) encode with one warp per chunk (their
// decodes: four elements a thread, grid-stride).
constexpr int kWarpsPerBlock = 8;

inline unsigned int warp_per_chunk_blocks(int64_t nchunks) {
  return static_cast<unsigned int>((nchunks + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// At the chunk of 32 (onebit's and int3's: one value a lane) a warp encodes
// kSmallChunks chunks, each lane holding its value of each between the scale
// and the codes, so that many loads of g and e are in flight (a warp per
// chunk of 32 is latency-bound: 0.6 of a copy's bandwidth for the sign, 0.33
// for int3, on an H100 / H200).
constexpr int kSmallChunks = 4;

inline unsigned int small_chunks_blocks(int64_t nchunks) {
  return warp_per_chunk_blocks((nchunks + kSmallChunks - 1) / kSmallChunks);
}

// This thread's place in a warp-per-chunk encode: its lane, its warp's chunk
// (past the end when chunk >= nchunks: the warp has nothing to do), the chunk's
// first element and length, and the chunk's gradient and residual (nullptr
// when the encode keeps none).
struct WarpChunk {
  int lane;
  int64_t chunk;
  int64_t begin;
  int64_t len;
  const float* grad;
  float* residual;
};

#ifdef __CUDACC__
// The largest |grad / divisor + residual| of the warp's chunk, as bits (exact
// in any order, NaN largest), on every lane (fp8's and int3's scales).
__device__ inline uint32_t warp_amax_bits(const WarpChunk& w, float divisor) {
  uint32_t amax = 0;
  for (int64_t i = w.lane; i < w.len; i += kLanes)
    amax = max(amax, magnitude_bits(ef_input(w.grad[i], divisor, w.residual ? w.residual[i] : 0.0f)));
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  return amax;
}

// This lane's place among its warp's kSmallChunks chunks of 32 (`first`, the
// warp's first chunk; `count` of them exist: 0 past the end), and its value of
// each, grad / divisor + residual (0 past n).
struct SmallChunks {
  int lane;
  int64_t first;
  int count;
  float x[kSmallChunks];
};

__device__ inline SmallChunks small_chunks(const float* grad, const float* residual, float divisor, int64_t n,
                                           int64_t nchunks) {
  SmallChunks c;
  c.lane = threadIdx.x % kLanes;
  c.first = (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kLanes) * kSmallChunks;
  c.count = c.first < nchunks ? static_cast<int>(min(static_cast<int64_t>(kSmallChunks), nchunks - c.first)) : 0;
#pragma unroll
  for (int j = 0; j < kSmallChunks; ++j) {
    const int64_t i = (c.first + j) * kLanes + c.lane;  // >= n past the last chunk
    c.x[j] = i < n ? ef_input(__ldg(grad + i), divisor, residual ? residual[i] : 0.0f) : 0.0f;
  }
  return c;
}

// The word-packed decodes' loop (sign, int3): four consecutive values a
// thread, grid-stride. The four share their 32's words and a chunk (both
// multiples of 4): `quad(i)` loads once what values i..i+3 need and returns
// their decoder f(prev, j) -> value i + j; where out is 16-byte aligned (kVec)
// the four are one 16-byte load (accumulating) and one 16-byte store.
template <bool kVec, class Quad>
__device__ inline void decode_quads(float* out, int64_t n, bool accumulate, Quad quad) {
  const int64_t nquads = (n + 3) / 4;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < nquads;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = 4 * q;
    const auto f = quad(i);
    float* o = out + i;
    if (kVec && i + 4 <= n) {
      const float4 prev = accumulate ? *reinterpret_cast<const float4*>(o) : make_float4(0.f, 0.f, 0.f, 0.f);
      *reinterpret_cast<float4*>(o) = make_float4(f(prev.x, 0), f(prev.y, 1), f(prev.z, 2), f(prev.w, 3));
    } else {
      const int len = static_cast<int>(min(static_cast<int64_t>(4), n - i));
      for (int j = 0; j < len; ++j) o[j] = f(accumulate ? o[j] : 0.0f, j);
    }
  }
}

// Values i..i+3 of a word-packed decode (i a multiple of 4): their 32's index
// (< 2^32: n < 2^37) and their chunk's bf16 scale.
struct QuadGroup {
  uint32_t group;
  float scale;
};

__device__ inline QuadGroup quad_group(int64_t i, int64_t chunk, const uint16_t* scales) {
  const uint32_t group = static_cast<uint32_t>(i / kBitsPerWord);
  const uint32_t per_chunk = static_cast<uint32_t>(chunk / kBitsPerWord);
  return {group, bf16_to_float(scales[per_chunk == 1 ? group : group / per_chunk])};
}

__device__ inline WarpChunk warp_chunk(const float* grad, float* residual, int64_t n, int64_t chunk_size) {
  WarpChunk w;
  w.lane = threadIdx.x % kLanes;
  w.chunk = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kLanes;
  w.begin = w.chunk * chunk_size;
  w.len = w.begin < n ? min(chunk_size, n - w.begin) : 0;
  w.grad = grad + w.begin;
  w.residual = residual ? residual + w.begin : nullptr;
  return w;
}
#endif

}  // namespace kernels
}  // namespace hetcomm
