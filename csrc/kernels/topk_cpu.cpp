#include "kernels/topk.h"

#include <algorithm>
#include <vector>

#include "kernels/codec_math.h"

namespace hetcomm {
namespace kernels {

HC_CPU_CLONES
void ef_accumulate_cpu(const float* grad, float divisor, float* x, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) x[i] = ef_input(grad[i], divisor, x[i]);
}

HC_CPU_CLONES
void scale_copy_cpu(const float* grad, float divisor, float* x, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) x[i] = div_rn(grad[i], divisor);
}

namespace {

// The k-th largest magnitude among mags (k >= 1), destroying mags' order.
float kth_largest(std::vector<float>& mags, int64_t k) {
  auto nth = mags.begin() + (k - 1);
  std::nth_element(mags.begin(), nth, mags.end(), std::greater<float>());
  return *nth;
}

// Writes, in index order, every i with |x_i| > t and the lowest-index ones with
// |x_i| == t until k are written. Candidates restricts the scan (or all n).
int64_t collect(const float* x, const int64_t* cand, int64_t ncand, int64_t k, float t,
                int32_t* idx, float* val) {
  int64_t greater = 0;
  for (int64_t j = 0; j < ncand; ++j) {
    const int64_t i = cand ? cand[j] : j;
    greater += magnitude(x[i]) > t;
  }
  int64_t ties_left = k - greater;
  int64_t out = 0;
  for (int64_t j = 0; j < ncand && out < k; ++j) {
    const int64_t i = cand ? cand[j] : j;
    const float m = magnitude(x[i]);
    if (m > t || (m == t && ties_left > 0)) {
      if (!(m > t)) --ties_left;
      idx[out] = static_cast<int32_t>(i);
      val[out] = x[i];
      ++out;
    }
  }
  return out;
}

}  // namespace

int64_t topk_select_exact_cpu(const float* x, int64_t n, int64_t k, int32_t* idx, float* val) {
  k = std::min(k, n);
  if (k <= 0) return 0;
  std::vector<float> mags(n);
  for (int64_t i = 0; i < n; ++i) mags[i] = magnitude(x[i]);
  const float t = kth_largest(mags, k);
  return collect(x, nullptr, n, k, t, idx, val);
}

int64_t topk_sample_size(int64_t n, int64_t k) {
  // ~256 sampled survivors keep the count within a few percent of k.
  const int64_t want = k > 0 ? (256 * n + k - 1) / k : n;
  return std::min(n, std::max<int64_t>(want, 1024));
}

int64_t topk_select_sampled_cpu(const float* x, int64_t n, int64_t k, int32_t* idx, float* val) {
  k = std::min(k, n);
  if (k <= 0) return 0;
  const int64_t m = topk_sample_size(n, k);
  if (m >= n) return topk_select_exact_cpu(x, n, k, idx, val);
  std::vector<float> sample(m);
  for (int64_t j = 0; j < m; ++j) sample[j] = magnitude(x[sample_position(j, m, n)]);
  const int64_t ks = std::max<int64_t>(1, (k * m + n - 1) / n);
  const float t = kth_largest(sample, ks);
  std::vector<int64_t> cand;
  cand.reserve(static_cast<size_t>(k + k / 4 + 16));
  for (int64_t i = 0; i < n; ++i)
    if (magnitude(x[i]) >= t) cand.push_back(i);
  const int64_t nc = static_cast<int64_t>(cand.size());
  if (nc <= k) {
    for (int64_t j = 0; j < nc; ++j) {
      idx[j] = static_cast<int32_t>(cand[j]);
      val[j] = x[cand[j]];
    }
    return nc;
  }
  // Too many survivors: exact top-k among them.
  std::vector<float> mags(nc);
  for (int64_t j = 0; j < nc; ++j) mags[j] = magnitude(x[cand[j]]);
  const float t2 = kth_largest(mags, k);
  return collect(x, cand.data(), nc, k, t2, idx, val);
}

void topk_clear_cpu(float* residual, const int32_t* idx, int64_t count) {
  for (int64_t j = 0; j < count; ++j) residual[idx[j]] = 0.0f;
}

void scatter_add_cpu(const int32_t* idx, const float* val, int64_t count, float alpha, float* out) {
  for (int64_t j = 0; j < count; ++j) out[idx[j]] = topk_decode(out[idx[j]], val[j], alpha);
}

}  // namespace kernels
}  // namespace hetcomm
