// CUDA twin of outer_product_cpu (lowrank_cpu.cpp): one thread per output
// element, the same outer_element, so CPU and every GPU give the same bits.
#include "kernels/cuda_check.cuh"
#include "kernels/lowrank.h"

namespace hetcomm {
namespace kernels {

namespace {

__global__ void outer_product_kernel(const float* p, const float* qt, float* out, int64_t rows, int64_t cols,
                                     int64_t r) {
  const int64_t n = rows * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / cols, j = e % cols;
    out[e] = outer_element(p + i * r, qt, cols, r, j);
  }
}

}  // namespace

void outer_product_cuda(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r,
                        void* stream) {
  if (rows * cols == 0) return;
  outer_product_kernel<<<grid_for(rows * cols, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(p, qt, out, rows,
                                                                                                  cols, r);
  HC_CUDA_LAUNCH_CHECK("outer_product");
}

}  // namespace kernels
}  // namespace hetcomm
