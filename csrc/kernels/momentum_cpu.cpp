#include "kernels/momentum.h"

#include "kernels/codec_math.h"

namespace hetcomm {
namespace kernels {

HC_CPU_CLONES
void momentum_fold_in_cpu(float* x, const float* m, float alpha, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) x[i] = mul_add_rn(alpha, m[i], x[i]);
}

HC_CPU_CLONES
void momentum_handoff_cpu(float* x, float* m, float beta, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float m_new = x[i];
    x[i] = momentum_delta(m_new, m[i], beta);
    m[i] = m_new;
  }
}

}  // namespace kernels
}  // namespace hetcomm
