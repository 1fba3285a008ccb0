#include "kernels/sign.h"

#include <algorithm>
#include <vector>

#include "kernels/codec_math.h"

namespace hetcomm {
namespace kernels {

namespace {

// One chunk, in simple loops the compiler vectorises:
//   x = ef_input(g, d, e)                 into a scratch buffer
//   scale: lane l sums x[l], x[l+32], ... then the xor butterfly (the order a
//   CUDA warp uses, so scales are bit-identical), rounded to bf16
//   bits packed per word; residual from x, bit and scale
HC_CPU_CLONES
void encode_chunk(const float* g, float* e, float divisor, int64_t len, float* x, uint32_t* words,
                  uint16_t* scale_out) {
  if (e) {
    for (int64_t i = 0; i < len; ++i) x[i] = ef_input(g[i], divisor, e[i]);
  } else {
    for (int64_t i = 0; i < len; ++i) x[i] = ef_input(g[i], divisor, 0.0f);
  }
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  for (int64_t i = len; i < padded; ++i) x[i] = 0.0f;  // pad the last word with +0 (bit 1, |x| 0)
  float part[kLanes] = {0.0f};
  for (int64_t i = 0; i < padded; i += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] = add_rn(part[l], magnitude(x[i + l]));
  const uint16_t bits = sign_scale_bits(butterfly_sum32(part), static_cast<float>(len));
  const float scale = bf16_to_float(bits);
  *scale_out = bits;
  const int64_t nwords = (len + kBitsPerWord - 1) / kBitsPerWord;
  for (int64_t w = 0; w < nwords; ++w) {
    uint32_t word = 0;
    for (int j = 0; j < kBitsPerWord; ++j) word |= sign_bit(x[w * kBitsPerWord + j]) << j;
    words[w] = word;
  }
  if (len % kBitsPerWord) words[nwords - 1] &= (1u << (len % kBitsPerWord)) - 1u;  // zero padding bits
  if (e) {
    for (int64_t i = 0; i < len; ++i) e[i] = sign_residual(x[i], sign_bit(x[i]), scale);
  }
}

HC_CPU_CLONES
void decode_chunk(const uint32_t* words, float scale, float* out, int64_t len, float alpha, bool accumulate) {
  const int64_t nwords = (len + kBitsPerWord - 1) / kBitsPerWord;
  for (int64_t w = 0; w < nwords; ++w) {
    const uint32_t word = words[w];
    const int64_t base = w * kBitsPerWord;
    const int m = static_cast<int>(std::min<int64_t>(kBitsPerWord, len - base));
    float* o = out + base;
    if (m == kBitsPerWord) {
      if (accumulate) {
        for (int j = 0; j < kBitsPerWord; ++j) o[j] = sign_decode(o[j], (word >> j) & 1u, scale, alpha);
      } else {
        for (int j = 0; j < kBitsPerWord; ++j) o[j] = sign_decode(0.0f, (word >> j) & 1u, scale, alpha);
      }
    } else {
      for (int j = 0; j < m; ++j) o[j] = sign_decode(accumulate ? o[j] : 0.0f, (word >> j) & 1u, scale, alpha);
    }
  }
}

}  // namespace

void sign_encode_cpu(const SignEncodeParams& p, int64_t chunk_begin, int64_t chunk_end) {
  const int64_t words_per_chunk = p.chunk / kBitsPerWord;
  std::vector<float> scratch(static_cast<size_t>(p.chunk + kLanes));
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const int64_t begin = c * p.chunk;
    const int64_t len = std::min(p.chunk, p.n - begin);
    encode_chunk(p.grad + begin, p.residual ? p.residual + begin : nullptr, p.divisor, len, scratch.data(),
                 p.words + c * words_per_chunk, p.scales + c);
  }
}

void sign_decode_cpu(const SignDecodeParams& p, int64_t chunk_begin, int64_t chunk_end) {
  const int64_t words_per_chunk = p.chunk / kBitsPerWord;
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const int64_t begin = c * p.chunk;
    decode_chunk(p.words + c * words_per_chunk, bf16_to_float(p.scales[c]), p.out + begin,
                 std::min(p.chunk, p.n - begin), p.alpha, p.accumulate);
  }
}

}  // namespace kernels
}  // namespace hetcomm
