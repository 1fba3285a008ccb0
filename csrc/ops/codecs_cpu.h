// CPU bodies of the codec ops in codecs.h: the torch-free kernels
// (csrc/kernels/*_cpu.cpp) run under at::parallel_for. Arguments are checked
// by codecs.cpp and dense_ops.cpp before they get here; codecs_cuda.h has the
// same calls for CUDA.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "kernels/cast.h"
#include "kernels/fp8.h"
#include "kernels/int3.h"
#include "kernels/lowrank.h"
#include "kernels/momentum.h"
#include "kernels/sign.h"

namespace hetcomm {
namespace ops {
namespace cpu {

void sign_encode(const kernels::SignEncodeParams& p);
void sign_decode(const kernels::SignDecodeParams& p);
void fp8_encode(const kernels::Fp8EncodeParams& p);
void fp8_decode(const kernels::Fp8DecodeParams& p);
void int3_encode(const kernels::Int3EncodeParams& p);
void int3_decode(const kernels::Int3DecodeParams& p);
// grad: float32, contiguous; residual: undefined or float32[grad.numel()]; 0 <= k <= n.
std::tuple<at::Tensor, at::Tensor> topk_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t k, bool exact);
void scatter_add(const int32_t* idx, const float* val, int64_t count, float alpha, float* out);
void cast_encode(kernels::Wire16 fmt, const float* in, float divisor, uint16_t* out, int64_t n);
void cast_decode(kernels::Wire16 fmt, const uint16_t* in, float mul, float* out, int64_t n);
void lowrank_outer(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r);
void lowrank_finish(const float* p, const float* qt, float* x, float* residual, float divisor, float share,
                    int64_t rows, int64_t cols, int64_t r);
// lowrank's P = M qt^T and Q^T = p^T M for M = x * inv_divisor + residual (kernels/lowrank.h)
void lowrank_project(const float* x, const float* residual, float inv_divisor, const float* qt, float* p, int64_t rows,
                     int64_t cols, int64_t r);
void lowrank_back_project(const float* x, const float* residual, float inv_divisor, const float* p, float* qt,
                          int64_t rows, int64_t cols, int64_t r);
void orthonormalize_blocks(float* base, const std::vector<kernels::ColumnBlock>& blocks, float eps);
void momentum_fold_in(float* x, const float* m, float alpha, int64_t n);
void momentum_handoff(float* x, float* m, float beta, int64_t n);
bool all_finite(const float* x, int64_t n);
void dense_input(const float* x, const float* residual, float divisor, float* out, int64_t n);

}  // namespace cpu
}  // namespace ops
}  // namespace hetcomm
