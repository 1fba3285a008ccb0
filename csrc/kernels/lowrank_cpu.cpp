#include "kernels/lowrank.h"

#include <cmath>

#include "kernels/codec_math.h"

namespace hetcomm {
namespace kernels {

void orthonormalize_columns_cpu(float* p, int64_t rows, int64_t cols, float eps) {
  for (int64_t k = 0; k < cols; ++k) {
    for (int64_t j = 0; j < k; ++j) {
      double dot = 0.0;
      for (int64_t i = 0; i < rows; ++i) dot += static_cast<double>(p[i * cols + k]) * p[i * cols + j];
      const float d = static_cast<float>(dot);
      for (int64_t i = 0; i < rows; ++i) p[i * cols + k] = add_rn(p[i * cols + k], -(d * p[i * cols + j]));
    }
    double sq = 0.0;
    for (int64_t i = 0; i < rows; ++i) sq += static_cast<double>(p[i * cols + k]) * p[i * cols + k];
    const float norm = static_cast<float>(std::sqrt(sq)) + eps;
    if (norm == 0.0f) continue;  // a zero column (eps 0) stays zero
    for (int64_t i = 0; i < rows; ++i) p[i * cols + k] = div_rn(p[i * cols + k], norm);
  }
}

HC_CPU_CLONES
void outer_product_cpu(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r,
                       int64_t row_begin, int64_t row_end) {
  // outer_element's sum, k outermost so the j loop vectorises: each o[j]
  // starts at 0 and takes the products k = 0, 1, ... in order, exactly as there.
  for (int64_t i = row_begin; i < row_end; ++i) {
    float* o = out + i * cols;
    for (int64_t j = 0; j < cols; ++j) o[j] = 0.0f;
    for (int64_t k = 0; k < r; ++k) {
      const float a = p[i * r + k];
      const float* qk = qt + k * cols;
      for (int64_t j = 0; j < cols; ++j) o[j] = mul_add_rn(a, qk[j], o[j]);
    }
  }
}

}  // namespace kernels
}  // namespace hetcomm
