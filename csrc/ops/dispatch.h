// Inside the ATen wrappers (codecs.cpp, dense_ops.cpp): the argument checks
// they share and the dispatch to a device. Every op checks its arguments
// first, for every device, then runs its body on the input's device: cpu::X
// (codecs_cpu.h) or cuda::X (codecs_cuda.h).
#pragma once

#include <ATen/ATen.h>

#include "ops/codecs_cpu.h"
#ifdef HETCOMM_WITH_CUDA
#include "ops/codecs_cuda.h"
#define HC_CUDA(call) call
#else
#define HC_CUDA(call) TORCH_INTERNAL_ASSERT(false, "hetcomm: CUDA dispatch in a CPU-only build")
#endif

#define HC_RUN(t, name, cpu_call, cuda_call)             \
  do {                                                   \
    if (::hetcomm::ops::detail::runs_on_cuda(t, name)) { \
      HC_CUDA(cuda_call);                                \
    } else {                                             \
      cpu_call;                                          \
    }                                                    \
  } while (0)

namespace hetcomm {
namespace ops {
namespace detail {

// Whether `t` runs on CUDA (a CUDA tensor in a CUDA build); otherwise it must be a CPU tensor.
bool runs_on_cuda(const at::Tensor& t, const char* name);

// The Python name of a dtype, as the user wrote it.
const char* dtype_name(at::ScalarType type);

// t: defined, on `like`'s device, contiguous, of dtype `type`, at least `numel`
// elements (exactly `numel` when `exact`); `size_rule` names numel's rule.
void check_buffer(const at::Tensor& t, const char* name, const at::Tensor& like, at::ScalarType type, int64_t numel,
                  const char* size_rule, bool exact = false);

}  // namespace detail
}  // namespace ops
}  // namespace hetcomm
