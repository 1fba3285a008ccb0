// CUDA twin of sign_cpu.cpp: one warp per chunk, the same per-element math and
// the same reduction order (lane-strided partial sums, xor butterfly), so the
// scales, bits and residuals are bit-identical to the CPU's.
#include "kernels/codec_math.h"
#include "kernels/cuda_check.cuh"
#include "kernels/sign.h"

namespace hetcomm {
namespace kernels {

namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void sign_encode_kernel(SignEncodeParams p, int64_t nchunks) {
  const int lane = threadIdx.x % kLanes;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kLanes;
  if (c >= nchunks) return;
  const int64_t begin = c * p.chunk;
  const int64_t len = min(p.chunk, p.n - begin);
  const float* g = p.grad + begin;
  float* e = p.residual ? p.residual + begin : nullptr;

  float part = 0.0f;
  for (int64_t i = lane; i < len; i += kLanes)
    part = add_rn(part, magnitude(ef_input(g[i], p.divisor, e ? e[i] : 0.0f)));
  for (int offset = kLanes / 2; offset > 0; offset >>= 1)
    part = add_rn(part, __shfl_xor_sync(0xffffffffu, part, offset));
  const float scale = div_rn(part, static_cast<float>(len));
  if (lane == 0) p.scales[c] = scale;

  uint32_t* words = p.words + c * (p.chunk / kBitsPerWord);
  for (int64_t base = 0; base < len; base += kBitsPerWord) {
    const int64_t i = base + lane;
    uint32_t bit = 0;
    if (i < len) {
      const float x = ef_input(g[i], p.divisor, e ? e[i] : 0.0f);
      bit = sign_bit(x);
      if (e) e[i] = sign_residual(x, bit, scale);
    }
    const uint32_t word = __ballot_sync(0xffffffffu, bit);
    if (lane == 0) words[base / kBitsPerWord] = word;
  }
}

__global__ void sign_decode_kernel(SignDecodeParams p) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t bit = (p.words[i / kBitsPerWord] >> (i % kBitsPerWord)) & 1u;
    const float prev = p.accumulate ? p.out[i] : 0.0f;
    p.out[i] = sign_decode(prev, bit, p.scales[i / p.chunk], p.alpha);
  }
}

}  // namespace

void sign_encode_cuda(const SignEncodeParams& p, void* stream) {
  const int64_t nchunks = sign_num_chunks(p.n, p.chunk);
  if (nchunks == 0) return;
  const unsigned int blocks = static_cast<unsigned int>((nchunks + kWarpsPerBlock - 1) / kWarpsPerBlock);
  sign_encode_kernel<<<blocks, kWarpsPerBlock * kLanes, 0, static_cast<cudaStream_t>(stream)>>>(p, nchunks);
  HC_CUDA_LAUNCH_CHECK("sign_encode");
}

void sign_decode_cuda(const SignDecodeParams& p, void* stream) {
  if (p.n == 0) return;
  sign_decode_kernel<<<grid_for(p.n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(p);
  HC_CUDA_LAUNCH_CHECK("sign_decode");
}

}  // namespace kernels
}  // namespace hetcomm
