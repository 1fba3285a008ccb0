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
