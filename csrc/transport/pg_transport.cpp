#include "transport/pg_transport.h"

#include <torch/version.h>

#include <stdexcept>

namespace hetcomm {

namespace {

int64_t nbytes(const at::Tensor& t) { return static_cast<int64_t>(t.numel()) * t.element_size(); }

void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined() && t.is_contiguous(), "hetcomm: ", name, " must be a defined contiguous tensor");
}

// Whether the group moves CUDA tensors with gloo: gloo's all-reduce and
// all-gather take CUDA tensors (through pinned host copies of its own); its
// send/recv, all-to-all and reduce-scatter are ours to stage through the host.
bool gloo_for_cuda(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  try {
    return pg->getBackend(c10::DeviceType::CUDA)->getBackendName() == "gloo";
  } catch (const std::exception&) {
    return false;  // no CUDA backend registered: the collective raises its own error
  }
}

// Pinned host memory (torch's caching host allocator): copies at full PCIe speed.
at::Tensor host_like(const at::Tensor& t) {
  return t.defined() ? at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true)) : t;
}

at::Tensor on_host(const at::Tensor& t) { return t.defined() ? host_like(t).copy_(t) : t; }

}  // namespace

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device)
    : pg_(std::move(pg)), device_(device) {
  TORCH_CHECK_VALUE(pg_, "hetcomm: process_group is None");
  TORCH_CHECK_VALUE(device_.is_cpu() || (device_.is_cuda() && device_.has_index()),
                    "hetcomm: device must be cpu or cuda:<index>, got ", device_);
  stage_cuda_ = device_.is_cuda() && gloo_for_cuda(pg_);
}

bool ProcessGroupTransport::staged(const at::Tensor& t) const { return stage_cuda_ && t.defined() && t.is_cuda(); }

std::string ProcessGroupTransport::name() const { return "pg:" + pg_->getBackendName(); }

void ProcessGroupTransport::check_peer(int peer, const char* name) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size() && peer != rank(), "hetcomm: ", name,
                    " must be another rank in [0, ", size(), "), got ", peer);
}

void ProcessGroupTransport::wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what, int64_t sent,
                                 int64_t recv, std::chrono::steady_clock::time_point start) {
  try {
    // The process group's own timeout bounds this: a dead peer raises.
    work->wait();
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("hetcomm: ") + what + " on " + name() + " failed (rank " +
                             std::to_string(rank()) + "/" + std::to_string(size()) + "): " + e.what());
  }
  const auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  counters_.bytes_sent += sent;
  counters_.bytes_recv += recv;
  counters_.comm_ns += ns;
  counters_.calls += 1;
}

void ProcessGroupTransport::send(const at::Tensor& t, int dst, int tag) {
  if (staged(t)) return send(on_host(t), dst, tag);
  check_contiguous(t, "send tensor");
  check_peer(dst, "dst");
  const auto start = std::chrono::steady_clock::now();
  std::vector<at::Tensor> v{t};
  wait(pg_->send(v, dst, tag), "send", nbytes(t), 0, start);
}

void ProcessGroupTransport::recv(at::Tensor& t, int src, int tag) {
  if (staged(t)) {
    at::Tensor h = host_like(t);
    recv(h, src, tag);
    t.copy_(h);
    return;
  }
  check_contiguous(t, "recv tensor");
  check_peer(src, "src");
  const auto start = std::chrono::steady_clock::now();
  std::vector<at::Tensor> v{t};
  wait(pg_->recv(v, src, tag), "recv", 0, nbytes(t), start);
}

void ProcessGroupTransport::send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) {
  if (staged(out) || staged(in)) {
    at::Tensor h_in = host_like(in);
    send_recv(dst >= 0 ? on_host(out) : out, dst, h_in, src, tag);
    if (src >= 0) in.copy_(h_in);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  c10::intrusive_ptr<c10d::Work> ws, wr;
  std::vector<at::Tensor> vs{out}, vr{in};
  if (dst >= 0) {
    check_contiguous(out, "send tensor");
    check_peer(dst, "dst");
    ws = pg_->send(vs, dst, tag);
  }
  if (src >= 0) {
    check_contiguous(in, "recv tensor");
    check_peer(src, "src");
    wr = pg_->recv(vr, src, tag);
  }
  if (ws) wait(ws, "send", nbytes(out), 0, start);
  if (wr) wait(wr, "recv", 0, nbytes(in), start);
}

void ProcessGroupTransport::all_reduce_sum(at::Tensor& t) {
  check_contiguous(t, "all_reduce tensor");
  const int w = size();
  const auto start = std::chrono::steady_clock::now();
  if (w == 1) return;
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  const int64_t ring = 2 * (w - 1) * nbytes(t) / w;
  wait(pg_->allreduce(v, opts), "all_reduce", ring, ring, start);
}

void ProcessGroupTransport::all_gather(at::Tensor& out, const at::Tensor& in) {
  check_contiguous(in, "all_gather input");
  check_contiguous(out, "all_gather output");
  const int w = size();
  TORCH_CHECK_VALUE(out.numel() == in.numel() * w && out.scalar_type() == in.scalar_type(),
                    "hetcomm: all_gather output must hold world_size * input.numel() elements of the input's dtype");
  const auto start = std::chrono::steady_clock::now();
  if (w == 1) {
    out.copy_(in);
    return;
  }
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int r = 0; r < w; ++r) outs[0].push_back(out.narrow(0, r * in.numel(), in.numel()));
  std::vector<at::Tensor> ins{in};
  const int64_t b = (w - 1) * nbytes(in);
  wait(pg_->allgather(outs, ins), "all_gather", b, b, start);
}

void ProcessGroupTransport::all_to_all(at::Tensor& out, const at::Tensor& in) {
  if (staged(out) || staged(in)) {
    at::Tensor h = host_like(out);
    all_to_all(h, on_host(in));
    out.copy_(h);
    return;
  }
  check_contiguous(in, "all_to_all input");
  check_contiguous(out, "all_to_all output");
  const int w = size();
  TORCH_CHECK_VALUE(in.numel() == out.numel() && in.numel() % w == 0 && out.scalar_type() == in.scalar_type(),
                    "hetcomm: all_to_all input and output must have equal numel and dtype, divisible by world_size");
  const auto start = std::chrono::steady_clock::now();
  if (w == 1) {
    out.copy_(in);
    return;
  }
  std::vector<int64_t> splits;  // empty: equal splits
  at::Tensor in_mut = in;
  const int64_t b = (w - 1) * nbytes(in) / w;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
  wait(pg_->all_to_all_single(out, in_mut, splits, splits), "all_to_all", b, b, start);
#else  // the same op under its older name
  wait(pg_->alltoall_base(out, in_mut, splits, splits), "all_to_all", b, b, start);
#endif
}

void ProcessGroupTransport::reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) {
  if (staged(out) || staged(in)) {
    at::Tensor h = host_like(out);
    reduce_scatter_sum(h, on_host(in));
    out.copy_(h);
    return;
  }
  check_contiguous(in, "reduce_scatter input");
  check_contiguous(out, "reduce_scatter output");
  const int w = size();
  TORCH_CHECK_VALUE(in.numel() == out.numel() * w && out.scalar_type() == in.scalar_type(),
                    "hetcomm: reduce_scatter input must hold world_size * output.numel() elements of the output's dtype");
  const auto start = std::chrono::steady_clock::now();
  if (w == 1) {
    out.copy_(in);
    return;
  }
  at::Tensor in_mut = in;
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  const int64_t b = (w - 1) * nbytes(out);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
  wait(pg_->reduce_scatter_single(out, in_mut, opts), "reduce_scatter", b, b, start);
#else
  wait(pg_->_reduce_scatter_base(out, in_mut, opts), "reduce_scatter", b, b, start);
#endif
}

void ProcessGroupTransport::barrier() {
  const auto start = std::chrono::steady_clock::now();
  if (size() == 1) return;
  wait(pg_->barrier(), "barrier", 0, 0, start);
}

}  // namespace hetcomm
