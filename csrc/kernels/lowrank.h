// Deterministic dense pieces of the low-rank codec. Torch-free.
// Every rank runs these on identical inputs (the all-reduced P and Q), so they
// must give identical bits in every process: fixed loop order, no BLAS (whose
// blocking can depend on memory alignment).
#pragma once

#include <cstdint>

#include "kernels/codec_math.h"

namespace hetcomm {
namespace kernels {

// Element (i, j) of p (rows x r) @ qt (r x cols): the r products added in
// order k = 0, 1, ..., from 0, each rounded (no FMA). The CPU loop and the
// CUDA kernel both compute exactly this, so every device gives the same bits.
HC_HD float outer_element(const float* p_row, const float* qt, int64_t cols, int64_t r, int64_t j) {
  float acc = 0.0f;
  for (int64_t k = 0; k < r; ++k) acc = mul_add_rn(p_row[k], qt[k * cols + j], acc);
  return acc;
}

// Modified Gram-Schmidt on the columns of p (rows x cols, row-major), in
// place: each column loses its projections on the previous ones, then is
// divided by (its norm + eps). Dot products accumulate in double.
void orthonormalize_columns_cpu(float* p, int64_t rows, int64_t cols, float eps);

// out (rows x cols) = p (rows x r) @ qt (r x cols), row-major; rows [row_begin, row_end).
// (qt is Q transposed, so the inner loop runs over contiguous memory.)
void outer_product_cpu(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r,
                       int64_t row_begin, int64_t row_end);
// The same on the GPU, enqueued on `stream` (a cudaStream_t).
void outer_product_cuda(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r,
                        void* stream);

}  // namespace kernels
}  // namespace hetcomm
