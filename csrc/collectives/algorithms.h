// All-reduce (SUM, in place) algorithms written once against Transport's
// point-to-point calls. Every one ends with the same bytes on every rank:
// each element is summed once, by one rank, in a fixed order, and copied (the
// pair exchange: summed by both ranks, the same operands in the same order).
// Any world size (non powers of two too) and any length.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "collectives/compressed.h"
#include "transport/transport.h"

namespace hetcomm {
namespace collectives {

// x[lo:hi] of a 1-D x: for a stride of 1 one as_strided, where narrow dispatches three ops (narrow, slice,
// as_strided); else narrow.
at::Tensor span(const at::Tensor& x, int64_t lo, int64_t hi);

// Two ranks: each sends its whole vector to the other once, and both add
// rank 0's values to rank 1's (one round; a ring of two makes two rounds of
// halves, the same bytes). Every rank ends with the same bits.
void allreduce_pair(Transport& t, at::Tensor& x);
// Reduce-scatter + all-gather around a ring; order[i] is the rank at ring
// position i (a permutation of 0..size-1; empty: 0, 1, ..., size-1). On two
// ranks, allreduce_pair.
void allreduce_ring(Transport& t, at::Tensor& x, const std::vector<int>& order = {});
// Rabenseifner: recursive halving reduce-scatter + recursive doubling
// all-gather; the ranks beyond the largest power of two fold in first.
void allreduce_halving_doubling(Transport& t, at::Tensor& x);
// Binary tree: reduce to rank 0, broadcast back.
void allreduce_tree(Transport& t, at::Tensor& x);

// out = block rank() of the sum over ranks of in (size() equal blocks), by a
// ring of point-to-point calls.
void reduce_scatter_ring(Transport& t, at::Tensor& out, const at::Tensor& in);

// Tags of point-to-point calls (gloo matches sends to receives by tag, NCCL
// by order). A collective's steps add their step index to its base, below
// the next base; a subgroup adds its own base to every tag of its calls.
namespace tags {
constexpr int kSteps = 0;           // ring / halving-doubling steps: + step (< world size)
constexpr int kUnfold = 100;        // halving-doubling returns the folded ranks' result
constexpr int kGather = 500;        // the intra-node all-gather that ends a hierarchical all-reduce
constexpr int kDirect = 600;        // a subgroup's started all-gather: + step (< world size)
constexpr int kLocal = 1000;        // subgroup: the ranks of this node (hierarchical)
constexpr int kAcross = 2000;       // subgroup: the ranks with this local index on every node
}  // namespace tags

// A transport over a subset of a parent's ranks (members[i] is subgroup rank
// i). Collectives are built from the parent's point-to-point calls, so any
// algorithm or codec can run on e.g. the ranks with one local index. The
// parent's counters hold what went over the wire.
class SubgroupTransport : public Transport {
 public:
  SubgroupTransport(Transport& parent, std::vector<int> members, int tag_base);
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  std::string name() const override { return parent_.name() + "/sub"; }
  at::Device device() const override { return parent_.device(); }
  void synchronize() override { parent_.synchronize(); }
  bool overlaps() const override { return parent_.overlaps(); }

 protected:
  void do_send(const at::Tensor& t, int dst, int tag) override;
  void do_recv(at::Tensor& t, int src, int tag) override;
  void do_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) override;
  void do_all_reduce_sum(at::Tensor& t) override;
  void do_all_gather(at::Tensor& out, const at::Tensor& in) override;
  void do_all_to_all(at::Tensor& out, const at::Tensor& in) override;
  void do_reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) override;
  void do_barrier() override;
  // Where the parent overlaps(): every pair's exchange posted at once (the
  // all-gather direct, not a ring), waited for together.
  Pending do_start_all_gather(at::Tensor& out, const at::Tensor& in) override;
  Pending do_start_all_to_all(at::Tensor& out, const at::Tensor& in) override;
  Pending do_start_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) override;

 private:
  // Both: block_for(r) (m elements) to rank r, out's block r from rank r, for
  // every other rank at once (tags tag + 1 .. tag + size() - 1); this rank's own copied.
  Pending start_pairwise(at::Tensor& out, int64_t m, const std::function<at::Tensor(int)>& block_for, int tag);

  Transport& parent_;
  std::vector<int> members_;
  int rank_;
  int tag_base_;
};

// A wire format: what a bucket's fp32 elements become on the wire (the
// engine's per-bucket codec; all but kLowRank also name the inter-node stage
// of the hierarchical all-reduce).
enum class Codec : int { kNone = 0, kFP16 = 1, kBF16 = 2, kOneBit = 3, kTopK = 4, kLowRank = 5, kFP8 = 6, kInt3 = 7 };

// Intra-node reduce-scatter (ring), inter-node all-reduce of each rank's
// shard among the ranks with the same local index, intra-node all-gather.
// node_of[r] is rank r's node id; every node must hold the same number of
// ranks. The inter-node stage is an exact ring (kNone), a 16-bit cast (kFP16 /
// kBF16: the node's float32 sum rounded once, a ring in 16 bits) or compressed
// (kOneBit / kFP8 / kInt3 / kTopK, with the given residuals, sized for this
// rank's shard); intra-node stays float32.
struct InterOptions {
  Codec codec = Codec::kNone;
  int64_t chunk = 2048;
  double topk_ratio = 0.01;
  bool topk_exact = true;
  int64_t pieces = 0;  // of the onebit / fp8 / int3 exchange (0: by its size, see allreduce_onebit)
  bool pack = false;   // the onebit / fp8 / int3 messages zstd-packed (see allreduce_onebit)
  at::Tensor residual, server_residual;
  at::Tensor update_denominator;  // top-k's, the whole bucket's (undefined: none); each rank's shard takes its part
  CodecTimer* timer = nullptr;  // where the inter-node codec's time is added (the reducer's, for stats())
  // Given: the ranks' finiteness is learnt without a flag's all-reduce. A shard
  // not finite after the intra-node stage is flagged across nodes (Finite);
  // where any was, the shard's ranks fill it with NaN, so the all-gather shows
  // it to every rank, and everywhere is whether x came out finite (false: the
  // caller puts back the residuals the inter-node stage wrote).
  Finite* finite = nullptr;
};
void allreduce_hierarchical(Transport& t, at::Tensor& x, const std::vector<int>& node_of,
                            const InterOptions& inter = InterOptions());

// How a sum is computed (hetcomm/planner.py picks one per bucket). The one
// dispatch by algorithm: the reducer and the Python binding both call it.
enum class Algo : int { kNative = 0, kRing = 1, kHalvingDoubling = 2, kTree = 3, kHierarchical = 4 };
// x becomes the sum over ranks by `algo`: the ring in `order` (empty: rank
// order), the hierarchy by `node_of` with its inter-node stage as `inter` says.
void allreduce_by(Transport& t, at::Tensor& x, Algo algo, const std::vector<int>& order = {},
                  const std::vector<int>& node_of = {}, const InterOptions& inter = InterOptions());
// Where this rank sits: its node's ranks (ascending), the ranks with its local
// index (one per node, in node order), and its local index.
struct Hierarchy {
  std::vector<int> locals;
  std::vector<int> peers;
  int local_index;
};
Hierarchy hierarchy_of(const std::vector<int>& node_of, int rank, int world);

// This rank's shard of an n-element bucket in the hierarchical algorithm
// (the size of its inter-node residuals).
int64_t hierarchical_shard_numel(int64_t n, const std::vector<int>& node_of, int rank);
// Where a bucket's error-feedback state sits in the bucket, as (worker residual
// offset, onebit server residual offset): flat codecs keep a whole-bucket
// worker residual; hierarchical onebit / top-k keep this rank's shard of the
// node's sum, and onebit's server residual is a segment of that.
std::pair<int64_t, int64_t> state_offsets(int64_t n, int world, int rank, const std::vector<int>& node_of,
                                          bool hierarchical);

}  // namespace collectives
}  // namespace hetcomm
