#include "ops/codecs.h"

#include <cmath>

#include "kernels/cast.h"
#include "kernels/fp8.h"
#include "kernels/int3.h"
#include "kernels/sign.h"
#include "ops/dispatch.h"

namespace hetcomm {
namespace ops {

namespace k = hetcomm::kernels;
using detail::check_buffer;
using detail::dtype_name;
using detail::runs_on_cuda;

namespace detail {

bool runs_on_cuda(const at::Tensor& t, const char* name) {
#ifdef HETCOMM_WITH_CUDA
  if (t.is_cuda()) return true;
#endif
  TORCH_CHECK_VALUE(t.device().is_cpu(), "hetcomm: ", name, " must be a CPU tensor (got ", t.device(),
                    "); CUDA tensors need a CUDA build of hetcomm (see hetcomm.build_info())");
  return false;
}

const char* dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kByte: return "uint8";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    default: return c10::toString(type);
  }
}

void check_buffer(const at::Tensor& t, const char* name, const at::Tensor& like, at::ScalarType type, int64_t numel,
                  const char* size_rule, bool exact) {
  TORCH_CHECK_VALUE(t.defined(), "hetcomm: ", name, " is undefined");
  TORCH_CHECK_VALUE(t.device() == like.device(), "hetcomm: ", name, " must be on ", like.device(), ", got ",
                    t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == type, "hetcomm: ", name, " must be ", dtype_name(type), ", got ",
                   dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.is_contiguous(), "hetcomm: ", name, " must be contiguous");
  TORCH_CHECK_VALUE(exact ? t.numel() == numel : t.numel() >= numel, "hetcomm: ", name, " must hold ", size_rule,
                    " = ", numel, " elements, got ", t.numel());
}

}  // namespace detail

namespace {

// The error-feedback residual, when given: float32 with the gradient's numel, beside it.
void check_residual(const at::Tensor& residual, const at::Tensor& grad) {
  if (!residual.defined()) return;
  TORCH_CHECK_VALUE(residual.numel() == grad.numel(), "hetcomm: residual must have the gradient's numel (",
                    grad.numel(), "), got ", residual.numel());
  check_buffer(residual, "residual", grad, at::kFloat, grad.numel(), "the gradient's numel");
}

float* opt_ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// A bfloat16 tensor's elements as their bits (the kernels are torch-free).
uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// A decode's output: `out` checked (float32, n elements, beside `like`), or a new one when undefined.
at::Tensor decode_output(at::Tensor out, bool accumulate, const at::Tensor& like, int64_t n) {
  if (!out.defined()) {
    TORCH_CHECK_VALUE(!accumulate, "hetcomm: accumulate=True needs an out tensor");
    return at::empty({n}, like.options().dtype(at::kFloat));
  }
  check_buffer(out, "out", like, at::kFloat, n, "n", true);
  return out;
}

// A chunked decode's sizes, checked before anything is computed from them.
void check_decode_sizes(int64_t n, int64_t chunk) {
  check_chunk(chunk);
  TORCH_CHECK_VALUE(n >= 0, "hetcomm: n must be >= 0, got ", n);
}

// A chunked decode's tensors (sign, fp8), checked: the codes (`type`, at least
// `code_numel` = `code_rule`), a scale per chunk (`scale_type`) beside them;
// the output as decode_output makes it. Contiguous. After check_decode_sizes(n, chunk).
struct ChunkedDecode {
  at::Tensor codes, scales, out;
};

ChunkedDecode check_decode(const at::Tensor& codes, const char* name, at::ScalarType type, int64_t code_numel,
                           const char* code_rule, const at::Tensor& scales, at::ScalarType scale_type, int64_t n,
                           int64_t nchunks, at::Tensor out, bool accumulate) {
  TORCH_CHECK_VALUE(codes.defined() && scales.defined(), "hetcomm: ", name, " and scales must be tensors");
  ChunkedDecode d{codes.contiguous(), scales.contiguous(), at::Tensor()};
  check_buffer(d.codes, name, d.codes, type, code_numel, code_rule);
  check_buffer(d.scales, "scales", d.codes, scale_type, nchunks, "ceil(n/chunk)");
  d.out = decode_output(out, accumulate, d.codes, n);
  return d;
}

k::Wire16 wire16(at::ScalarType type) { return type == at::kHalf ? k::Wire16::kHalf : k::Wire16::kBFloat16; }

}  // namespace

void check_divisor(double divisor) {
  TORCH_CHECK_VALUE(std::isfinite(divisor) && divisor > 0.0, "hetcomm: divisor must be finite and > 0, got ",
                    divisor);
}

void check_chunk(int64_t chunk) {
  TORCH_CHECK_VALUE(chunk > 0 && chunk % 32 == 0, "hetcomm: chunk must be a positive multiple of 32, got ", chunk);
}

// NaN and infinities propagate into the sum, so a finite float32 sum proves
// it (about 15x faster than isfinite(x).all()); a non-finite sum (or an
// overflowing one) is checked element by element.
bool all_finite(const at::Tensor& x) {
  // a float32 CPU tensor in one pass of our own: torch's sum, isfinite and item took 4 % of the comm thread's CPU
  // on digits' lowrank step (a 2.6 K-value P), most of it dispatch and the reduction's set-up
  if (x.is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous())
    return cpu::all_finite(x.data_ptr<float>(), x.numel());
  if (at::isfinite(x.sum()).item<bool>()) return true;
  return at::isfinite(x).all().item<bool>();
}

void check_float_vector(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), "hetcomm: ", name, " is undefined");
  runs_on_cuda(t, name);
  TORCH_CHECK_TYPE(t.is_floating_point(), "hetcomm: ", name,
                   " must be a floating-point tensor (float32, float16 or bfloat16), got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.numel() < (int64_t{1} << 31), "hetcomm: ", name, " must have fewer than 2^31 elements, got ",
                    t.numel());
}

at::Tensor as_float32(const at::Tensor& t, const char* name) {
  check_float_vector(t, name);
  return t.reshape({-1}).to(at::kFloat).contiguous();
}

int64_t topk_count(int64_t n, double ratio) {
  TORCH_CHECK_VALUE(n >= 0, "hetcomm: n must be >= 0, got ", n);
  TORCH_CHECK_VALUE(ratio > 0.0 && ratio <= 1.0, "hetcomm: topk ratio must be in (0, 1], got ", ratio);
  return std::min<int64_t>(n, static_cast<int64_t>(std::ceil(ratio * static_cast<double>(n))));
}

namespace {

// A chunked encode's arguments (sign, fp8), checked: the divisor, the chunk,
// the gradient (returned as contiguous float32) and its residual.
at::Tensor check_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk) {
  check_divisor(divisor);
  check_chunk(chunk);
  at::Tensor g = as_float32(grad, "grad");
  check_residual(residual, g);
  return g;
}

}  // namespace

namespace {

// The bit-packed codecs (sign: 1 bit an element, int3: 3) share their
// arguments' rules and buffers: int32 words holding uint32 bit patterns, a
// bf16 scale per chunk. A codec names its kernels' parameters, sizes and ops.
struct SignCodec {
  using Encode = k::SignEncodeParams;
  using Decode = k::SignDecodeParams;
  static constexpr const char* kWordsRule = "ceil(n/32)";
  static int64_t num_words(int64_t n) { return k::sign_num_words(n); }
  static int64_t num_chunks(int64_t n, int64_t chunk) { return k::sign_num_chunks(n, chunk); }
  static void encode(const Encode& p, const at::Tensor& on) {
    HC_RUN(on, "grad", cpu::sign_encode(p), cuda::sign_encode(p, on.device()));
  }
  static void decode(const Decode& p, const at::Tensor& on) {
    HC_RUN(on, "words", cpu::sign_decode(p), cuda::sign_decode(p, on.device()));
  }
};

struct Int3Codec {
  using Encode = k::Int3EncodeParams;
  using Decode = k::Int3DecodeParams;
  static constexpr const char* kWordsRule = "3 * ceil(n/32)";
  static int64_t num_words(int64_t n) { return k::int3_num_words(n); }
  static int64_t num_chunks(int64_t n, int64_t chunk) { return k::int3_num_chunks(n, chunk); }
  static void encode(const Encode& p, const at::Tensor& on) {
    HC_RUN(on, "grad", cpu::int3_encode(p), cuda::int3_encode(p, on.device()));
  }
  static void decode(const Decode& p, const at::Tensor& on) {
    HC_RUN(on, "words", cpu::int3_decode(p), cuda::int3_decode(p, on.device()));
  }
};

template <class C>
void packed_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                        at::Tensor& words, at::Tensor& scales) {
  const at::Tensor g = check_encode(grad, residual, divisor, chunk);
  const int64_t n = g.numel();
  check_buffer(words, "words", g, at::kInt, C::num_words(n), C::kWordsRule, true);
  check_buffer(scales, "scales", g, at::kBFloat16, C::num_chunks(n, chunk), "ceil(n/chunk)", true);
  const typename C::Encode p{g.data_ptr<float>(), opt_ptr(residual), static_cast<float>(divisor), n, chunk,
                             reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>()), bf16_bits(scales)};
  C::encode(p, g);
}

template <class C>
std::tuple<at::Tensor, at::Tensor> packed_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                                 int64_t chunk) {
  check_chunk(chunk);
  check_float_vector(grad, "grad");
  const int64_t n = grad.numel();
  at::Tensor words = at::zeros({C::num_words(n)}, grad.options().dtype(at::kInt));
  at::Tensor scales = at::empty({C::num_chunks(n, chunk)}, grad.options().dtype(at::kBFloat16));
  packed_encode_into<C>(grad, residual, divisor, chunk, words, scales);
  return {words, scales};
}

template <class C>
at::Tensor packed_decode(const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
                         at::Tensor out, bool accumulate) {
  check_decode_sizes(n, chunk);  // (num_chunks divides by the chunk)
  const ChunkedDecode d = check_decode(words, "words", at::kInt, C::num_words(n), C::kWordsRule, scales,
                                       at::kBFloat16, n, C::num_chunks(n, chunk), out, accumulate);
  const typename C::Decode p{reinterpret_cast<const uint32_t*>(d.codes.data_ptr<int32_t>()), bf16_bits(d.scales),
                             d.out.data_ptr<float>(), n, chunk, static_cast<float>(alpha), accumulate};
  C::decode(p, d.codes);
  return d.out;
}

}  // namespace

void sign_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                      at::Tensor& words, at::Tensor& scales) {
  packed_encode_into<SignCodec>(grad, residual, divisor, chunk, words, scales);
}

std::tuple<at::Tensor, at::Tensor> sign_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t chunk) {
  return packed_encode<SignCodec>(grad, residual, divisor, chunk);
}

at::Tensor sign_decode(const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
                       at::Tensor out, bool accumulate) {
  return packed_decode<SignCodec>(words, scales, n, chunk, alpha, out, accumulate);
}

void int3_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                      at::Tensor& words, at::Tensor& scales) {
  packed_encode_into<Int3Codec>(grad, residual, divisor, chunk, words, scales);
}

std::tuple<at::Tensor, at::Tensor> int3_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t chunk) {
  return packed_encode<Int3Codec>(grad, residual, divisor, chunk);
}

at::Tensor int3_decode(const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
                       at::Tensor out, bool accumulate) {
  return packed_decode<Int3Codec>(words, scales, n, chunk, alpha, out, accumulate);
}

void fp8_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                     at::Tensor& codes, at::Tensor& scales) {
  const at::Tensor g = check_encode(grad, residual, divisor, chunk);
  const int64_t n = g.numel();
  check_buffer(codes, "codes", g, at::kByte, n, "n");
  check_buffer(scales, "scales", g, at::kFloat, k::fp8_num_chunks(n, chunk), "ceil(n/chunk)");
  const k::Fp8EncodeParams p{g.data_ptr<float>(), opt_ptr(residual), static_cast<float>(divisor), n, chunk,
                             codes.data_ptr<uint8_t>(), scales.data_ptr<float>()};
  HC_RUN(g, "grad", cpu::fp8_encode(p), cuda::fp8_encode(p, g.device()));
}

std::tuple<at::Tensor, at::Tensor> fp8_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                              int64_t chunk) {
  check_chunk(chunk);
  check_float_vector(grad, "grad");
  const int64_t n = grad.numel();
  at::Tensor codes = at::empty({n}, grad.options().dtype(at::kByte));
  at::Tensor scales = at::empty({k::fp8_num_chunks(n, chunk)}, grad.options().dtype(at::kFloat));
  fp8_encode_into(grad, residual, divisor, chunk, codes, scales);
  return {codes, scales};
}

at::Tensor fp8_decode(const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
                      at::Tensor out, bool accumulate) {
  check_decode_sizes(n, chunk);  // (fp8_num_chunks divides by the chunk)
  const ChunkedDecode d = check_decode(codes, "codes", at::kByte, n, "n", scales, at::kFloat, n,
                                       k::fp8_num_chunks(n, chunk), out, accumulate);
  const k::Fp8DecodeParams p{d.codes.data_ptr<uint8_t>(), d.scales.data_ptr<float>(), d.out.data_ptr<float>(), n, chunk,
                             static_cast<float>(alpha), accumulate};
  HC_RUN(d.codes, "codes", cpu::fp8_decode(p), cuda::fp8_decode(p, d.codes.device()));
  return d.out;
}

std::tuple<at::Tensor, at::Tensor> topk_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t kk, bool exact, const at::Tensor& denominator) {
  check_divisor(divisor);
  TORCH_CHECK_VALUE(kk >= 0 && kk <= grad.numel(), "hetcomm: k must be in [0, grad.numel() = ", grad.numel(),
                    "], got ", kk);
  const at::Tensor g = as_float32(grad, "grad");
  check_residual(residual, g);
  if (!denominator.defined()) {
    HC_RUN(g, "grad", return cpu::topk_encode(g, residual, divisor, kk, exact),
           return cuda::topk_encode(g, residual, divisor, kk, exact));
  }
  check_buffer(denominator, "denominator", g, at::kFloat, g.numel(), "grad's numel", true);
  // x as the plain encoder makes it (k = 0: the accumulation alone), ranked by |x| / denominator
  at::Tensor x = residual;
  if (residual.defined()) {
    HC_RUN(g, "grad", cpu::topk_encode(g, residual, divisor, 0, exact), cuda::topk_encode(g, residual, divisor, 0, exact));
  } else {
    x = g / divisor;
  }
  const at::Tensor rank_by = x.abs().div_(denominator.view({-1}));
  at::Tensor idx;
  HC_RUN(g, "grad", idx = std::get<0>(cpu::topk_encode(rank_by, at::Tensor(), 1.0, kk, exact)),
         idx = std::get<0>(cuda::topk_encode(rank_by, at::Tensor(), 1.0, kk, exact)));
  const at::Tensor where = idx.to(at::kLong);
  at::Tensor val = x.index_select(0, where);
  if (residual.defined()) residual.index_fill_(0, where, 0.0);
  return {idx, val};
}

at::Tensor scatter_add(const at::Tensor& idx, const at::Tensor& val, at::Tensor out, double alpha) {
  TORCH_CHECK_VALUE(out.defined(), "hetcomm: out is undefined");
  const at::Tensor i = idx.contiguous(), v = val.contiguous();
  check_buffer(out, "out", out, at::kFloat, 0, "any number of");
  check_buffer(i, "idx", out, at::kInt, 0, "any number of");
  check_buffer(v, "val", out, at::kFloat, i.numel(), "idx's numel", true);
  const bool cuda = runs_on_cuda(out, "out");
  if (!cuda && i.numel() > 0) {  // (on a GPU this would cost a synchronisation per call: indices come from topk_encode)
    const auto [lo, hi] = at::aminmax(i);
    TORCH_CHECK_VALUE(lo.item<int32_t>() >= 0 && hi.item<int32_t>() < out.numel(),
                      "hetcomm: idx must lie in [0, out.numel() = ", out.numel(), ")");
  }
  const int32_t* ip = i.data_ptr<int32_t>();
  const float* vp = v.data_ptr<float>();
  HC_RUN(out, "out", cpu::scatter_add(ip, vp, i.numel(), static_cast<float>(alpha), out.data_ptr<float>()),
         cuda::scatter_add(ip, vp, i.numel(), static_cast<float>(alpha), out.data_ptr<float>(), out.device()));
  return out;
}

void cast_encode_into(const at::Tensor& x, double divisor, at::Tensor& out) {
  check_divisor(divisor);
  const at::Tensor f = as_float32(x, "x");
  TORCH_CHECK_VALUE(out.defined(), "hetcomm: out is undefined");
  TORCH_CHECK_TYPE(out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16,
                   "hetcomm: wire dtype must be float16 or bfloat16, got ", out.scalar_type());
  check_buffer(out, "out", f, out.scalar_type(), f.numel(), "x's numel", true);
  const float* in = f.data_ptr<float>();
  auto* o = static_cast<uint16_t*>(out.data_ptr());
  const auto fmt = wire16(out.scalar_type());
  const float d = static_cast<float>(divisor);
  HC_RUN(f, "x", cpu::cast_encode(fmt, in, d, o, f.numel()), cuda::cast_encode(fmt, in, d, o, f.numel(), f.device()));
}

at::Tensor cast_encode(const at::Tensor& x, double divisor, at::ScalarType wire) {
  check_float_vector(x, "x");
  at::Tensor out = at::empty({x.numel()}, x.options().dtype(wire));
  cast_encode_into(x, divisor, out);
  return out;
}

at::Tensor cast_decode(const at::Tensor& h, double mul, at::Tensor out) {
  TORCH_CHECK_VALUE(h.defined(), "hetcomm: h is undefined");
  TORCH_CHECK_TYPE(h.scalar_type() == at::kHalf || h.scalar_type() == at::kBFloat16,
                   "hetcomm: h must be float16 or bfloat16, got ", h.scalar_type());
  const at::Tensor hc = h.reshape({-1}).contiguous();
  if (!out.defined()) out = at::empty({hc.numel()}, hc.options().dtype(at::kFloat));
  check_buffer(out, "out", hc, at::kFloat, hc.numel(), "h's numel", true);
  const auto* in = static_cast<const uint16_t*>(hc.data_ptr());
  float* o = out.data_ptr<float>();
  const auto fmt = wire16(h.scalar_type());
  const float m = static_cast<float>(mul);
  HC_RUN(hc, "h", cpu::cast_decode(fmt, in, m, o, hc.numel()), cuda::cast_decode(fmt, in, m, o, hc.numel(), hc.device()));
  return out;
}

}  // namespace ops
}  // namespace hetcomm
