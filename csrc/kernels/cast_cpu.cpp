#include "kernels/cast.h"

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

}  // namespace kernels
}  // namespace hetcomm
