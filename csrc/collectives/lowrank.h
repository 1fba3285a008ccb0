// Low-rank (PowerSGD-style) all-reduce of one bucket, run on the comm thread
// so any number of buckets keeps the same collective order on every rank.
#pragma once

#include <ATen/ATen.h>

#include "collectives/compressed.h"
#include "transport/transport.h"

namespace hetcomm {
namespace collectives {

// layout: int64 [k, 4] rows of (offset, rows, cols, rank). rank == 0 marks a
// tensor sent dense (rows * cols elements at offset); rank > 0 a matrix
// approximated as P Q^T with P: rows x rank, Q: cols x rank.
// q_state: the concatenated Q of every matrix (warm start), updated in place.
// residual (numel x.numel(), may be undefined): error feedback on the matrices;
// each rank keeps M_r - approx / divisor_r (its share of the sum's approximation).
// x = sum_i x_i / divisor_i on the dense parts, its rank-r approximation on the matrices.
void allreduce_lowrank(Transport& t, at::Tensor& x, double divisor, const at::Tensor& layout, at::Tensor& q_state,
                       const at::Tensor& residual, CodecTimer& timer);

// Elements of q_state a layout needs.
int64_t lowrank_q_numel(const at::Tensor& layout);

}  // namespace collectives
}  // namespace hetcomm
