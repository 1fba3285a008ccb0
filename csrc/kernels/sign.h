// 1-bit sign compression with error feedback. Torch-free.
//
// For each chunk of `chunk` elements (a multiple of 32):
//   x = grad / divisor + residual            (residual == nullptr: x = grad / divisor)
//   scale = mean(|x|) over the chunk, rounded to bf16 (fixed reduction order, see codec_math.h)
//   bit_i = x_i >= 0, packed 32 per uint32 word, little-endian bit order
//   residual = x - scale * (bit ? +1 : -1)   (when residual != nullptr)
// Words of a partial final chunk are zero-padded.
#pragma once

#include <cstdint>

namespace hetcomm {
namespace kernels {

struct SignEncodeParams {
  const float* grad;
  float* residual;  // in/out, may be null (no error feedback)
  float divisor;
  int64_t n;
  int64_t chunk;     // multiple of 32
  uint32_t* words;   // ceil(n / 32)
  uint16_t* scales;  // ceil(n / chunk), bf16 bits
};

struct SignDecodeParams {
  const uint32_t* words;
  const uint16_t* scales;  // bf16 bits
  float* out;       // n
  int64_t n;
  int64_t chunk;
  float alpha;      // out (+)= alpha * (+-scale)
  bool accumulate;  // false: out = ..., true: out += ...
};

inline int64_t sign_num_words(int64_t n) { return (n + 31) / 32; }
inline int64_t sign_num_chunks(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }

// CPU: encode/decode chunks [chunk_begin, chunk_end); callers parallelise over chunks.
void sign_encode_cpu(const SignEncodeParams& p, int64_t chunk_begin, int64_t chunk_end);
void sign_decode_cpu(const SignDecodeParams& p, int64_t chunk_begin, int64_t chunk_end);

// CUDA: whole tensors, enqueued on `stream` (a cudaStream_t).
void sign_encode_cuda(const SignEncodeParams& p, void* stream);
void sign_decode_cuda(const SignDecodeParams& p, void* stream);

}  // namespace kernels
}  // namespace hetcomm
