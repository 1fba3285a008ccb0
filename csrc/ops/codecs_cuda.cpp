#include "ops/codecs_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cast.h"
#include "kernels/codec_math.h"
#include "kernels/lowrank.h"
#include "kernels/sign.h"
#include "kernels/topk.h"

namespace hetcomm {
namespace ops {
namespace cuda {

namespace k = hetcomm::kernels;

namespace {

void* stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

void check_cuda(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == like.get_device() && t.is_contiguous(), "hetcomm: ", name,
                    " must be a contiguous tensor on ", like.device());
}

at::Tensor f32(const at::Tensor& t) { return t.reshape({-1}).to(at::kFloat).contiguous(); }

}  // namespace

void sign_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                      at::Tensor& words, at::Tensor& scales) {
  c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor g = f32(grad);
  if (residual.defined()) check_cuda(residual, "residual", grad);
  check_cuda(words, "words", grad);
  check_cuda(scales, "scales", grad);
  k::SignEncodeParams p{g.data_ptr<float>(), residual.defined() ? residual.data_ptr<float>() : nullptr,
                        static_cast<float>(divisor), g.numel(), chunk,
                        reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>()), scales.data_ptr<float>()};
  k::sign_encode_cuda(p, stream_of(grad));
}

at::Tensor sign_decode(const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
                       at::Tensor out, bool accumulate) {
  c10::cuda::CUDAGuard guard(words.device());
  if (!out.defined()) out = at::empty({n}, words.options().dtype(at::kFloat));
  check_cuda(out, "out", words);
  check_cuda(scales, "scales", words);
  const at::Tensor w = words.contiguous();
  k::SignDecodeParams p{reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>()), scales.data_ptr<float>(),
                        out.data_ptr<float>(), n, chunk, static_cast<float>(alpha), accumulate};
  k::sign_decode_cuda(p, stream_of(words));
  return out;
}

void fp8_encode(const k::Fp8EncodeParams& p, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::fp8_encode_cuda(p, c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

void fp8_decode(const k::Fp8DecodeParams& p, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::fp8_decode_cuda(p, c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

std::tuple<at::Tensor, at::Tensor> topk_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t kk, bool exact) {
  c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor g = f32(grad);
  const int64_t n = g.numel();
  kk = std::min(kk, n);
  at::Tensor x;
  if (residual.defined()) {
    check_cuda(residual, "residual", grad);
    k::ef_accumulate_cuda(g.data_ptr<float>(), static_cast<float>(divisor), residual.data_ptr<float>(), n,
                          stream_of(grad));
    x = residual;
  } else {
    x = g / divisor;
  }
  at::Tensor idx64;
  if (kk == 0) {
    idx64 = at::empty({0}, g.options().dtype(at::kLong));
  } else if (exact) {
    // Everything above the k-th largest |x|, then its ties from the lowest
    // index on: the CPU's choice, whatever order at::topk keeps ties in.
    // Compared as bits, as on the CPU (+0 == -0, NaN above infinity).
    const at::Tensor a = x.abs().view(at::kInt);
    const at::Tensor kth = std::get<0>(at::topk(a, kk, 0, true, true)).narrow(0, kk - 1, 1);
    const at::Tensor above = at::nonzero(a > kth).view({-1});
    const at::Tensor ties = at::nonzero(a == kth).view({-1});
    idx64 = at::cat({above, ties.narrow(0, 0, std::max<int64_t>(0, std::min(ties.numel(), kk - above.numel())))});
  } else {
    // DGC's sampled threshold: the same deterministic sample as the CPU's.
    // Sample and threshold stay on the GPU: the count below is the one copy to the host.
    const int64_t m = k::topk_sample_size(n, kk);
    at::Tensor sample = at::empty({m}, g.options());
    k::topk_sample_cuda(x.data_ptr<float>(), n, m, sample.data_ptr<float>(), stream_of(grad));
    const int64_t ks = std::max<int64_t>(1, (kk * m + n - 1) / n);
    const at::Tensor threshold = std::get<0>(at::kthvalue(sample, m - ks + 1)).contiguous();
    const int64_t cap = 2 * kk;
    at::Tensor ci = at::empty({cap}, g.options().dtype(at::kInt));
    at::Tensor cv = at::empty({cap}, g.options());
    at::Tensor count = at::zeros({1}, g.options().dtype(at::kLong));
    k::topk_threshold_select_cuda(x.data_ptr<float>(), n, threshold.data_ptr<float>(), cap, ci.data_ptr<int32_t>(), cv.data_ptr<float>(),
                                  reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()), stream_of(grad));
    const int64_t c = count.item<int64_t>();
    if (c > cap) {
      idx64 = std::get<1>(at::topk(x.abs(), kk, 0, true, false));  // the sample misled us: exact
    } else if (c > kk) {
      const at::Tensor keep = std::get<1>(at::topk(cv.narrow(0, 0, c).abs(), kk, 0, true, false));
      idx64 = ci.narrow(0, 0, c).index_select(0, keep).to(at::kLong);
    } else {
      idx64 = ci.narrow(0, 0, c).to(at::kLong);
    }
  }
  idx64 = std::get<0>(at::sort(idx64));  // ascending, as on the CPU
  at::Tensor val = x.index_select(0, idx64);
  at::Tensor idx = idx64.to(at::kInt);
  if (residual.defined()) k::topk_clear_cuda(residual.data_ptr<float>(), idx.data_ptr<int32_t>(), idx.numel(), stream_of(grad));
  return {idx, val};
}

at::Tensor scatter_add(const at::Tensor& idx, const at::Tensor& val, at::Tensor out, double alpha) {
  c10::cuda::CUDAGuard guard(out.device());
  check_cuda(out, "out", out);
  const at::Tensor i = idx.contiguous(), v = val.contiguous();
  check_cuda(i, "idx", out);
  check_cuda(v, "val", out);
  k::scatter_add_cuda(i.data_ptr<int32_t>(), v.data_ptr<float>(), i.numel(), static_cast<float>(alpha),
                      out.data_ptr<float>(), stream_of(out));
  return out;
}

void cast_encode_into(const at::Tensor& x, double divisor, at::Tensor& out) {
  c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor f = f32(x);
  check_cuda(out, "out", x);
  const auto fmt = out.scalar_type() == at::kHalf ? k::Wire16::kHalf : k::Wire16::kBFloat16;
  k::cast_encode_cuda(fmt, f.data_ptr<float>(), static_cast<float>(divisor), static_cast<uint16_t*>(out.data_ptr()),
                      f.numel(), stream_of(x));
}

at::Tensor cast_decode(const at::Tensor& h, double mul, at::Tensor out) {
  c10::cuda::CUDAGuard guard(h.device());
  const at::Tensor hc = h.reshape({-1}).contiguous();
  if (!out.defined()) out = at::empty({hc.numel()}, h.options().dtype(at::kFloat));
  check_cuda(out, "out", h);
  const auto fmt = h.scalar_type() == at::kHalf ? k::Wire16::kHalf : k::Wire16::kBFloat16;
  k::cast_decode_cuda(fmt, static_cast<const uint16_t*>(hc.data_ptr()), static_cast<float>(mul), out.data_ptr<float>(),
                      hc.numel(), stream_of(h));
  return out;
}

at::Tensor lowrank_outer(const at::Tensor& p, const at::Tensor& qt, at::Tensor out) {
  c10::cuda::CUDAGuard guard(p.device());
  check_cuda(p, "p", p);
  check_cuda(qt, "qt", p);
  check_cuda(out, "out", p);
  k::outer_product_cuda(p.data_ptr<float>(), qt.data_ptr<float>(), out.data_ptr<float>(), p.size(0), qt.size(1),
                        p.size(1), stream_of(p));
  return out;
}

}  // namespace cuda
}  // namespace ops
}  // namespace hetcomm
