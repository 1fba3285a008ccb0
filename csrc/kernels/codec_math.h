// Per-element math shared by the CPU loops and the CUDA kernels.
// Torch-free: plain floats and integers. Every function here is used by both
// sides, so the CPU tests check the arithmetic the GPU runs.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HC_HD __host__ __device__ __forceinline__
#else
#define HC_HD inline __attribute__((always_inline))
#endif

// CPU loops are compiled twice, for AVX2 and for the baseline, and picked at
// load time (GCC function multi-versioning). No FMA either way: results match.
#if !defined(__CUDACC__) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HC_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HC_CPU_CLONES
#endif

namespace hetcomm {
namespace kernels {

// Elements per uint32 word of packed signs.
constexpr int64_t kBitsPerWord = 32;
// Partial sums per chunk: the reduction order of the chunk mean is fixed (32
// lane-strided partial sums, then an xor butterfly) so that the CPU and a CUDA
// warp produce bit-identical scales.
constexpr int kLanes = 32;

HC_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

HC_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Correctly rounded a*b + c without contraction into an FMA (host builds use
// -ffp-contract=off; on the device the _rn intrinsics are never fused).
HC_HD float mul_add_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(a, b), c);
#else
  return a * b + c;
#endif
}

HC_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

HC_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

HC_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// The error-feedback input: the weighted gradient plus what earlier steps owe.
// Divide before anything else (weights are 1/divisor; division keeps equal
// batch sizes bit-identical to PyTorch's `div_(world_size)`).
HC_HD float ef_input(float grad, float divisor, float residual) {
  return add_rn(div_rn(grad, divisor), residual);
}

// Momentum compression's hand-over: what the optimizer is given so that its
// own buffer (beta * m_old + this) becomes m_new.
HC_HD float momentum_delta(float m_new, float m_old, float beta) { return add_rn(m_new, -mul_rn(beta, m_old)); }

// ---- 1-bit sign codec -----------------------------------------------------
// x >= 0 (including -0.0) encodes as 1 (+scale); x < 0 as 0 (-scale).
HC_HD uint32_t sign_bit(float x) { return x >= 0.0f ? 1u : 0u; }

HC_HD float sign_value(uint32_t bit, float scale) { return bit ? scale : -scale; }

// New residual: what the 1-bit message did not carry.
HC_HD float sign_residual(float x, uint32_t bit, float scale) {
  return add_rn(x, -sign_value(bit, scale));
}

// out (+)= alpha * (+-scale)
HC_HD float sign_decode(float prev, uint32_t bit, float scale, float alpha) {
  return mul_add_rn(alpha, sign_value(bit, scale), prev);
}

// Partial sums p[0..31] -> one float in the order a CUDA warp's xor butterfly
// (__shfl_xor_sync with 16, 8, 4, 2, 1) gives lane 0: at offset o lane i < o
// adds lane i + o (= i ^ o), so only those sums are formed here (31 additions,
// not 5 x 32); the result is lane 0's to the bit. Overwrites p.
HC_HD float butterfly_sum32(float* p) {
  for (int offset = kLanes / 2; offset > 0; offset >>= 1)
    for (int i = 0; i < offset; ++i) p[i] = add_rn(p[i], p[i + offset]);
  return p[0];
}

// ---- fp16 / bf16 conversions (round to nearest even, like torch) ---------
HC_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // NaN -> quiet NaN
}

HC_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// A 1-bit chunk's scale travels as bf16: the chunk's mean magnitude rounded to
// nearest even (relative error <= 2^-8, which error feedback keeps), so a
// scale per 32 values costs 1/16 byte per element. The encoder's residual
// uses the rounded scale, the one every decoder sees.
HC_HD uint16_t sign_scale_bits(float sum_abs, float len) { return float_to_bf16(div_rn(sum_abs, len)); }

// Branch-free (selects only) so CPU loops vectorise; same results as the
// textbook branching version.
HC_HD uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal result: rebias the exponent by (15 - 127) and round to nearest even.
  const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
  // Subnormal result (|f| < 2^-14): adding 0.5f aligns the half mantissa with
  // the float's low bits, and the FPU rounds to nearest even.
  const uint32_t sub = float_bits(add_rn(bits_float(a), 0.5f)) - 0x3f000000u;
  uint32_t r = a < 0x38800000u ? sub : normal;
  r = a >= 0x477ff000u ? 0x7c00u : r;  // >= 65520 (and inf) -> inf
  r = a > 0x7f800000u ? 0x7e00u : r;   // NaN -> quiet NaN
  return static_cast<uint16_t>(sign | r);
}

HC_HD float half_to_float(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t normal = (em << 13) + 0x38000000u;
  const uint32_t special = 0x7f800000u | ((em & 0x3ffu) << 13);
  // Subnormal: em * 2^-24 is exact in float.
  const uint32_t sub = float_bits(static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f);
  uint32_t r = em < 0x400u ? sub : normal;
  r = em >= 0x7c00u ? special : r;
  return bits_float(sign | r);
}

// Scaled casts: divide before the cast, so large gradients do not overflow fp16.
HC_HD uint16_t scaled_to_half(float x, float divisor) { return float_to_half(div_rn(x, divisor)); }
HC_HD uint16_t scaled_to_bf16(float x, float divisor) { return float_to_bf16(div_rn(x, divisor)); }
HC_HD float half_scaled(uint16_t h, float mul) { return half_to_float(h) * mul; }
HC_HD float bf16_scaled(uint16_t h, float mul) { return bf16_to_float(h) * mul; }

// ---- fp8 e4m3 (OCP "e4m3fn": bias 7, no inf, 0x7f / 0xff NaN, max 448) -----
constexpr float kE4M3Max = 448.0f;

// Round to nearest even like torch's float8_e4m3fn conversion; finite values
// beyond +-448 saturate to +-448 (callers scale first, so only rounding of
// the largest element reaches them); inf and NaN become NaN (0x7f).
HC_HD uint8_t float_to_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  uint32_t a = u & 0x7fffffffu;
  const bool nan = a >= 0x7f800000u;
  a = a > 0x43e00000u ? 0x43e00000u : a;  // saturate at 448
  // Normal result (|f| >= 2^-6): rebias the exponent by (7 - 127), keep 3 mantissa bits, round to nearest even.
  const uint32_t normal = (a - (120u << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  // Subnormal result (multiples of 2^-9): adding 2^14 leaves the float's ulp at 2^-9, the FPU rounds.
  const uint32_t sub = float_bits(add_rn(bits_float(a), 16384.0f)) - 0x46800000u;
  uint32_t r = a < 0x3c800000u ? sub : normal;
  r = nan ? 0x7fu : r;
  return static_cast<uint8_t>(sign | r);
}

HC_HD float e4m3_to_float(uint8_t q) {
  const uint32_t sign = (static_cast<uint32_t>(q) & 0x80u) << 24;
  const uint32_t em = q & 0x7fu;
  const uint32_t normal = (em << 20) + (120u << 23);
  // Subnormal: em * 2^-9 is exact in float.
  const uint32_t sub = float_bits(static_cast<float>(static_cast<int32_t>(em)) * 0.001953125f);
  uint32_t r = em < 0x08u ? sub : normal;
  r = em == 0x7fu ? 0x7fc00000u : r;
  return bits_float(sign | r);
}

// |x| as bits: for magnitudes the integer order is the float order and every
// NaN compares largest, so a max over bits is exact, order-free and keeps NaN.
HC_HD uint32_t magnitude_bits(float x) { return float_bits(x) & 0x7fffffffu; }

// A chunk's scale from its largest magnitude: the power of two s >= amax / 448
// (so every x / s fits and x / s, q * s are exact); 0 for an all-zero chunk;
// non-finite when amax is (the NaN/Inf then reaches every decoded value).
HC_HD float fp8_scale(float amax) {
  const uint32_t u = float_bits(div_rn(amax, kE4M3Max));
  if (u == 0u) return 0.0f;
  const uint32_t exp = u & 0x7f800000u;
  if (exp == 0x7f800000u) return bits_float(u);          // inf / NaN
  if (exp == 0u) return bits_float(0x00800000u);          // below 2^-126: the smallest normal
  return bits_float((u & 0x007fffffu) ? exp + 0x00800000u : exp);
}

// 1 / scale, exact for the power-of-two scales of fp8_scale (0 for a zero
// scale: every code is then 0), so x * inv_scale is x / scale to the bit
// without a division per element.
HC_HD float fp8_inverse(float scale) { return scale == 0.0f ? 0.0f : div_rn(1.0f, scale); }

HC_HD uint8_t fp8_encode(float x, float inv_scale) { return float_to_e4m3(mul_rn(x, inv_scale)); }

HC_HD float fp8_value(uint8_t q, float scale) { return e4m3_to_float(q) * scale; }

// New residual: what the 8-bit message did not carry.
HC_HD float fp8_residual(float x, uint8_t q, float scale) { return add_rn(x, -fp8_value(q, scale)); }

// out (+)= alpha * q * scale
HC_HD float fp8_decode(float prev, uint8_t q, float scale, float alpha) {
  return mul_add_rn(alpha, fp8_value(q, scale), prev);
}

// ---- 3-bit linear (int3.h) ---------------------------------------------------
constexpr float kInt3Max = 3.0f;
constexpr uint32_t kInt3Zero = 3u;  // the code of 0 (codes are q + 3)

// A chunk's scale from its largest magnitude: amax / 3 rounded to bf16 (the
// bits that travel; every decoder multiplies by the same value).
HC_HD uint16_t int3_scale_bits(float amax) { return float_to_bf16(div_rn(amax, kInt3Max)); }

HC_HD float round_half_even(float y) {
#if defined(__CUDA_ARCH__)
  return rintf(y);
#else
  return __builtin_rintf(y);  // the default rounding mode: to nearest, ties to even
#endif
}

// x's code (0..6) at `scale`: round(x / scale) clamped to [-3, 3], plus 3.
// A zero scale (an all-zero chunk, or one whose max / 3 rounds to 0 in bf16)
// or a non-finite one gives 0's code (the decoded value is then 0, or NaN
// where the scale is not finite: a NaN or infinity in the chunk reaches every
// decoded value of it).
HC_HD uint32_t int3_code(float x, float scale) {
  const bool usable = scale > 0.0f && float_bits(scale) < 0x7f800000u;
  float y = usable ? div_rn(x, scale) : 0.0f;
  y = y > kInt3Max ? kInt3Max : y;
  y = y < -kInt3Max ? -kInt3Max : y;
  y = y == y ? y : 0.0f;  // NaN (an x that is, at a finite scale: not reached through the encoders)
  return static_cast<uint32_t>(static_cast<int32_t>(round_half_even(y)) + static_cast<int32_t>(kInt3Zero));
}

HC_HD float int3_value(uint32_t code, float scale) {
  return mul_rn(static_cast<float>(static_cast<int32_t>(code) - static_cast<int32_t>(kInt3Zero)), scale);
}

// New residual: what the 3-bit message did not carry.
HC_HD float int3_residual(float x, uint32_t code, float scale) { return add_rn(x, -int3_value(code, scale)); }

// out (+)= alpha * q * scale
HC_HD float int3_decode(float prev, uint32_t code, float scale, float alpha) {
  return mul_add_rn(alpha, int3_value(code, scale), prev);
}

// Element j's code from the three bit planes of its 32.
HC_HD uint32_t int3_unpack(uint32_t w0, uint32_t w1, uint32_t w2, int j) {
  return ((w0 >> j) & 1u) | (((w1 >> j) & 1u) << 1) | (((w2 >> j) & 1u) << 2);
}

// ---- top-k ------------------------------------------------------------------
HC_HD float magnitude(float x) { return x < 0.0f ? -x : x; }

// out[idx] (+)= alpha * value
HC_HD float topk_decode(float prev, float value, float alpha) { return mul_add_rn(alpha, value, prev); }

// Deterministic sample position j of m over n elements (stratified: one
// pseudo-random element per stride), shared so CPU and GPU sample the same.
HC_HD int64_t sample_position(int64_t j, int64_t m, int64_t n) {
  const int64_t lo = j * n / m;
  const int64_t hi = (j + 1) * n / m;
  uint32_t h = static_cast<uint32_t>(j) * 2654435761u;
  h ^= h >> 16;
  const int64_t width = hi - lo;
  return width > 0 ? lo + static_cast<int64_t>(h % static_cast<uint32_t>(width)) : lo;
}

}  // namespace kernels
}  // namespace hetcomm
