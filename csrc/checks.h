// One way to check CUDA and NCCL calls: the message names the API, the failing
// call's text, the error and where (as NCCL's CUDACHECK and c10d's
// C10D_NCCL_CHECK do). Torch-free: the kernels' .cu files use it too.
#pragma once

#include <stdexcept>
#include <string>

namespace hetcomm {
namespace detail {

[[noreturn]] inline void check_failed(const char* api, const char* call, const char* error, const char* file,
                                      int line) {
  throw std::runtime_error(std::string("hetcomm: ") + api + " call " + call + " failed: " + error + " (" + file + ":" +
                           std::to_string(line) + ")");
}

}  // namespace detail
}  // namespace hetcomm

// Throws std::runtime_error (RuntimeError in Python) when `call` does not
// return cudaSuccess. Needs <cuda_runtime.h>.
#define HC_CUDA_CHECK(call)                                                                             \
  do {                                                                                                  \
    const cudaError_t hc_err_ = (call);                                                                 \
    if (hc_err_ != cudaSuccess)                                                                         \
      ::hetcomm::detail::check_failed("CUDA", #call, cudaGetErrorString(hc_err_), __FILE__, __LINE__);  \
  } while (0)

// After a kernel launch (`kernel`: a string literal naming it): a bad launch
// configuration or an earlier asynchronous error.
#define HC_CUDA_LAUNCH_CHECK(kernel)                                                                        \
  do {                                                                                                      \
    const cudaError_t hc_err_ = cudaGetLastError();                                                         \
    if (hc_err_ != cudaSuccess)                                                                             \
      ::hetcomm::detail::check_failed("CUDA", "launch of " kernel, cudaGetErrorString(hc_err_), __FILE__, __LINE__); \
  } while (0)

// Inside NcclTransport: its own handler runs (it aborts the communicator, so
// no rank waits forever on it) with the call's text.
#define HC_NCCL_CHECK(call) check((call), #call)
