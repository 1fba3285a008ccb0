// lowrank's pipeline: a bucket's second all-reduce sent with the next
// bucket's first, or held buckets' two rounds sent with the step's last
// bucket (BucketReducer::reduce_pipelined); its future completes in a later
// job. The rest of a bucket's reduction is in bucket_reducer.cpp.
#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/lowrank.h"
#include "engine/bucket_reducer.h"

namespace hetcomm {

bool BucketReducer::pipelines(const BucketJob& job) {
  // with a carry too: auto's trials switch a bucket's plan every step, so each of their lowrank steps has one, and
  // timed unpipelined (and not together) lowrank's round read 1.4x its steady step on the wide model at 100 Mbit,
  // int3's 1.0-1.1x (bench/README "lowrank's round on every bucket")
  return job.pipeline && job.codec == Codec::kLowRank && job.buffer.scalar_type() == at::kFloat &&
         !job.momentum.defined();
}

void ParkedBucket::finish() {
  step->finish();
  if (job.carry.defined()) {
    job.buffer.copy_(input);
    job.carry.zero_();
  }
}

void BucketReducer::sum_by(const BucketJob& job, at::Tensor& b) {
  collectives::sum_lowrank_factors(*transport_, b, job.lowrank_wire,
                                   job.algo == Algo::kHierarchical ? &node_of_ : nullptr, codec_);
}

namespace {

// Sums the tensors behind ps in one all-reduce of their concatenation (sum),
// each getting its part back.
void sum_together(const std::vector<at::Tensor*>& ps, const std::function<void(at::Tensor&)>& sum) {
  if (ps.size() == 1) {
    sum(*ps[0]);
    return;
  }
  std::vector<at::Tensor> parts;
  for (at::Tensor* p : ps) parts.push_back(*p);
  at::Tensor both = at::cat(parts);
  sum(both);
  int64_t o = 0;
  for (at::Tensor* p : ps) {
    p->copy_(both.narrow(0, o, p->numel()));
    o += p->numel();
  }
}

}  // namespace

void BucketReducer::reduce_group(Parked& group) {
  Transport& t = *transport_;
  const BucketJob& front = group.front()->job;  // every bucket of the group has its algorithm and wire
  const auto sum = [this, &front](at::Tensor& b) { sum_by(front, b); };
  std::vector<at::Tensor*> firsts;
  for (auto& p : group) firsts.push_back(&p->step->first());
  sum_together(firsts, sum);
  // every rank holds the same sums, so the same buckets end here alike
  std::vector<ParkedBucket*> finite;
  for (auto& p : group) {
    if (p->step->after_first(t))
      finite.push_back(p.get());
    else
      reduce_nonfinite(p->job, divisor_ * loss_scale_);
  }
  if (finite.empty()) return;
  std::vector<at::Tensor*> seconds;
  for (ParkedBucket* p : finite) seconds.push_back(&p->step->second());
  sum_together(seconds, sum);
  for (ParkedBucket* p : finite) p->finish();
}

void BucketReducer::flush(Parked& out) {
  const WireMark mark = wire_mark();
  if (parked_) {
    sum_by(parked_->job, parked_->step->second());
    parked_->finish();
    out.push_back(std::move(parked_));
  }
  if (!held_.empty()) {
    reduce_group(held_);
    for (auto& p : held_) out.push_back(std::move(p));
    held_.clear();
  }
  add_wire_since(mark);
}

void BucketReducer::reduce_pipelined(BucketJob& job, PipelineOutcome& out) {
  start_sum(job);
  Transport& t = *transport_;
  // one all-reduce for both: the same algorithm and the same wire dtype
  const auto same = [&job](const ParkedBucket& p) {
    return p.job.algo == job.algo && p.job.lowrank_wire == job.lowrank_wire;
  };
  const bool holds = job.hold && !job.last;
  const bool joins = parked_ && same(*parked_) && !holds;
  const bool groups = !held_.empty() && same(*held_.front());
  if ((parked_ && !joins) || (!held_.empty() && !groups)) {
    flush(out.earlier);  // their own rounds first
    out.earlier_done = true;
  }
  const auto started = std::chrono::steady_clock::now();
  const WireMark mark = wire_mark();
  if (job.algo == Algo::kHierarchical) collectives::hierarchy_of(node_of_, t.rank(), t.size());  // checks node_of
  const double divisor = divisor_ * loss_scale_;
  // a carry joins a copy: the bucket stays as it came until the step is known finite everywhere (reduce_nonfinite)
  at::Tensor input = job.carry.defined() ? job.buffer.clone().add_(job.carry, divisor) : job.buffer;
  // lowrank's error feedback keeps what this rank's share of the sum (its batch weight, not the loss scale) missed
  auto step = std::make_unique<collectives::LowrankStep>(input, divisor, job.layout, job.q_state, job.residual,
                                                         codec_, 1.0 / divisor_, job.lowrank_wire);
  if (holds) {  // P is computed (behind backward); its all-reduce waits for the next bucket
    held_.push_back(std::make_unique<ParkedBucket>(ParkedBucket{job, std::move(step), input}));
    out.parked = true;
    end_bucket(job, started, mark);
    return;
  }
  if (!held_.empty()) {  // the held buckets and this one: two rounds together
    held_.push_back(std::make_unique<ParkedBucket>(ParkedBucket{job, std::move(step), input}));
    reduce_group(held_);
    held_.pop_back();  // this job's own step: done
    for (auto& p : held_) out.earlier.push_back(std::move(p));
    held_.clear();
    out.earlier_done = true;
  } else {
    if (joins) {
      at::Tensor& second = parked_->step->second();
      sum_together({&second, &step->first()}, [this, &job](at::Tensor& b) { sum_by(job, b); });
      parked_->finish();
      out.earlier.push_back(std::move(parked_));
      out.earlier_done = true;
    } else {
      sum_by(job, step->first());
    }
    if (!step->after_first(t)) {
      reduce_nonfinite(job, divisor);
    } else if (job.last) {
      sum_by(job, step->second());
      ParkedBucket{job, std::move(step), input}.finish();
    } else {
      parked_ = std::make_unique<ParkedBucket>(ParkedBucket{job, std::move(step), input});
      out.parked = true;
    }
  }
  t.synchronize();
  end_bucket(job, started, mark);
}

}  // namespace hetcomm
