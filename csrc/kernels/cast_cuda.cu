// CUDA twin of cast_cpu.cpp: the same scaled conversions, elementwise.
#include "kernels/cast.h"
#include "kernels/codec_math.h"
#include "kernels/cuda_check.cuh"

namespace hetcomm {
namespace kernels {

namespace {

// Four elements a thread where the pointers allow 16-byte loads (8-byte
// stores): a quarter of the threads and twice the bytes in flight per load of
// the one-element loop (ncu: 30 % of DRAM bandwidth with one). The rest, and
// misaligned views, one element a thread. The same per-element math either way.
struct Cast4 {
  uint16_t v[4];
};

__device__ __forceinline__ uint16_t encode_one(Wire16 fmt, float x, float divisor) {
  return fmt == Wire16::kHalf ? scaled_to_half(x, divisor) : scaled_to_bf16(x, divisor);
}

__device__ __forceinline__ float decode_one(Wire16 fmt, uint16_t x, float mul) {
  return fmt == Wire16::kHalf ? half_scaled(x, mul) : bf16_scaled(x, mul);
}

__global__ void cast_encode_kernel(Wire16 fmt, const float* in, float divisor, uint16_t* out, int64_t n,
                                   int64_t n4) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t q = first; q < n4; q += stride) {
    const float4 a = reinterpret_cast<const float4*>(in)[q];
    Cast4 c;
    c.v[0] = encode_one(fmt, a.x, divisor);
    c.v[1] = encode_one(fmt, a.y, divisor);
    c.v[2] = encode_one(fmt, a.z, divisor);
    c.v[3] = encode_one(fmt, a.w, divisor);
    reinterpret_cast<uint2*>(out)[q] = *reinterpret_cast<const uint2*>(&c);
  }
  for (int64_t i = 4 * n4 + first; i < n; i += stride) out[i] = encode_one(fmt, in[i], divisor);
}

__global__ void cast_decode_kernel(Wire16 fmt, const uint16_t* in, float mul, float* out, int64_t n, int64_t n4) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t q = first; q < n4; q += stride) {
    const uint2 raw = reinterpret_cast<const uint2*>(in)[q];
    const Cast4& c = *reinterpret_cast<const Cast4*>(&raw);
    reinterpret_cast<float4*>(out)[q] =
        make_float4(decode_one(fmt, c.v[0], mul), decode_one(fmt, c.v[1], mul), decode_one(fmt, c.v[2], mul),
                    decode_one(fmt, c.v[3], mul));
  }
  for (int64_t i = 4 * n4 + first; i < n; i += stride) out[i] = decode_one(fmt, in[i], mul);
}

// Elements taken four at a time: all of whole quads when both pointers allow it, else none.
inline int64_t quads(const void* f32, const void* u16, int64_t n) {
  const bool aligned = reinterpret_cast<uintptr_t>(f32) % 16 == 0 && reinterpret_cast<uintptr_t>(u16) % 8 == 0;
  return aligned ? n / 4 : 0;
}

}  // namespace

void cast_encode_cuda(Wire16 fmt, const float* in, float divisor, uint16_t* out, int64_t n, void* stream) {
  if (n == 0) return;
  const int64_t n4 = quads(in, out, n);
  cast_encode_kernel<<<grid_for(n4 > 0 ? n4 : n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(fmt, in, divisor,
                                                                                                    out, n, n4);
  HC_CUDA_LAUNCH_CHECK("cast_encode");
}

void cast_decode_cuda(Wire16 fmt, const uint16_t* in, float mul, float* out, int64_t n, void* stream) {
  if (n == 0) return;
  const int64_t n4 = quads(out, in, n);
  cast_decode_kernel<<<grid_for(n4 > 0 ? n4 : n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(fmt, in, mul, out,
                                                                                                    n, n4);
  HC_CUDA_LAUNCH_CHECK("cast_decode");
}

}  // namespace kernels
}  // namespace hetcomm
