// What the comm thread does with one DDP bucket: apply the step's weight and
// reduce it with the bucket's codec. Also the small control collectives of a
// step (batch sizes, the first-step configuration check). Not thread-safe:
// only the comm thread calls it (stats() reads atomics).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/compressed.h"
#include "collectives/lowrank.h"
#include "transport/transport.h"

namespace hetcomm {

using collectives::Algo;
using collectives::Codec;

struct BucketJob {
  int64_t index = 0;
  at::Tensor buffer;  // DDP's flat bucket, reduced in place
  Codec codec = Codec::kNone;
  Algo algo = Algo::kNative;
  int64_t chunk = 2048;
  double topk_ratio = 0.01;
  bool topk_exact = true;
  // onebit, fp8, int3: their messages zstd-packed (collectives/packing.h), the same on every rank
  bool pack = false;
  // An attached Adam's per-element sqrt(v) + eps (float32, the bucket's numel; may be undefined):
  // top-k ranks the entries by |x| / it (the update each would make, not the momentum).
  at::Tensor update_denominator;
  at::Tensor residual;         // worker / top-k residual, float32, may be undefined
  at::Tensor server_residual;  // onebit and fp8 only, may be undefined
  at::Tensor layout;           // lowrank only: int64 [k, 4]
  at::Tensor q_state;          // lowrank only: warm-start Q, updated in place
  at::ScalarType lowrank_wire = at::kFloat;  // lowrank only: what its all-reduces send (float32, bfloat16, fp8)
  // Momentum compression (HookState.attach_optimizer): the SGD momentum m of
  // the bucket, identical on every rank; float32, may be undefined.
  at::Tensor momentum;
  double beta = 0.0;
  // What an earlier plan of this bucket did not deliver yet (its residuals,
  // placed at their offsets, in units of this rank's weighted contribution):
  // added to this step's contribution, then zeroed. float32, may be undefined.
  at::Tensor carry;
  bool last = false;           // last bucket of the step
  // The hook's buckets: the step's next bucket will come (DDP hands over
  // every one), so a lowrank bucket may wait for it (see BucketReducer::pipelines).
  bool pipeline = false;
  // A pipelined lowrank bucket that is not the step's last: its first
  // all-reduce waits for the step's next bucket, and the step's buckets then
  // send two rounds together (BucketReducer::reduce_pipelined).
  bool hold = false;
  // A small floating-point vector (clip_grad_norm_'s sketch of the step) whose
  // sum over the ranks starts before this job's own collectives, so that it
  // moves while the bucket is reduced; BucketReducer::finish_sum returns it.
  // May be undefined.
  at::Tensor sum_first;
};

// A lowrank bucket between its two all-reduces: it waits for the next bucket
// to send its second one together with that bucket's first. With a carry the
// step runs on input, a copy of the bucket with the carry added (the bucket
// stays as it came until the step is known finite everywhere); finish() ends
// the step and, with a carry, writes the bucket and zeroes the carry.
struct ParkedBucket {
  BucketJob job;
  std::unique_ptr<collectives::LowrankStep> step;
  at::Tensor input;
  void finish();
};

// Buckets whose futures are still open, in the order they came.
using Parked = std::vector<std::unique_ptr<ParkedBucket>>;

struct PipelineOutcome {
  // The buckets parked or held before this job whose steps it ended (their
  // futures are still open), and whether those steps are done. Released by
  // the engine, under the GIL.
  Parked earlier;
  bool earlier_done = false;
  bool parked = false;  // this job waits for the next one: its future stays open
};

struct ReduceTotals {
  int64_t bytes_sent = 0, bytes_recv = 0, comm_ns = 0, codec_ns = 0, numel = 0, buckets = 0, fp32_bytes = 0;
  int64_t collectives = 0;  // the transport's calls (an all-reduce, a point-to-point step: one each)
  int64_t bytes_sent_across = 0, bytes_recv_across = 0;  // to / from ranks on other nodes (Transport::set_nodes)
  int64_t packed_rounds = 0, unpacked_rounds = 0;  // rounds offered for packing that went packed / raw
};

class BucketReducer {
 public:
  explicit BucketReducer(std::shared_ptr<Transport> t);

  // All-reduces the local batch size; the step's divisor becomes sum(b) / b.
  void set_batch_size(double local);
  double divisor() const { return divisor_; }
  // This rank's loss scale s (GradScaler): its buckets hold s g, and each is
  // reduced as g (the scale joins the divisor) until the next call.
  void set_loss_scale(double s);
  at::Tensor reduce(BucketJob& job);
  // Whether job goes through reduce_pipelined: a lowrank bucket of the hook
  // (job.pipeline) in a float32 buffer (CPU or CUDA) with no momentum.
  // Each lowrank bucket costs two rounds of all-reduces, and every round
  // waits for the slowest rank; pipelined, the step's B buckets cost B + 1:
  // a bucket's second all-reduce (Q^T) goes with the next bucket's first
  // (P and the dense parts). A bucket's result then waits for the next
  // bucket's hand-over; its first all-reduce still overlaps backward.
  static bool pipelines(const BucketJob& job);
  // A pipelined job: the parked bucket's second all-reduce joins this job's
  // first (same algorithm; else the parked one ends on its own first), then
  // this job parks unless it is the step's last. A job with hold (not the
  // step's last) computes its P and waits before its first all-reduce; the
  // next job without hold then sends every held bucket's first all-reduce
  // with its own, and their second ones together: the step's B buckets cost
  // two rounds, not B + 1, where nothing of backward is left to overlap
  // (the hook decides by measuring both). Only the comm thread calls it, so
  // every rank sends the same all-reduces in the same order.
  void reduce_pipelined(BucketJob& job, PipelineOutcome& out);
  // Ends the parked or held buckets' steps before any other job (a parked
  // one: its second all-reduce; held ones: both rounds): out gets them, in
  // the order they came (none if none waited).
  void flush(Parked& out);
  // All-gathers an int64 vector: returns [world, numel].
  at::Tensor gather_config(const at::Tensor& config);
  // Sums a small floating-point vector over the ranks (exact, in its dtype;
  // counted in the totals): returns the sum on the CPU.
  at::Tensor sum(const at::Tensor& x);
  // The sum a job's sum_first started (waits for it): on the CPU.
  at::Tensor finish_sum();
  // Ring order and node of each rank (from the topology), used by kRing and kHierarchical.
  void set_topology(std::vector<int> ring_order, std::vector<int> node_of);
  static void check_topology(const std::vector<int>& ring_order, const std::vector<int>& node_of, int world);

  ReduceTotals totals() const;
  // Steps (and compressed buckets) whose gradient was non-finite on some rank.
  int64_t nonfinite_steps() const { return nonfinite_steps_; }
  int64_t nonfinite_buckets() const { return nonfinite_buckets_; }
  // Reductions that held a plan change's carry back (a non-finite step): the
  // same count on every rank, so the ranks agree when a carry was consumed.
  int64_t carry_holds() const { return carry_holds_; }
  ReduceTotals last_step() const;
  // (bucket index, seconds on the comm thread) of each bucket of the last complete step.
  std::vector<std::pair<int64_t, double>> last_step_buckets() const;

 private:
  // The transport's counters now, and adding what they grew by since to this reducer's totals.
  struct WireMark {
    int64_t sent, recv, comm_ns, calls, sent_across, recv_across, packed, unpacked;
  };
  WireMark wire_mark() const;
  void add_wire_since(const WireMark& m);
  // A compressed bucket that is not finite on some rank: reduced exactly.
  void reduce_nonfinite(BucketJob& job, double divisor);
  // lowrank's sum of a factor buffer with the bucket's algorithm and wire.
  void sum_by(const BucketJob& job, at::Tensor& b);
  // Starts job.sum_first's sum (if any), after waiting for a started one that
  // nobody finished (the ranks started it alike, so it completes).
  void start_sum(BucketJob& job);
  // The accounting of one bucket's job (bytes, time, the step's end).
  void end_bucket(const BucketJob& job, std::chrono::steady_clock::time_point started, const WireMark& mark);

  std::shared_ptr<Transport> transport_;
  double divisor_;
  double loss_scale_ = 1.0;
  std::vector<int> ring_order_, node_of_;
  collectives::CodecTimer codec_;
  // Where a compressed bucket's residuals are copied before its reduction
  // (put back where a rank's input was not finite); grown to the largest.
  at::Tensor saved_;
  at::Tensor started_sum_;  // a job's sum_first on the transport's device, in flight until finish_sum
  Pending started_pending_;
  std::atomic<int64_t> sent_{0}, recv_{0}, comm_ns_{0}, numel_{0}, buckets_{0}, fp32_bytes_{0}, calls_{0};
  std::atomic<int64_t> sent_across_{0}, recv_across_{0}, packed_rounds_{0}, unpacked_rounds_{0};
  std::atomic<int64_t> nonfinite_steps_{0}, nonfinite_buckets_{0}, carry_holds_{0};
  bool step_nonfinite_ = false;
  ReduceTotals step_start_, last_step_;
  std::vector<std::pair<int64_t, double>> step_buckets_, last_step_buckets_;
  mutable std::mutex snap_mu_;
  // Both rounds of the held buckets and group (the last of it may be a job
  // that did not wait): its first all-reduces in one, then its second ones.
  void reduce_group(Parked& group);
  std::unique_ptr<ParkedBucket> parked_;
  Parked held_;  // before their first all-reduce (hold); never together with parked_
};

}  // namespace hetcomm
