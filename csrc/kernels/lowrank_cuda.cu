// CUDA twins of lowrank_cpu.cpp: the outer product and the step's end (one
// thread per output element, the same outer_element and lowrank_residual) and
// Gram-Schmidt (one block of kDotLanes threads per matrix, the same lanes and
// tree), so CPU and every GPU give the same bits.
#include "kernels/cuda_check.cuh"
#include "kernels/lowrank.h"

#include <algorithm>

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

__global__ void lowrank_finish_kernel(const float* p, const float* qt, float* x, float* residual, float divisor,
                                      float share, int64_t rows, int64_t cols, int64_t r) {
  const int64_t n = rows * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / cols, j = e % cols;
    const float out = outer_element(p + i * r, qt, cols, r, j);
    if (residual != nullptr) residual[e] = lowrank_residual(x[e], divisor, residual[e], share, out);
    x[e] = out;
  }
}

// Matrices per launch, passed by value (a kernel's parameters may take 4 KB).
constexpr int kBlocksPerLaunch = 64;

struct BlockList {
  ColumnBlock block[kBlocksPerLaunch];
};

// Thread t owns rows t, t + kDotLanes, ...: it forms their lane of each dot
// product and then updates those rows only, so between one column's
// reduction and the next nothing but the shared partial sums is exchanged.
__global__ void __launch_bounds__(kDotLanes) orthonormalize_kernel(float* base, BlockList list, float eps) {
  __shared__ double lane[kDotLanes];
  const ColumnBlock b = list.block[blockIdx.x];
  float* p = base + b.offset;
  const int t = threadIdx.x;
  for (int64_t k = 0; k < b.cols; ++k) {
    for (int64_t j = 0; j <= k; ++j) {  // j < k: projections; j == k: the norm
      double acc = 0.0;
      for (int64_t i = t; i < b.rows; i += kDotLanes) acc = dot_step(acc, p[i * b.cols + k], p[i * b.cols + j]);
      lane[t] = acc;
      __syncthreads();
      for (int offset = kDotLanes / 2; offset > 0; offset >>= 1) {
        if (t < offset) lane[t] = dot_add(lane[t], lane[t + offset]);
        __syncthreads();
      }
      const double total = lane[0];
      __syncthreads();  // every thread has read it before the next dot overwrites it
      if (j < k) {
        const float d = static_cast<float>(total);
        for (int64_t i = t; i < b.rows; i += kDotLanes) p[i * b.cols + k] = project_out(p[i * b.cols + k], d, p[i * b.cols + j]);
      } else {
        const float norm = column_norm(total, eps);
        if (norm == 0.0f) continue;  // a zero column (eps 0) stays zero
        for (int64_t i = t; i < b.rows; i += kDotLanes) p[i * b.cols + k] = div_rn(p[i * b.cols + k], norm);
      }
    }
  }
}

}  // namespace

void orthonormalize_blocks_cuda(float* base, const ColumnBlock* blocks, int64_t count, float eps, void* stream) {
  for (int64_t first = 0; first < count; first += kBlocksPerLaunch) {
    const int n = static_cast<int>(std::min<int64_t>(kBlocksPerLaunch, count - first));
    BlockList list{};
    for (int i = 0; i < n; ++i) list.block[i] = blocks[first + i];
    orthonormalize_kernel<<<n, kDotLanes, 0, static_cast<cudaStream_t>(stream)>>>(base, list, eps);
    HC_CUDA_LAUNCH_CHECK("orthonormalize");
  }
}

void lowrank_finish_cuda(const float* p, const float* qt, float* x, float* residual, float divisor, float share,
                         int64_t rows, int64_t cols, int64_t r, void* stream) {
  if (rows * cols == 0) return;
  lowrank_finish_kernel<<<grid_for(rows * cols, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      p, qt, x, residual, divisor, share, rows, cols, r);
  HC_CUDA_LAUNCH_CHECK("lowrank_finish");
}

void outer_product_cuda(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r,
                        void* stream) {
  if (rows * cols == 0) return;
  outer_product_kernel<<<grid_for(rows * cols, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(p, qt, out, rows,
                                                                                                  cols, r);
  HC_CUDA_LAUNCH_CHECK("outer_product");
}

}  // namespace kernels
}  // namespace hetcomm
