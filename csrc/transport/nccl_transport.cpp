#include "transport/nccl_transport.h"

#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "checks.h"

#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace hetcomm {

ncclDataType_t nccl_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kDouble: return ncclFloat64;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default:
      TORCH_CHECK_TYPE(false, "hetcomm: NCCL has no type for ", t);
  }
}

NcclTransport::NcclTransport(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int rank,
                             int size, int device, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), device_(device), timeout_(timeout),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, static_cast<c10::DeviceIndex>(device))) {
  TORCH_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "hetcomm: NcclTransport rank must be in [0, size)");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  ncclUniqueId id;
  if (rank == 0) {
    HC_NCCL_CHECK(ncclGetUniqueId(&id));
    std::vector<uint8_t> bytes(sizeof(id));
    std::memcpy(bytes.data(), &id, sizeof(id));
    store->set(key, bytes);
  } else {
    const std::vector<uint8_t> bytes = store->get(key);  // waits up to the store's timeout
    TORCH_CHECK(bytes.size() == sizeof(id), "hetcomm: corrupt NCCL unique id in the store under ", key);
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // calls return ncclInProgress; we poll, so we can time out and abort
  HC_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size, id, rank, &config));
  wait_ready("ncclCommInitRankConfig");
}

NcclTransport::~NcclTransport() {
  if (comm_ != nullptr && !aborted_) {
    // Finalize may block on a dead peer: abort instead (never throws from here).
    ncclCommAbort(comm_);
  }
}

void NcclTransport::abort(const std::string& why) {
  if (!aborted_ && comm_ != nullptr) {
    ncclCommAbort(comm_);
    aborted_ = true;
  }
  throw std::runtime_error("hetcomm: NCCL communicator aborted: " + why);
}

void NcclTransport::check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  const char* last = comm_ ? ncclGetLastError(comm_) : "";
  abort(std::string(what) + " failed: " + ncclGetErrorString(r) + (last && *last ? std::string(" (") + last + ")" : ""));
}

void NcclTransport::wait_ready(const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    HC_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) check(state, what);
    if (std::chrono::steady_clock::now() > deadline) abort(std::string(what) + " timed out");
    std::this_thread::yield();
  }
}

void NcclTransport::wait_for_current_stream() {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaEvent_t ev;
  HC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  HC_CUDA_CHECK(cudaEventRecord(ev, c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream()));
  HC_CUDA_CHECK(cudaStreamWaitEvent(stream_.stream(), ev, 0));
  HC_CUDA_CHECK(cudaEventDestroy(ev));
}

void NcclTransport::synchronize() {
  TORCH_CHECK(!aborted_, "hetcomm: the NCCL communicator was aborted earlier");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaEvent_t ev;
  HC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  HC_CUDA_CHECK(cudaEventRecord(ev, stream_.stream()));
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t q = cudaEventQuery(ev);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      cudaEventDestroy(ev);  // best effort on the way out: the query's error is the one to report
      ::hetcomm::detail::check_failed("CUDA", "cudaEventQuery(ev)", cudaGetErrorString(q), __FILE__, __LINE__);
    }
    ncclResult_t state = ncclSuccess;
    HC_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      cudaEventDestroy(ev);
      check(state, "an enqueued collective");
    }
    if (std::chrono::steady_clock::now() - start > timeout_) {
      cudaEventDestroy(ev);
      abort("a collective did not finish within the timeout (a dead or stuck peer?)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  HC_CUDA_CHECK(cudaEventDestroy(ev));
  counters_.comm_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

void NcclTransport::check_place(const at::Tensor& t, const char* name) const {
  TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == device_, "hetcomm: ", name, " must be on cuda:", device_,
                    " (the NcclTransport's device), got ", t.device());
}

void NcclTransport::do_send(const at::Tensor& t, int dst, int /*tag*/) {
  at::Tensor none;
  do_send_recv(t, dst, none, -1, 0);
}

void NcclTransport::do_recv(at::Tensor& t, int src, int /*tag*/) { do_send_recv(at::Tensor(), -1, t, src, 0); }

void NcclTransport::do_send_recv(const at::Tensor& out, int dst, at::Tensor& in, int src, int /*tag*/) {
  // NCCL matches point-to-point calls by order, not tags: the algorithms
  // issue them in the same order on both sides. An empty side is skipped
  // (both ends see the same size).
  const bool sending = dst >= 0 && out.numel() > 0, receiving = src >= 0 && in.numel() > 0;
  if (!sending && !receiving) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  HC_NCCL_CHECK(ncclGroupStart());
  if (sending)
    HC_NCCL_CHECK(ncclSend(out.data_ptr(), out.numel(), nccl_dtype(out.scalar_type()), dst, comm_, stream_.stream()));
  if (receiving)
    HC_NCCL_CHECK(ncclRecv(in.data_ptr(), in.numel(), nccl_dtype(in.scalar_type()), src, comm_, stream_.stream()));
  HC_NCCL_CHECK(ncclGroupEnd());
  wait_ready("send/recv");
}

void NcclTransport::do_all_reduce_sum(at::Tensor& t) {
  if (t.numel() == 0) return;  // the same on every rank; NCCL may reject empty (null) buffers
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  HC_NCCL_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_dtype(t.scalar_type()), ncclSum, comm_,
                              stream_.stream()));
  wait_ready("ncclAllReduce");
}

void NcclTransport::do_all_gather(at::Tensor& out, const at::Tensor& in) {
  if (in.numel() == 0) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  HC_NCCL_CHECK(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), nccl_dtype(in.scalar_type()), comm_,
                              stream_.stream()));
  wait_ready("ncclAllGather");
}

void NcclTransport::do_all_to_all(at::Tensor& out, const at::Tensor& in) {
  if (in.numel() == 0) return;
  const int64_t m = in.numel() / size_;
  const ncclDataType_t dt = nccl_dtype(in.scalar_type());
  const int64_t es = in.element_size();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  HC_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < size_; ++r) {
    HC_NCCL_CHECK(ncclSend(static_cast<const char*>(in.data_ptr()) + r * m * es, m, dt, r, comm_, stream_.stream()));
    HC_NCCL_CHECK(ncclRecv(static_cast<char*>(out.data_ptr()) + r * m * es, m, dt, r, comm_, stream_.stream()));
  }
  HC_NCCL_CHECK(ncclGroupEnd());
  wait_ready("all_to_all");
}

void NcclTransport::do_reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) {
  if (out.numel() == 0) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  HC_NCCL_CHECK(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_dtype(in.scalar_type()), ncclSum,
                                  comm_, stream_.stream()));
  wait_ready("ncclReduceScatter");
}

void NcclTransport::do_barrier() {
  at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
  do_all_reduce_sum(one);
  synchronize();
}

}  // namespace hetcomm
