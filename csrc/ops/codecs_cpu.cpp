#include "ops/codecs_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>

#include "kernels/lowrank.h"
#include "kernels/momentum.h"
#include "kernels/topk.h"

namespace hetcomm {
namespace ops {
namespace cpu {

namespace k = hetcomm::kernels;

namespace {

constexpr int64_t kGrainElements = 1 << 15;

int64_t chunk_grain(int64_t chunk) { return std::max<int64_t>(1, kGrainElements / chunk); }

// Rows of a matrix with `cols` columns a task takes: about 16384 elements.
int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace

void sign_encode(const k::SignEncodeParams& p) {
  at::parallel_for(0, k::sign_num_chunks(p.n, p.chunk), chunk_grain(p.chunk),
                   [&](int64_t b, int64_t e) { k::sign_encode_cpu(p, b, e); });
}

void sign_decode(const k::SignDecodeParams& p) {
  at::parallel_for(0, k::sign_num_chunks(p.n, p.chunk), chunk_grain(p.chunk),
                   [&](int64_t b, int64_t e) { k::sign_decode_cpu(p, b, e); });
}

void fp8_encode(const k::Fp8EncodeParams& p) {
  at::parallel_for(0, k::fp8_num_chunks(p.n, p.chunk), chunk_grain(p.chunk),
                   [&](int64_t b, int64_t e) { k::fp8_encode_cpu(p, b, e); });
}

void fp8_decode(const k::Fp8DecodeParams& p) {
  at::parallel_for(0, k::fp8_num_chunks(p.n, p.chunk), chunk_grain(p.chunk),
                   [&](int64_t b, int64_t e) { k::fp8_decode_cpu(p, b, e); });
}

void int3_encode(const k::Int3EncodeParams& p) {
  at::parallel_for(0, k::int3_num_chunks(p.n, p.chunk), chunk_grain(p.chunk),
                   [&](int64_t b, int64_t e) { k::int3_encode_cpu(p, b, e); });
}

void int3_decode(const k::Int3DecodeParams& p) {
  at::parallel_for(0, k::int3_num_chunks(p.n, p.chunk), chunk_grain(p.chunk),
                   [&](int64_t b, int64_t e) { k::int3_decode_cpu(p, b, e); });
}

std::tuple<at::Tensor, at::Tensor> topk_encode(const at::Tensor& grad, const at::Tensor& residual, double divisor,
                                               int64_t kk, bool exact) {
  const int64_t n = grad.numel();
  at::Tensor x = residual.defined() ? residual : at::empty({n}, at::kFloat);
  float* xp = x.data_ptr<float>();
  const float* gp = grad.data_ptr<float>();
  const float d = static_cast<float>(divisor);
  at::parallel_for(0, n, kGrainElements, [&](int64_t b, int64_t e) {
    if (residual.defined())
      k::ef_accumulate_cpu(gp, d, xp, b, e);
    else
      k::scale_copy_cpu(gp, d, xp, b, e);
  });
  at::Tensor idx = at::empty({kk}, at::kInt);
  at::Tensor val = at::empty({kk}, at::kFloat);
  const k::ParallelFor pfor = [](int64_t count, const std::function<void(int64_t, int64_t)>& body) {
    at::parallel_for(0, count, 1, body);
  };
  const int64_t count = exact ? k::topk_select_exact_cpu(xp, n, kk, idx.data_ptr<int32_t>(), val.data_ptr<float>(), pfor)
                              : k::topk_select_sampled_cpu(xp, n, kk, idx.data_ptr<int32_t>(), val.data_ptr<float>(), pfor);
  if (residual.defined()) k::topk_clear_cpu(xp, idx.data_ptr<int32_t>(), count);
  return {idx.narrow(0, 0, count), val.narrow(0, 0, count)};
}

void scatter_add(const int32_t* idx, const float* val, int64_t count, float alpha, float* out) {
  k::scatter_add_cpu(idx, val, count, alpha, out);  // sequential: the order of repeated indices is fixed
}

void cast_encode(k::Wire16 fmt, const float* in, float divisor, uint16_t* out, int64_t n) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t b, int64_t e) { k::cast_encode_cpu(fmt, in, divisor, out, b, e); });
}

void cast_decode(k::Wire16 fmt, const uint16_t* in, float mul, float* out, int64_t n) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t b, int64_t e) { k::cast_decode_cpu(fmt, in, mul, out, b, e); });
}

void momentum_fold_in(float* x, const float* m, float alpha, int64_t n) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t b, int64_t e) { k::momentum_fold_in_cpu(x, m, alpha, b, e); });
}

void momentum_handoff(float* x, float* m, float beta, int64_t n) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t b, int64_t e) { k::momentum_handoff_cpu(x, m, beta, b, e); });
}

void lowrank_outer(const float* p, const float* qt, float* out, int64_t rows, int64_t cols, int64_t r) {
  at::parallel_for(0, rows, row_grain(cols),
                   [&](int64_t b, int64_t e) { k::outer_product_cpu(p, qt, out, rows, cols, r, b, e); });
}

void lowrank_finish(const float* p, const float* qt, float* x, float* residual, float divisor, float share,
                    int64_t rows, int64_t cols, int64_t r) {
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t b, int64_t e) {
    std::vector<float> row(static_cast<size_t>(cols));
    k::lowrank_finish_cpu(p, qt, x, residual, divisor, share, rows, cols, r, row.data(), b, e);
  });
}

void lowrank_project(const float* x, const float* residual, float inv_divisor, const float* qt, float* p, int64_t rows,
                     int64_t cols, int64_t r) {
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t b, int64_t e) {
    std::vector<float> row(static_cast<size_t>(cols));
    k::lowrank_project_cpu(x, residual, inv_divisor, qt, p, rows, cols, r, row.data(), b, e);
  });
}

void lowrank_back_project(const float* x, const float* residual, float inv_divisor, const float* p, float* qt,
                          int64_t rows, int64_t cols, int64_t r) {
  // Columns a task takes: Q^T's piece of them (r x width floats) stays within 16 KB, and each thread gets one
  // where it can. Each entry's sum runs over the rows in order whatever the width: the same bits either way.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t fits = std::max<int64_t>(64, 4096 / std::max<int64_t>(r, 1));
  int64_t width = std::min<int64_t>(fits, (cols + threads - 1) / threads);
  width = std::max<int64_t>(8, (width + 7) / 8 * 8);
  const int64_t blocks = (cols + width - 1) / width;
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    std::vector<float> seg(static_cast<size_t>(k::kBackProjectRows * width));
    for (int64_t c = b; c < e; ++c)
      k::lowrank_back_project_cpu(x, residual, inv_divisor, p, qt, rows, cols, r, seg.data(), c * width,
                                  std::min(cols, (c + 1) * width));
  });
}

void orthonormalize_blocks(float* base, const std::vector<k::ColumnBlock>& blocks, float eps) {
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) k::orthonormalize_columns_cpu(base + blocks[i].offset, blocks[i].rows, blocks[i].cols, eps);
  });
}

bool all_finite(const float* x, int64_t n) {
  return at::parallel_reduce(
      0, n, kGrainElements, true, [&](int64_t b, int64_t e, bool ok) { return ok && k::all_finite_cpu(x, b, e); },
      [](bool a, bool b) { return a && b; });
}

void dense_input(const float* x, const float* residual, float divisor, float* out, int64_t n) {
  at::parallel_for(0, n, kGrainElements,
                   [&](int64_t b, int64_t e) { k::dense_input_cpu(x, residual, divisor, out, b, e); });
}

}  // namespace cpu
}  // namespace ops
}  // namespace hetcomm
