// What the comm thread does with one DDP bucket: apply the step's weight and
// reduce it with the bucket's codec. Also the small control collectives of a
// step (batch sizes, the first-step configuration check). Not thread-safe:
// only the comm thread calls it (stats() reads atomics).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/compressed.h"
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
  // An attached Adam's per-element sqrt(v) + eps (float32, the bucket's numel; may be undefined):
  // top-k ranks the entries by |x| / it (the update each would make, not the momentum).
  at::Tensor update_denominator;
  at::Tensor residual;         // worker / top-k residual, float32, may be undefined
  at::Tensor server_residual;  // onebit and fp8 only, may be undefined
  at::Tensor layout;           // lowrank only: int64 [k, 4]
  at::Tensor q_state;          // lowrank only: warm-start Q, updated in place
  // Momentum compression (HookState.attach_optimizer): the SGD momentum m of
  // the bucket, identical on every rank; float32, may be undefined.
  at::Tensor momentum;
  double beta = 0.0;
  // What an earlier plan of this bucket did not deliver yet (its residuals,
  // placed at their offsets, in units of this rank's weighted contribution):
  // added to this step's contribution, then zeroed. float32, may be undefined.
  at::Tensor carry;
  bool last = false;           // last bucket of the step
};

struct ReduceTotals {
  int64_t bytes_sent = 0, bytes_recv = 0, comm_ns = 0, codec_ns = 0, numel = 0, buckets = 0, fp32_bytes = 0;
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
  // All-gathers an int64 vector: returns [world, numel].
  at::Tensor gather_config(const at::Tensor& config);
  // Sums a small floating-point vector over the ranks (exact, in its dtype;
  // counted in the totals): returns the sum on the CPU.
  at::Tensor sum(const at::Tensor& x);
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
    int64_t sent, recv, comm_ns;
  };
  WireMark wire_mark() const;
  void add_wire_since(const WireMark& m);

  std::shared_ptr<Transport> transport_;
  double divisor_;
  double loss_scale_ = 1.0;
  std::vector<int> ring_order_, node_of_;
  collectives::CodecTimer codec_;
  std::atomic<int64_t> sent_{0}, recv_{0}, comm_ns_{0}, numel_{0}, buckets_{0}, fp32_bytes_{0};
  std::atomic<int64_t> nonfinite_steps_{0}, nonfinite_buckets_{0}, carry_holds_{0};
  bool step_nonfinite_ = false;
  ReduceTotals step_start_, last_step_;
  std::vector<std::pair<int64_t, double>> step_buckets_, last_step_buckets_;
  mutable std::mutex snap_mu_;
};

}  // namespace hetcomm
