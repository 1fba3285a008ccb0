// 3-bit linear compression with error feedback. Torch-free.
//
// For each chunk of `chunk` elements (a multiple of 32):
//   x = grad / divisor + residual            (residual == nullptr: x = grad / divisor)
//   scale = max |x| / 3, rounded to bf16     (max is exact in any order: every device computes the same)
//   q_i = round_half_even(x_i / scale) in [-3, 3], sent as q_i + 3 (0..6)
//   residual = x - q * scale                 (when residual != nullptr)
// The codes of each 32 elements travel as three uint32 bit planes (word k
// holds bit k of the 32 codes, element j at bit j): 3 bits an element, plus
// the bf16 scale (at the chunk of 32, 3.5 bits an element against fp8's
// 8.125). Unlike onebit's sign times the mean magnitude, an element under a
// sixth of the chunk's largest is sent as 0 and waits in the residual, so the
// message's error per element is at most |x| or scale / 2; with it the
// gradient itself can be compressed under momentum and Adam (bench/README "A
// 3-bit wire").
#pragma once

#include <cstdint>

namespace hetcomm {
namespace kernels {

struct Int3EncodeParams {
  const float* grad;
  float* residual;  // in/out, may be null (no error feedback)
  float divisor;
  int64_t n;
  int64_t chunk;     // multiple of 32
  uint32_t* words;   // int3_num_words(n)
  uint16_t* scales;  // ceil(n / chunk), bf16 bits
};

struct Int3DecodeParams {
  const uint32_t* words;
  const uint16_t* scales;  // bf16 bits
  float* out;       // n
  int64_t n;
  int64_t chunk;
  float alpha;      // out (+)= alpha * q * scale
  bool accumulate;  // false: out = ..., true: out += ...
};

// Three bit-plane words per 32 elements (a partial last 32: its absent codes are 0).
inline int64_t int3_num_words(int64_t n) { return 3 * ((n + 31) / 32); }
inline int64_t int3_num_chunks(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }

// CPU: encode/decode chunks [chunk_begin, chunk_end); callers parallelise over chunks.
void int3_encode_cpu(const Int3EncodeParams& p, int64_t chunk_begin, int64_t chunk_end);
void int3_decode_cpu(const Int3DecodeParams& p, int64_t chunk_begin, int64_t chunk_end);

// CUDA: whole tensors, enqueued on `stream` (a cudaStream_t).
void int3_encode_cuda(const Int3EncodeParams& p, void* stream);
void int3_decode_cuda(const Int3DecodeParams& p, void* stream);

}  // namespace kernels
}  // namespace hetcomm
