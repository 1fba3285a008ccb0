#include "ops/codecs_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cast.h"
#include "kernels/momentum.h"
#include "kernels/codec_math.h"
#include "kernels/lowrank.h"
#include "kernels/sign.h"
#include "kernels/topk.h"

namespace hetcomm {
namespace ops {
namespace cuda {

namespace k = hetcomm::kernels;

namespace {

void* stream_of(const at::Device& device) { return c10::cuda::getCurrentCUDAStream(device.index()).stream(); }

void* stream_of(const at::Tensor& t) { return stream_of(t.device()); }

}  // namespace

void sign_encode(const k::SignEncodeParams& p, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::sign_encode_cuda(p, stream_of(device));
}

void sign_decode(const k::SignDecodeParams& p, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::sign_decode_cuda(p, stream_of(device));
}

void fp8_encode(const k::Fp8EncodeParams& p, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::fp8_encode_cuda(p, stream_of(device));
}

void fp8_decode(const k::Fp8DecodeParams& p, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::fp8_decode_cuda(p, stream_of(device));
}

void int3_encode(const k::Int3EncodeParams& p, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::int3_encode_cuda(p, stream_of(device));
}

void int3_decode(const k::Int3DecodeParams& p, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::int3_decode_cuda(p, stream_of(device));
}

std::tuple<at::Tensor, at::Tensor> topk_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t kk, bool exact) {
  c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor& g = grad;
  const int64_t n = g.numel();
  at::Tensor x;
  if (residual.defined()) {
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

void scatter_add(const int32_t* idx, const float* val, int64_t count, float alpha, float* out,
                 const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::scatter_add_cuda(idx, val, count, alpha, out, stream_of(device));
}

void cast_encode(k::Wire16 fmt, const float* in, float divisor, uint16_t* out, int64_t n, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::cast_encode_cuda(fmt, in, divisor, out, n, stream_of(device));
}

void cast_decode(k::Wire16 fmt, const uint16_t* in, float mul, float* out, int64_t n, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::cast_decode_cuda(fmt, in, mul, out, n, stream_of(device));
}

void momentum_fold_in(float* x, const float* m, float alpha, int64_t n, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::momentum_fold_in_cuda(x, m, alpha, n, stream_of(device));
}

void momentum_handoff(float* x, float* m, float beta, int64_t n, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::momentum_handoff_cuda(x, m, beta, n, stream_of(device));
}

void lowrank_outer(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r,
                   const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::outer_product_cuda(p, qt, out, rows, cols, r, stream_of(device));
}

void lowrank_finish(const float* p, const float* qt, float* x, float* residual, float divisor, float share,
                    int64_t rows, int64_t cols, int64_t r, const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::lowrank_finish_cuda(p, qt, x, residual, divisor, share, rows, cols, r, stream_of(device));
}

void orthonormalize_blocks(float* base, const std::vector<k::ColumnBlock>& blocks, float eps,
                           const at::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  k::orthonormalize_blocks_cuda(base, blocks.data(), static_cast<int64_t>(blocks.size()), eps, stream_of(device));
}

}  // namespace cuda
}  // namespace ops
}  // namespace hetcomm
