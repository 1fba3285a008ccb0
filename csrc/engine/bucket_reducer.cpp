#include "engine/bucket_reducer.h"

#include <cmath>

#include "collectives/lowrank.h"

namespace hetcomm {

BucketReducer::BucketReducer(std::shared_ptr<Transport> t)
    : transport_(std::move(t)), divisor_(static_cast<double>(transport_->size())) {}

void BucketReducer::set_batch_size(double local) {
  TORCH_CHECK_VALUE(std::isfinite(local) && local > 0, "hetcomm: local batch size must be > 0, got ", local);
  at::Tensor b = at::full({1}, local, at::kDouble);
  transport_->all_reduce_sum(b);
  divisor_ = b.item<double>() / local;
}

at::Tensor BucketReducer::gather_config(const at::Tensor& config) {
  at::Tensor c = config.to(at::kLong).contiguous();
  at::Tensor all = at::empty({transport_->size() * c.numel()}, at::kLong);
  transport_->all_gather(all, c);
  return all.view({transport_->size(), c.numel()});
}

at::Tensor BucketReducer::reduce(BucketJob& job) {
  Transport& t = *transport_;
  WireCounters& wc = t.counters();
  const int64_t s0 = wc.bytes_sent, r0 = wc.bytes_recv, c0 = wc.comm_ns;
  at::Tensor& buf = job.buffer;
  const int w = t.size();
  switch (job.codec) {
    case Codec::kNone:
      collectives::allreduce_dense(t, buf, divisor_, at::kFloat, codec_);
      break;
    case Codec::kFP16:
      collectives::allreduce_dense(t, buf, divisor_, at::kHalf, codec_);
      break;
    case Codec::kBF16:
      collectives::allreduce_dense(t, buf, divisor_, at::kBFloat16, codec_);
      break;
    case Codec::kOneBit:
    case Codec::kTopK:
    case Codec::kLowRank: {
      // The codecs work in float32; other bucket dtypes go through a copy.
      at::Tensor x = buf.scalar_type() == at::kFloat ? buf : buf.to(at::kFloat);
      if (job.codec == Codec::kOneBit)
        collectives::allreduce_onebit(t, x, divisor_, job.chunk, job.residual, job.server_residual, codec_);
      else if (job.codec == Codec::kLowRank)
        collectives::allreduce_lowrank(t, x, divisor_, job.layout, job.q_state, job.residual, codec_);
      else
        collectives::allreduce_topk(t, x, divisor_, job.topk_ratio, job.topk_exact, job.residual, codec_);
      if (!x.is_same(buf)) buf.copy_(x);
      break;
    }
  }
  sent_ += wc.bytes_sent - s0;
  recv_ += wc.bytes_recv - r0;
  comm_ns_ += wc.comm_ns - c0;
  numel_ += buf.numel();
  buckets_ += 1;
  fp32_bytes_ += w > 1 ? 2 * (w - 1) * buf.numel() * 4 / w : 0;
  if (job.last) {
    std::lock_guard<std::mutex> lock(snap_mu_);
    const ReduceTotals now = totals();
    last_step_ = {now.bytes_sent - step_start_.bytes_sent, now.bytes_recv - step_start_.bytes_recv,
                  now.comm_ns - step_start_.comm_ns,       now.codec_ns - step_start_.codec_ns,
                  now.numel - step_start_.numel,           now.buckets - step_start_.buckets,
                  now.fp32_bytes - step_start_.fp32_bytes};
    step_start_ = now;
  }
  return buf;
}

ReduceTotals BucketReducer::totals() const {
  return {sent_, recv_, comm_ns_, codec_.ns, numel_, buckets_, fp32_bytes_};
}

ReduceTotals BucketReducer::last_step() const {
  std::lock_guard<std::mutex> lock(snap_mu_);
  return last_step_;
}

}  // namespace hetcomm
