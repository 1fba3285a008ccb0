// CUDA twin of sign_cpu.cpp: one warp per chunk, the same per-element math and
// the same reduction order (lane-strided partial sums, xor butterfly), so the
// scales (bf16), bits and residuals are bit-identical to the CPU's.
#include "kernels/codec_math.h"
#include "kernels/cuda_check.cuh"
#include "kernels/sign.h"

namespace hetcomm {
namespace kernels {

namespace {

// The warp's chunk scale from each lane's partial sum of |x|: the xor
// butterfly (the order the CPU's butterfly_sum32 reproduces), the mean rounded
// to bf16 and stored by lane 0; every lane gets the rounded scale.
__device__ __forceinline__ float chunk_scale(const SignEncodeParams& p, const WarpChunk& w, float part) {
  for (int offset = kLanes / 2; offset > 0; offset >>= 1)
    part = add_rn(part, __shfl_xor_sync(0xffffffffu, part, offset));
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

// The default chunk (kItems * 32 elements): one warp per chunk as above, but
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

  float x[kItems];
  if (e && len == kItems * kLanes) {
#pragma unroll
    for (int jb = 0; jb < kItems; jb += kBatch) {
      float gv[kBatch], ev[kBatch];
#pragma unroll
      for (int t = 0; t < kBatch; ++t) {
        gv[t] = __ldg(g + w.lane + (jb + t) * kLanes);
        ev[t] = e[w.lane + (jb + t) * kLanes];
      }
#pragma unroll
      for (int t = 0; t < kBatch; ++t) x[jb + t] = ef_input(gv[t], p.divisor, ev[t]);
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

// One block per chunk (grid-stride): the chunk's scale is read once and no
// element needs a 64-bit division to find its chunk. Where out is 16-byte
// aligned each thread writes 4 consecutive elements with one store.
template <bool kVec>
__global__ void sign_decode_kernel(SignDecodeParams p, int64_t nchunks) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int64_t begin = c * p.chunk;
    const int len = static_cast<int>(min(p.chunk, p.n - begin));
    const float scale = bf16_to_float(p.scales[c]);
    const uint32_t* words = p.words + begin / kBitsPerWord;
    float* out = p.out + begin;
    int done = 0;
    if (kVec) {
      done = len / 4 * 4;
      for (int i = 4 * threadIdx.x; i < done; i += 4 * blockDim.x) {
        const uint32_t bits = words[i / kBitsPerWord] >> (i % kBitsPerWord);  // i % 4 == 0: 4 bits in one word
        float4 prev = p.accumulate ? *reinterpret_cast<const float4*>(out + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        float4 v;
        v.x = sign_decode(prev.x, bits & 1u, scale, p.alpha);
        v.y = sign_decode(prev.y, (bits >> 1) & 1u, scale, p.alpha);
        v.z = sign_decode(prev.z, (bits >> 2) & 1u, scale, p.alpha);
        v.w = sign_decode(prev.w, (bits >> 3) & 1u, scale, p.alpha);
        *reinterpret_cast<float4*>(out + i) = v;
      }
    }
    for (int i = done + threadIdx.x; i < len; i += blockDim.x) {
      const uint32_t bit = (words[i / kBitsPerWord] >> (i % kBitsPerWord)) & 1u;
      out[i] = sign_decode(p.accumulate ? out[i] : 0.0f, bit, scale, p.alpha);
    }
  }
}

}  // namespace

void sign_encode_cuda(const SignEncodeParams& p, void* stream) {
  const int64_t nchunks = sign_num_chunks(p.n, p.chunk);
  if (nchunks == 0) return;
  const unsigned int blocks = warp_per_chunk_blocks(nchunks);
  auto s = static_cast<cudaStream_t>(stream);
  if (p.chunk == 64 * kLanes)
    sign_encode_regs_kernel<64><<<blocks, kWarpsPerBlock * kLanes, 0, s>>>(p, nchunks);
  else
    sign_encode_kernel<<<blocks, kWarpsPerBlock * kLanes, 0, s>>>(p, nchunks);
  HC_CUDA_LAUNCH_CHECK("sign_encode");
}

void sign_decode_cuda(const SignDecodeParams& p, void* stream) {
  const int64_t nchunks = sign_num_chunks(p.n, p.chunk);
  if (nchunks == 0) return;
  const unsigned int blocks = block_per_chunk_blocks(nchunks);
  auto s = static_cast<cudaStream_t>(stream);
  // chunk is a multiple of 32: every chunk of an aligned out starts aligned
  if (reinterpret_cast<uintptr_t>(p.out) % 16 == 0)
    sign_decode_kernel<true><<<blocks, 256, 0, s>>>(p, nchunks);
  else
    sign_decode_kernel<false><<<blocks, 256, 0, s>>>(p, nchunks);
  HC_CUDA_LAUNCH_CHECK("sign_decode");
}

}  // namespace kernels
}  // namespace hetcomm
