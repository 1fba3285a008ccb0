#include "collectives/lowrank.h"

#include <ATen/ScalarOps.h>

#include <functional>
#include <limits>
#include <vector>

#include "collectives/algorithms.h"
#include "ops/codecs.h"
#include "ops/codecs_cpu.h"

namespace hetcomm {
namespace collectives {

namespace {

// Views of a contiguous 1-D buffer (x, the residual, q_state, head_, qt_): one
// as_strided each (a flat piece: span), where narrow(...).view(...)
// dispatched four ops (narrow, slice, as_strided, view) and .t() two more. A
// digits step on the 2 x 2 testbed ran some 455 ATen ops on the comm thread,
// 75 of them narrows, and the dispatcher's bookkeeping was half of its CPU
// (bench/README "lowrank's views of its buffers in one op").

// rows x cols, row-major, at off
at::Tensor matrix(const at::Tensor& base, int64_t off, int64_t rows, int64_t cols) {
  return base.as_strided({rows, cols}, {cols, 1}, base.storage_offset() + off);
}

// the transpose of the row-major rows x cols matrix at off (cols x rows)
at::Tensor matrix_t(const at::Tensor& base, int64_t off, int64_t rows, int64_t cols) {
  return base.as_strided({cols, rows}, {1, cols}, base.storage_offset() + off);
}

// Part p's matrix in t (x or the residual; an undefined residual stays undefined).
at::Tensor m_part(const at::Tensor& t, const LowrankPart& p) {
  return t.defined() ? matrix(t, p.offset, p.rows, p.cols) : at::Tensor();
}

// t rounded to the wire dtype, in a new buffer on t's device (what is summed).
at::Tensor encoded(const at::Tensor& t, at::ScalarType wire) {
  at::Tensor h = at::empty({t.numel()}, t.options().dtype(wire));
  ops::cast_encode_into(t, 1.0, h);
  return h;
}

std::vector<LowrankPart> parse(const at::Tensor& layout, int64_t n) {
  TORCH_CHECK_VALUE(layout.dim() == 2 && layout.size(1) == 4 && layout.scalar_type() == at::kLong,
                    "hetcomm: lowrank layout must be int64 [k, 4] (offset, rows, cols, rank)");
  const at::Tensor l = layout.contiguous();
  const int64_t* p = l.data_ptr<int64_t>();
  std::vector<LowrankPart> parts;
  int64_t covered = 0;
  for (int64_t i = 0; i < l.size(0); ++i) {
    LowrankPart part{p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]};
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

LowrankStep::LowrankStep(const at::Tensor& x, double divisor, const at::Tensor& layout, const at::Tensor& q_state,
                         const at::Tensor& residual, CodecTimer& timer, double share, at::ScalarType wire)
    : x_(x),
      divisor_(divisor),
      q_state_(q_state),
      residual_(residual),
      timer_(timer),
      share_(share < 0 ? 1.0 / divisor : share),
      wire_(wire),
      parts_(parse(layout, x.numel())) {
  TORCH_CHECK_VALUE(wire == at::kFloat || wire == at::kBFloat16 || wire == at::kFloat8_e4m3fn,
                    "hetcomm: lowrank's wire must be float32, bfloat16 or float8_e4m3fn, got ", c10::toString(wire));
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 1,
                    "hetcomm: lowrank works on a contiguous 1-D float32 bucket");
  int64_t dense = 0, p_total = 0, q_total = 0;
  for (const auto& p : parts_) {
    if (p.rank == 0) {
      dense += p.numel();
    } else {
      p_blocks_.push_back({p_total, p.rows, p.rank});
      q_blocks_.push_back({q_total, p.cols, p.rank});
      p_total += p.rows * p.rank;
      q_total += p.cols * p.rank;
    }
  }
  TORCH_CHECK_VALUE(q_state.numel() == q_total && q_state.scalar_type() == at::kFloat && q_state.is_contiguous(),
                    "hetcomm: lowrank Q state must be contiguous float32 with ", q_total, " elements");
  TORCH_CHECK_VALUE(q_state.device() == x.device() && (!residual.defined() || residual.device() == x.device()),
                    "hetcomm: lowrank Q state and residual must be on the bucket's device ", x.device());
  TORCH_CHECK_VALUE(!residual.defined() || residual.numel() == x.numel(), "hetcomm: lowrank residual must have the bucket's ",
                    x.numel(), " elements, got ", residual.numel());
  // (its views are taken by offset: a strided residual would be read at the wrong places)
  TORCH_CHECK_VALUE(!residual.defined() || (residual.is_contiguous() && residual.scalar_type() == at::kFloat),
                    "hetcomm: lowrank residual must be a contiguous float32 tensor, got ",
                    residual.defined() ? c10::toString(residual.scalar_type()) : "none",
                    residual.defined() && !residual.is_contiguous() ? " (not contiguous)" : "");
  // One all-reduce for P and the dense parts, which also tells every rank
  // whether all x were finite: a non-finite entry of M makes its row of
  // P = M Q non-finite (inf * q is +-inf, inf * 0 and anything with NaN are
  // NaN), a dense one is sent as it is, and a sum with a non-finite term is
  // not finite. Each round of all-reduces is a wait for the slowest rank and
  // the link's latency (testbed, 2 x 2 ranks at 100 Mbit: a second bucket of
  // 256 KB cost 16-18 ms a step with three rounds), so no round of its own for
  // GradScaler's overflow check. Until the sum is known, x and the residual
  // stay as they came, so a non-finite step can still be reduced exactly.
  head_ = at::empty({p_total + dense}, x.options());
  p_total_ = p_total;
  // Each part's new Q, transposed (rank x cols, row-major): BLAS writes P^T M
  // into a contiguous rank x cols block about 10x faster on the CPU than M^T P
  // into a cols x rank one (MKL, one thread: 0.25 against 3.4 ms for 1024 x
  // 1024 at rank 4), and the outer product reads Q^T. q_state keeps Q (cols x
  // rank), the layout checkpoints hold.
  qt_ = at::empty({q_total}, x.options());
  Timed _(timer_);
  // M = x / divisor + residual (error feedback) is never stored for the
  // matrices: each product reads x and the residual (ops::lowrank_project), and
  // finish() forms each entry of M where it writes the new residual. (Their
  // roundings of M differ; P is an approximation's factor, and the residual
  // keeps exactly what this rank's share of the result did not deliver of M.)
  int64_t d = p_total, po = 0, qo = 0;
  for (const auto& p : parts_) {
    if (p.rank == 0) {
      at::Tensor h = span(head_, d, d + p.numel());
      dense_input(p, h);
      d += p.numel();
    } else {
      // M (Q^T)^T with Q^T contiguous (for BLAS on a GPU as fast as it goes here: M Q with Q contiguous was 4-5x
      // slower on the CPU, for the same reason as above)
      const at::Tensor qt = matrix_t(q_state, qo, p.cols, p.rank).contiguous();
      ops::lowrank_project(m_part(x_, p), m_part(residual_, p), divisor_, qt, matrix(head_, po, p.rows, p.rank));
      po += p.rows * p.rank;
      qo += p.cols * p.rank;
    }
  }
  // what is summed: head_ rounded to a bf16 wire (a value beyond bf16's range becomes an infinity)
  if (cast()) head_wire_ = encoded(head_, wire_);
}

void LowrankStep::dense_input(const LowrankPart& p, at::Tensor& out) const {
  if (x_.is_cpu()) {
    // the bits of the two kernels below without their dispatch and iterators (on digits' step 6 % of the comm
    // thread's CPU, for three biases); x and the residual are contiguous (the constructor checks), out a piece
    // of head_ or a new tensor
    ops::cpu::dense_input(x_.data_ptr<float>() + p.offset,
                          residual_.defined() ? residual_.data_ptr<float>() + p.offset : nullptr,
                          static_cast<float>(divisor_), out.data_ptr<float>(), p.numel());
    return;
  }
  // the same division kernel as x.div_(divisor): a dense part sums as the exact all-reduce does
  at::div_out(out, span(x_, p.offset, p.offset + p.numel()), at::native::wrapped_scalar_tensor(divisor_));
  if (residual_.defined()) out.add_(span(residual_, p.offset, p.offset + p.numel()));
}

bool LowrankStep::after_first(Transport& t) {
  Timed _(timer_);
  // Whether the summed P and dense parts are finite (see the constructor):
  // where they are not, some rank's x was not, and every rank, holding the
  // same sum, ends the step here alike (on a GPU: the step's one read of the
  // device). Otherwise an orthonormal P (every rank holds the same summed P,
  // so the same basis), then Q^T = P^T M.
  t.synchronize();
  if (cast()) ops::cast_decode(head_wire_, 1.0, head_);
  const bool finite = head_.is_cpu() ? ops::all_finite(head_) : at::isfinite(head_).all().item<bool>();
  if (!finite) return false;
  ops::orthonormalize_blocks(head_, p_blocks_, 0.0);
  int64_t po = 0, qo = 0;
  for (const auto& p : parts_) {
    if (p.rank == 0) continue;
    ops::lowrank_back_project(m_part(x_, p), m_part(residual_, p), divisor_, matrix(head_, po, p.rows, p.rank),
                              matrix(qt_, qo, p.rank, p.cols));
    po += p.rows * p.rank;
    qo += p.cols * p.rank;
  }
  if (cast()) qt_wire_ = encoded(qt_, wire_);
  return true;
}

void LowrankStep::finish() {
  Timed _(timer_);
  if (cast()) ops::cast_decode(qt_wire_, 1.0, qt_);
  int64_t d = p_total_, po = 0, qo = 0;
  for (const auto& p : parts_) {
    if (p.rank == 0) {
      at::Tensor out = span(x_, p.offset, p.offset + p.numel());
      at::Tensor r = residual_.defined() ? span(residual_, p.offset, p.offset + p.numel()) : at::Tensor();
      const at::Tensor sum = span(head_, d, d + p.numel());
      d += p.numel();
      if (r.defined() && rounded()) {
        // The rounded sum stands for the sum over ranks; this rank keeps what
        // its own share (by default its weight 1/divisor; the shares sum to 1)
        // did not deliver: residual = M - share * sum, M as the constructor sent it.
        at::Tensor m = at::empty_like(r);
        dense_input(p, m);
        at::sub_out(r, m, sum, share_);
      } else if (r.defined()) {
        r.zero_();  // a dense part's float32 sum is exact: nothing missed
      }
      out.copy_(sum);
    } else {
      at::Tensor pm = matrix(head_, po, p.rows, p.rank);
      at::Tensor qtm = matrix(qt_, qo, p.rank, p.cols);
      // The warm start for the next step. A zero row of the summed Q^T (M
      // was zero on every rank: a parameter no rank used, its residual held
      // back or zero; or the summed M Q was) keeps the old column: copied,
      // it would stay zero from then on (Gram-Schmidt leaves a zero column
      // zero), and so would every later approximation of the matrix (a 256 x
      // 256 layer that no rank used in the first compressed step: its reduced
      // gradient was 0 at every later step, and its residual grew by the
      // whole gradient).
      at::Tensor qv = matrix(q_state_, qo, p.cols, p.rank);
      ops::take_q(qv, qtm);
      // One pass: x becomes the approximation (identical inputs on every rank
      // -> identical bits: our own fixed-order product, not BLAS), and the
      // residual what this rank's share of it did not deliver of its M.
      at::Tensor xm = matrix(x_, p.offset, p.rows, p.cols);
      ops::lowrank_finish(pm, qtm, xm, residual_.defined() ? matrix(residual_, p.offset, p.rows, p.cols) : at::Tensor(),
                          divisor_, share_);
      po += p.rows * p.rank;
      qo += p.cols * p.rank;
    }
  }
  // The next step's warm start, orthonormal, as PowerSGD's hook makes it:
  // P = M Q then scales each of its columns by one singular value of M, not
  // by two (Q = M^T P unnormalized makes P = M M^T P), so the small
  // directions stay above float32's rounding of the large ones when P is
  // orthonormalized. (The approximation above used the summed Q^T itself.)
  // Every rank holds the same summed Q^T, so the same Q.
  at::Tensor q = q_state_.view({-1});
  ops::orthonormalize_blocks(q, q_blocks_, 0.0);
}

void sum_lowrank_factors(Transport& t, at::Tensor& b, at::ScalarType wire, const std::vector<int>* node_of,
                         CodecTimer& timer) {
  if (wire != at::kFloat8_e4m3fn) {
    if (node_of == nullptr)
      t.all_reduce_sum(b);
    else if (b.numel() > 0)
      allreduce_hierarchical(t, b, *node_of);
    return;
  }
  TORCH_CHECK_VALUE(b.scalar_type() == at::kFloat, "hetcomm: lowrank's fp8 wire sums float32 factors");
  Finite finite{node_of != nullptr || ops::all_finite(b)};  // the hierarchy checks its shards itself
  if (node_of == nullptr) {
    allreduce_fp8(t, b, 1.0, kLowrankFp8Chunk, at::Tensor(), at::Tensor(), timer, 0, nullptr, &finite);
  } else if (b.numel() > 0) {
    InterOptions inter;
    inter.codec = Codec::kFP8;
    inter.chunk = kLowrankFp8Chunk;
    inter.timer = &timer;
    inter.finite = &finite;
    allreduce_hierarchical(t, b, *node_of, inter);
  }
  // a flagged message leaves b as this rank's own: NaN shows every rank what the sum of P would have
  if (!finite.everywhere) b.fill_(std::numeric_limits<float>::quiet_NaN());
}

namespace {

bool lowrank_step(Transport& t, at::Tensor& x, double divisor, const at::Tensor& layout, at::Tensor& q_state,
                  const at::Tensor& residual, CodecTimer& timer, double share, at::ScalarType wire,
                  const std::function<void(at::Tensor&)>& sum) {
  LowrankStep step(x, divisor, layout, q_state, residual, timer, share, wire);
  sum(step.first());
  if (!step.after_first(t)) return false;
  sum(step.second());
  step.finish();
  return true;
}

}  // namespace

bool allreduce_lowrank(Transport& t, at::Tensor& x, double divisor, const at::Tensor& layout, at::Tensor& q_state,
                       const at::Tensor& residual, CodecTimer& timer, double share, at::ScalarType wire) {
  return lowrank_step(t, x, divisor, layout, q_state, residual, timer, share, wire,
                      [&](at::Tensor& b) { sum_lowrank_factors(t, b, wire, nullptr, timer); });
}

bool allreduce_lowrank_hierarchical(Transport& t, at::Tensor& x, double divisor, const at::Tensor& layout,
                                    at::Tensor& q_state, const at::Tensor& residual, const std::vector<int>& node_of,
                                    CodecTimer& timer, double share, at::ScalarType wire) {
  hierarchy_of(node_of, t.rank(), t.size());  // checks node_of (equal nodes) before any collective
  return lowrank_step(t, x, divisor, layout, q_state, residual, timer, share, wire,
                      [&](at::Tensor& b) { sum_lowrank_factors(t, b, wire, &node_of, timer); });
}

}  // namespace collectives
}  // namespace hetcomm
