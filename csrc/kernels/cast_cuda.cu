// CUDA twin of cast_cpu.cpp: the same scaled conversions, elementwise.
#include "kernels/cast.h"
#include "kernels/codec_math.h"
#include "kernels/cuda_check.cuh"

namespace hetcomm {
namespace kernels {

namespace {

__global__ void cast_encode_kernel(Wire16 fmt, const float* in, float divisor, uint16_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = fmt == Wire16::kHalf ? scaled_to_half(in[i], divisor) : scaled_to_bf16(in[i], divisor);
}

__global__ void cast_decode_kernel(Wire16 fmt, const uint16_t* in, float mul, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = fmt == Wire16::kHalf ? half_scaled(in[i], mul) : bf16_scaled(in[i], mul);
}

}  // namespace

void cast_encode_cuda(Wire16 fmt, const float* in, float divisor, uint16_t* out, int64_t n, void* stream) {
  if (n == 0) return;
  cast_encode_kernel<<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(fmt, in, divisor, out, n);
  HC_CUDA_LAUNCH_CHECK("cast_encode");
}

void cast_decode_cuda(Wire16 fmt, const uint16_t* in, float mul, float* out, int64_t n, void* stream) {
  if (n == 0) return;
  cast_decode_kernel<<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(fmt, in, mul, out, n);
  HC_CUDA_LAUNCH_CHECK("cast_decode");
}

}  // namespace kernels
}  // namespace hetcomm
