// Momentum compression (HookState.attach_optimizer), elementwise, torch-free.
// fold_in: x += alpha * m, what a rank sends (its local momentum, weighted).
// handoff, in one pass: x holds the new momentum m_new (the reduced, compressed
// one); the optimizer is handed m_new - beta * m_old in x (its own buffer,
// beta m_old + that, becomes m_new) and m keeps m_new. One read and one write
// of each, no temporary (the ATen form, clone / sub_ / copy_, makes three
// passes and a bucket-sized allocation every step). Both are the same per
// element wherever a slice starts, so the two phases can apply them piece by
// piece (collectives::MomentumFold).
#pragma once

#include <cstdint>

namespace hetcomm {
namespace kernels {

void momentum_fold_in_cpu(float* x, const float* m, float alpha, int64_t begin, int64_t end);
void momentum_fold_in_cuda(float* x, const float* m, float alpha, int64_t n, void* stream);
void momentum_handoff_cpu(float* x, float* m, float beta, int64_t begin, int64_t end);
void momentum_handoff_cuda(float* x, float* m, float beta, int64_t n, void* stream);

}  // namespace kernels
}  // namespace hetcomm
