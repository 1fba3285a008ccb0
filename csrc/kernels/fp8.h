// 8-bit (fp8 e4m3) compression with a power-of-two scale per chunk and error
// feedback. Torch-free.
//
// For each chunk of `chunk` elements:
//   x = grad / divisor + residual            (residual == nullptr: x = grad / divisor)
//   scale = fp8_scale(max |x|)               (the power of two >= max|x| / 448, see codec_math.h)
//   code_i = e4m3(x_i / scale)               (round to nearest even; x / scale is exact)
//   residual = x - e4m3_value(code) * scale  (when residual != nullptr)
// Per element the message misses at most max(|x| / 16, scale / 1024) <=
// max(|x| / 16, max|x| / 229376, 2^-136): 3 mantissa bits, e4m3's smallest
// step 2^-9 at the bottom of the scaled range, and scales no smaller than
// 2^-126. Max is exact in any order, so every device computes the same scales
// and codes.
#pragma once

#include <cstdint>

namespace hetcomm {
namespace kernels {

struct Fp8EncodeParams {
  const float* grad;
  float* residual;  // in/out, may be null (no error feedback)
  float divisor;
  int64_t n;
  int64_t chunk;     // multiple of 32
  uint8_t* codes;    // n
  float* scales;     // ceil(n / chunk)
};

struct Fp8DecodeParams {
  const uint8_t* codes;
  const float* scales;
  float* out;       // n
  int64_t n;
  int64_t chunk;
  float alpha;      // out (+)= alpha * code * scale
  bool accumulate;  // false: out = ..., true: out += ...
};

inline int64_t fp8_num_chunks(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }

// CPU: encode/decode chunks [chunk_begin, chunk_end); callers parallelise over chunks.
void fp8_encode_cpu(const Fp8EncodeParams& p, int64_t chunk_begin, int64_t chunk_end);
void fp8_decode_cpu(const Fp8DecodeParams& p, int64_t chunk_begin, int64_t chunk_end);

// CUDA: whole tensors, enqueued on `stream` (a cudaStream_t).
void fp8_encode_cuda(const Fp8EncodeParams& p, void* stream);
void fp8_decode_cuda(const Fp8DecodeParams& p, void* stream);

}  // namespace kernels
}  // namespace hetcomm
