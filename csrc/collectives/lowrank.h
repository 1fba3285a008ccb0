// Low-rank (PowerSGD-style) all-reduce of one bucket, run on the comm thread
// so any number of buckets keeps the same collective order on every rank.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "collectives/compressed.h"
#include "kernels/lowrank.h"
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
// share: this rank's part of the sum's approximation for error feedback
// (default 1 / divisor; the shares of all ranks sum to 1).
// wire: what the two all-reduces send: float32; bfloat16 (half the bytes,
// summed in bf16); or fp8 (at::kFloat8_e4m3fn: about a quarter, the float32
// sums taken by sum_lowrank_factors' fp8 all-reduce). The bf16 and fp8 sums
// are rounded, and each rank's residual then keeps M - share * delivered on
// the dense parts too (on the matrices it always does), so what the rounding
// lost is sent again the next step: over the ranks the residuals hold
// sum(M) - delivered exactly as with float32 (the float32 wire sums the dense
// parts exactly and zeroes their residual). P's rounding moves the basis a
// little (every rank orthonormalizes the same delivered P), Q's is in the
// delivered approximation the residuals are kept against.
// Returns false when x held a NaN or an infinity on some rank (every rank
// learns it from the sum of P and the dense parts, so every rank returns the same):
// x, the residual and Q are then as they came, for the caller to reduce x
// exactly. The step holds no buffer of x's size: M = x / divisor + residual
// is read where x and the residual are.
bool allreduce_lowrank(Transport& t, at::Tensor& x, double divisor, const at::Tensor& layout, at::Tensor& q_state,
                       const at::Tensor& residual, CodecTimer& timer, double share = -1.0,
                       at::ScalarType wire = at::kFloat);

// The same step with its two all-reduces (P and the dense parts; then Q^T)
// hierarchical: summed inside each node, across the nodes among the ranks of
// one local index, and gathered back inside the node (allreduce_hierarchical,
// exact). P = sum_r M_r Q is linear in the M_r, so this is the flat step's
// result with the sums taken another way: the full matrices never travel, and
// each all-reduce sends 2 (nodes - 1) messages a rank across nodes.
bool allreduce_lowrank_hierarchical(Transport& t, at::Tensor& x, double divisor, const at::Tensor& layout,
                                    at::Tensor& q_state, const at::Tensor& residual, const std::vector<int>& node_of,
                                    CodecTimer& timer, double share = -1.0, at::ScalarType wire = at::kFloat);

// The elements per scale of lowrank's fp8 wire (fp8's own default chunk).
constexpr int64_t kLowrankFp8Chunk = 256;

// b becomes the sum over ranks of one of lowrank's rounds (P with the dense
// parts, or Q^T; float32, or bfloat16 for that wire): the transport's
// all-reduce (node_of null) or the exact hierarchy by node_of; for the fp8
// wire (b float32) compressed as the fp8 mode sums a bucket (allreduce_fp8,
// or across nodes only in the hierarchy), without error feedback of its own
// (the step's residuals keep what the delivered sums lost) and with the
// ranks' finiteness carried in its messages: where any rank's b was not
// finite, b is NaN on every rank. The same bits on every rank.
void sum_lowrank_factors(Transport& t, at::Tensor& b, at::ScalarType wire, const std::vector<int>* node_of,
                         CodecTimer& timer);

// A row of the layout.
struct LowrankPart {
  int64_t offset, rows, cols, rank;
  int64_t numel() const { return rows * cols; }
};

// One bucket's step of allreduce_lowrank in its stages, for a caller that
// runs the two all-reduces itself (the engine merges one bucket's second
// all-reduce with the next bucket's first). allreduce_lowrank is: construct
// (M, P and the dense parts: first() is ready), sum first(), after_first()
// (false: some rank's x was not finite, nothing was changed; else second()
// is ready), sum second(), finish(). x, q_state and residual
// (arguments as above) are kept by reference until finish(). first() and
// second() are in float32, or bfloat16 for that wire (sum_lowrank_factors
// takes either).
class LowrankStep {
 public:
  LowrankStep(const at::Tensor& x, double divisor, const at::Tensor& layout, const at::Tensor& q_state,
              const at::Tensor& residual, CodecTimer& timer, double share = -1.0, at::ScalarType wire = at::kFloat);
  at::Tensor& first() { return cast() ? head_wire_ : head_; }
  bool after_first(Transport& t);
  at::Tensor& second() { return cast() ? qt_wire_ : qt_; }
  void finish();

 private:
  // the sums are rounded (bf16, fp8); a bf16 wire's are cast copies of head_ and qt_
  bool rounded() const { return wire_ != at::kFloat; }
  bool cast() const { return wire_ == at::kBFloat16; }
  // M of a dense part (x / divisor + residual) into out (its numel)
  void dense_input(const LowrankPart& p, at::Tensor& out) const;
  at::Tensor x_;
  double divisor_;
  at::Tensor q_state_, residual_, head_, qt_;
  at::Tensor head_wire_, qt_wire_;  // bfloat16 wire: what is summed, encoded from head_ and qt_
  CodecTimer& timer_;
  double share_;
  at::ScalarType wire_;
  int64_t p_total_ = 0;
  std::vector<LowrankPart> parts_;
  // The matrices' P (rows x rank, in head_) and Q (cols x rank, in q_state_),
  // orthonormalized in place on the bucket's device
  std::vector<kernels::ColumnBlock> p_blocks_, q_blocks_;
};

// Elements of q_state a layout needs.
int64_t lowrank_q_numel(const at::Tensor& layout);

}  // namespace collectives
}  // namespace hetcomm
