#include "kernels/lowrank.h"

#include <cmath>

#include "kernels/codec_math.h"

namespace hetcomm {
namespace kernels {

namespace {

// Columns a and b's dot product in kDotLanes lanes and the tree (lowrank.h).
double column_dot(const float* p, int64_t rows, int64_t cols, int64_t a, int64_t b) {
  double lane[kDotLanes] = {};
  for (int64_t i = 0; i < rows; ++i) lane[i % kDotLanes] = dot_step(lane[i % kDotLanes], p[i * cols + a], p[i * cols + b]);
  for (int offset = kDotLanes / 2; offset > 0; offset >>= 1)
    for (int i = 0; i < offset; ++i) lane[i] = dot_add(lane[i], lane[i + offset]);
  return lane[0];
}

// Row p_row @ qt (cols entries) into o: outer_element's sum, k outermost so
// the j loop vectorises: each o[j] starts at 0 and takes the products k = 0,
// 1, ... in order, exactly as there.
HC_HD void outer_row(const float* p_row, const float* qt, float* o, int64_t cols, int64_t r) {
  for (int64_t j = 0; j < cols; ++j) o[j] = 0.0f;
  for (int64_t k = 0; k < r; ++k) {
    const float a = p_row[k];
    const float* qk = qt + k * cols;
    for (int64_t j = 0; j < cols; ++j) o[j] = mul_add_rn(a, qk[j], o[j]);
  }
}

}  // namespace

void orthonormalize_columns_cpu(float* p, int64_t rows, int64_t cols, float eps) {
  for (int64_t k = 0; k < cols; ++k) {
    for (int64_t j = 0; j < k; ++j) {
      const float d = static_cast<float>(column_dot(p, rows, cols, k, j));
      for (int64_t i = 0; i < rows; ++i) p[i * cols + k] = project_out(p[i * cols + k], d, p[i * cols + j]);
    }
    const float norm = column_norm(column_dot(p, rows, cols, k, k), eps);
    if (norm == 0.0f) continue;  // a zero column (eps 0) stays zero
    for (int64_t i = 0; i < rows; ++i) p[i * cols + k] = div_rn(p[i * cols + k], norm);
  }
}

HC_CPU_CLONES
void lowrank_finish_cpu(const float* p, const float* qt, float* x, float* residual, float divisor, float share,
                        int64_t rows, int64_t cols, int64_t r, float* row, int64_t row_begin, int64_t row_end) {
  for (int64_t i = row_begin; i < row_end; ++i) {
    float* xi = x + i * cols;
    if (residual == nullptr) {  // the old x is not read: the row goes straight into it
      outer_row(p + i * r, qt, xi, cols, r);
      continue;
    }
    outer_row(p + i * r, qt, row, cols, r);
    float* ri = residual + i * cols;
    for (int64_t j = 0; j < cols; ++j) {
      ri[j] = lowrank_residual(xi[j], divisor, ri[j], share, row[j]);
      xi[j] = row[j];
    }
  }
}

HC_CPU_CLONES
void outer_product_cpu(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r,
                       int64_t row_begin, int64_t row_end) {
  for (int64_t i = row_begin; i < row_end; ++i) outer_row(p + i * r, qt, out + i * cols, cols, r);
}

void dense_input_cpu(const float* x, const float* residual, float divisor, float* out, int64_t begin, int64_t end) {
  if (residual == nullptr) {
    for (int64_t i = begin; i < end; ++i) out[i] = x[i] / divisor;
  } else {
    for (int64_t i = begin; i < end; ++i) out[i] = x[i] / divisor + residual[i];
  }
}

}  // namespace kernels
}  // namespace hetcomm
