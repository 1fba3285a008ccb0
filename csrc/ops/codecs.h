// The codec ops: ATen wrappers around the torch-free kernels (csrc/kernels/).
// Each checks its arguments (naming the argument and the rule), allocates its
// outputs, then runs on the input's device: CUDA tensors go to codecs_cuda.h
// (the same per-element math), CPU tensors to the CPU loops under
// at::parallel_for. Used by the Python ops (bindings.cpp) and the collectives.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "kernels/lowrank.h"

namespace hetcomm {
namespace ops {

// Returns (words: int32[ceil(n/32)] holding uint32 bit patterns, scales: bfloat16[ceil(n/chunk)]).
// residual (float32, numel n) is updated in place when defined.
std::tuple<at::Tensor, at::Tensor> sign_encode(const at::Tensor& grad, const at::Tensor& residual,
                                               double divisor, int64_t chunk);
// Encodes into caller-provided words/scales (sizes as above); used on the hot path.
void sign_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                      at::Tensor& words, at::Tensor& scales);
// out (numel n, float32) = or += alpha * decoded. Returns out (allocated when undefined).
at::Tensor sign_decode(const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk,
                       double alpha, at::Tensor out, bool accumulate);

// fp8 e4m3 with a power-of-two scale per chunk (kernels/fp8.h). Returns
// (codes: uint8[n], scales: float32[ceil(n/chunk)]); residual as for sign_encode.
// Checks every argument first, then runs on grad's device.
std::tuple<at::Tensor, at::Tensor> fp8_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                              int64_t chunk);
void fp8_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                     at::Tensor& codes, at::Tensor& scales);
// out (numel n, float32) = or += alpha * decoded. Returns out (allocated when undefined).
at::Tensor fp8_decode(const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
                      at::Tensor out, bool accumulate);

// 3-bit linear codes with a bf16 scale per chunk (kernels/int3.h). Returns
// (words: int32[int3_num_words(n)], scales: bfloat16[ceil(n/chunk)]); residual as for sign_encode.
std::tuple<at::Tensor, at::Tensor> int3_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t chunk);
void int3_encode_into(const at::Tensor& grad, const at::Tensor& residual, double divisor, int64_t chunk,
                      at::Tensor& words, at::Tensor& scales);
// out (numel n, float32) = or += alpha * decoded. Returns out (allocated when undefined).
at::Tensor int3_decode(const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
                       at::Tensor out, bool accumulate);

// x = grad / divisor + residual; the k largest |x| -> (idx int32, val float32), ascending index.
// The residual keeps the rest. exact=false uses the sampled threshold (about k, at most k).
// denominator (optional, float32 > 0, one per element): the k largest |x| / denominator are
// chosen instead (values still x's): an attached Adam's sqrt(v) + eps, so that the entries
// whose update is largest go first, not those whose momentum is.
std::tuple<at::Tensor, at::Tensor> topk_encode(const at::Tensor& grad, const at::Tensor& residual,
                                               double divisor, int64_t k, bool exact,
                                               const at::Tensor& denominator = at::Tensor());
// out[idx] += alpha * val, sequentially. Returns out.
at::Tensor scatter_add(const at::Tensor& idx, const at::Tensor& val, at::Tensor out, double alpha);

// float32 -> float16/bfloat16 of x / divisor; and 16-bit -> float32 times mul.
at::Tensor cast_encode(const at::Tensor& x, double divisor, at::ScalarType wire);
void cast_encode_into(const at::Tensor& x, double divisor, at::Tensor& out);
at::Tensor cast_decode(const at::Tensor& h, double mul, at::Tensor out);

// Momentum compression, in place, one pass each (kernels/momentum.h): fold_in:
// x += alpha * m; handoff: x (the new momentum) becomes x - beta * m, m becomes
// the old x. Both float32, contiguous, the same numel and device.
void momentum_fold_in(at::Tensor& x, const at::Tensor& m, double alpha);
void momentum_handoff(at::Tensor& x, at::Tensor& m, double beta);

// Low-rank pieces every rank must compute to the same bits.
// out (rows x cols, float32) = p (rows x r) @ qt (r x cols), fixed order, no BLAS.
at::Tensor lowrank_outer(const at::Tensor& p, const at::Tensor& qt, at::Tensor out);
// The step's end for one matrix, in one pass: x (rows x cols, this rank's
// gradient, float32, contiguous) becomes p @ qt as lowrank_outer makes it;
// with `residual` (x's shape) the residual becomes x / divisor + residual -
// share * (p @ qt), from the old x (kernels::lowrank_residual).
void lowrank_finish(const at::Tensor& p, const at::Tensor& qt, at::Tensor& x, const at::Tensor& residual,
                    double divisor, double share);
// lowrank's two products of M = x / divisor + residual (x rows x cols, residual
// undefined or x's numel; all contiguous float32 on one device): P (rows x r) =
// M qt^T and Q^T (r x cols) = p^T M, into out where given. M is never stored:
// on the CPU one pass over x and the residual a product (kernels/lowrank.h),
// on a GPU cuBLAS's product with the residual, then x's accumulated over
// divisor. Summed over the ranks next, they need no bits in common.
at::Tensor lowrank_project(const at::Tensor& x, const at::Tensor& residual, double divisor, const at::Tensor& qt,
                           at::Tensor out);
at::Tensor lowrank_back_project(const at::Tensor& x, const at::Tensor& residual, double divisor, const at::Tensor& p,
                                at::Tensor out);
// q (cols x rank) takes qt's rows (rank x cols) as its columns, except a row
// of qt that is all zero: that column of q stays as it was. lowrank's next Q
// where a matrix's new Q^T has a zero row (its M Q was zero on every rank,
// e.g. a parameter no rank used): Q keeps its direction instead of dying.
void take_q(at::Tensor& q, const at::Tensor& qt);
// Modified Gram-Schmidt of p's columns (rows x cols, float32) in place, on
// p's device, the same bits on every device.
void orthonormalize_columns(at::Tensor& p, double eps);
// The same for each block of `flat` (contiguous float32) at once: one launch
// on a GPU for all of a bucket's matrices.
void orthonormalize_blocks(at::Tensor& flat, const std::vector<kernels::ColumnBlock>& blocks, double eps);

// Whether x holds no NaN and no infinity (a finite sum proves it in one fast
// reduction; otherwise element by element). Waits for a CUDA x.
bool all_finite(const at::Tensor& x);

// Shared checks.
void check_float_vector(const at::Tensor& t, const char* name);
void check_chunk(int64_t chunk);
void check_divisor(double divisor);
// beta (a momentum's decay) in [0, 1).
void check_beta(double beta);
// The momentum pair of fold_in / handoff: x float32 and contiguous, m (named
// m_name in the error) float32, contiguous, x's numel, beside x; alpha finite; beta as above.
void check_momentum(const at::Tensor& x, const at::Tensor& m, const char* m_name, double alpha, double beta);
at::Tensor as_float32(const at::Tensor& t, const char* name);
int64_t topk_count(int64_t n, double ratio);

}  // namespace ops
}  // namespace hetcomm
