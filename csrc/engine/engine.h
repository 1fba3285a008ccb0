// The comm engine of one HookState: a transport, the bucket reducer and its
// FIFO comm thread. Every submit returns at once with a Future that the comm
// thread completes. Once a job fails every later job fails at once with the
// first error: after a failed collective the ranks are out of step, and going
// on would hang.
//
// The Futures hold Python objects (DDP's Python comm hooks must return one of
// PyObject type), so completing one takes the GIL: this file and bindings.cpp
// are the two that see Python.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Optional.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/bucket_reducer.h"
#include "engine/worker.h"
#include "transport/transport.h"
#ifdef HETCOMM_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace hetcomm {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// A CUDA job's hand-off from the caller's stream to the comm stream (engine.cpp).
class StreamHandoff;

struct EngineStats {
  int64_t nonfinite_steps = 0, nonfinite_buckets = 0;
  ReduceTotals total, last_step;
};

class Engine {
 public:
  // Over a c10d process group (gloo, or NCCL through c10d) on `device`.
  Engine(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device);
  // Over any transport (hetcomm's own NCCL communicator).
  explicit Engine(std::shared_ptr<Transport> t);
  // Dropped while jobs are queued (no close()): the comm thread needs the GIL
  // to complete their futures, so it is waited for without holding the GIL.
  // (In a child forked from the process that made it, the bindings let go of
  // an engine without this destructor: see make_engine in bindings.cpp.)
  ~Engine();

  // Checks the job (codec, algorithm, sizes, devices of its state), then
  // reduces it on the comm thread; the Future's value is the bucket.
  FuturePtr submit_bucket(BucketJob job);
  // The batch-size weights of the next step (all-gathered on the comm thread).
  FuturePtr submit_batch_size(double local);
  // This rank's loss scale for the buckets submitted after this call (local, no collective).
  void set_loss_scale(double s);
  // All-gathers an int64 vector: the Future's value is [world, numel].
  FuturePtr submit_config(at::Tensor config);
  // Sums a small 1-D floating-point vector over the ranks, in order with the
  // buckets (the gradient-norm sketch of HookState.clip_grad_norm_).
  FuturePtr submit_sum(at::Tensor x);
  // The sum a bucket's sum_first started (BucketJob): a future of it on the CPU.
  FuturePtr finish_sum();
  // Applies to buckets submitted after this call (FIFO on the comm thread).
  void set_topology(std::vector<int> order, std::vector<int> node_of);
  // Which node each rank is on, for the counts of bytes across nodes
  // (Transport::set_nodes); in order with the buckets, as set_topology.
  void set_nodes(std::vector<int> node_of);

  // Blocks until the queued jobs have run (a pipelined lowrank bucket may
  // still wait for the step's next bucket: see BucketReducer::pipelines).
  // Submits and drain() in a forked child: a std::runtime_error (Worker::post).
  void drain() { worker_.drain(); }
  // Stops the comm thread after its queued jobs, then lets go of the process
  // group: destroy_process_group() then frees it while Python is alive, not
  // at interpreter exit (where gloo's threads abort the process). Nothing in
  // a forked child (HookState's __del__ and atexit close there too).
  void close();
  int64_t nonfinite_steps() const { return reducer_.nonfinite_steps(); }
  int64_t carry_holds() const { return reducer_.carry_holds(); }
  std::vector<std::pair<int64_t, double>> last_step_buckets() const { return reducer_.last_step_buckets(); }
  EngineStats stats() const;
  int rank() const { return transport_->rank(); }
  int size() const { return transport_->size(); }

 private:
  // Posts fn to the comm thread; the Future's value is fn's result. One
  // engine serves one device: its transport's.
  FuturePtr run(std::function<at::Tensor()> fn, const at::Tensor& bucket = at::Tensor());
  // On the comm thread: runs fn (then `after`, inside the same error
  // handling), takes the GIL, runs `release` (which drops what the job
  // captured), completes fut with fn's result or its error and lets go of
  // fut. Once the caller sees the future done it may exit Python, and a
  // thread that takes the GIL after finalization began is ended by CPython
  // inside a destructor (std::terminate: "terminate called without an
  // active exception"); the job's tensors and the future's value may hold
  // the last references to Python objects, whose release takes the GIL. So
  // nothing of the job outlives the GIL hold that completes its future.
  void execute(FuturePtr& fut, const std::function<at::Tensor()>& fn, const std::function<void()>& after,
               const std::function<void()>& release);
  // A job of BucketReducer::reduce_pipelined: its future may stay open
  // (parked_futs_) until a later job ends its step.
  FuturePtr run_pipelined(BucketJob job);
  // Under the GIL: completes the futures of the parked buckets whose steps
  // ended (the first parked.size() open ones) with their buffers if done,
  // else with `error` (which fails every open one) or a note that it never ended.
  void settle_parked(const Parked& parked, bool done, const std::exception_ptr& error);
  // The first error of a job (failure_), and the error later jobs fail with, unrun (nullptr while none failed).
  void record_failure(const std::exception& e);
  std::exception_ptr refusal() const;
  void check_device(const at::Tensor& bucket) const;  // the transport's device, or undefined
  bool sum_started_ = false;  // a bucket's sum_first since the last finish_sum (the caller's thread's view)
  // A job's future: CUDA-aware on a CUDA transport (completed with events on the comm stream).
  FuturePtr new_future() const;
  // On the caller's thread: for a CUDA transport, an event after what the
  // caller's stream has queued (the gradients); nullptr on the CPU.
  std::shared_ptr<StreamHandoff> hand_off();
  // On the comm thread, for the length of a job: the comm stream is current (a CUDA transport).
  class CommStreamScope;
  // On the comm thread: waits for the job's collectives and kernels.
  void settle_stream();
  // The caching allocator keeps a CUDA bucket's memory until the comm stream is done with it.
  void record_stream(const at::Tensor& bucket);
#ifdef HETCOMM_WITH_CUDA
  c10::cuda::CUDAStream comm_stream();
  c10::optional<c10::cuda::CUDAStream> stream_;
#endif

  std::shared_ptr<Transport> transport_;
  BucketReducer reducer_;
  mutable std::mutex mu_;
  std::string failure_;
  std::vector<FuturePtr> parked_futs_;  // comm thread only, in the buckets' order
  Worker worker_;  // last: its thread stops before the members it uses go away
};

}  // namespace hetcomm
