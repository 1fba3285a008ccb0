// Deterministic dense pieces of the low-rank codec. Torch-free.
// Every rank runs these on identical inputs (the all-reduced P and Q), so they
// must give identical bits in every process: fixed loop order, no BLAS (whose
// blocking can depend on memory alignment).
#pragma once

#include <cstdint>

namespace hetcomm {
namespace kernels {

// Modified Gram-Schmidt on the columns of p (rows x cols, row-major), in
// place: each column loses its projections on the previous ones, then is
// divided by (its norm + eps). Dot products accumulate in double.
void orthonormalize_columns_cpu(float* p, int64_t rows, int64_t cols, float eps);

// out (rows x cols) = p (rows x r) @ qt (r x cols), row-major; rows [row_begin, row_end).
// (qt is Q transposed, so the inner loop runs over contiguous memory.)
void outer_product_cpu(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r,
                       int64_t row_begin, int64_t row_end);

}  // namespace kernels
}  // namespace hetcomm
