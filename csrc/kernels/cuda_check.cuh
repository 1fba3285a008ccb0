// Launch helpers for the torch-free CUDA kernels.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace hetcomm {
namespace kernels {

inline void cuda_check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("hetcomm: CUDA launch of ") + what + " failed: " + cudaGetErrorString(err));
}

inline unsigned int grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 65535 * 32 ? (blocks > 0 ? blocks : 1) : 65535 * 32);
}

}  // namespace kernels
}  // namespace hetcomm
