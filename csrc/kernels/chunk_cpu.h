// A chunked encoder's first pass on the CPU (fp8, int3): x = grad / divisor +
// residual into a scratch buffer, and the largest |x| as bits (for magnitudes
// the integer order is the float order and NaN is largest: exact in any
// order, so the CUDA warps find the same). Inlined into each encoder's
// multi-versioned loop.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/codec_math.h"

namespace hetcomm {
namespace kernels {

inline __attribute__((always_inline)) uint32_t ef_input_amax(const float* g, const float* e, float divisor,
                                                             int64_t len, float* x) {
  if (e) {
    for (int64_t i = 0; i < len; ++i) x[i] = ef_input(g[i], divisor, e[i]);
  } else {
    for (int64_t i = 0; i < len; ++i) x[i] = ef_input(g[i], divisor, 0.0f);
  }
  uint32_t amax = 0;
  for (int64_t i = 0; i < len; ++i) amax = std::max(amax, magnitude_bits(x[i]));
  return amax;
}

}  // namespace kernels
}  // namespace hetcomm
