#include "transport/transport.h"

namespace hetcomm {

namespace {

int64_t nbytes(const at::Tensor& t) { return static_cast<int64_t>(t.numel()) * t.element_size(); }

}  // namespace

void Transport::check_tensor(const at::Tensor& t, const char* name) const {
  TORCH_CHECK_VALUE(t.defined() && t.is_contiguous(), "hetcomm: ", name, " must be a defined contiguous tensor");
  check_place(t, name);
}

void Transport::check_peer(int peer, const char* name) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size() && peer != rank(), "hetcomm: ", name,
                    " must be another rank in [0, ", size(), "), got ", peer);
}

void Transport::check_nodes(const std::vector<int>& node_of, int size) {
  TORCH_CHECK_VALUE(node_of.empty() || static_cast<int>(node_of.size()) == size,
                    "hetcomm: node_of must name a node for each of the ", size, " ranks (or be empty), got ",
                    node_of.size());
  for (int nd : node_of) TORCH_CHECK_VALUE(nd >= 0, "hetcomm: node ids must be >= 0, got ", nd);
}

void Transport::set_nodes(std::vector<int> node_of) {
  check_nodes(node_of, size());
  node_of_ = std::move(node_of);
  off_node_ranks_ = 0;
  for (int r = 0; r < static_cast<int>(node_of_.size()); ++r) off_node_ranks_ += off_node(r);
}

void Transport::count_p2p(int64_t sent, int dst, int64_t recv, int src, int64_t calls) {
  counters_.bytes_sent += sent;
  counters_.bytes_recv += recv;
  counters_.calls += calls;
  if (dst >= 0 && off_node(dst)) counters_.bytes_sent_across += sent;
  if (src >= 0 && off_node(src)) counters_.bytes_recv_across += recv;
}

void Transport::count_group(int64_t sent, int64_t recv) {
  counters_.bytes_sent += sent;
  counters_.bytes_recv += recv;
  counters_.calls += 1;
  const int64_t peers = size() - 1;
  if (peers > 0 && off_node_ranks_ > 0) {
    counters_.bytes_sent_across += sent * off_node_ranks_ / peers;
    counters_.bytes_recv_across += recv * off_node_ranks_ / peers;
  }
}

void Transport::send(const at::Tensor& t, int dst, int tag) {
  check_tensor(t, "send tensor");
  check_peer(dst, "dst");
  do_send(t, dst, tag);
  count_p2p(nbytes(t), dst, 0, -1, 1);
}

void Transport::recv(at::Tensor& t, int src, int tag) {
  check_tensor(t, "recv tensor");
  check_peer(src, "src");
  do_recv(t, src, tag);
  count_p2p(0, -1, nbytes(t), src, 1);
}

void Transport::send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) {
  start_send_recv(out, dst, in, src, tag).wait();
}

Pending Transport::start_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) {
  if (dst >= 0) {
    check_tensor(out, "send tensor");
    check_peer(dst, "dst");
  }
  if (src >= 0) {
    check_tensor(in, "recv tensor");
    check_peer(src, "src");
  }
  if (dst < 0 && src < 0) return {};
  count_p2p(dst >= 0 ? nbytes(out) : 0, dst, src >= 0 ? nbytes(in) : 0, src, (dst >= 0) + (src >= 0));
  return do_start_send_recv(out, dst, in, src, tag);
}

void Transport::all_reduce_sum(at::Tensor& t) { start_all_reduce_sum(t).wait(); }

Pending Transport::start_all_reduce_sum(at::Tensor& t) {
  check_tensor(t, "all_reduce tensor");
  const int w = size();
  const int64_t ring = w > 1 ? 2 * (w - 1) * nbytes(t) / w : 0;
  count_group(ring, ring);
  return w > 1 ? do_start_all_reduce_sum(t) : Pending();
}

void Transport::all_gather(at::Tensor& out, const at::Tensor& in) { start_all_gather(out, in).wait(); }

void Transport::all_to_all(at::Tensor& out, const at::Tensor& in) { start_all_to_all(out, in).wait(); }

Pending Transport::start_all_gather(at::Tensor& out, const at::Tensor& in) {
  check_tensor(in, "all_gather input");
  check_tensor(out, "all_gather output");
  const int w = size();
  TORCH_CHECK_VALUE(out.numel() == in.numel() * w && out.scalar_type() == in.scalar_type(),
                    "hetcomm: all_gather output must hold world_size * input.numel() elements of the input's dtype");
  count_group((w - 1) * nbytes(in), (w - 1) * nbytes(in));
  if (w == 1) {
    out.copy_(in);
    return {};
  }
  return do_start_all_gather(out, in);
}

Pending Transport::start_all_to_all(at::Tensor& out, const at::Tensor& in) {
  check_tensor(in, "all_to_all input");
  check_tensor(out, "all_to_all output");
  const int w = size();
  TORCH_CHECK_VALUE(in.numel() == out.numel() && in.numel() % w == 0 && out.scalar_type() == in.scalar_type(),
                    "hetcomm: all_to_all input and output must have equal numel and dtype, divisible by world_size");
  count_group((w - 1) * nbytes(in) / w, (w - 1) * nbytes(in) / w);
  if (w == 1) {
    out.copy_(in);
    return {};
  }
  return do_start_all_to_all(out, in);
}

Pending Transport::do_start_all_gather(at::Tensor& out, const at::Tensor& in) {
  do_all_gather(out, in);
  return {};
}

Pending Transport::do_start_all_to_all(at::Tensor& out, const at::Tensor& in) {
  do_all_to_all(out, in);
  return {};
}

Pending Transport::do_start_all_reduce_sum(at::Tensor& t) {
  do_all_reduce_sum(t);
  return {};
}

Pending Transport::do_start_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int tag) {
  do_send_recv(out, dst, in, src, tag);
  return {};
}

void Transport::reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) {
  check_tensor(in, "reduce_scatter input");
  check_tensor(out, "reduce_scatter output");
  const int w = size();
  TORCH_CHECK_VALUE(in.numel() == out.numel() * w && out.scalar_type() == in.scalar_type(),
                    "hetcomm: reduce_scatter input must hold world_size * output.numel() elements of the output's "
                    "dtype");
  if (w == 1)
    out.copy_(in);
  else
    do_reduce_scatter_sum(out, in);
  count_group((w - 1) * nbytes(out), (w - 1) * nbytes(out));
}

void Transport::barrier() {
  if (size() > 1) do_barrier();
  count_group(0, 0);
}

}  // namespace hetcomm
