// Launch helpers for the torch-free CUDA kernels (checks: csrc/checks.h).
#pragma once

#include <cuda_runtime.h>

#include "checks.h"

namespace hetcomm {
namespace kernels {

inline unsigned int grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 65535 * 32 ? (blocks > 0 ? blocks : 1) : 65535 * 32);
}

}  // namespace kernels
}  // namespace hetcomm
