#include "engine/engine.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>

#include "ops/codecs.h"
#include "transport/pg_transport.h"
#ifdef HETCOMM_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "checks.h"
#include "transport/nccl_transport.h"
#endif

namespace py = pybind11;

namespace hetcomm {

namespace {

// A job's tensor work runs below autograd's dispatch keys, as an op's kernel
// does: every tensor it touches is a gradient, a residual or a buffer of its
// own, none requires a gradient, and no autograd graph sees them. On the CPU
// each of a step's ~450 small ops (views of the bucket, its factors and
// shards) then skips autograd's kernel and the view tracking of
// ADInplaceOrView (digits on the 2 x 2 testbed, in turns: the comm thread's
// CPU 0.8 -> 0.7 ms a step). Futures are completed outside it: their callbacks
// (a user's then()) run with the thread's usual dispatch.
using BelowAutograd = at::AutoDispatchBelowADInplaceOrView;

}  // namespace

#ifdef HETCOMM_WITH_CUDA
// Made on the caller's thread: an event after what its current stream has
// queued. Waited for on the comm thread: the comm stream waits, not the host.
class StreamHandoff {
 public:
  explicit StreamHandoff(c10::Device device) {
    c10::cuda::CUDAGuard guard(device);
    HC_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    const cudaError_t recorded = cudaEventRecord(ready_, c10::cuda::getCurrentCUDAStream(device.index()).stream());
    if (recorded != cudaSuccess) cudaEventDestroy(ready_);
    HC_CUDA_CHECK(recorded);
  }
  StreamHandoff(const StreamHandoff&) = delete;
  StreamHandoff& operator=(const StreamHandoff&) = delete;
  // A pending event may be destroyed: CUDA frees it once the wait is done.
  ~StreamHandoff() { cudaEventDestroy(ready_); }
  // With the comm stream current.
  void wait() { HC_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream().stream(), ready_, 0)); }

 private:
  cudaEvent_t ready_ = nullptr;
};

class Engine::CommStreamScope {
 public:
  CommStreamScope(Engine* engine, bool cuda) {
    if (cuda) guard_.emplace(engine->comm_stream());
  }

 private:
  c10::optional<c10::cuda::CUDAStreamGuard> guard_;
};

std::shared_ptr<StreamHandoff> Engine::hand_off() {
  const at::Device device = transport_->device();
  if (!device.is_cuda()) return nullptr;
  comm_stream();  // made here, on the caller's thread, before any job of the comm thread asks for it
  return std::make_shared<StreamHandoff>(device);
}

void Engine::settle_stream() {
  transport_->synchronize();  // NCCL: bounded by the timeout, aborts the communicator
  if (transport_->device().is_cuda()) comm_stream().synchronize();  // a process group: its own watchdog bounds this
}

void Engine::record_stream(const at::Tensor& bucket) {
  if (bucket.defined() && bucket.is_cuda())
    c10::cuda::CUDACachingAllocator::recordStream(bucket.storage().data_ptr(), comm_stream());
}

// NcclTransport enqueues on its own stream; with a process group the engine
// keeps a stream of its own.
c10::cuda::CUDAStream Engine::comm_stream() {
  if (auto nccl = std::dynamic_pointer_cast<NcclTransport>(transport_)) return nccl->stream();
  if (!stream_) stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, transport_->device().index());
  return *stream_;
}
#else
// A CPU-only build: nothing to hand from one stream to another.
class StreamHandoff {
 public:
  void wait() {}
};

class Engine::CommStreamScope {
 public:
  CommStreamScope(Engine*, bool) {}
};

std::shared_ptr<StreamHandoff> Engine::hand_off() { return nullptr; }
void Engine::settle_stream() { transport_->synchronize(); }
void Engine::record_stream(const at::Tensor&) {}
#endif

Engine::Engine(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device)
    : transport_(std::make_shared<ProcessGroupTransport>(std::move(pg), device)), reducer_(transport_) {}

Engine::Engine(std::shared_ptr<Transport> t) : transport_(std::move(t)), reducer_(transport_) {}

Engine::~Engine() {
  if (PyGILState_Check()) {
    py::gil_scoped_release nogil;
    close();
  } else {
    close();
  }
}

void Engine::close() {
  if (worker_.forked()) return;  // a forked child: the thread and what it holds are the parent's
  // A bucket parked by an interrupted step ends its step before the thread
  // stops (every rank's engine runs the same jobs, so the same all-reduce).
  // Nothing parked (the usual case): the job takes no GIL, which may be
  // gone (an engine dropped while the interpreter finalizes).
  if (!worker_.closed()) {
    try {
      worker_.post([this] {
        if (parked_futs_.empty()) return;
        // A parked bucket made the comm stream already (run_pipelined, on the caller's thread)
        CommStreamScope scope(this, transport_->device().is_cuda());
        Parked parked;
        bool done = false;
        std::exception_ptr error = refusal();
        if (!error) {
          try {
            BelowAutograd below;
            reducer_.flush(parked);
            settle_stream();
            done = true;
          } catch (const std::exception& e) {
            record_failure(e);
            error = std::current_exception();
          }
        }
        py::gil_scoped_acquire gil;
        settle_parked(parked, done, error);
        parked.clear();
      });
    } catch (const std::runtime_error&) {  // closed meanwhile by another thread
    }
  }
  if (worker_.close()) transport_->release();
}

void Engine::record_failure(const std::exception& e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.empty()) failure_ = e.what();
}

std::exception_ptr Engine::refusal() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.empty()) return nullptr;
  return std::make_exception_ptr(
      std::runtime_error("hetcomm: not run because an earlier collective failed: " + failure_));
}

void Engine::settle_parked(const Parked& parked, bool done, const std::exception_ptr& error) {
  // parked_futs_ came in the buckets' order: the first parked.size() are theirs; an error fails every open one
  const size_t n = error ? parked_futs_.size() : std::min(parked.size(), parked_futs_.size());
  for (size_t i = 0; i < n; ++i) {
    if (!error && done) {
      parked_futs_[i]->markCompleted(torch::jit::toIValue(py::cast(parked[i]->job.buffer), c10::PyObjectType::get()));
    } else {
      parked_futs_[i]->setError(error ? error
                                      : std::make_exception_ptr(std::runtime_error(
                                            "hetcomm: a lowrank bucket waited for the step's next bucket, which "
                                            "never came")));
    }
  }
  parked_futs_.erase(parked_futs_.begin(), parked_futs_.begin() + static_cast<std::ptrdiff_t>(n));
}

FuturePtr Engine::run_pipelined(BucketJob job) {
  check_device(job.buffer);
  FuturePtr fut = new_future();
  std::shared_ptr<StreamHandoff> handoff = hand_off();
  worker_.post([this, fut, job = std::move(job), handoff]() mutable {
    CommStreamScope scope(this, handoff != nullptr);  // until the futures are settled: their events go on it
    PipelineOutcome out;
    std::exception_ptr error = refusal();
    if (!error) {
      try {
        BelowAutograd below;
        if (handoff) handoff->wait();
        reducer_.reduce_pipelined(job, out);
        settle_stream();
        record_stream(job.buffer);
      } catch (const std::exception& e) {
        record_failure(e);
        error = std::current_exception();
      }
    }
    py::gil_scoped_acquire gil;  // as in execute(): nothing of the jobs outlives this hold
    settle_parked(out.earlier, out.earlier_done, error);
    out.earlier.clear();
    if (error) {
      fut->setError(error);
    } else if (out.parked) {
      parked_futs_.push_back(fut);
    } else {
      fut->markCompleted(torch::jit::toIValue(py::cast(job.buffer), c10::PyObjectType::get()));
    }
    job = BucketJob();
    fut.reset();
  });
  return fut;
}

FuturePtr Engine::run(std::function<at::Tensor()> fn, const at::Tensor& bucket) {
  check_device(bucket);
  FuturePtr fut = new_future();
  std::shared_ptr<StreamHandoff> handoff = hand_off();
  if (!handoff) {
    worker_.post([this, fut, fn = std::move(fn)]() mutable { execute(fut, fn, nullptr, [&fn] { fn = nullptr; }); });
    return fut;
  }
  // A CUDA transport: the comm stream first waits for what the caller's
  // stream has queued (the gradients), the job's kernels and collectives run
  // on the comm stream, and the Future is CUDA-aware: completed with events on
  // the comm stream, so DDP's wait() makes its stream wait without blocking
  // the host. The comm thread then waits for the stream itself (NCCL: polling
  // async errors, aborting on timeout) so a dead peer raises, not hangs.
  worker_.post([this, fut, fn = std::move(fn), bucket = bucket, handoff]() mutable {
    CommStreamScope scope(this, true);
    // Inside the job's error handling: a failure here fails its future.
    auto waited = [&fn, &handoff] {
      handoff->wait();
      return fn();
    };
    execute(
        fut, waited,
        [&] {
          settle_stream();
          record_stream(bucket);
        },
        [&] {
          fn = nullptr;
          bucket.reset();
        });  // markCompleted records the future's events on the comm stream
  });
  return fut;
}

void Engine::check_device(const at::Tensor& bucket) const {
  const at::Device device = transport_->device();
  TORCH_CHECK_VALUE(!bucket.defined() || bucket.device() == device, "hetcomm: bucket is on ", bucket.device(),
                    " but this HookState's transport works on ", device,
                    " (one HookState serves the buckets of one device)");
}

FuturePtr Engine::new_future() const {
  const at::Device device = transport_->device();
  if (device.is_cpu()) return c10::make_intrusive<c10::ivalue::Future>(c10::PyObjectType::get());
  return c10::make_intrusive<c10::ivalue::Future>(c10::PyObjectType::get(), std::vector<c10::Device>{device});
}

void Engine::execute(FuturePtr& fut, const std::function<at::Tensor()>& fn, const std::function<void()>& after,
                     const std::function<void()>& release) {
  at::Tensor result;
  std::exception_ptr error = refusal();
  Parked parked;
  bool parked_done = false;
  if (!error) {
    try {
      BelowAutograd below;
      reducer_.flush(parked);  // a parked or held bucket's step ends before any other job
      parked_done = true;
      result = fn();
      if (after) after();
    } catch (const std::exception& e) {
      record_failure(e);
      error = std::current_exception();
    }
  }
  py::gil_scoped_acquire gil;
  // What the job captured goes first, before anyone can see the future done:
  // a tensor whose Python object the caller let go of is freed with it, and
  // freeing one may let the GIL go for a moment.
  if (release) release();
  settle_parked(parked, parked_done, error);
  parked.clear();
  if (error) {
    fut->setError(error);
  } else {
    fut->markCompleted(torch::jit::toIValue(py::cast(result), c10::PyObjectType::get()));
  }
  // The value's Python object holds the result too, so dropping ours frees
  // nothing; nor does dropping fut while its caller holds it.
  result = at::Tensor();
  fut.reset();
}

namespace {

// A small vector the ranks sum exactly (submit_sum's, a bucket's sum_first).
void check_small_sum(const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.dim() == 1 && at::isFloatingType(x.scalar_type()) && x.numel() <= (int64_t{1} << 20), "hetcomm: ",
                    name, " must be a 1-D floating-point vector of <= 2**20 elements, got ", x.dim(), "-D ",
                    x.scalar_type(), " of ", x.numel());
}

}  // namespace

FuturePtr Engine::submit_bucket(BucketJob job) {
  TORCH_CHECK_VALUE(job.codec != Codec::kLowRank || (job.layout.defined() && job.q_state.defined()),
                    "hetcomm: the lowrank codec needs a layout and a Q state");
  ops::check_float_vector(job.buffer, "bucket buffer");
  TORCH_CHECK_VALUE(job.buffer.is_contiguous(), "hetcomm: bucket buffer must be contiguous");
  ops::check_chunk(job.chunk);
  TORCH_CHECK_VALUE(job.topk_ratio > 0.0 && job.topk_ratio <= 1.0, "hetcomm: topk_ratio must be in (0, 1], got ",
                    job.topk_ratio);
  ops::check_beta(job.beta);
  if (job.sum_first.defined()) check_small_sum(job.sum_first, "sum_first");
  const int64_t n = job.buffer.numel();
  TORCH_CHECK_VALUE(!job.momentum.defined() || job.momentum.numel() == n, "hetcomm: momentum must have the bucket's ",
                    n, " elements");
  TORCH_CHECK_VALUE(!job.update_denominator.defined() ||
                        (job.update_denominator.numel() == n && job.update_denominator.scalar_type() == at::kFloat &&
                         job.update_denominator.is_contiguous() && job.update_denominator.device() == job.buffer.device()),
                    "hetcomm: update_denominator must be contiguous float32 with the bucket's ", n,
                    " elements, on the bucket's device");
  TORCH_CHECK_VALUE(!job.update_denominator.defined() || job.codec == Codec::kTopK,
                    "hetcomm: update_denominator ranks top-k's entries; it is for codec topk only");
  TORCH_CHECK_VALUE(!job.carry.defined() || job.carry.numel() == n, "hetcomm: carry must have the bucket's ", n,
                    " elements");
  for (const at::Tensor* s : {&job.residual, &job.server_residual, &job.q_state, &job.momentum, &job.carry}) {
    if (!s->defined()) continue;
    TORCH_CHECK_VALUE(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 1 &&
                          s->device() == job.buffer.device(),
                      "hetcomm: residuals and Q state must be contiguous 1-D float32 on the bucket's device");
  }
  if (job.residual.defined() && job.codec != Codec::kLowRank && job.algo != Algo::kHierarchical)
    TORCH_CHECK_VALUE(job.residual.numel() == n, "hetcomm: residual must have the bucket's ", n, " elements, got ",
                      job.residual.numel());
  job.buffer = job.buffer.view({-1});
  sum_started_ = sum_started_ || job.sum_first.defined();
  if (BucketReducer::pipelines(job)) return run_pipelined(std::move(job));
  return run([this, job]() mutable { return reducer_.reduce(job); }, job.buffer);
}

FuturePtr Engine::submit_batch_size(double local) {
  TORCH_CHECK_VALUE(std::isfinite(local) && local > 0, "hetcomm: local batch size must be > 0, got ", local);
  return run([this, local] {
    reducer_.set_batch_size(local);
    return at::full({1}, reducer_.divisor(), at::kDouble);
  });
}

void Engine::set_loss_scale(double s) {
  TORCH_CHECK_VALUE(std::isfinite(s) && s > 0, "hetcomm: loss scale must be finite and > 0, got ", s);
  run([this, s] {
    reducer_.set_loss_scale(s);
    return at::zeros({0});
  });
}

FuturePtr Engine::submit_config(at::Tensor config) {
  TORCH_CHECK_VALUE(config.dim() == 1, "hetcomm: config must be 1-D");
  return run([this, config] { return reducer_.gather_config(config); });
}

FuturePtr Engine::submit_sum(at::Tensor x) {
  check_small_sum(x, "submit_sum's x");
  return run([this, x] { return reducer_.sum(x); });
}

FuturePtr Engine::finish_sum() {
  TORCH_CHECK_VALUE(sum_started_, "hetcomm: finish_sum: no bucket started a sum (submit_bucket's sum_first) since the "
                                  "last finish_sum");
  sum_started_ = false;
  return run([this] { return reducer_.finish_sum(); });
}

void Engine::set_topology(std::vector<int> order, std::vector<int> node_of) {
  BucketReducer::check_topology(order, node_of, transport_->size());  // here, not on the comm thread
  run([this, order, node_of] {
    reducer_.set_topology(order, node_of);
    return at::zeros({0});
  });
}

void Engine::set_nodes(std::vector<int> node_of) {
  Transport::check_nodes(node_of, transport_->size());  // here, not on the comm thread
  run([this, node_of] {
    transport_->set_nodes(node_of);
    return at::zeros({0});
  });
}

EngineStats Engine::stats() const {
  EngineStats s;
  s.nonfinite_steps = reducer_.nonfinite_steps();
  s.nonfinite_buckets = reducer_.nonfinite_buckets();
  s.total = reducer_.totals();
  s.last_step = reducer_.last_step();
  return s;
}

}  // namespace hetcomm
