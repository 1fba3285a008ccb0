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

// onebit's chunk of 32, which int3 shares (one value per lane): a warp takes
// kSmallChunks chunks, each lane's values held in registers between the max
// and the codes, so g and e are read once and the loads of 4 chunks are in
// flight together (the warp-per-chunk kernel above: 0.32-0.34 of a copy's
// bandwidth on an H200). Lane 3j + k stores chunk j's word k, lane j its scale.
constexpr int kSmallChunks = 4;

__global__ void __launch_bounds__(kWarpsPerBlock * kLanes) int3_encode_c32_kernel(Int3EncodeParams p, int64_t nchunks) {
  const int lane = threadIdx.x % kLanes;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kLanes) * kSmallChunks;
  if (first >= nchunks) return;
  const int count = static_cast<int>(min(static_cast<int64_t>(kSmallChunks), nchunks - first));
  float x[kSmallChunks];
  uint32_t amax[kSmallChunks];
#pragma unroll
  for (int j = 0; j < kSmallChunks; ++j) {
    const int64_t i = (first + j) * kLanes + lane;  // >= n past the last chunk
    x[j] = i < p.n ? ef_input(__ldg(p.grad + i), p.divisor, p.residual ? p.residual[i] : 0.0f) : 0.0f;
    amax[j] = i < p.n ? magnitude_bits(x[j]) : 0u;
  }
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1)
#pragma unroll
    for (int j = 0; j < kSmallChunks; ++j) amax[j] = max(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], offset));
  uint16_t my_scale = 0;
  uint32_t my_word = 0;
#pragma unroll
  for (int j = 0; j < kSmallChunks; ++j) {
    if (j >= count) break;  // the same for the whole warp
    const uint16_t bits = int3_scale_bits(bits_float(amax[j]));
    const float scale = bf16_to_float(bits);
    const int64_t i = (first + j) * kLanes + lane;
    uint32_t code = 0;  // absent codes are 0, as on the CPU
    if (i < p.n) {
      code = int3_code(x[j], scale);
      if (p.residual) p.residual[i] = int3_residual(x[j], code, scale);
    }
    const uint32_t w0 = __ballot_sync(0xffffffffu, code & 1u);
    const uint32_t w1 = __ballot_sync(0xffffffffu, (code >> 1) & 1u);
    const uint32_t w2 = __ballot_sync(0xffffffffu, (code >> 2) & 1u);
    if (lane == j) my_scale = bits;
    if (lane == 3 * j) my_word = w0;
    if (lane == 3 * j + 1) my_word = w1;
    if (lane == 3 * j + 2) my_word = w2;
  }
  if (lane < count) p.scales[first + lane] = my_scale;
  if (lane < 3 * count) p.words[3 * first + lane] = my_word;  // chunk 32: three words per chunk
}

// Four consecutive elements a thread (grid-stride), as sign_decode: the four
// share their 32's three words and a chunk (both multiples of 4), so three
// word loads, one scale load and, where out is 16-byte aligned, one 16-byte
// store. The first version decoded one element a thread with a 64-bit
// division for its chunk: 0.19 of a copy's bandwidth on an H200.
template <bool kVec>
__global__ void int3_decode_kernel(Int3DecodeParams p, int64_t nquads) {
  const uint32_t groups_per_chunk = static_cast<uint32_t>(p.chunk / kBitsPerWord);
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < nquads;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = 4 * q;
    const uint32_t group = static_cast<uint32_t>(i / kBitsPerWord);  // < 2^32: n < 2^37
    const uint32_t c = groups_per_chunk == 1 ? group : group / groups_per_chunk;
    const float scale = bf16_to_float(p.scales[c]);
    const uint32_t* w = p.words + 3 * static_cast<int64_t>(group);
    const int shift = static_cast<int>(i % kBitsPerWord);
    const uint32_t w0 = w[0] >> shift, w1 = w[1] >> shift, w2 = w[2] >> shift;
    float* out = p.out + i;
    if (kVec && i + 4 <= p.n) {
      const float4 prev = p.accumulate ? *reinterpret_cast<const float4*>(out) : make_float4(0.f, 0.f, 0.f, 0.f);
      float4 v;
      v.x = int3_decode(prev.x, int3_unpack(w0, w1, w2, 0), scale, p.alpha);
      v.y = int3_decode(prev.y, int3_unpack(w0, w1, w2, 1), scale, p.alpha);
      v.z = int3_decode(prev.z, int3_unpack(w0, w1, w2, 2), scale, p.alpha);
      v.w = int3_decode(prev.w, int3_unpack(w0, w1, w2, 3), scale, p.alpha);
      *reinterpret_cast<float4*>(out) = v;
    } else {
      const int len = static_cast<int>(min(static_cast<int64_t>(4), p.n - i));
      for (int j = 0; j < len; ++j)
        out[j] = int3_decode(p.accumulate ? out[j] : 0.0f, int3_unpack(w0, w1, w2, j), scale, p.alpha);
    }
  }
}

}  // namespace

void int3_encode_cuda(const Int3EncodeParams& p, void* stream) {
  const int64_t nchunks = int3_num_chunks(p.n, p.chunk);
  if (nchunks == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (p.chunk == kLanes)
    int3_encode_c32_kernel<<<warp_per_chunk_blocks((nchunks + kSmallChunks - 1) / kSmallChunks),
                             kWarpsPerBlock * kLanes, 0, s>>>(p, nchunks);
  else
    int3_encode_kernel<<<warp_per_chunk_blocks(nchunks), kWarpsPerBlock * kLanes, 0, s>>>(p, nchunks);
  HC_CUDA_LAUNCH_CHECK("int3_encode");
}

void int3_decode_cuda(const Int3DecodeParams& p, void* stream) {
  if (p.n == 0) return;
  const int64_t nquads = (p.n + 3) / 4;
  auto s = static_cast<cudaStream_t>(stream);
  if (reinterpret_cast<uintptr_t>(p.out) % 16 == 0)
    int3_decode_kernel<true><<<grid_for(nquads, 256), 256, 0, s>>>(p, nquads);
  else
    int3_decode_kernel<false><<<grid_for(nquads, 256), 256, 0, s>>>(p, nquads);
  HC_CUDA_LAUNCH_CHECK("int3_decode");
}

}  // namespace kernels
}  // namespace hetcomm
