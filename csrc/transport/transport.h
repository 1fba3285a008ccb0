// The interface every algorithm is written against. Tensors are contiguous
// and live on the transport's device. Every call blocks until its data is
// usable (CPU) or ordered on the transport's stream (GPU) and throws on error,
// including a dead peer or a timeout.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace hetcomm {

// Algorithmic bytes a rank put on / took off the wire (the ring-equivalent
// volume of each collective, the convention nccl-tests uses for busbw), and
// the time spent inside collectives. The *_across counts are the part that
// went to / came from ranks on other nodes (Transport::set_nodes).
struct WireCounters {
  std::atomic<int64_t> bytes_sent{0};
  std::atomic<int64_t> bytes_recv{0};
  std::atomic<int64_t> bytes_sent_across{0};
  std::atomic<int64_t> bytes_recv_across{0};
  std::atomic<int64_t> comm_ns{0};
  std::atomic<int64_t> calls{0};
  // Rounds offered for packing (collectives/packing.h) that went packed / raw.
  std::atomic<int64_t> packed_rounds{0};
  std::atomic<int64_t> unpacked_rounds{0};
};

// A collective started by Transport::start_*: wait() returns when its data is
// usable (as the blocking call would) and throws as it would. Waiting twice,
// or on a collective that had finished when started, does nothing.
class Pending {
 public:
  Pending() = default;
  explicit Pending(std::function<void()> wait) : wait_(std::move(wait)) {}
  void wait() {
    auto w = std::move(wait_);
    wait_ = nullptr;
    if (w) w();
  }

 private:
  std::function<void()> wait_;
};

// The public calls check their arguments (naming the argument and the rule)
// and count the bytes once, for every transport; the transports implement
// the protected do_* calls, which may assume checked arguments.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;
  // Lets go of what it holds of the outside world (a process group) once no
  // call will come: the engine calls it after its comm thread has ended.
  virtual void release() {}

  void send(const at::Tensor& t, int dst, int tag);
  void recv(at::Tensor& t, int src, int tag);
  // Both at once (a ring step): neither side blocks the other. dst or src may be -1 (skip).
  void send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag);
  // In place: t = sum over ranks of t.
  void all_reduce_sum(at::Tensor& t);
  // out (size() * in.numel()) = concatenation of every rank's in, in rank order.
  void all_gather(at::Tensor& out, const at::Tensor& in);
  // in and out hold size() equal blocks; block j of in goes to rank j, and
  // block i of out comes from rank i.
  void all_to_all(at::Tensor& out, const at::Tensor& in);
  // The same two collectives started: where overlaps() they move the data
  // while the caller works (out and in must stay alive and untouched until
  // wait()); elsewhere they finish before returning. Every rank starts
  // collectives in the same order.
  Pending start_all_gather(at::Tensor& out, const at::Tensor& in);
  Pending start_all_to_all(at::Tensor& out, const at::Tensor& in);
  Pending start_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag);
  // all_reduce_sum started (t stays alive and untouched until wait()).
  Pending start_all_reduce_sum(at::Tensor& t);
  // Whether started collectives progress while the host encodes the next
  // piece (a process group's own threads move host tensors).
  virtual bool overlaps() const { return false; }
  // out (in.numel() / size()) = the sum over ranks of block rank() of in.
  void reduce_scatter_sum(at::Tensor& out, const at::Tensor& in);
  void barrier();

  // Where this transport's tensors live: the small control collectives of a
  // step (batch sizes, the configuration check) allocate there.
  virtual at::Device device() const { return at::Device(at::kCPU); }
  // Returns when everything issued so far has finished (calls that only
  // enqueue work on a stream need it before the host reads a result).
  virtual void synchronize() {}

  WireCounters& counters() { return counters_; }
  // Which node each rank is on (node_of[r]; empty, the default: unknown, and
  // nothing is counted as across). Then a point-to-point message counts as
  // across where its peer is on another node; a whole-group collective
  // (all-reduce, all-gather, all-to-all, reduce-scatter) by its share of
  // peers on other nodes, (ranks off this node) / (size() - 1) of its volume:
  // exact for a direct exchange (the all-gather and all-to-all as hetcomm's
  // subgroups post them, an all-reduce as reduce-scatter + all-gather),
  // while a backend's ring or tree routes its bytes its own way.
  void set_nodes(std::vector<int> node_of);
  // set_nodes' rule on its argument, for a caller that checks before queueing it.
  static void check_nodes(const std::vector<int>& node_of, int size);

 protected:
  virtual void do_send(const at::Tensor& t, int dst, int tag) = 0;
  virtual void do_recv(at::Tensor& t, int src, int tag) = 0;
  virtual void do_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) = 0;
  virtual void do_all_reduce_sum(at::Tensor& t) = 0;
  virtual void do_all_gather(at::Tensor& out, const at::Tensor& in) = 0;
  virtual void do_all_to_all(at::Tensor& out, const at::Tensor& in) = 0;
  virtual void do_reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) = 0;
  virtual void do_barrier() = 0;
  // Default: the blocking call.
  virtual Pending do_start_all_gather(at::Tensor& out, const at::Tensor& in);
  virtual Pending do_start_all_to_all(at::Tensor& out, const at::Tensor& in);
  virtual Pending do_start_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag);
  virtual Pending do_start_all_reduce_sum(at::Tensor& t);
  // Where a transport needs its tensors (NCCL: on its device); the default takes any.
  virtual void check_place(const at::Tensor& /*t*/, const char* /*name*/) const {}

  WireCounters counters_;

 private:
  void check_tensor(const at::Tensor& t, const char* name) const;
  void check_peer(int peer, const char* name) const;
  // A point-to-point exchange with dst / src (-1: none) and a whole-group collective.
  void count_p2p(int64_t sent, int dst, int64_t recv, int src, int64_t calls);
  void count_group(int64_t sent, int64_t recv);
  bool off_node(int peer) const { return !node_of_.empty() && node_of_[peer] != node_of_[rank()]; }

  std::vector<int> node_of_;
  int64_t off_node_ranks_ = 0;
};

}  // namespace hetcomm
