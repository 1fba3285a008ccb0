// Scaled casts to the 16-bit wire formats and back. Torch-free.
//   encode: out = half(in / divisor)      (divide before the cast: no overflow)
//   decode: out = float(in) * mul
// fp16 and bf16 are carried as uint16_t bit patterns.
#pragma once

#include <cstdint>

namespace hetcomm {
namespace kernels {

enum class Wire16 { kHalf = 0, kBFloat16 = 1 };

void cast_encode_cpu(Wire16 fmt, const float* in, float divisor, uint16_t* out, int64_t begin, int64_t end);
void cast_decode_cpu(Wire16 fmt, const uint16_t* in, float mul, float* out, int64_t begin, int64_t end);
// Whether in[begin, end) holds no infinity and no NaN (no exponent of all ones).
bool all_finite_cpu(const float* in, int64_t begin, int64_t end);

void cast_encode_cuda(Wire16 fmt, const float* in, float divisor, uint16_t* out, int64_t n, void* stream);
void cast_decode_cuda(Wire16 fmt, const uint16_t* in, float mul, float* out, int64_t n, void* stream);

}  // namespace kernels
}  // namespace hetcomm
