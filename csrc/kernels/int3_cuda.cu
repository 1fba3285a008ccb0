// CUDA twin of int3_cpu.cpp: one warp per chunk, the same per-element math;
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

// One element a thread (grid-stride): its 32's three words and its chunk's scale.
__global__ void int3_decode_kernel(Int3DecodeParams p) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t* w = p.words + 3 * (i / kBitsPerWord);
    const uint32_t code = int3_unpack(w[0], w[1], w[2], static_cast<int>(i % kBitsPerWord));
    const float scale = bf16_to_float(p.scales[i / p.chunk]);
    p.out[i] = int3_decode(p.accumulate ? p.out[i] : 0.0f, code, scale, p.alpha);
  }
}

}  // namespace

void int3_encode_cuda(const Int3EncodeParams& p, void* stream) {
  const int64_t nchunks = int3_num_chunks(p.n, p.chunk);
  if (nchunks == 0) return;
  int3_encode_kernel<<<warp_per_chunk_blocks(nchunks), kWarpsPerBlock * kLanes, 0, static_cast<cudaStream_t>(stream)>>>(
      p, nchunks);
  HC_CUDA_LAUNCH_CHECK("int3_encode");
}

void int3_decode_cuda(const Int3DecodeParams& p, void* stream) {
  if (p.n == 0) return;
  int3_decode_kernel<<<grid_for(p.n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(p);
  HC_CUDA_LAUNCH_CHECK("int3_decode");
}

}  // namespace kernels
}  // namespace hetcomm
