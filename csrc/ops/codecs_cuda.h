// CUDA versions of the ATen codec wrappers in codecs.h: same contracts,
// kernels from csrc/kernels/*_cuda.cu (the same per-element math), enqueued
// on the current CUDA stream. Only in CUDA builds (HETCOMM_WITH_CUDA).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "kernels/fp8.h"

namespace hetcomm {
namespace ops {
namespace cuda {

void sign_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                      at::Tensor& words, at::Tensor& scales);
at::Tensor sign_decode(const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
                       at::Tensor out, bool accumulate);
// Checked by the caller (codecs.cpp): enqueue on the device's current stream.
void fp8_encode(const kernels::Fp8EncodeParams& p, const at::Device& device);
void fp8_decode(const kernels::Fp8DecodeParams& p, const at::Device& device);
std::tuple<at::Tensor, at::Tensor> topk_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t k, bool exact);
at::Tensor scatter_add(const at::Tensor& idx, const at::Tensor& val, at::Tensor out, double alpha);
void cast_encode_into(const at::Tensor& x, double divisor, at::Tensor& out);
at::Tensor cast_decode(const at::Tensor& h, double mul, at::Tensor out);
at::Tensor lowrank_outer(const at::Tensor& p, const at::Tensor& qt, at::Tensor out);

}  // namespace cuda
}  // namespace ops
}  // namespace hetcomm
