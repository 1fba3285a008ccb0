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

constexpr int64_t kBlock = int64_t{1} << 16;  // elements per block of the parallel passes
constexpr int kTopShift = 20;                 // bins of the first pass: magnitude bits >> 20 (2048)

// |x| as bits that order like the magnitudes (+0 == -0; NaN above infinity).
inline uint32_t mag_bits(float v) { return float_bits(v) & 0x7fffffffu; }

void run_blocks(const ParallelFor& pfor, int64_t blocks, const std::function<void(int64_t, int64_t)>& body) {
  if (pfor)
    pfor(blocks, body);
  else
    body(0, blocks);
}

// Writes, in index order, every entry whose magnitude bits exceed t and, of
// those equal to t, the lowest-index ones while the total stays within
// `take`. Counts per block first, so the blocks then write in parallel at
// their offsets. Returns the count, or -1 (nothing written) when it would
// exceed `capacity`.
int64_t select_from(const float* x, int64_t n, uint32_t t, int64_t take, int64_t capacity, int32_t* idx,
                    float* val, const ParallelFor& pfor) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<int64_t> greater(static_cast<size_t>(blocks)), equal(static_cast<size_t>(blocks));
  run_blocks(pfor, blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t g = 0, q = 0;
      for (int64_t i = b * kBlock, e = std::min(n, i + kBlock); i < e; ++i) {
        const uint32_t u = mag_bits(x[i]);
        g += u > t;
        q += u == t;
      }
      greater[b] = g;
      equal[b] = q;
    }
  });
  int64_t ties_left = take;
  for (int64_t b = 0; b < blocks; ++b) ties_left -= greater[b];
  std::vector<int64_t> offset(static_cast<size_t>(blocks)), ties(static_cast<size_t>(blocks));
  int64_t out = 0;
  for (int64_t b = 0; b < blocks; ++b) {  // earlier blocks take their ties first
    ties[b] = std::max<int64_t>(0, std::min(equal[b], ties_left));
    ties_left -= ties[b];
    offset[b] = out;
    out += greater[b] + ties[b];
  }
  if (out > capacity) return -1;
  run_blocks(pfor, blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t o = offset[b], tie = ties[b];
      for (int64_t i = b * kBlock, e = std::min(n, i + kBlock); i < e; ++i) {
        const uint32_t u = mag_bits(x[i]);
        if (u > t || (u == t && tie > 0)) {
          tie -= u == t;
          idx[o] = static_cast<int32_t>(i);
          val[o] = x[i];
          ++o;
        }
      }
    }
  });
  return out;
}

}  // namespace

int64_t topk_select_exact_cpu(const float* x, int64_t n, int64_t k, int32_t* idx, float* val,
                              const ParallelFor& pfor) {
  k = std::min(k, n);
  if (k <= 0) return 0;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  constexpr int kBins = 1 << (31 - kTopShift);
  // 1. Histogram of the top bits, per block, then summed.
  std::vector<int32_t> hist(static_cast<size_t>(blocks) * kBins, 0);
  run_blocks(pfor, blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int32_t* h = hist.data() + b * kBins;
      for (int64_t i = b * kBlock, e = std::min(n, i + kBlock); i < e; ++i) ++h[mag_bits(x[i]) >> kTopShift];
    }
  });
  std::vector<int64_t> total(kBins, 0);
  for (int64_t b = 0; b < blocks; ++b)
    for (int j = 0; j < kBins; ++j) total[j] += hist[b * kBins + j];
  int bin = kBins - 1;
  int64_t above = 0;
  while (above + total[bin] < k) above += total[bin--];
  // 2. The (k - above)-th largest inside that bin is the threshold.
  std::vector<std::vector<uint32_t>> cand(static_cast<size_t>(blocks));
  run_blocks(pfor, blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      cand[b].reserve(static_cast<size_t>(hist[b * kBins + bin]));
      for (int64_t i = b * kBlock, e = std::min(n, i + kBlock); i < e; ++i) {
        const uint32_t u = mag_bits(x[i]);
        if (static_cast<int>(u >> kTopShift) == bin) cand[b].push_back(u);
      }
    }
  });
  std::vector<uint32_t> in_bin;
  in_bin.reserve(static_cast<size_t>(total[bin]));
  for (const auto& c : cand) in_bin.insert(in_bin.end(), c.begin(), c.end());
  auto nth = in_bin.begin() + (k - above - 1);
  std::nth_element(in_bin.begin(), nth, in_bin.end(), std::greater<uint32_t>());
  return select_from(x, n, *nth, k, k, idx, val, pfor);
}

int64_t topk_sample_size(int64_t n, int64_t k) {
  // ~256 sampled survivors keep the count within a few percent of k.
  const int64_t want = k > 0 ? (256 * n + k - 1) / k : n;
  return std::min(n, std::max<int64_t>(want, 1024));
}

int64_t topk_select_sampled_cpu(const float* x, int64_t n, int64_t k, int32_t* idx, float* val,
                                const ParallelFor& pfor) {
  k = std::min(k, n);
  if (k <= 0) return 0;
  const int64_t m = topk_sample_size(n, k);
  if (m >= n) return topk_select_exact_cpu(x, n, k, idx, val, pfor);
  std::vector<uint32_t> sample(static_cast<size_t>(m));
  for (int64_t j = 0; j < m; ++j) sample[j] = mag_bits(x[sample_position(j, m, n)]);
  const int64_t ks = std::max<int64_t>(1, (k * m + n - 1) / n);
  auto nth = sample.begin() + (ks - 1);
  std::nth_element(sample.begin(), nth, sample.end(), std::greater<uint32_t>());
  // Everything at or above the sample's threshold; if that is more than k,
  // the exact top k (which lies among them).
  const int64_t count = select_from(x, n, *nth, n, k, idx, val, pfor);
  return count >= 0 ? count : topk_select_exact_cpu(x, n, k, idx, val, pfor);
}

void topk_clear_cpu(float* residual, const int32_t* idx, int64_t count) {
  for (int64_t j = 0; j < count; ++j) residual[idx[j]] = 0.0f;
}

void scatter_add_cpu(const int32_t* idx, const float* val, int64_t count, float alpha, float* out) {
  for (int64_t j = 0; j < count; ++j) out[idx[j]] = topk_decode(out[idx[j]], val[j], alpha);
}

}  // namespace kernels
}  // namespace hetcomm
