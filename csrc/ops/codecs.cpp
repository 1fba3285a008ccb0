#include "ops/codecs.h"

#include <ATen/Parallel.h>

#include <cmath>

#include "kernels/cast.h"
#include "kernels/fp8.h"
#include "kernels/lowrank.h"
#include "kernels/sign.h"
#include "kernels/topk.h"
#ifdef HETCOMM_WITH_CUDA
#include "ops/codecs_cuda.h"
#define HC_CUDA_DISPATCH(t, call) \
  if ((t).is_cuda()) return call
#else
#define HC_CUDA_DISPATCH(t, call)
#endif

namespace hetcomm {
namespace ops {

namespace k = hetcomm::kernels;

namespace {

constexpr int64_t kGrainElements = 1 << 15;

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "hetcomm: ", name, " must be a CPU tensor (got ", t.device(),
                    "); CUDA tensors need a CUDA build of hetcomm (see hetcomm.build_info())");
}

void check_residual(const at::Tensor& residual, int64_t n) {
  if (!residual.defined()) return;
  check_cpu(residual, "residual");
  TORCH_CHECK_TYPE(residual.scalar_type() == at::kFloat, "hetcomm: residual must be float32, got ",
                   residual.scalar_type());
  TORCH_CHECK_VALUE(residual.is_contiguous(), "hetcomm: residual must be contiguous");
  TORCH_CHECK_VALUE(residual.numel() == n, "hetcomm: residual must have the gradient's numel (", n, "), got ",
                    residual.numel());
}

float* opt_ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

}  // namespace

void check_divisor(double divisor) {
  TORCH_CHECK_VALUE(std::isfinite(divisor) && divisor > 0.0, "hetcomm: divisor must be finite and > 0, got ",
                    divisor);
}

void check_chunk(int64_t chunk) {
  TORCH_CHECK_VALUE(chunk > 0 && chunk % 32 == 0, "hetcomm: chunk must be a positive multiple of 32, got ", chunk);
}

void check_float_vector(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), "hetcomm: ", name, " is undefined");
#ifdef HETCOMM_WITH_CUDA
  if (!t.is_cuda()) check_cpu(t, name);
#else
  check_cpu(t, name);
#endif
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

void sign_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                      at::Tensor& words, at::Tensor& scales) {
  check_divisor(divisor);
  check_chunk(chunk);
  HC_CUDA_DISPATCH(grad, cuda::sign_encode_into(grad, residual, divisor, chunk, words, scales));
  const at::Tensor g = as_float32(grad, "grad");
  const int64_t n = g.numel();
  check_residual(residual, n);
  const int64_t nchunks = k::sign_num_chunks(n, chunk);
  TORCH_CHECK_VALUE(words.numel() == k::sign_num_words(n) && words.scalar_type() == at::kInt && words.is_contiguous(),
                    "hetcomm: words must be contiguous int32 with ceil(n/32) elements");
  TORCH_CHECK_VALUE(scales.numel() == nchunks && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
                    "hetcomm: scales must be contiguous float32 with ceil(n/chunk) elements");
  k::SignEncodeParams p{g.data_ptr<float>(), opt_ptr(residual), static_cast<float>(divisor), n, chunk,
                        reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>()), scales.data_ptr<float>()};
  const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk);
  at::parallel_for(0, nchunks, grain, [&](int64_t b, int64_t e) { k::sign_encode_cpu(p, b, e); });
}

std::tuple<at::Tensor, at::Tensor> sign_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t chunk) {
  check_chunk(chunk);
  check_float_vector(grad, "grad");
  const int64_t n = grad.numel();
  at::Tensor words = at::zeros({k::sign_num_words(n)}, grad.options().dtype(at::kInt));
  at::Tensor scales = at::empty({k::sign_num_chunks(n, chunk)}, grad.options().dtype(at::kFloat));
  sign_encode_into(grad, residual, divisor, chunk, words, scales);
  return {words, scales};
}

at::Tensor sign_decode(const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
                       at::Tensor out, bool accumulate) {
  // Checked first, for every device (then dispatched).
  check_chunk(chunk);
  TORCH_CHECK_VALUE(n >= 0, "hetcomm: n must be >= 0, got ", n);
  TORCH_CHECK_VALUE(words.defined() && scales.defined(), "hetcomm: words and scales must be tensors");
  TORCH_CHECK_TYPE(words.scalar_type() == at::kInt, "hetcomm: words must be int32, got ", words.scalar_type());
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat, "hetcomm: scales must be float32, got ",
                   scales.scalar_type());
  TORCH_CHECK_VALUE(scales.device() == words.device(), "hetcomm: scales must be on ", words.device(), ", got ",
                    scales.device());
  TORCH_CHECK_VALUE(words.numel() >= k::sign_num_words(n), "hetcomm: words must hold ceil(n/32) = ",
                    k::sign_num_words(n), " words, got ", words.numel());
  const int64_t nchunks = k::sign_num_chunks(n, chunk);
  TORCH_CHECK_VALUE(scales.numel() >= nchunks, "hetcomm: scales must hold ceil(n/chunk) = ", nchunks,
                    " values, got ", scales.numel());
  TORCH_CHECK_VALUE(out.defined() || !accumulate, "hetcomm: accumulate=True needs an out tensor");
  if (out.defined()) {
    TORCH_CHECK_VALUE(out.device() == words.device(), "hetcomm: out must be on ", words.device(), ", got ",
                      out.device());
    TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "hetcomm: out must be float32, got ", out.scalar_type());
    TORCH_CHECK_VALUE(out.is_contiguous() && out.numel() == n, "hetcomm: out must be contiguous with n = ", n,
                      " elements, got ", out.numel());
  }
  HC_CUDA_DISPATCH(words, cuda::sign_decode(words, scales, n, chunk, alpha, out, accumulate));
  check_cpu(words, "words");
  if (!out.defined()) out = at::empty({n}, at::kFloat);
  const at::Tensor w = words.contiguous();
  const at::Tensor s = scales.contiguous();
  k::SignDecodeParams p{reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>()), s.data_ptr<float>(),
                        out.data_ptr<float>(), n, chunk, static_cast<float>(alpha), accumulate};
  const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk);
  at::parallel_for(0, nchunks, grain, [&](int64_t b, int64_t e) { k::sign_decode_cpu(p, b, e); });
  return out;
}

namespace {

// t: defined, on `like`'s device, contiguous, of dtype `type`, at least `numel` elements.
void check_buffer(const at::Tensor& t, const char* name, const at::Tensor& like, at::ScalarType type, int64_t numel,
                  const char* size_rule) {
  TORCH_CHECK_VALUE(t.defined(), "hetcomm: ", name, " is undefined");
  TORCH_CHECK_VALUE(t.device() == like.device(), "hetcomm: ", name, " must be on ", like.device(), ", got ",
                    t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == type, "hetcomm: ", name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), "hetcomm: ", name, " must be contiguous");
  TORCH_CHECK_VALUE(t.numel() >= numel, "hetcomm: ", name, " must hold ", size_rule, " = ", numel, " elements, got ",
                    t.numel());
}

}  // namespace

void fp8_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                     at::Tensor& codes, at::Tensor& scales) {
  check_divisor(divisor);
  check_chunk(chunk);
  const at::Tensor g = as_float32(grad, "grad");
  const int64_t n = g.numel();
  if (residual.defined()) {
    TORCH_CHECK_VALUE(residual.numel() == n, "hetcomm: residual must have the gradient's numel (", n, "), got ",
                      residual.numel());
    check_buffer(residual, "residual", g, at::kFloat, n, "the gradient's numel");
  }
  check_buffer(codes, "codes", g, at::kByte, n, "n");
  check_buffer(scales, "scales", g, at::kFloat, k::fp8_num_chunks(n, chunk), "ceil(n/chunk)");
  const k::Fp8EncodeParams p{g.data_ptr<float>(), opt_ptr(residual), static_cast<float>(divisor), n, chunk,
                             codes.data_ptr<uint8_t>(), scales.data_ptr<float>()};
#ifdef HETCOMM_WITH_CUDA
  if (g.is_cuda()) return cuda::fp8_encode(p, g.device());
#endif
  at::parallel_for(0, k::fp8_num_chunks(n, chunk), std::max<int64_t>(1, kGrainElements / chunk),
                   [&](int64_t b, int64_t e) { k::fp8_encode_cpu(p, b, e); });
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
  check_chunk(chunk);
  TORCH_CHECK_VALUE(n >= 0, "hetcomm: n must be >= 0, got ", n);
  TORCH_CHECK_VALUE(codes.defined(), "hetcomm: codes is undefined");
  check_buffer(codes, "codes", codes, at::kByte, n, "n");
  check_buffer(scales, "scales", codes, at::kFloat, k::fp8_num_chunks(n, chunk), "ceil(n/chunk)");
  if (!out.defined()) {
    TORCH_CHECK_VALUE(!accumulate, "hetcomm: accumulate=True needs an out tensor");
    out = at::empty({n}, codes.options().dtype(at::kFloat));
  }
  check_buffer(out, "out", codes, at::kFloat, n, "n");
  TORCH_CHECK_VALUE(out.numel() == n, "hetcomm: out must have n = ", n, " elements, got ", out.numel());
  const k::Fp8DecodeParams p{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), out.data_ptr<float>(), n, chunk,
                             static_cast<float>(alpha), accumulate};
#ifdef HETCOMM_WITH_CUDA
  if (codes.is_cuda()) {
    cuda::fp8_decode(p, codes.device());
    return out;
  }
#endif
  check_cpu(codes, "codes");
  at::parallel_for(0, k::fp8_num_chunks(n, chunk), std::max<int64_t>(1, kGrainElements / chunk),
                   [&](int64_t b, int64_t e) { k::fp8_decode_cpu(p, b, e); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> topk_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t kk, bool exact) {
  check_divisor(divisor);
  TORCH_CHECK_VALUE(kk >= 0 && kk <= grad.numel(), "hetcomm: k must be in [0, grad.numel() = ", grad.numel(),
                    "], got ", kk);
  HC_CUDA_DISPATCH(grad, cuda::topk_encode(grad, residual, divisor, kk, exact));
  const at::Tensor g = as_float32(grad, "grad");
  const int64_t n = g.numel();
  check_residual(residual, n);
  kk = std::min(kk, n);
  at::Tensor x = residual.defined() ? residual : at::empty({n}, at::kFloat);
  float* xp = x.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float d = static_cast<float>(divisor);
  at::parallel_for(0, n, kGrainElements, [&](int64_t b, int64_t e) {
    if (residual.defined())
      k::ef_accumulate_cpu(gp, d, xp, b, e);
    else
      k::scale_copy_cpu(gp, d, xp, b, e);
  });
  at::Tensor idx = at::empty({kk}, at::kInt);
  at::Tensor val = at::empty({kk}, at::kFloat);
  const k::ParallelFor pfor = [](int64_t count, const std::function<void(int64_t, int64_t)>& body) {
    at::parallel_for(0, count, 1, body);
  };
  const int64_t count = exact ? k::topk_select_exact_cpu(xp, n, kk, idx.data_ptr<int32_t>(), val.data_ptr<float>(), pfor)
                              : k::topk_select_sampled_cpu(xp, n, kk, idx.data_ptr<int32_t>(), val.data_ptr<float>(), pfor);
  if (residual.defined()) k::topk_clear_cpu(xp, idx.data_ptr<int32_t>(), count);
  return {idx.narrow(0, 0, count), val.narrow(0, 0, count)};
}

at::Tensor scatter_add(const at::Tensor& idx, const at::Tensor& val, at::Tensor out, double alpha) {
  HC_CUDA_DISPATCH(out, cuda::scatter_add(idx, val, out, alpha));
  check_cpu(idx, "idx");
  check_cpu(val, "val");
  check_cpu(out, "out");
  TORCH_CHECK_TYPE(idx.scalar_type() == at::kInt, "hetcomm: idx must be int32, got ", idx.scalar_type());
  TORCH_CHECK_TYPE(val.scalar_type() == at::kFloat, "hetcomm: val must be float32, got ", val.scalar_type());
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "hetcomm: out must be float32, got ", out.scalar_type());
  TORCH_CHECK_VALUE(idx.numel() == val.numel(), "hetcomm: idx and val must have the same numel, got ", idx.numel(),
                    " and ", val.numel());
  TORCH_CHECK_VALUE(out.is_contiguous(), "hetcomm: out must be contiguous");
  const at::Tensor i = idx.contiguous();
  const at::Tensor v = val.contiguous();
  if (i.numel() > 0) {
    const auto [lo, hi] = at::aminmax(i);
    TORCH_CHECK_VALUE(lo.item<int32_t>() >= 0 && hi.item<int32_t>() < out.numel(),
                      "hetcomm: idx must lie in [0, out.numel() = ", out.numel(), ")");
  }
  k::scatter_add_cpu(i.data_ptr<int32_t>(), v.data_ptr<float>(), i.numel(), static_cast<float>(alpha),
                     out.data_ptr<float>());
  return out;
}

void cast_encode_into(const at::Tensor& x, double divisor, at::Tensor& out) {
  check_divisor(divisor);
  HC_CUDA_DISPATCH(x, cuda::cast_encode_into(x, divisor, out));
  const at::Tensor f = as_float32(x, "x");
  TORCH_CHECK_TYPE(out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16,
                   "hetcomm: wire dtype must be float16 or bfloat16, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.is_contiguous() && out.numel() == f.numel(), "hetcomm: out must be contiguous with x's numel");
  const auto fmt = out.scalar_type() == at::kHalf ? k::Wire16::kHalf : k::Wire16::kBFloat16;
  const float* in = f.data_ptr<float>();
  auto* o = static_cast<uint16_t*>(out.data_ptr());
  const float d = static_cast<float>(divisor);
  at::parallel_for(0, f.numel(), kGrainElements,
                   [&](int64_t b, int64_t e) { k::cast_encode_cpu(fmt, in, d, o, b, e); });
}

at::Tensor cast_encode(const at::Tensor& x, double divisor, at::ScalarType wire) {
  check_float_vector(x, "x");
  at::Tensor out = at::empty({x.numel()}, x.options().dtype(wire));
  cast_encode_into(x, divisor, out);
  return out;
}

at::Tensor cast_decode(const at::Tensor& h, double mul, at::Tensor out) {
  HC_CUDA_DISPATCH(h, cuda::cast_decode(h, mul, out));
  check_cpu(h, "h");
  TORCH_CHECK_TYPE(h.scalar_type() == at::kHalf || h.scalar_type() == at::kBFloat16,
                   "hetcomm: h must be float16 or bfloat16, got ", h.scalar_type());
  const at::Tensor hc = h.reshape({-1}).contiguous();
  if (!out.defined()) out = at::empty({hc.numel()}, at::kFloat);
  check_cpu(out, "out");
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "hetcomm: out must be float32, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.is_contiguous() && out.numel() == hc.numel(), "hetcomm: out must be contiguous with h's numel");
  const auto fmt = h.scalar_type() == at::kHalf ? k::Wire16::kHalf : k::Wire16::kBFloat16;
  const auto* in = static_cast<const uint16_t*>(hc.data_ptr());
  float* o = out.data_ptr<float>();
  const float m = static_cast<float>(mul);
  at::parallel_for(0, hc.numel(), kGrainElements,
                   [&](int64_t b, int64_t e) { k::cast_decode_cpu(fmt, in, m, o, b, e); });
  return out;
}

at::Tensor lowrank_outer(const at::Tensor& p, const at::Tensor& qt, at::Tensor out) {
  TORCH_CHECK_VALUE(p.dim() == 2 && qt.dim() == 2 && p.size(1) == qt.size(0), "hetcomm: p (rows x r) and qt (r x cols) "
                    "must be matrices with matching r, got ", p.sizes(), " and ", qt.sizes());
  TORCH_CHECK_TYPE(p.scalar_type() == at::kFloat && qt.scalar_type() == at::kFloat, "hetcomm: p and qt must be float32");
  TORCH_CHECK_VALUE(p.device() == qt.device(), "hetcomm: p and qt must be on one device, got ", p.device(), " and ",
                    qt.device());
  const at::Tensor pc = p.contiguous(), qc = qt.contiguous();
  const int64_t rows = p.size(0), cols = qt.size(1), r = p.size(1);
  if (!out.defined()) out = at::empty({rows, cols}, pc.options());
  TORCH_CHECK_VALUE(out.is_contiguous() && out.numel() == rows * cols && out.scalar_type() == at::kFloat &&
                        out.device() == p.device(),
                    "hetcomm: out must be contiguous float32 with rows * cols elements on p's device");
  HC_CUDA_DISPATCH(pc, cuda::lowrank_outer(pc, qc, out));
  check_cpu(pc, "p");
  const float* pp = pc.data_ptr<float>();
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)), [&](int64_t b, int64_t e) {
    k::outer_product_cpu(pp, qp, op, rows, cols, r, b, e);
  });
  return out;
}

void orthonormalize_columns(at::Tensor& p, double eps) {
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, "hetcomm: eps must be finite and >= 0, got ", eps);
  TORCH_CHECK_VALUE(p.dim() == 2 && p.is_contiguous() && p.scalar_type() == at::kFloat,
                    "hetcomm: p must be a contiguous float32 matrix");
  at::Tensor host = p.is_cpu() ? p : p.cpu();
  k::orthonormalize_columns_cpu(host.data_ptr<float>(), host.size(0), host.size(1), static_cast<float>(eps));
  if (!host.is_same(p)) p.copy_(host);
}

}  // namespace ops
}  // namespace hetcomm
