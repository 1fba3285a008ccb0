#include "kernels/sign.h"

#include <algorithm>

#include "kernels/codec_math.h"

namespace hetcomm {
namespace kernels {

namespace {

// Mean |x| of one chunk in the fixed order: lane l sums elements l, l+32, ...
// sequentially, then the 32 partial sums meet in the xor butterfly.
float chunk_mean_abs(const float* g, const float* e, float divisor, int64_t len) {
  float part[kLanes] = {0.0f};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float x = ef_input(g[i + l], divisor, e ? e[i + l] : 0.0f);
      part[l] = add_rn(part[l], magnitude(x));
    }
  }
  for (int l = 0; i + l < len; ++l) {
    const float x = ef_input(g[i + l], divisor, e ? e[i + l] : 0.0f);
    part[l] = add_rn(part[l], magnitude(x));
  }
  return div_rn(butterfly_sum32(part), static_cast<float>(len));
}

}  // namespace

void sign_encode_cpu(const SignEncodeParams& p, int64_t chunk_begin, int64_t chunk_end) {
  const int64_t words_per_chunk = p.chunk / kBitsPerWord;
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const int64_t begin = c * p.chunk;
    const int64_t len = std::min(p.chunk, p.n - begin);
    const float* g = p.grad + begin;
    float* e = p.residual ? p.residual + begin : nullptr;
    const float scale = chunk_mean_abs(g, e, p.divisor, len);
    p.scales[c] = scale;
    uint32_t* words = p.words + c * words_per_chunk;
    const int64_t nwords = (len + kBitsPerWord - 1) / kBitsPerWord;
    for (int64_t w = 0; w < nwords; ++w) {
      const int64_t base = w * kBitsPerWord;
      const int64_t m = std::min<int64_t>(kBitsPerWord, len - base);
      uint32_t word = 0;
      for (int64_t j = 0; j < m; ++j) {
        const float x = ef_input(g[base + j], p.divisor, e ? e[base + j] : 0.0f);
        const uint32_t bit = sign_bit(x);
        word |= bit << j;
        if (e) e[base + j] = sign_residual(x, bit, scale);
      }
      words[w] = word;
    }
  }
}

void sign_decode_cpu(const SignDecodeParams& p, int64_t chunk_begin, int64_t chunk_end) {
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const int64_t begin = c * p.chunk;
    const int64_t end = std::min(p.n, begin + p.chunk);
    const float scale = p.scales[c];
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t bit = (p.words[i / kBitsPerWord] >> (i % kBitsPerWord)) & 1u;
      const float prev = p.accumulate ? p.out[i] : 0.0f;
      p.out[i] = sign_decode(prev, bit, scale, p.alpha);
    }
  }
}

}  // namespace kernels
}  // namespace hetcomm
