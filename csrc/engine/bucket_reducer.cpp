#include "engine/bucket_reducer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <optional>

#include "collectives/algorithms.h"
#include "collectives/lowrank.h"
#include "ops/codecs.h"

namespace hetcomm {

BucketReducer::BucketReducer(std::shared_ptr<Transport> t)
    : transport_(std::move(t)), divisor_(static_cast<double>(transport_->size())) {}

void BucketReducer::set_batch_size(double local) {
  TORCH_CHECK_VALUE(std::isfinite(local) && local > 0, "hetcomm: local batch size must be > 0, got ", local);
  at::Tensor b = at::full({1}, local, at::TensorOptions().dtype(at::kDouble).device(transport_->device()));
  transport_->all_reduce_sum(b);
  transport_->synchronize();
  divisor_ = b.cpu().item<double>() / local;
}

void BucketReducer::set_loss_scale(double s) {
  TORCH_CHECK_VALUE(std::isfinite(s) && s > 0, "hetcomm: loss scale must be finite and > 0, got ", s);
  loss_scale_ = s;
}

namespace {

// x on the CPU, sharing no storage with `sent`, the tensor a collective
// wrote: the process group's own threads may let go of `sent` only a moment
// after the wait, and the result becomes a Python object (a future's value)
// whose last release, were it theirs, would take the GIL on their thread.
at::Tensor own_copy(const at::Tensor& x, const at::Tensor& sent) {
  at::Tensor out = x.cpu();
  return out.is_alias_of(sent) ? out.clone() : out;
}

}  // namespace

at::Tensor BucketReducer::gather_config(const at::Tensor& config) {
  const auto opts = at::TensorOptions().dtype(at::kLong).device(transport_->device());
  at::Tensor c = config.to(opts).contiguous();
  at::Tensor all = at::empty({transport_->size() * c.numel()}, opts);
  transport_->all_gather(all, c);
  transport_->synchronize();
  return own_copy(all.view({transport_->size(), c.numel()}), all);
}

BucketReducer::WireMark BucketReducer::wire_mark() const {
  const WireCounters& wc = transport_->counters();
  return {wc.bytes_sent, wc.bytes_recv, wc.comm_ns, wc.calls, wc.bytes_sent_across, wc.bytes_recv_across,
          wc.packed_rounds, wc.unpacked_rounds};
}

void BucketReducer::add_wire_since(const WireMark& m) {
  const WireMark now = wire_mark();
  sent_ += now.sent - m.sent;
  recv_ += now.recv - m.recv;
  comm_ns_ += now.comm_ns - m.comm_ns;
  calls_ += now.calls - m.calls;
  sent_across_ += now.sent_across - m.sent_across;
  recv_across_ += now.recv_across - m.recv_across;
  packed_rounds_ += now.packed - m.packed;
  unpacked_rounds_ += now.unpacked - m.unpacked;
}

at::Tensor BucketReducer::sum(const at::Tensor& x) {
  Transport& t = *transport_;
  const WireMark mark = wire_mark();
  at::Tensor v = x.to(t.device()).contiguous().clone();
  t.all_reduce_sum(v);
  t.synchronize();
  add_wire_since(mark);
  return own_copy(v, v);
}

void BucketReducer::start_sum(BucketJob& job) {
  if (!job.sum_first.defined()) return;
  Transport& t = *transport_;
  const WireMark mark = wire_mark();
  started_pending_.wait();
  started_sum_ = job.sum_first.to(t.device()).contiguous().clone();
  started_pending_ = t.start_all_reduce_sum(started_sum_);
  add_wire_since(mark);
}

at::Tensor BucketReducer::finish_sum() {
  TORCH_CHECK(started_sum_.defined(), "hetcomm: no sum was started (a bucket's sum_first) to finish");
  Transport& t = *transport_;
  const WireMark mark = wire_mark();
  started_pending_.wait();
  t.synchronize();
  add_wire_since(mark);
  at::Tensor v = std::move(started_sum_);
  started_sum_ = at::Tensor();
  return own_copy(v, v);
}

void BucketReducer::check_topology(const std::vector<int>& ring_order, const std::vector<int>& node_of, int w) {
  TORCH_CHECK_VALUE(ring_order.empty() || static_cast<int>(ring_order.size()) == w, "hetcomm: ring order needs ", w,
                    " ranks");
  Transport::check_nodes(node_of, w);
  std::vector<int> sorted = ring_order;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < static_cast<int>(sorted.size()); ++i)
    TORCH_CHECK_VALUE(sorted[i] == i, "hetcomm: ring order must be a permutation of the ", w, " ranks");
}

void BucketReducer::set_topology(std::vector<int> ring_order, std::vector<int> node_of) {
  check_topology(ring_order, node_of, transport_->size());
  ring_order_ = std::move(ring_order);
  node_of_ = std::move(node_of);
}

namespace {

// The state a compressed reduction writes before it knows whether every
// rank's input was finite, copied into `scratch` (grown where too small), to
// be put back where one was not: "as if the step never happened".
class SavedState {
 public:
  SavedState(at::Tensor& scratch, std::initializer_list<at::Tensor> state) {
    int64_t n = 0;
    for (const at::Tensor& s : state)
      if (s.defined()) n += s.numel();
    if (n == 0) return;
    const at::Tensor& first =
        *std::find_if(state.begin(), state.end(), [](const at::Tensor& s) { return s.defined(); });
    if (!scratch.defined() || scratch.numel() < n || scratch.device() != first.device())
      scratch = at::empty({n}, first.options().dtype(at::kFloat));
    int64_t o = 0;
    for (const at::Tensor& s : state) {
      if (!s.defined()) continue;
      copies_.emplace_back(s, scratch.narrow(0, o, s.numel()));
      copies_.back().second.copy_(s.view({-1}));
      o += s.numel();
    }
  }
  void restore() {
    for (auto& [s, copy] : copies_) s.view({-1}).copy_(copy);
  }

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;  // (state, its copy)
};

// Whether x holds a NaN or an infinity on any rank (one 4-byte all-reduce).
bool any_rank_nonfinite(Transport& t, const at::Tensor& x) {
  at::Tensor flag = at::full({1}, ops::all_finite(x) ? 0.0f : 1.0f, at::TensorOptions().dtype(at::kFloat).device(x.device()));
  t.all_reduce_sum(flag);
  t.synchronize();
  return flag.cpu().item<float>() > 0;
}

}  // namespace

at::Tensor BucketReducer::reduce(BucketJob& job) {
  start_sum(job);
  const auto started = std::chrono::steady_clock::now();
  Transport& t = *transport_;
  const WireMark mark = wire_mark();
  at::Tensor& buf = job.buffer;
  const int w = t.size();
  // sum_i b_i / b (batch-size weighting) times this rank's loss scale: the
  // bucket holds s g and every collective below divides by this.
  const double divisor = divisor_ * loss_scale_;
  switch (job.codec) {
    case Codec::kNone:
    case Codec::kFP16:
    case Codec::kBF16: {
      const at::ScalarType wire =
          job.codec == Codec::kNone ? at::kFloat : (job.codec == Codec::kFP16 ? at::kHalf : at::kBFloat16);
      // A plan change's carry joins the exact sum, unless the step is
      // non-finite somewhere (then it waits for the next step).
      if (job.carry.defined()) {
        if (any_rank_nonfinite(t, buf)) {
          carry_holds_ += 1;
        } else {
          buf.add_(job.carry, divisor);
          job.carry.zero_();
        }
      }
      const Algo algo = job.algo;
      const auto& order = ring_order_;
      const auto& nodes = node_of_;
      if (algo == Algo::kHierarchical && wire != at::kFloat && buf.scalar_type() == at::kFloat) {
        // A 16-bit cast across nodes only: each node sums in float32 and rounds that once (divided first, so
        // no overflow the cast of each rank's share would not have had).
        collectives::InterOptions inter;
        inter.codec = job.codec;
        inter.timer = &codec_;
        if (divisor != 1.0) buf.div_(divisor);
        collectives::allreduce_hierarchical(t, buf, nodes, inter);
      } else {
        collectives::allreduce_dense(t, buf, divisor, wire, codec_, [algo, &order, &nodes](Transport& tr, at::Tensor& y) {
          collectives::allreduce_by(tr, y, algo, order, nodes);
        });
      }
      // Warm-up and dense buckets: m follows the optimizer's own buffer, with
      // the same operations (m = beta m + g), so it matches it bit for bit. A
      // non-finite result (the same on every rank) is a step the optimizer
      // skips: m skips it too.
      if (job.momentum.defined() && ops::all_finite(buf)) job.momentum.mul_(job.beta).add_(buf);
      break;
    }
    case Codec::kOneBit:
    case Codec::kFP8:
    case Codec::kInt3:
    case Codec::kTopK:
    case Codec::kLowRank: {
      // No all-reduce of a finiteness flag first (one round less a bucket:
      // digits' fp8 step on the 2 x 2 testbed went from 16.9 to 14.4 ms flat,
      // 13.7 to 13.3 across nodes; bench/README). lowrank learns
      // whether every rank is finite from its first all-reduce; the others
      // from their messages (collectives::Finite), having written residuals by
      // then: copied here, put back where a rank's input was not finite. Each
      // leaves x as it came there, so buf must be intact until then.
      const bool lowrank = job.codec == Codec::kLowRank;
      const bool hierarchical = job.algo == Algo::kHierarchical && !lowrank;
      // The codecs work in float32; other bucket dtypes go through a copy, and
      // so does a bucket that is written before the check: where the carry or
      // the momentum join it, and the hierarchy's exact intra-node stage.
      at::Tensor x = buf.scalar_type() == at::kFloat ? buf : buf.to(at::kFloat);
      // the hierarchy divides before its exact intra-node sum: where nothing joins x first, that division makes
      // the copy (the same kernel as the copy's div_: one pass over the bucket less)
      const bool divided = hierarchical && x.is_same(buf) && !job.carry.defined() && !job.momentum.defined();
      if (divided)
        x = at::div(buf, divisor);
      else if (x.is_same(buf) && (job.carry.defined() || job.momentum.defined() || hierarchical))
        x = buf.clone();
      std::optional<SavedState> saved;
      if (!lowrank) saved.emplace(saved_, std::initializer_list<at::Tensor>{job.residual, job.server_residual});
      // this rank's input (the carry and the momentum, finite, are added to it); the hierarchy checks its shards
      collectives::Finite finite{lowrank || hierarchical || ops::all_finite(buf)};
      if (job.carry.defined()) x.add_(job.carry, divisor);
      // Momentum compression (1-bit Adam's scheme for SGD): every rank sends
      // its local momentum beta m + g_i (weighted: sum_i x_i / d_i = beta m +
      // the weighted mean of g), so the codec's error feedback runs on the
      // momentum and every rank gets the same new m; the optimizer is handed
      // m_new - beta m_old (its own buffer, beta m_old + that, becomes m_new)
      // and m keeps m_new. Flat onebit / fp8 / int3 do both piece by piece inside the
      // exchange (the same bits, behind the wire); the others around it.
      const bool two_phase = job.algo != Algo::kHierarchical && (job.codec == Codec::kOneBit || job.codec == Codec::kFP8 || job.codec == Codec::kInt3);
      collectives::MomentumFold fold{job.momentum, job.beta * divisor / w, job.beta};
      const collectives::MomentumFold* folded = job.momentum.defined() && two_phase ? &fold : nullptr;
      if (job.momentum.defined() && folded == nullptr) ops::momentum_fold_in(x, job.momentum, fold.add_alpha);
      bool reduced = true;  // false: some rank's input was not finite (buf and lowrank's state untouched)
      if (hierarchical) {
        // Exact inside nodes, compressed across them.
        TORCH_CHECK_VALUE(!node_of_.empty(), "hetcomm: the hierarchical algorithm needs the topology");
        collectives::InterOptions inter;
        inter.codec = job.codec;
        inter.chunk = job.chunk;
        inter.topk_ratio = job.topk_ratio;
        inter.topk_exact = job.topk_exact;
        inter.pack = job.pack;
        inter.update_denominator = job.update_denominator;
        inter.residual = job.residual;
        inter.server_residual = job.server_residual;
        inter.timer = &codec_;
        inter.finite = &finite;
        if (!divided) x.div_(divisor);
        collectives::allreduce_hierarchical(t, x, node_of_, inter);
      } else if (job.codec == Codec::kOneBit)
        collectives::allreduce_onebit(t, x, divisor, job.chunk, job.residual, job.server_residual, codec_, 0, folded,
                                      &finite, job.pack);
      else if (job.codec == Codec::kFP8)
        collectives::allreduce_fp8(t, x, divisor, job.chunk, job.residual, job.server_residual, codec_, 0, folded,
                                   &finite, job.pack);
      else if (job.codec == Codec::kInt3)
        collectives::allreduce_int3(t, x, divisor, job.chunk, job.residual, job.server_residual, codec_, 0, folded,
                                    &finite, job.pack);
      // lowrank's error feedback keeps what this rank's share of the sum (its batch weight, not the loss
      // scale) missed
      else if (job.codec == Codec::kLowRank && job.algo == Algo::kHierarchical)
        reduced = collectives::allreduce_lowrank_hierarchical(t, x, divisor, job.layout, job.q_state, job.residual,
                                                              node_of_, codec_, 1.0 / divisor_, job.lowrank_wire);
      else if (job.codec == Codec::kLowRank)
        reduced = collectives::allreduce_lowrank(t, x, divisor, job.layout, job.q_state, job.residual, codec_,
                                                 1.0 / divisor_, job.lowrank_wire);
      else
        collectives::allreduce_topk(t, x, divisor, job.topk_ratio, job.topk_exact, job.residual, codec_,
                                    job.update_denominator, &finite);
      if (!lowrank) reduced = finite.everywhere;
      if (!reduced) {
        if (saved) saved->restore();
        reduce_nonfinite(job, divisor);
        break;
      }
      if (job.carry.defined()) job.carry.zero_();
      if (job.momentum.defined() && folded == nullptr) ops::momentum_handoff(x, job.momentum, job.beta);
      if (!x.is_same(buf)) buf.copy_(x);
      break;
    }
  }
  t.synchronize();  // a stream transport (NCCL): the job's GPU time counts as comm time of this bucket
  end_bucket(job, started, mark);
  return buf;
}

void BucketReducer::end_bucket(const BucketJob& job, std::chrono::steady_clock::time_point started,
                               const WireMark& mark) {
  add_wire_since(mark);
  const int w = transport_->size();
  numel_ += job.buffer.numel();
  buckets_ += 1;
  fp32_bytes_ += w > 1 ? 2 * (w - 1) * job.buffer.numel() * 4 / w : 0;
  step_buckets_.emplace_back(job.index, std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  if (job.last) {
    if (step_nonfinite_) nonfinite_steps_ += 1;
    step_nonfinite_ = false;
    std::lock_guard<std::mutex> lock(snap_mu_);
    const ReduceTotals now = totals();
    last_step_ = {now.bytes_sent - step_start_.bytes_sent, now.bytes_recv - step_start_.bytes_recv,
                  now.comm_ns - step_start_.comm_ns,       now.codec_ns - step_start_.codec_ns,
                  now.numel - step_start_.numel,           now.buckets - step_start_.buckets,
                  now.fp32_bytes - step_start_.fp32_bytes, now.collectives - step_start_.collectives,
                  now.bytes_sent_across - step_start_.bytes_sent_across,
                  now.bytes_recv_across - step_start_.bytes_recv_across,
                  now.packed_rounds - step_start_.packed_rounds,
                  now.unpacked_rounds - step_start_.unpacked_rounds};
    step_start_ = now;
    last_step_buckets_ = std::move(step_buckets_);
    step_buckets_.clear();
  }
}

// Overflow (e.g. fp16 + GradScaler) or a NaN on some rank: the bucket is
// reduced exactly, as allreduce_hook would (every rank sees the same NaN/Inf,
// so GradScaler skips the step everywhere), and the residuals, the server
// residual, Q and the carry stay as they were.
void BucketReducer::reduce_nonfinite(BucketJob& job, double divisor) {
  step_nonfinite_ = true;
  nonfinite_buckets_ += 1;
  if (job.carry.defined()) carry_holds_ += 1;
  collectives::allreduce_dense(*transport_, job.buffer, divisor, at::kFloat, codec_);
}

ReduceTotals BucketReducer::totals() const {
  return {sent_, recv_, comm_ns_, codec_.ns, numel_, buckets_,
          fp32_bytes_, calls_, sent_across_, recv_across_, packed_rounds_, unpacked_rounds_};
}

std::vector<std::pair<int64_t, double>> BucketReducer::last_step_buckets() const {
  std::lock_guard<std::mutex> lock(snap_mu_);
  return last_step_buckets_;
}

ReduceTotals BucketReducer::last_step() const {
  std::lock_guard<std::mutex> lock(snap_mu_);
  return last_step_;
}

}  // namespace hetcomm
