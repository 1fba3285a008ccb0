// Transport over any c10d ProcessGroup (gloo on CPU, NCCL on GPU).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>

#include "transport/transport.h"

namespace hetcomm {

class ProcessGroupTransport : public Transport {
 public:
  // device: where the tensors of the small control collectives go (CPU for
  // gloo; the rank's GPU for a process group with only NCCL).
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device = at::Device(at::kCPU));

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  void release() override;

  at::Device device() const override { return device_; }
  // Host tensors: the process group's threads move them while the caller
  // works. (A GPU's collectives keep today's blocking order: unmeasured.)
  bool overlaps() const override { return device_.is_cpu(); }

 protected:
  void do_send(const at::Tensor& t, int dst, int tag) override;
  void do_recv(at::Tensor& t, int src, int tag) override;
  void do_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) override;
  void do_all_reduce_sum(at::Tensor& t) override;
  void do_all_gather(at::Tensor& out, const at::Tensor& in) override;
  void do_all_to_all(at::Tensor& out, const at::Tensor& in) override;
  void do_reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) override;
  void do_barrier() override;
  Pending do_start_all_gather(at::Tensor& out, const at::Tensor& in) override;
  Pending do_start_all_to_all(at::Tensor& out, const at::Tensor& in) override;
  Pending do_start_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) override;
  Pending do_start_all_reduce_sum(at::Tensor& t) override;

 private:
  using Post = std::function<c10::intrusive_ptr<c10d::Work>()>;
  // Waits for work (the process group's timeout bounds it: a dead peer
  // raises, naming the op) and adds the time since start to comm_ns.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what, std::chrono::steady_clock::time_point start);
  // Posts an op through post(). gloo raises at once, not from wait(), when
  // the pair to a peer already knows the peer closed it (a send or receive
  // to a dead rank): that error reads the same as one from wait().
  c10::intrusive_ptr<c10d::Work> issue(const char* what, const Post& post);
  // The op posted and waited for, its time from before the post.
  void complete(const char* what, const Post& post);
  // The op posted now and waited for later, counting only the time spent waiting.
  Pending pending(const char* what, const Post& post);
  // The error of a failed op: "hetcomm: <op> on pg:<backend> failed (rank r/n): <why>".
  [[noreturn]] void fail(const char* what, const std::exception& e) const;
  // A CUDA tensor on a group whose CUDA backend is gloo, for an op gloo takes
  // only on the host: the op runs on pinned host copies.
  bool staged(const at::Tensor& t) const;

  // The group, or a clear error once release() has let go of it.
  c10d::ProcessGroup& group() const;

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  at::Device device_;
  int rank_ = 0, size_ = 1;
  std::string name_;
  bool stage_cuda_ = false;
};

}  // namespace hetcomm
