#include "collectives/lowrank.h"

#include <functional>
#include <vector>

#include "collectives/algorithms.h"
#include "ops/codecs.h"

namespace hetcomm {
namespace collectives {

namespace {

struct Part {
  int64_t offset, rows, cols, rank;
  int64_t numel() const { return rows * cols; }
};

std::vector<Part> parse(const at::Tensor& layout, int64_t n) {
  TORCH_CHECK_VALUE(layout.dim() == 2 && layout.size(1) == 4 && layout.scalar_type() == at::kLong,
                    "hetcomm: lowrank layout must be int64 [k, 4] (offset, rows, cols, rank)");
  const at::Tensor l = layout.contiguous();
  const int64_t* p = l.data_ptr<int64_t>();
  std::vector<Part> parts;
  int64_t covered = 0;
  for (int64_t i = 0; i < l.size(0); ++i) {
    Part part{p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]};
    // rows, cols <= n first: then rows * cols cannot overflow
    TORCH_CHECK_VALUE(part.offset >= 0 && part.offset <= n && part.rows >= 1 && part.cols >= 1 && part.rows <= n &&
                          part.cols <= n && part.numel() <= n - part.offset,
                      "hetcomm: lowrank layout row ", i, " lies outside the bucket");
    TORCH_CHECK_VALUE(part.rank >= 0 && part.rank <= std::min(part.rows, part.cols),
                      "hetcomm: lowrank rank of row ", i, " must be in [0, min(rows, cols)]");
    covered += part.numel();
    parts.push_back(part);
  }
  TORCH_CHECK_VALUE(covered == n, "hetcomm: lowrank layout covers ", covered, " of the bucket's ", n, " elements");
  return parts;
}

}  // namespace

int64_t lowrank_q_numel(const at::Tensor& layout) {
  TORCH_CHECK_VALUE(layout.dim() == 2 && layout.size(1) == 4 && layout.scalar_type() == at::kLong && layout.is_cpu(),
                    "hetcomm: lowrank layout must be a CPU int64 [k, 4] tensor (offset, rows, cols, rank)");
  const at::Tensor l = layout.contiguous();
  const int64_t* p = l.data_ptr<int64_t>();
  int64_t q = 0;
  for (int64_t i = 0; i < l.size(0); ++i) {
    const int64_t cols = p[4 * i + 2], rank = p[4 * i + 3];
    TORCH_CHECK_VALUE(cols >= 1 && cols < (int64_t{1} << 31) && rank >= 0 && rank < (int64_t{1} << 31),
                      "hetcomm: lowrank layout row ", i, " needs cols in [1, 2^31) and rank in [0, 2^31)");
    q += cols * rank;
  }
  return q;
}

namespace {

// The step of allreduce_lowrank, with `sum` the all-reduce of its two
// buffers (P with the dense parts, then Q^T).
void lowrank_step(Transport& t, at::Tensor& x, double divisor, const at::Tensor& layout, at::Tensor& q_state,
                  const at::Tensor& residual, CodecTimer& timer, double share,
                  const std::function<void(at::Tensor&)>& sum) {
  if (share < 0) share = 1.0 / divisor;
  const std::vector<Part> parts = parse(layout, x.numel());
  int64_t dense = 0, p_total = 0, q_total = 0;
  for (const Part& p : parts) {
    if (p.rank == 0) {
      dense += p.numel();
    } else {
      p_total += p.rows * p.rank;
      q_total += p.cols * p.rank;
    }
  }
  TORCH_CHECK_VALUE(q_state.numel() == q_total && q_state.scalar_type() == at::kFloat && q_state.is_contiguous(),
                    "hetcomm: lowrank Q state must be contiguous float32 with ", q_total, " elements");
  TORCH_CHECK_VALUE(q_state.device() == x.device() && (!residual.defined() || residual.device() == x.device()),
                    "hetcomm: lowrank Q state and residual must be on the bucket's device ", x.device());
  // P and the dense parts in one buffer, one all-reduce for both: each round
  // of all-reduces is a wait for the slowest rank and the link's latency
  // (testbed, 2 x 2 ranks at 100 Mbit: a second bucket of 256 KB cost 16-18 ms
  // a step with three rounds).
  at::Tensor pd_buf = at::empty({p_total + dense}, x.options());
  at::Tensor p_buf = pd_buf.narrow(0, 0, p_total);
  at::Tensor dense_buf = pd_buf.narrow(0, p_total, dense);
  // Each part's new Q, transposed (rank x cols, row-major): BLAS writes P^T M
  // into a contiguous rank x cols block about 10x faster on the CPU than M^T P
  // into a cols x rank one (MKL, one thread: 0.25 against 3.4 ms for 1024 x
  // 1024 at rank 4), and the outer product reads Q^T. q_state keeps Q (cols x
  // rank), the layout checkpoints hold.
  at::Tensor qt_buf = at::empty({q_total}, x.options());
  int64_t d = 0, po = 0, qo = 0;
  {
    Timed _(timer);
    // M = x / divisor (+ residual on the matrices: error feedback).
    x.div_(divisor);
    if (residual.defined()) x.add_(residual);
    for (const Part& p : parts) {
      at::Tensor m = x.narrow(0, p.offset, p.numel());
      if (p.rank == 0) {
        dense_buf.narrow(0, d, p.numel()).copy_(m);
        d += p.numel();
      } else {
        // M (Q^T)^T with Q^T contiguous: as fast as BLAS goes here (M Q with Q
        // contiguous: 4-5x slower, for the same reason as above)
        const at::Tensor qt = q_state.narrow(0, qo, p.cols * p.rank).view({p.cols, p.rank}).t().contiguous();
        at::Tensor out = p_buf.narrow(0, po, p.rows * p.rank).view({p.rows, p.rank});
        at::mm_out(out, m.view({p.rows, p.cols}), qt.t());
        po += p.rows * p.rank;
        qo += p.cols * p.rank;
      }
    }
  }
  sum(pd_buf);
  {
    Timed _(timer);
    // Orthonormal P (every rank holds the same summed P, so the same basis:
    // on the host, P is small), then Q^T = P^T M.
    t.synchronize();
    at::Tensor p_host = p_buf.cpu();
    po = 0;
    for (const Part& p : parts) {
      if (p.rank == 0) continue;
      at::Tensor pm = p_host.narrow(0, po, p.rows * p.rank).view({p.rows, p.rank});
      ops::orthonormalize_columns(pm, 1e-8);
      po += p.rows * p.rank;
    }
    if (!p_host.is_same(p_buf)) p_buf.copy_(p_host);
    po = qo = 0;
    for (const Part& p : parts) {
      if (p.rank == 0) continue;
      at::Tensor pm = p_buf.narrow(0, po, p.rows * p.rank).view({p.rows, p.rank});
      at::Tensor m = x.narrow(0, p.offset, p.numel()).view({p.rows, p.cols});
      at::Tensor out = qt_buf.narrow(0, qo, p.cols * p.rank).view({p.rank, p.cols});
      at::mm_out(out, pm.t(), m);
      po += p.rows * p.rank;
      qo += p.cols * p.rank;
    }
  }
  sum(qt_buf);
  Timed _(timer);
  d = po = qo = 0;
  for (const Part& p : parts) {
    at::Tensor m = x.narrow(0, p.offset, p.numel());
    if (p.rank == 0) {
      m.copy_(dense_buf.narrow(0, d, p.numel()));
      if (residual.defined()) residual.narrow(0, p.offset, p.numel()).zero_();
      d += p.numel();
      continue;
    }
    at::Tensor pm = p_buf.narrow(0, po, p.rows * p.rank).view({p.rows, p.rank});
    at::Tensor qtm = qt_buf.narrow(0, qo, p.cols * p.rank).view({p.rank, p.cols});
    q_state.narrow(0, qo, p.cols * p.rank).view({p.cols, p.rank}).copy_(qtm.t());  // warm start for the next step
    // The approximation stands for the sum over ranks; this rank keeps what its
    // own share (by default its weight 1/divisor; the shares sum to 1) did not
    // deliver: residual = M - share * approx, computed in place (M first, then
    // the approximation over M).
    at::Tensor mat = m.view({p.rows, p.cols});
    at::Tensor r;
    if (residual.defined()) {
      r = residual.narrow(0, p.offset, p.numel());
      r.copy_(m);
    }
    // Identical inputs on every rank -> identical bits: our own fixed-order product, not BLAS.
    ops::lowrank_outer(pm, qtm, mat);
    if (r.defined()) r.sub_(m, share);
    po += p.rows * p.rank;
    qo += p.cols * p.rank;
  }
}

}  // namespace

void allreduce_lowrank(Transport& t, at::Tensor& x, double divisor, const at::Tensor& layout, at::Tensor& q_state,
                       const at::Tensor& residual, CodecTimer& timer, double share) {
  lowrank_step(t, x, divisor, layout, q_state, residual, timer, share, [&t](at::Tensor& b) { t.all_reduce_sum(b); });
}

void allreduce_lowrank_hierarchical(Transport& t, at::Tensor& x, double divisor, const at::Tensor& layout,
                                    at::Tensor& q_state, const at::Tensor& residual, const std::vector<int>& node_of,
                                    CodecTimer& timer, double share) {
  hierarchy_of(node_of, t.rank(), t.size());  // checks node_of (equal nodes) before x is changed in place
  lowrank_step(t, x, divisor, layout, q_state, residual, timer, share, [&](at::Tensor& b) {
    if (b.numel() > 0) allreduce_hierarchical(t, b, node_of);
  });
}

}  // namespace collectives
}  // namespace hetcomm
