#include "kernels/cast.h"

#include <cstring>

#include "kernels/codec_math.h"

namespace hetcomm {
namespace kernels {

HC_CPU_CLONES
void cast_encode_cpu(Wire16 fmt, const float* in, float divisor, uint16_t* out, int64_t begin, int64_t end) {
  if (fmt == Wire16::kHalf) {
    for (int64_t i = begin; i < end; ++i) out[i] = scaled_to_half(in[i], divisor);
  } else {
    for (int64_t i = begin; i < end; ++i) out[i] = scaled_to_bf16(in[i], divisor);
  }
}

HC_CPU_CLONES
void cast_decode_cpu(Wire16 fmt, const uint16_t* in, float mul, float* out, int64_t begin, int64_t end) {
  if (fmt == Wire16::kHalf) {
    for (int64_t i = begin; i < end; ++i) out[i] = half_scaled(in[i], mul);
  } else {
    for (int64_t i = begin; i < end; ++i) out[i] = bf16_scaled(in[i], mul);
  }
}

HC_CPU_CLONES
bool all_finite_cpu(const float* in, int64_t begin, int64_t end) {
  // the exponents read as bits and OR-ed: a loop that vectorizes, where a float test of each value or a float sum
  // would need reassociation
  uint32_t any = 0;
  for (int64_t i = begin; i < end; ++i) {
    uint32_t bits;
    std::memcpy(&bits, in + i, sizeof bits);
    any |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return any == 0;
}

}  // namespace kernels
}  // namespace hetcomm
