// CUDA twin of momentum_cpu.cpp: the same fold-in and hand-over, elementwise.
#include "kernels/codec_math.h"
#include "kernels/cuda_check.cuh"
#include "kernels/momentum.h"

namespace hetcomm {
namespace kernels {

namespace {

__global__ void momentum_fold_in_kernel(float* x, const float* m, float alpha, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = mul_add_rn(alpha, m[i], x[i]);
}

__global__ void momentum_handoff_kernel(float* x, float* m, float beta, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float m_new = x[i];
    x[i] = momentum_delta(m_new, m[i], beta);
    m[i] = m_new;
  }
}

}  // namespace

void momentum_fold_in_cuda(float* x, const float* m, float alpha, int64_t n, void* stream) {
  if (n == 0) return;
  momentum_fold_in_kernel<<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(x, m, alpha, n);
  HC_CUDA_LAUNCH_CHECK("momentum_fold_in");
}

void momentum_handoff_cuda(float* x, float* m, float beta, int64_t n, void* stream) {
  if (n == 0) return;
  momentum_handoff_kernel<<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(x, m, beta, n);
  HC_CUDA_LAUNCH_CHECK("momentum_handoff");
}

}  // namespace kernels
}  // namespace hetcomm
