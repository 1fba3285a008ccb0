#include "collectives/algorithms.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <stdexcept>

#include "collectives/compressed.h"
#include "ops/codecs.h"

namespace hetcomm {
namespace collectives {

namespace {

// k + 1 boundaries of k near-equal blocks of n elements.
std::vector<int64_t> blocks(int64_t n, int64_t k) {
  std::vector<int64_t> b(k + 1);
  for (int64_t i = 0; i <= k; ++i) b[i] = n * i / k;
  return b;
}

int mod(int a, int m) { return ((a % m) + m) % m; }

// Ring reduce-scatter over positions: afterwards position p holds block p,
// summed over every rank. order[p] is the rank at position p.
void ring_reduce_scatter(Transport& t, at::Tensor& x, const std::vector<int>& order, const std::vector<int64_t>& b,
                         int tag) {
  const int w = static_cast<int>(order.size());
  const int pos = static_cast<int>(std::find(order.begin(), order.end(), t.rank()) - order.begin());
  const int right = order[mod(pos + 1, w)], left = order[mod(pos - 1, w)];
  int64_t widest = 0;
  for (int i = 0; i < w; ++i) widest = std::max(widest, b[i + 1] - b[i]);
  at::Tensor tmp = at::empty({widest}, x.options());
  for (int s = 0; s < w - 1; ++s) {
    const int out_blk = mod(pos - 1 - s, w), in_blk = mod(pos - 2 - s, w);
    at::Tensor out = span(x, b[out_blk], b[out_blk + 1]);
    at::Tensor in = span(tmp, 0, b[in_blk + 1] - b[in_blk]);
    t.send_recv(out, out.numel() ? right : -1, in, in.numel() ? left : -1, tag + s);
    span(x, b[in_blk], b[in_blk + 1]).add_(in);
  }
}

// Ring all-gather: position p starts with block p.
void ring_all_gather(Transport& t, at::Tensor& x, const std::vector<int>& order, const std::vector<int64_t>& b,
                     int tag) {
  const int w = static_cast<int>(order.size());
  const int pos = static_cast<int>(std::find(order.begin(), order.end(), t.rank()) - order.begin());
  const int right = order[mod(pos + 1, w)], left = order[mod(pos - 1, w)];
  for (int s = 0; s < w - 1; ++s) {
    const int out_blk = mod(pos - s, w), in_blk = mod(pos - s - 1, w);
    at::Tensor out = span(x, b[out_blk], b[out_blk + 1]);
    at::Tensor in = span(x, b[in_blk], b[in_blk + 1]);
    t.send_recv(out, out.numel() ? right : -1, in, in.numel() ? left : -1, tag + s);
  }
}

std::vector<int> identity(int w) {
  std::vector<int> o(w);
  std::iota(o.begin(), o.end(), 0);
  return o;
}

void check_order(const std::vector<int>& order, int w) {
  std::vector<int> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK_VALUE(sorted == identity(w), "hetcomm: ring order must be a permutation of the ", w, " ranks");
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 1 && x.is_contiguous(), "hetcomm: all-reduce input must be a contiguous 1-D tensor");
}

}  // namespace

at::Tensor span(const at::Tensor& x, int64_t lo, int64_t hi) {
  if (x.dim() != 1 || x.stride(0) != 1) return x.narrow(0, lo, hi - lo);
  return x.as_strided({hi - lo}, {1}, x.storage_offset() + lo);
}

void allreduce_pair(Transport& t, at::Tensor& x) {
  check_x(x);
  TORCH_CHECK_VALUE(t.size() == 2, "hetcomm: the pairwise all-reduce needs 2 ranks, got ", t.size());
  if (x.numel() == 0) return;
  const int other = 1 - t.rank();
  at::Tensor theirs = at::empty_like(x);
  t.send_recv(x, other, theirs, other, tags::kSteps);
  if (t.rank() == 0)
    x.add_(theirs);  // rank 0's values + rank 1's on both ranks: the same operands in the same order, the same bits
  else
    at::add_out(x, theirs, x);
}

void allreduce_ring(Transport& t, at::Tensor& x, const std::vector<int>& order_in) {
  check_x(x);
  const int w = t.size();
  if (w == 1) return;
  if (w == 2) {  // a ring of two: the same bytes in one exchange instead of two rounds of halves
    allreduce_pair(t, x);
    return;
  }
  const std::vector<int> order = order_in.empty() ? identity(w) : order_in;
  check_order(order, w);
  const auto b = blocks(x.numel(), w);
  ring_reduce_scatter(t, x, order, b, tags::kSteps);
  ring_all_gather(t, x, order, b, w);
}

void allreduce_halving_doubling(Transport& t, at::Tensor& x) {
  check_x(x);
  const int w = t.size(), me = t.rank();
  if (w == 1) return;
  int p = 1;
  while (p * 2 <= w) p *= 2;
  const int r = w - p;
  const int64_t n = x.numel();
  // Fold: among the first 2r ranks, each even rank hands its vector to the next.
  int nr;
  if (me < 2 * r) {
    if (me % 2 == 0) {
      t.send(x, me + 1, 0);
      nr = -1;
    } else {
      at::Tensor tmp = at::empty_like(x);
      t.recv(tmp, me - 1, 0);
      x.add_(tmp);
      nr = me / 2;
    }
  } else {
    nr = me - r;
  }
  auto real = [r](int v) { return v < r ? 2 * v + 1 : v + r; };
  if (nr >= 0) {
    const auto b = blocks(n, p);
    at::Tensor tmp = at::empty({n / 2 + 1}, x.options());
    // Recursive halving reduce-scatter: afterwards new rank nr owns block nr.
    int lo = 0, hi = p, tag = 1;
    for (int mask = p / 2; mask >= 1; mask /= 2, ++tag) {
      const int mid = (lo + hi) / 2;
      const bool upper = nr & mask;
      const int keep_lo = upper ? mid : lo, keep_hi = upper ? hi : mid;
      const int give_lo = upper ? lo : mid, give_hi = upper ? mid : hi;
      at::Tensor give = span(x, b[give_lo], b[give_hi]);
      at::Tensor in = span(tmp, 0, b[keep_hi] - b[keep_lo]);
      const int partner = real(nr ^ mask);
      t.send_recv(give, give.numel() ? partner : -1, in, in.numel() ? partner : -1, tag);
      span(x, b[keep_lo], b[keep_hi]).add_(in);
      lo = keep_lo;
      hi = keep_hi;
    }
    // Recursive doubling all-gather.
    for (int mask = 1; mask < p; mask *= 2, ++tag) {
      const int base = nr & ~(mask - 1), other = base ^ mask;
      at::Tensor mine = span(x, b[base], b[base + mask]);
      at::Tensor theirs = span(x, b[other], b[other + mask]);
      const int partner = real(nr ^ mask);
      t.send_recv(mine, mine.numel() ? partner : -1, theirs, theirs.numel() ? partner : -1, tag);
    }
  }
  // Unfold: the folded ranks get the result back.
  if (me < 2 * r) {
    if (me % 2 == 0)
      t.recv(x, me + 1, tags::kUnfold);
    else
      t.send(x, me - 1, tags::kUnfold);
  }
}

void allreduce_tree(Transport& t, at::Tensor& x) {
  check_x(x);
  const int w = t.size(), me = t.rank();
  if (w == 1) return;
  at::Tensor tmp = at::empty_like(x);
  for (int c = 2 * me + 1; c <= 2 * me + 2 && c < w; ++c) {
    t.recv(tmp, c, 0);
    x.add_(tmp);
  }
  if (me > 0) {
    t.send(x, (me - 1) / 2, 0);
    t.recv(x, (me - 1) / 2, 1);
  }
  for (int c = 2 * me + 1; c <= 2 * me + 2 && c < w; ++c) t.send(x, c, 1);
}

// ---- subgroups ------------------------------------------------------------------

SubgroupTransport::SubgroupTransport(Transport& parent, std::vector<int> members, int tag_base)
    : parent_(parent), members_(std::move(members)), tag_base_(tag_base) {
  auto it = std::find(members_.begin(), members_.end(), parent.rank());
  TORCH_CHECK_VALUE(it != members_.end(), "hetcomm: this rank is not a member of the subgroup");
  rank_ = static_cast<int>(it - members_.begin());
}

void SubgroupTransport::do_send(const at::Tensor& t, int dst, int tag) { parent_.send(t, members_.at(dst), tag_base_ + tag); }

void SubgroupTransport::do_recv(at::Tensor& t, int src, int tag) { parent_.recv(t, members_.at(src), tag_base_ + tag); }

void SubgroupTransport::do_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) {
  parent_.send_recv(out, dst >= 0 ? members_.at(dst) : -1, in, src >= 0 ? members_.at(src) : -1, tag_base_ + tag);
}

void SubgroupTransport::do_all_reduce_sum(at::Tensor& t) { allreduce_ring(*this, t); }

void SubgroupTransport::do_all_gather(at::Tensor& out, const at::Tensor& in) {
  const int w = size();
  const int64_t m = in.numel();
  out.narrow(0, rank_ * m, m).copy_(in);
  std::vector<int64_t> b(w + 1);
  for (int i = 0; i <= w; ++i) b[i] = i * m;
  ring_all_gather(*this, out, identity(w), b, tags::kSteps);
}

void SubgroupTransport::do_all_to_all(at::Tensor& out, const at::Tensor& in) {
  const int w = size();
  const int64_t m = in.numel() / w;
  out.narrow(0, rank_ * m, m).copy_(in.narrow(0, rank_ * m, m));
  for (int s = 1; s < w; ++s) {
    const int dst = mod(rank_ + s, w), src = mod(rank_ - s, w);
    at::Tensor recv_block = out.narrow(0, src * m, m);
    send_recv(in.narrow(0, dst * m, m), dst, recv_block, src, s);
  }
}

Pending SubgroupTransport::do_start_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) {
  return parent_.start_send_recv(out, dst >= 0 ? members_.at(dst) : -1, in, src >= 0 ? members_.at(src) : -1,
                                 tag_base_ + tag);
}

namespace {

// Waits for every one of parts, in order.
Pending all_of(std::vector<Pending> parts) {
  return Pending([parts = std::move(parts)]() mutable {
    for (auto& p : parts) p.wait();
  });
}

}  // namespace

Pending SubgroupTransport::start_pairwise(at::Tensor& out, int64_t m, const std::function<at::Tensor(int)>& block_for,
                                          int tag) {
  const int w = size();
  out.narrow(0, rank_ * m, m).copy_(block_for(rank_));
  std::vector<Pending> parts;
  for (int s = 1; s < w; ++s) {
    const int dst = mod(rank_ + s, w), src = mod(rank_ - s, w);
    at::Tensor recv_block = out.narrow(0, src * m, m);
    parts.push_back(start_send_recv(block_for(dst), dst, recv_block, src, tag + s));
  }
  return all_of(std::move(parts));
}

Pending SubgroupTransport::do_start_all_to_all(at::Tensor& out, const at::Tensor& in) {
  if (!overlaps()) return Transport::do_start_all_to_all(out, in);
  const int64_t m = in.numel() / size();
  return start_pairwise(out, m, [&](int r) { return in.narrow(0, r * m, m); }, tags::kSteps);
}

Pending SubgroupTransport::do_start_all_gather(at::Tensor& out, const at::Tensor& in) {
  if (!overlaps()) return Transport::do_start_all_gather(out, in);
  return start_pairwise(out, in.numel(), [&](int) { return in; }, tags::kDirect);
}

void reduce_scatter_ring(Transport& t, at::Tensor& out, const at::Tensor& in) {
  const int w = t.size();
  const int64_t m = out.numel();
  TORCH_CHECK_VALUE(in.dim() == 1 && out.dim() == 1 && in.numel() == m * w && in.scalar_type() == out.scalar_type(),
                    "hetcomm: reduce_scatter input must be 1-D with world_size * output.numel() elements of the "
                    "output's dtype");
  at::Tensor x = in.clone();
  std::vector<int64_t> b(w + 1);
  for (int i = 0; i <= w; ++i) b[i] = i * m;
  ring_reduce_scatter(t, x, identity(w), b, tags::kSteps);
  out.copy_(x.narrow(0, t.rank() * m, m));
}

void SubgroupTransport::do_reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) { reduce_scatter_ring(*this, out, in); }

void SubgroupTransport::do_barrier() {
  at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(device()));
  all_reduce_sum(one);
}

// ---- hierarchical ------------------------------------------------------------------

Hierarchy hierarchy_of(const std::vector<int>& node_of, int rank, int world) {
  TORCH_CHECK_VALUE(world >= 1 && static_cast<int>(node_of.size()) == world,
                    "hetcomm: node_of must name a node for each of the ", world, " ranks");
  TORCH_CHECK_VALUE(rank >= 0 && rank < world, "hetcomm: rank must be in [0, ", world, "), got ", rank);
  for (int nd : node_of) TORCH_CHECK_VALUE(nd >= 0, "hetcomm: node ids must be >= 0, got ", nd);
  std::vector<int> nodes;  // in order of first appearance
  std::map<int, std::vector<int>> members;
  for (int r = 0; r < world; ++r) {
    if (!members.count(node_of[r])) nodes.push_back(node_of[r]);
    members[node_of[r]].push_back(r);
  }
  const size_t per = members[nodes[0]].size();
  for (int nd : nodes)
    TORCH_CHECK_VALUE(members[nd].size() == per, "hetcomm: the hierarchical all-reduce needs the same number of "
                                                 "ranks on every node");
  Hierarchy l;
  l.locals = members[node_of[rank]];
  l.local_index = static_cast<int>(std::find(l.locals.begin(), l.locals.end(), rank) - l.locals.begin());
  for (int nd : nodes) l.peers.push_back(members[nd][l.local_index]);
  return l;
}

int64_t hierarchical_shard_numel(int64_t n, const std::vector<int>& node_of, int rank) {
  TORCH_CHECK_VALUE(n >= 0, "hetcomm: n must be >= 0, got ", n);
  TORCH_CHECK_VALUE(!node_of.empty(), "hetcomm: node_of must name the node of at least one rank");
  const Hierarchy l = hierarchy_of(node_of, rank, static_cast<int>(node_of.size()));
  const auto b = blocks(n, static_cast<int64_t>(l.locals.size()));
  return b[l.local_index + 1] - b[l.local_index];
}

std::pair<int64_t, int64_t> state_offsets(int64_t n, int world, int rank, const std::vector<int>& node_of,
                                          bool hierarchical) {
  if (!hierarchical) return {0, onebit_segment_offset(n, world, rank)};
  TORCH_CHECK_VALUE(static_cast<int>(node_of.size()) == world, "hetcomm: node_of must name a node for each of the ",
                    world, " ranks");
  const Hierarchy l = hierarchy_of(node_of, rank, world);
  const auto b = blocks(n, static_cast<int64_t>(l.locals.size()));
  const int64_t shard = b[l.local_index + 1] - b[l.local_index];
  const int me = static_cast<int>(std::find(l.peers.begin(), l.peers.end(), rank) - l.peers.begin());
  return {b[l.local_index], b[l.local_index] + onebit_segment_offset(shard, static_cast<int>(l.peers.size()), me)};
}

namespace {

// Steps 2 and 3 of the hierarchy with a 16-bit cast across nodes: this rank's
// shard of the node's float32 sum rounded once, summed in 16 bits among its
// peers (the same operands in the same order on each), and the 16-bit shards
// gathered inside the node: the sum is a 16-bit value, so gathering it in 16
// bits and widening once gives float32's bits in half the bytes.
void cast_across_then_gather(Transport& t, Transport& local, at::Tensor& x, const Hierarchy& l,
                             const std::vector<int64_t>& b, const InterOptions& inter) {
  CodecTimer own;
  CodecTimer& timer = inter.timer ? *inter.timer : own;
  at::Tensor h = at::empty({x.numel()}, x.options().dtype(inter.codec == Codec::kFP16 ? at::kHalf : at::kBFloat16));
  at::Tensor mine = span(h, b[l.local_index], b[l.local_index + 1]);
  if (mine.numel() > 0) {
    {
      Timed _(timer);
      ops::cast_encode_into(span(x, b[l.local_index], b[l.local_index + 1]), 1.0, mine);
    }
    SubgroupTransport across(t, l.peers, tags::kAcross);
    allreduce_ring(across, mine);
  }
  if (l.locals.size() > 1) ring_all_gather(local, h, identity(local.size()), b, tags::kGather);
  Timed _(timer);
  ops::cast_decode(h, 1.0, x);
  if (inter.finite != nullptr) inter.finite->everywhere = ops::all_finite(x);
}

}  // namespace

void allreduce_hierarchical(Transport& t, at::Tensor& x, const std::vector<int>& node_of, const InterOptions& inter) {
  check_x(x);
  const Hierarchy l = hierarchy_of(node_of, t.rank(), t.size());
  const int64_t n = x.numel();
  const auto b = blocks(n, static_cast<int64_t>(l.locals.size()));
  SubgroupTransport local(t, l.locals, tags::kLocal);
  // 1. intra-node reduce-scatter: local index i ends with block i of the node's sum
  if (l.locals.size() > 1) ring_reduce_scatter(local, x, identity(local.size()), b, tags::kSteps);
  // 2. inter-node all-reduce of that block among the ranks with the same local index
  at::Tensor shard = span(x, b[l.local_index], b[l.local_index + 1]);
  if (l.peers.size() > 1 && (inter.codec == Codec::kFP16 || inter.codec == Codec::kBF16)) {
    cast_across_then_gather(t, local, x, l, b, inter);
    return;
  }
  if (l.peers.size() > 1 && shard.numel() > 0) {
    SubgroupTransport across(t, l.peers, tags::kAcross);
    CodecTimer own;
    CodecTimer& timer = inter.timer ? *inter.timer : own;
    Finite shard_finite{inter.finite == nullptr || inter.codec == Codec::kNone || ops::all_finite(shard)};
    Finite* f = inter.finite != nullptr ? &shard_finite : nullptr;
    switch (inter.codec) {
      case Codec::kNone:
        allreduce_ring(across, shard);
        break;
      case Codec::kOneBit:
        allreduce_onebit(across, shard, 1.0, inter.chunk, inter.residual, inter.server_residual, timer, inter.pieces,
                         nullptr, f, inter.pack);
        break;
      case Codec::kFP8:
        allreduce_fp8(across, shard, 1.0, inter.chunk, inter.residual, inter.server_residual, timer, inter.pieces,
                      nullptr, f, inter.pack);
        break;
      case Codec::kInt3:
        allreduce_int3(across, shard, 1.0, inter.chunk, inter.residual, inter.server_residual, timer, inter.pieces,
                       nullptr, f, inter.pack);
        break;
      case Codec::kTopK:
        allreduce_topk(across, shard, 1.0, inter.topk_ratio, inter.topk_exact, inter.residual, timer,
                       inter.update_denominator.defined()
                           ? inter.update_denominator.narrow(0, b[l.local_index], shard.numel())
                           : at::Tensor(),
                       f);
        break;
      default:
        TORCH_CHECK_VALUE(false, "hetcomm: the hierarchical all-reduce carries none, fp16, bf16, onebit, fp8, int3 or "
                          "topk across nodes, got codec ", static_cast<int>(inter.codec));
    }
    if (!shard_finite.everywhere) shard.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  // 3. intra-node all-gather
  if (l.locals.size() > 1) ring_all_gather(local, x, identity(local.size()), b, tags::kGather);
  if (inter.finite != nullptr) inter.finite->everywhere = ops::all_finite(x);  // the same x on every rank
}

void allreduce_by(Transport& t, at::Tensor& x, Algo algo, const std::vector<int>& order,
                  const std::vector<int>& node_of, const InterOptions& inter) {
  switch (algo) {
    case Algo::kNative:
      t.all_reduce_sum(x);
      return;
    case Algo::kRing:
      allreduce_ring(t, x, order);
      return;
    case Algo::kHalvingDoubling:
      allreduce_halving_doubling(t, x);
      return;
    case Algo::kTree:
      allreduce_tree(t, x);
      return;
    case Algo::kHierarchical:
      TORCH_CHECK_VALUE(!node_of.empty(), "hetcomm: the hierarchical algorithm needs the topology (node of each rank)");
      allreduce_hierarchical(t, x, node_of, inter);
      return;
  }
  TORCH_CHECK_VALUE(false, "hetcomm: unknown algorithm id ", static_cast<int>(algo));
}

}  // namespace collectives
}  // namespace hetcomm
