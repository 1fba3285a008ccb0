// Transport over a communicator of our own: rank 0 makes the NCCL unique id,
// it travels through the c10d Store, every rank joins with
// ncclCommInitRankConfig (non-blocking). Every call is enqueued on this
// transport's CUDA stream; synchronize() waits for it while polling
// ncclCommGetAsyncError, and aborts the communicator on error or timeout, so
// a dead peer raises instead of hanging.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#include "transport/transport.h"

namespace hetcomm {

class NcclTransport : public Transport {
 public:
  NcclTransport(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int rank, int size,
                int device, std::chrono::milliseconds timeout);
  ~NcclTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl:" + std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR); }

  at::Device device() const override { return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_)); }

  // The stream every call is enqueued on.
  c10::cuda::CUDAStream stream() const { return stream_; }
  // Makes this transport's stream wait for what the calling thread's current
  // stream has queued so far (the producer of the tensors about to be sent).
  void wait_for_current_stream();
  // Blocks until everything enqueued so far has finished; throws (after
  // aborting the communicator) on an NCCL error or after the timeout.
  void synchronize() override;

 protected:
  void do_send(const at::Tensor& t, int dst, int tag) override;
  void do_recv(at::Tensor& t, int src, int tag) override;
  void do_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) override;
  void do_all_reduce_sum(at::Tensor& t) override;
  void do_all_gather(at::Tensor& out, const at::Tensor& in) override;
  void do_all_to_all(at::Tensor& out, const at::Tensor& in) override;
  void do_reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) override;
  void do_barrier() override;
  // Every tensor on this transport's GPU.
  void check_place(const at::Tensor& t, const char* name) const override;

 private:
  void check(ncclResult_t r, const char* what);
  void wait_ready(const char* what);
  void abort(const std::string& why);

  ncclComm_t comm_ = nullptr;
  int rank_, size_, device_;
  std::chrono::milliseconds timeout_;
  c10::cuda::CUDAStream stream_;
  bool aborted_ = false;
};

// ncclDataType_t of a tensor dtype (throws for the ones NCCL lacks).
ncclDataType_t nccl_dtype(at::ScalarType t);

}  // namespace hetcomm
