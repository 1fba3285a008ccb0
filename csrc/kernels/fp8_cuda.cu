// CUDA twin of fp8_cpu.cpp: one warp per chunk, the same per-element math;
// the chunk's max is exact in any order, so scales, codes and residuals are
// bit-identical to the CPU's.
#include "kernels/codec_math.h"
#include "kernels/cuda_check.cuh"
#include "kernels/fp8.h"

namespace hetcomm {
namespace kernels {

namespace {

__global__ void fp8_encode_kernel(Fp8EncodeParams p, int64_t nchunks) {
  const WarpChunk w = warp_chunk(p.grad, p.residual, p.n, p.chunk);
  if (w.chunk >= nchunks) return;
  const float* g = w.grad;
  float* e = w.residual;

  uint32_t amax = 0;
  for (int64_t i = w.lane; i < w.len; i += kLanes)
    amax = max(amax, magnitude_bits(ef_input(g[i], p.divisor, e ? e[i] : 0.0f)));
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = fp8_scale(bits_float(amax));
  if (w.lane == 0) p.scales[w.chunk] = scale;

  uint8_t* codes = p.codes + w.begin;
  const float inv = fp8_inverse(scale);
  for (int64_t i = w.lane; i < w.len; i += kLanes) {
    const float x = ef_input(g[i], p.divisor, e ? e[i] : 0.0f);
    const uint8_t q = fp8_encode(x, inv);
    codes[i] = q;
    if (e) e[i] = fp8_residual(x, q, scale);
  }
}

// One block per chunk (grid-stride): the chunk's scale is read once.
__global__ void fp8_decode_kernel(Fp8DecodeParams p, int64_t nchunks) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int64_t begin = c * p.chunk;
    const int len = static_cast<int>(min(p.chunk, p.n - begin));
    const float scale = p.scales[c];
    const uint8_t* codes = p.codes + begin;
    float* out = p.out + begin;
    for (int i = threadIdx.x; i < len; i += blockDim.x)
      out[i] = fp8_decode(p.accumulate ? out[i] : 0.0f, codes[i], scale, p.alpha);
  }
}

}  // namespace

void fp8_encode_cuda(const Fp8EncodeParams& p, void* stream) {
  const int64_t nchunks = fp8_num_chunks(p.n, p.chunk);
  if (nchunks == 0) return;
  const unsigned int blocks = warp_per_chunk_blocks(nchunks);
  fp8_encode_kernel<<<blocks, kWarpsPerBlock * kLanes, 0, static_cast<cudaStream_t>(stream)>>>(p, nchunks);
  HC_CUDA_LAUNCH_CHECK("fp8_encode");
}

void fp8_decode_cuda(const Fp8DecodeParams& p, void* stream) {
  const int64_t nchunks = fp8_num_chunks(p.n, p.chunk);
  if (nchunks == 0) return;
  const unsigned int blocks = block_per_chunk_blocks(nchunks);
  fp8_decode_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(p, nchunks);
  HC_CUDA_LAUNCH_CHECK("fp8_decode");
}

}  // namespace kernels
}  // namespace hetcomm
