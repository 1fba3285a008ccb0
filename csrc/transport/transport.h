// The interface every algorithm is written against. Tensors are contiguous
// and live on the transport's device. Every call blocks until its data is
// usable (CPU) or ordered on the transport's stream (GPU) and throws on error,
// including a dead peer or a timeout.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>

namespace hetcomm {

// Algorithmic bytes a rank put on / took off the wire (the ring-equivalent
// volume of each collective, the convention nccl-tests uses for busbw), and
// the time spent inside collectives.
struct WireCounters {
  std::atomic<int64_t> bytes_sent{0};
  std::atomic<int64_t> bytes_recv{0};
  std::atomic<int64_t> comm_ns{0};
  std::atomic<int64_t> calls{0};
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;

  virtual void send(const at::Tensor& t, int dst, int tag) = 0;
  virtual void recv(at::Tensor& t, int src, int tag) = 0;
  // Both at once (a ring step): neither side blocks the other. dst or src may be -1 (skip).
  virtual void send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) = 0;
  // In place: t = sum over ranks of t.
  virtual void all_reduce_sum(at::Tensor& t) = 0;
  // out (size() * in.numel()) = concatenation of every rank's in, in rank order.
  virtual void all_gather(at::Tensor& out, const at::Tensor& in) = 0;
  // in and out hold size() equal blocks; block j of in goes to rank j, and
  // block i of out comes from rank i.
  virtual void all_to_all(at::Tensor& out, const at::Tensor& in) = 0;
  // out (in.numel() / size()) = the sum over ranks of block rank() of in.
  virtual void reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) = 0;
  virtual void barrier() = 0;

  // Where this transport's tensors live: the small control collectives of a
  // step (batch sizes, the configuration check) allocate there.
  virtual at::Device device() const { return at::Device(at::kCPU); }
  // Returns when everything issued so far has finished (calls that only
  // enqueue work on a stream need it before the host reads a result).
  virtual void synchronize() {}

  WireCounters& counters() { return counters_; }

 protected:
  WireCounters counters_;
};

}  // namespace hetcomm
