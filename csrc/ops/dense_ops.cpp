// The ops that do not encode: momentum compression's two passes and the
// low-rank pieces every rank must compute to the same bits (codecs.h).
#include <algorithm>
#include <cmath>

#include "kernels/lowrank.h"
#include "ops/codecs.h"
#include "ops/dispatch.h"

namespace hetcomm {
namespace ops {

namespace k = hetcomm::kernels;
using detail::check_buffer;
using detail::dtype_name;

void check_momentum(const at::Tensor& x, const at::Tensor& m, const char* m_name, double alpha, double beta) {
  TORCH_CHECK_VALUE(x.defined(), "hetcomm: x is undefined");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "hetcomm: x must be float32, got ", dtype_name(x.scalar_type()));
  TORCH_CHECK_VALUE(x.is_contiguous(), "hetcomm: x must be contiguous");
  check_buffer(m, m_name, x, at::kFloat, x.numel(), "x's numel", true);
  TORCH_CHECK_VALUE(std::isfinite(alpha), "hetcomm: alpha must be finite, got ", alpha);
  check_beta(beta);
}

void check_beta(double beta) {
  TORCH_CHECK_VALUE(beta >= 0.0 && beta < 1.0, "hetcomm: beta must be in [0, 1), got ", beta);
}

void momentum_fold_in(at::Tensor& x, const at::Tensor& m, double alpha) {
  check_momentum(x, m, "m", alpha, 0.0);
  float* xp = x.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  const float a = static_cast<float>(alpha);
  HC_RUN(x, "x", cpu::momentum_fold_in(xp, mp, a, x.numel()), cuda::momentum_fold_in(xp, mp, a, x.numel(), x.device()));
}

void momentum_handoff(at::Tensor& x, at::Tensor& m, double beta) {
  check_momentum(x, m, "m", 0.0, beta);
  float* xp = x.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  const float b = static_cast<float>(beta);
  HC_RUN(x, "x", cpu::momentum_handoff(xp, mp, b, x.numel()), cuda::momentum_handoff(xp, mp, b, x.numel(), x.device()));
}

namespace {

// Whether t can hold a rows x cols float32 matrix in place beside p: contiguous, on p's device.
bool holds_matrix(const at::Tensor& t, int64_t rows, int64_t cols, const at::Tensor& p) {
  return t.is_contiguous() && t.numel() == rows * cols && t.scalar_type() == at::kFloat && t.device() == p.device();
}

}  // namespace

at::Tensor lowrank_outer(const at::Tensor& p, const at::Tensor& qt, at::Tensor out) {
  TORCH_CHECK_VALUE(p.dim() == 2 && qt.dim() == 2 && p.size(1) == qt.size(0), "hetcomm: p (rows x r) and qt (r x cols) "
                    "must be matrices with matching r, got ", p.sizes(), " and ", qt.sizes());
  TORCH_CHECK_TYPE(p.scalar_type() == at::kFloat && qt.scalar_type() == at::kFloat, "hetcomm: p and qt must be float32");
  TORCH_CHECK_VALUE(p.device() == qt.device(), "hetcomm: p and qt must be on one device, got ", p.device(), " and ",
                    qt.device());
  const at::Tensor pc = p.contiguous(), qc = qt.contiguous();
  const int64_t rows = p.size(0), cols = qt.size(1), r = p.size(1);
  if (!out.defined()) out = at::empty({rows, cols}, pc.options());
  TORCH_CHECK_VALUE(holds_matrix(out, rows, cols, p),
                    "hetcomm: out must be contiguous float32 with rows * cols elements on p's device");
  const float* pp = pc.data_ptr<float>();
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  HC_RUN(pc, "p", cpu::lowrank_outer(pp, qp, op, rows, cols, r), cuda::lowrank_outer(pp, qp, op, rows, cols, r, pc.device()));
  return out;
}

void lowrank_finish(const at::Tensor& p, const at::Tensor& qt, at::Tensor& x, const at::Tensor& residual,
                    double divisor, double share) {
  TORCH_CHECK_VALUE(p.dim() == 2 && qt.dim() == 2 && p.size(1) == qt.size(0) && p.is_contiguous() &&
                        qt.is_contiguous() && p.scalar_type() == at::kFloat && qt.scalar_type() == at::kFloat,
                    "hetcomm: p (rows x r) and qt (r x cols) must be contiguous float32 matrices with matching r, got ",
                    p.sizes(), " and ", qt.sizes());
  const int64_t rows = p.size(0), cols = qt.size(1), r = p.size(1);
  TORCH_CHECK_VALUE(p.device() == qt.device() && holds_matrix(x, rows, cols, p) &&
                        (!residual.defined() || holds_matrix(residual, rows, cols, p)),
                    "hetcomm: x (and residual) must be contiguous float32 with rows * cols = ", rows * cols,
                    " elements on p's device");
  check_divisor(divisor);
  TORCH_CHECK_VALUE(std::isfinite(share), "hetcomm: share must be finite, got ", share);
  const float* pp = p.data_ptr<float>();
  const float* qp = qt.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  float* rp = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const float d = static_cast<float>(divisor), s = static_cast<float>(share);
  HC_RUN(p, "p", cpu::lowrank_finish(pp, qp, xp, rp, d, s, rows, cols, r),
         cuda::lowrank_finish(pp, qp, xp, rp, d, s, rows, cols, r, p.device()));
}

namespace {

// x and residual (undefined, or x's shape) as a product's M = x / divisor + residual needs them: contiguous float32
// rows x cols beside `other` (qt or p), which must be contiguous float32 too
void check_m(const at::Tensor& x, const at::Tensor& residual, double divisor, const at::Tensor& other,
             const char* other_name) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
                    "hetcomm: x must be a contiguous float32 matrix (rows x cols), got ", x.sizes());
  TORCH_CHECK_VALUE(!residual.defined() || holds_matrix(residual, x.size(0), x.size(1), x),
                    "hetcomm: residual must be a contiguous float32 tensor of x's numel on x's device");
  TORCH_CHECK_VALUE(other.dim() == 2 && other.is_contiguous() && other.scalar_type() == at::kFloat &&
                        other.device() == x.device(),
                    "hetcomm: ", other_name, " must be a contiguous float32 matrix on x's device");
  check_divisor(divisor);
}

// out = M other (m_left) or other M by BLAS (cuBLAS on a GPU), M = x / divisor + residual never stored: the
// product with the residual, then x's accumulated over divisor (without a residual: x's, divided)
void blas_times_m(at::Tensor& out, const at::Tensor& x, const at::Tensor& residual, double divisor,
                  const at::Tensor& other, bool m_left) {
  const auto mm = [&](const at::Tensor& m) { m_left ? at::mm_out(out, m, other) : at::mm_out(out, other, m); };
  if (residual.defined()) {
    mm(residual.view(x.sizes()));
    m_left ? out.addmm_(x, other, 1.0, 1.0 / divisor) : out.addmm_(other, x, 1.0, 1.0 / divisor);
  } else {
    mm(x);
    out.div_(divisor);
  }
}

}  // namespace

namespace {

// P = M qt^T (m_left: other is qt, r x cols) or Q^T = p^T M (other is p, rows x r) into out, M = x / divisor +
// residual never stored: on the CPU one pass over x and the residual (kernels/lowrank.h), elsewhere BLAS
at::Tensor times_m(const at::Tensor& x, const at::Tensor& residual, double divisor, const at::Tensor& other,
                   bool m_left, at::Tensor out) {
  check_m(x, residual, divisor, other, m_left ? "qt" : "p");
  const int64_t rows = x.size(0), cols = x.size(1), r = other.size(m_left ? 0 : 1);
  TORCH_CHECK_VALUE(m_left ? other.size(1) == cols : other.size(0) == rows, "hetcomm: ",
                    m_left ? "qt must be r x cols (" : "p must be rows (", m_left ? cols : rows,
                    m_left ? "), got " : ") x r, got ", other.sizes());
  const int64_t out_rows = m_left ? rows : r, out_cols = m_left ? r : cols;
  if (!out.defined()) out = at::empty({out_rows, out_cols}, x.options());
  TORCH_CHECK_VALUE(holds_matrix(out, out_rows, out_cols, x), "hetcomm: out must be contiguous float32 with ",
                    m_left ? "rows * r" : "r * cols", " elements on x's device");
  at::Tensor o = out.view({out_rows, out_cols});
  if (!x.is_cpu()) {
    blas_times_m(o, x, residual, divisor, other.t(), m_left);  // Q^T = P^T M: its rows contiguous, as on the CPU
    return out;
  }
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const float inv = static_cast<float>(1.0 / divisor);
  if (m_left)
    cpu::lowrank_project(xp, rp, inv, other.data_ptr<float>(), o.data_ptr<float>(), rows, cols, r);
  else
    cpu::lowrank_back_project(xp, rp, inv, other.data_ptr<float>(), o.data_ptr<float>(), rows, cols, r);
  return out;
}

}  // namespace

at::Tensor lowrank_project(const at::Tensor& x, const at::Tensor& residual, double divisor, const at::Tensor& qt,
                           at::Tensor out) {
  return times_m(x, residual, divisor, qt, true, out);
}

at::Tensor lowrank_back_project(const at::Tensor& x, const at::Tensor& residual, double divisor, const at::Tensor& p,
                                at::Tensor out) {
  return times_m(x, residual, divisor, p, false, out);
}

void take_q(at::Tensor& q, const at::Tensor& qt) {
  TORCH_CHECK_VALUE(q.dim() == 2 && qt.dim() == 2 && q.size(0) == qt.size(1) && q.size(1) == qt.size(0) &&
                        q.is_contiguous() && qt.is_contiguous() && q.scalar_type() == at::kFloat &&
                        qt.scalar_type() == at::kFloat && q.device() == qt.device(),
                    "hetcomm: take_q needs q (cols x rank) and qt (rank x cols), contiguous float32 on one device");
  const int64_t cols = q.size(0), rank = q.size(1);
  if (!q.is_cpu()) {  // a few small launches; no read of the device
    q.copy_(at::where(qt.ne(0).any(1).unsqueeze(0), qt.t(), q));
    return;
  }
  float* qp = q.data_ptr<float>();
  const float* tp = qt.data_ptr<float>();
  for (int64_t k = 0; k < rank; ++k) {
    const float* row = tp + k * cols;
    if (std::all_of(row, row + cols, [](float v) { return v == 0.0f; })) continue;
    for (int64_t j = 0; j < cols; ++j) qp[j * rank + k] = row[j];
  }
}

void orthonormalize_columns(at::Tensor& p, double eps) {
  TORCH_CHECK_VALUE(p.dim() == 2 && p.is_contiguous() && p.scalar_type() == at::kFloat,
                    "hetcomm: p must be a contiguous float32 matrix");
  at::Tensor flat = p.view({-1});
  orthonormalize_blocks(flat, {k::ColumnBlock{0, p.size(0), p.size(1)}}, eps);
}

void orthonormalize_blocks(at::Tensor& flat, const std::vector<k::ColumnBlock>& blocks, double eps) {
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, "hetcomm: eps must be finite and >= 0, got ", eps);
  TORCH_CHECK_VALUE(flat.dim() == 1 && flat.is_contiguous() && flat.scalar_type() == at::kFloat,
                    "hetcomm: flat must be a contiguous 1-D float32 tensor");
  int64_t end = 0;  // of the previous block
  for (const auto& b : blocks) {
    TORCH_CHECK_VALUE(b.offset >= 0 && b.rows >= 0 && b.cols >= 0 && b.offset <= flat.numel() &&
                          (b.cols == 0 || b.rows <= (flat.numel() - b.offset) / b.cols),
                      "hetcomm: blocks: a block of ", b.rows, " x ", b.cols, " at ", b.offset, " lies outside flat's ",
                      flat.numel(), " elements");
    TORCH_CHECK_VALUE(b.offset >= end, "hetcomm: blocks must be in order and must not overlap: one at ", b.offset,
                      " starts before the previous one's end ", end);
    end = b.offset + b.rows * b.cols;
  }
  float* base = flat.data_ptr<float>();
  const float e = static_cast<float>(eps);
  HC_RUN(flat, "flat", cpu::orthonormalize_blocks(base, blocks, e),
         cuda::orthonormalize_blocks(base, blocks, e, flat.device()));
}

}  // namespace ops
}  // namespace hetcomm
