// Deterministic dense pieces of the low-rank codec. Torch-free.
// Every rank runs these on identical inputs (the all-reduced P and Q), so they
// must give identical bits in every process: fixed loop order, no BLAS (whose
// blocking can depend on memory alignment).
#pragma once

#include <cmath>
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

// Error feedback's residual after a step: what this rank's share of the
// approximation `out` did not deliver of its input M = x / divisor + residual.
HC_HD float lowrank_residual(float x, float divisor, float residual, float share, float out) {
  return add_rn(ef_input(x, divisor, residual), -mul_rn(share, out));
}

// ---- Modified Gram-Schmidt, the same bits on the CPU and every GPU ----------
// A matrix inside a flat float buffer: rows x cols, row-major, from offset.
struct ColumnBlock {
  int64_t offset, rows, cols;
};

// Dot products of two columns accumulate in double in a fixed order: lane t
// (of kDotLanes, a CUDA block's threads) sums rows t, t + kDotLanes, ... in
// turn, then the lanes are added in a fixed tree (at offset o, lane i < o adds
// lane i + o), as the block's shared-memory reduction does. A float product
// is exact in double, so fused or not, every device rounds each sum alike.
constexpr int kDotLanes = 256;

HC_HD double dot_step(double acc, float a, float b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(__dmul_rn(a, b), acc);
#else
  return static_cast<double>(a) * static_cast<double>(b) + acc;
#endif
}

HC_HD double dot_add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// Column k loses its projection d on an earlier (unit) column: p_k - d p_j.
HC_HD float project_out(float pk, float d, float pj) { return add_rn(pk, -mul_rn(d, pj)); }

// A column's divisor: its norm (sqrt of the sum of squares) + eps.
HC_HD float column_norm(double sum_squares, float eps) {
  return add_rn(static_cast<float>(sqrt(sum_squares)), eps);
}

// Modified Gram-Schmidt on the columns of p (rows x cols, row-major), in
// place: each column loses its projections on the previous ones, then is
// divided by (its norm + eps); a zero column stays zero (eps 0).
void orthonormalize_columns_cpu(float* p, int64_t rows, int64_t cols, float eps);
// The same for `count` matrices inside `base` (one CUDA block each), enqueued
// on `stream` (a cudaStream_t): no copy to the host and back.
void orthonormalize_blocks_cuda(float* base, const ColumnBlock* blocks, int64_t count, float eps, void* stream);

// out (rows x cols) = p (rows x r) @ qt (r x cols), row-major; rows [row_begin, row_end).
// (qt is Q transposed, so the inner loop runs over contiguous memory.)
void outer_product_cpu(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r,
                       int64_t row_begin, int64_t row_end);
// The same on the GPU, enqueued on `stream` (a cudaStream_t).
void outer_product_cuda(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r,
                        void* stream);
// The step's end in one pass over a matrix: x (rows x cols, this rank's
// gradient) becomes p @ qt (outer_element, every rank the same bits) and, with
// `residual`, residual becomes lowrank_residual of the old x; rows
// [row_begin, row_end). `row` holds cols floats of scratch.
void lowrank_finish_cpu(const float* p, const float* qt, float* x, float* residual, float divisor, float share,
                        int64_t rows, int64_t cols, int64_t r, float* row, int64_t row_begin, int64_t row_end);
// The two products of a step with M = x * inv_divisor + residual (residual
// null: x * inv_divisor), M formed as they run (in registers, or a row's
// piece in scratch), never stored; x, residual: rows x cols, row-major. Summed over the ranks, P and Q^T need no
// bits in common between processes, only a fixed order here (independent of
// the row or column range a thread takes): not BLAS, whose products of a
// matrix with 4-16 columns ran at a third of memory's bandwidth on the CPU
// (bench/README "lowrank's products in one pass over x and the residual").
// p (rows x r) = M qt^T, qt (r x cols) = Q^T: rows [row_begin, row_end); `row`
// holds cols floats of scratch.
void lowrank_project_cpu(const float* x, const float* residual, float inv_divisor, const float* qt, float* p,
                         int64_t rows, int64_t cols, int64_t r, float* row, int64_t row_begin, int64_t row_end);
// qt (r x cols) = p^T M, p (rows x r): columns [col_begin, col_end), each entry
// the sum over rows 0, 1, ... in order; `seg` holds kBackProjectRows (col_end - col_begin) floats.
constexpr int64_t kBackProjectRows = 4;
void lowrank_back_project_cpu(const float* x, const float* residual, float inv_divisor, const float* p, float* qt,
                              int64_t rows, int64_t cols, int64_t r, float* seg, int64_t col_begin, int64_t col_end);
// A part sent dense: out[i] = x[i] / divisor (+ residual[i] where residual is
// not null), each rounded: the bits of torch's division by a float scalar,
// then its addition. Elements [begin, end).
void dense_input_cpu(const float* x, const float* residual, float divisor, float* out, int64_t begin, int64_t end);
// The same on the GPU, enqueued on `stream` (a cudaStream_t).
void lowrank_finish_cuda(const float* p, const float* qt, float* x, float* residual, float divisor, float share,
                         int64_t rows, int64_t cols, int64_t r, void* stream);

}  // namespace kernels
}  // namespace hetcomm
