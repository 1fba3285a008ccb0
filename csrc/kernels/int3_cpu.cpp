#include <algorithm>
#include <vector>

#include "kernels/chunk_cpu.h"
#include "kernels/codec_math.h"
#include "kernels/int3.h"

namespace hetcomm {
namespace kernels {

namespace {

// One chunk: x into a scratch buffer, the largest |x| (as bits: exact in any
// order, NaN largest), the scale, then each 32's codes as three bit planes
// and the residual.
HC_CPU_CLONES
void encode_chunk(const float* g, float* e, float divisor, int64_t len, float* x, uint32_t* words,
                  uint16_t* scale_out) {
  const uint16_t bits = int3_scale_bits(bits_float(ef_input_amax(g, e, divisor, len, x)));
  *scale_out = bits;
  const float scale = bf16_to_float(bits);
  for (int64_t base = 0; base < len; base += kBitsPerWord) {
    const int count = static_cast<int>(std::min<int64_t>(kBitsPerWord, len - base));
    uint32_t codes[kBitsPerWord];
    for (int j = 0; j < count; ++j) codes[j] = int3_code(x[base + j], scale);
    uint32_t w0 = 0, w1 = 0, w2 = 0;
    for (int j = 0; j < count; ++j) {
      w0 |= (codes[j] & 1u) << j;
      w1 |= ((codes[j] >> 1) & 1u) << j;
      w2 |= ((codes[j] >> 2) & 1u) << j;
    }
    uint32_t* w = words + 3 * (base / kBitsPerWord);
    w[0] = w0;
    w[1] = w1;
    w[2] = w2;
    if (e) {
      for (int j = 0; j < count; ++j) e[base + j] = int3_residual(x[base + j], codes[j], scale);
    }
  }
}

HC_CPU_CLONES
void decode_chunk(const uint32_t* words, float scale, float* out, int64_t len, float alpha, bool accumulate) {
  for (int64_t base = 0; base < len; base += kBitsPerWord) {
    const int count = static_cast<int>(std::min<int64_t>(kBitsPerWord, len - base));
    const uint32_t* w = words + 3 * (base / kBitsPerWord);
    float* o = out + base;
    for (int j = 0; j < count; ++j)
      o[j] = int3_decode(accumulate ? o[j] : 0.0f, int3_unpack(w[0], w[1], w[2], j), scale, alpha);
  }
}

}  // namespace

void int3_encode_cpu(const Int3EncodeParams& p, int64_t chunk_begin, int64_t chunk_end) {
  std::vector<float> scratch(static_cast<size_t>(p.chunk));
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const int64_t begin = c * p.chunk;
    encode_chunk(p.grad + begin, p.residual ? p.residual + begin : nullptr, p.divisor,
                 std::min(p.chunk, p.n - begin), scratch.data(), p.words + 3 * (begin / kBitsPerWord), p.scales + c);
  }
}

void int3_decode_cpu(const Int3DecodeParams& p, int64_t chunk_begin, int64_t chunk_end) {
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const int64_t begin = c * p.chunk;
    decode_chunk(p.words + 3 * (begin / kBitsPerWord), bf16_to_float(p.scales[c]), p.out + begin,
                 std::min(p.chunk, p.n - begin), p.alpha, p.accumulate);
  }
}

}  // namespace kernels
}  // namespace hetcomm
