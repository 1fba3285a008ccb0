// Top-k sparsification with error feedback. Torch-free.
//
//   x = grad / divisor + residual       (ef_accumulate writes x into the residual buffer)
//   select the k entries of largest |x| -> (int32 index ascending, value) pairs
//   residual keeps everything not sent  (topk_clear zeroes the sent entries)
// Exact selection takes exactly k; ties at the threshold go to the lowest indices.
// Sampled selection (as in DGC) estimates the threshold from a deterministic
// stratified sample and returns about k (never more than k) entries.
#pragma once

#include <cstdint>
#include <functional>

namespace hetcomm {
namespace kernels {

// x[i] = grad[i] / divisor + x[i] for i in [begin, end)   (x == residual)
void ef_accumulate_cpu(const float* grad, float divisor, float* x, int64_t begin, int64_t end);
// x[i] = grad[i] / divisor                               (no error feedback)
void scale_copy_cpu(const float* grad, float divisor, float* x, int64_t begin, int64_t end);

// Runs body(first, last) over [0, count) split into pieces, possibly on
// several threads; returns when all are done. The default runs it inline.
using ParallelFor = std::function<void(int64_t count, const std::function<void(int64_t, int64_t)>& body)>;

// Returns the count written (k for exact; <= k for sampled). idx/val hold k slots.
// Exact: a radix select on the magnitudes' bits (a histogram of the top 11
// bits, then the exact k-th among the one bin that holds it), then the
// writes, each pass over fixed blocks of x run through `pfor`. NaN counts as
// larger than infinity.
int64_t topk_select_exact_cpu(const float* x, int64_t n, int64_t k, int32_t* idx, float* val,
                              const ParallelFor& pfor = nullptr);
int64_t topk_select_sampled_cpu(const float* x, int64_t n, int64_t k, int32_t* idx, float* val,
                                const ParallelFor& pfor = nullptr);
// Sample size used by the sampled selection (shared with the CUDA version).
int64_t topk_sample_size(int64_t n, int64_t k);

void topk_clear_cpu(float* residual, const int32_t* idx, int64_t count);
// out[idx[j]] += alpha * val[j] for j in order (sequential: deterministic).
void scatter_add_cpu(const int32_t* idx, const float* val, int64_t count, float alpha, float* out);

// CUDA versions (stream is a cudaStream_t). The CUDA selection is the sampled
// threshold plus an exact refinement among the candidates; *count_out is a
// device int64.
void ef_accumulate_cuda(const float* grad, float divisor, float* x, int64_t n, void* stream);
void topk_clear_cuda(float* residual, const int32_t* idx, int64_t count, void* stream);
void scatter_add_cuda(const int32_t* idx, const float* val, int64_t count, float alpha, float* out,
                      void* stream);
// out[j] = |x[sample_position(j, m, n)]|, j < m
void topk_sample_cuda(const float* x, int64_t n, int64_t m, float* out, void* stream);
// *threshold is a device float: no copy to the host between sampling and selection
void topk_threshold_select_cuda(const float* x, int64_t n, const float* threshold, int64_t capacity,
                                int32_t* idx, float* val, unsigned long long* count_out, void* stream);

}  // namespace kernels
}  // namespace hetcomm
