#include <algorithm>
#include <vector>

#include "kernels/chunk_cpu.h"
#include "kernels/codec_math.h"
#include "kernels/fp8.h"

namespace hetcomm {
namespace kernels {

namespace {

// One chunk: x into a scratch buffer, the largest |x| (as bits: for
// magnitudes the integer order is the float order, and NaN is largest), codes,
// then the residual.
HC_CPU_CLONES
void encode_chunk(const float* g, float* e, float divisor, int64_t len, float* x, uint8_t* codes, float* scale_out) {
  const float scale = fp8_scale(bits_float(ef_input_amax(g, e, divisor, len, x)));
  *scale_out = scale;
  const float inv = fp8_inverse(scale);
  for (int64_t i = 0; i < len; ++i) codes[i] = fp8_encode(x[i], inv);
  if (e) {
    for (int64_t i = 0; i < len; ++i) e[i] = fp8_residual(x[i], codes[i], scale);
  }
}

HC_CPU_CLONES
void decode_chunk(const uint8_t* codes, float scale, float* out, int64_t len, float alpha, bool accumulate) {
  if (accumulate) {
    for (int64_t i = 0; i < len; ++i) out[i] = fp8_decode(out[i], codes[i], scale, alpha);
  } else {
    for (int64_t i = 0; i < len; ++i) out[i] = fp8_decode(0.0f, codes[i], scale, alpha);
  }
}

}  // namespace

void fp8_encode_cpu(const Fp8EncodeParams& p, int64_t chunk_begin, int64_t chunk_end) {
  std::vector<float> scratch(static_cast<size_t>(p.chunk));
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const int64_t begin = c * p.chunk;
    encode_chunk(p.grad + begin, p.residual ? p.residual + begin : nullptr, p.divisor, std::min(p.chunk, p.n - begin),
                 scratch.data(), p.codes + begin, p.scales + c);
  }
}

void fp8_decode_cpu(const Fp8DecodeParams& p, int64_t chunk_begin, int64_t chunk_end) {
  for (int64_t c = chunk_begin; c < chunk_end; ++c) {
    const int64_t begin = c * p.chunk;
    decode_chunk(p.codes + begin, p.scales[c], p.out + begin, std::min(p.chunk, p.n - begin), p.alpha, p.accumulate);
  }
}

}  // namespace kernels
}  // namespace hetcomm
