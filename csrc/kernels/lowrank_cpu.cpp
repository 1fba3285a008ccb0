#include "kernels/lowrank.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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

// Eight floats in one register where the clone has them (AVX2: one ymm; the
// baseline: two xmm), whichever the compiler's loop vectoriser would make.
typedef float Float8 __attribute__((vector_size(32)));
constexpr int64_t kF8 = 8;

// (every helper of the clones below is inlined into them, HC_HD: a call out of the AVX2 clone would run the
// baseline's code and pass its vectors through memory)
#define HC_LAMBDA_INLINE __attribute__((always_inline))

HC_HD Float8 load8(const float* p) {
  Float8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

HC_HD void store8(float* p, Float8 v) { std::memcpy(p, &v, sizeof v); }

HC_HD Float8 splat8(float a) { return Float8{a, a, a, a, a, a, a, a}; }

// The lanes of v added in a fixed tree (lane i + width into lane i, width 4, 2, 1).
HC_HD float lanes_sum(Float8 v) {
  float a[kF8];
  std::memcpy(a, &v, sizeof a);
  for (int width = kF8 / 2; width > 0; width >>= 1)
    for (int l = 0; l < width; ++l) a[l] += a[l + width];
  return a[0];
}

// A row (or a piece of one) of M = x * inv_divisor + residual (residual null: x * inv_divisor) into m.
HC_HD void m_row(const float* x, const float* residual, float inv_divisor, float* m, int64_t n) {
  const int64_t body = n - n % kF8;
  const Float8 inv = splat8(inv_divisor);
  if (residual == nullptr) {
    for (int64_t j = 0; j < body; j += kF8) store8(m + j, load8(x + j) * inv);
    for (int64_t j = body; j < n; ++j) m[j] = x[j] * inv_divisor;
  } else {
    for (int64_t j = 0; j < body; j += kF8) store8(m + j, load8(x + j) * inv + load8(residual + j));
    for (int64_t j = body; j < n; ++j) m[j] = x[j] * inv_divisor + residual[j];
  }
}

// Columns of Q a pass over a row takes together.
constexpr int64_t kProjectGroup = 4;

// A row of M's products with up to kProjectGroup columns of Q (q: their rows
// of Q^T), into out[0..count): each in two registers of lanes (the even and
// the odd chunks of 8: two chains of additions, not one), their sum's lanes in
// a fixed tree, then the columns past the last chunk in order. The row's M is
// read from `m` (kFormed), or formed from x and the residual as the products
// run, as m_row forms it (then `m` holds only what lies past the last chunk).
template <bool kFormed>
HC_HD void project_row(const float* x, const float* residual, float inv_divisor, float* m,
                           const float* const* q, int64_t count, int64_t cols, float* out) {
  const int64_t pairs = cols - cols % (2 * kF8), body = cols - cols % kF8;
  const Float8 inv = splat8(inv_divisor);
  const auto chunk = [&](int64_t j) HC_LAMBDA_INLINE {
    if (kFormed) return load8(m + j);
    const Float8 a = load8(x + j) * inv;
    return residual == nullptr ? a : a + load8(residual + j);
  };
  Float8 even[kProjectGroup] = {}, odd[kProjectGroup] = {};
  for (int64_t j = 0; j < pairs; j += 2 * kF8) {
    const Float8 a = chunk(j), b = chunk(j + kF8);
    for (int64_t g = 0; g < kProjectGroup; ++g) {
      even[g] += a * load8(q[g] + j);
      odd[g] += b * load8(q[g] + j + kF8);
    }
  }
  if (body > pairs) {
    const Float8 a = chunk(pairs);
    for (int64_t g = 0; g < kProjectGroup; ++g) even[g] += a * load8(q[g] + pairs);
  }
  if (!kFormed) m_row(x + body, residual == nullptr ? nullptr : residual + body, inv_divisor, m + body, cols - body);
  for (int64_t g = 0; g < count; ++g) {
    float t = lanes_sum(even[g] + odd[g]);
    for (int64_t j = body; j < cols; ++j) t += m[j] * q[g][j];
    out[g] = t;
  }
}

// kN rows from row i into Q^T's columns [col_begin, col_begin + w): row i + n's piece of M into seg + n w, then
// each entry o of each row k of Q^T becomes (((o + p[i][k] m_i) + p[i+1][k] m_{i+1}) + ...), rows in order.
template <int64_t kN>
HC_HD void back_project_rows(const float* x, const float* residual, float inv_divisor, const float* p, float* qt,
                             int64_t cols, int64_t r, float* seg, int64_t col_begin, int64_t w, int64_t i) {
  const int64_t body = w - w % kF8;
  const float* m[kN];
  for (int64_t n = 0; n < kN; ++n) {
    const int64_t at = (i + n) * cols + col_begin;
    m_row(x + at, residual == nullptr ? nullptr : residual + at, inv_divisor, seg + n * w, w);
    m[n] = seg + n * w;
  }
  for (int64_t k = 0; k < r; ++k) {
    float* o = qt + k * cols + col_begin;
    float a[kN];
    Float8 av[kN];
    for (int64_t n = 0; n < kN; ++n) {
      a[n] = p[(i + n) * r + k];
      av[n] = splat8(a[n]);
    }
    for (int64_t j = 0; j < body; j += kF8) {
      Float8 t = load8(o + j);
      for (int64_t n = 0; n < kN; ++n) t = t + av[n] * load8(m[n] + j);
      store8(o + j, t);
    }
    for (int64_t j = body; j < w; ++j) {
      float t = o[j];
      for (int64_t n = 0; n < kN; ++n) t = t + a[n] * m[n][j];
      o[j] = t;
    }
  }
}

}  // namespace

HC_CPU_CLONES
void lowrank_project_cpu(const float* x, const float* residual, float inv_divisor, const float* qt, float* p,
                         int64_t rows, int64_t cols, int64_t r, float* row, int64_t row_begin, int64_t row_end) {
  (void)rows;
  if (r <= 0) return;  // no columns of Q (and none to read)
  const float* q[kProjectGroup];
  if (r <= kProjectGroup) {  // one pass a row, M formed as it goes (a short group reads its last column again)
    for (int64_t g = 0; g < kProjectGroup; ++g) q[g] = qt + std::min<int64_t>(g, r - 1) * cols;
    for (int64_t i = row_begin; i < row_end; ++i)
      project_row<false>(x + i * cols, residual == nullptr ? nullptr : residual + i * cols, inv_divisor, row, q, r,
                         cols, p + i * r);
    return;
  }
  for (int64_t i = row_begin; i < row_end; ++i) {
    // the row's M once (it stays in the L1 cache for the groups), then up to kProjectGroup columns of Q a pass
    // (a short last group reads its last column again and drops those sums)
    m_row(x + i * cols, residual == nullptr ? nullptr : residual + i * cols, inv_divisor, row, cols);
    for (int64_t k0 = 0; k0 < r; k0 += kProjectGroup) {
      for (int64_t g = 0; g < kProjectGroup; ++g) q[g] = qt + std::min<int64_t>(k0 + g, r - 1) * cols;
      project_row<true>(nullptr, nullptr, inv_divisor, row, q, std::min(kProjectGroup, r - k0), cols, p + i * r + k0);
    }
  }
}

HC_CPU_CLONES
void lowrank_back_project_cpu(const float* x, const float* residual, float inv_divisor, const float* p, float* qt,
                              int64_t rows, int64_t cols, int64_t r, float* seg, int64_t col_begin, int64_t col_end) {
  const int64_t w = col_end - col_begin;
  for (int64_t k = 0; k < r; ++k)
    for (int64_t j = 0; j < w; ++j) qt[k * cols + col_begin + j] = 0.0f;
  // Up to kBackProjectRows rows a pass (their pieces of M in seg, w floats each): each entry of Q^T takes row i's
  // product, then row i + 1's, ..., the order of one row a pass, and is loaded and stored once for them all.
  int64_t i = 0;
  for (; i + kBackProjectRows <= rows; i += kBackProjectRows)
    back_project_rows<kBackProjectRows>(x, residual, inv_divisor, p, qt, cols, r, seg, col_begin, w, i);
  if (rows - i >= 2) {
    back_project_rows<2>(x, residual, inv_divisor, p, qt, cols, r, seg, col_begin, w, i);
    i += 2;
  }
  if (i < rows) back_project_rows<1>(x, residual, inv_divisor, p, qt, cols, r, seg, col_begin, w, i);
}

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
