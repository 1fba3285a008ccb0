// The transports' bindings: blocking calls from Python (the GIL released
// around each), defined once on the base class so every transport has them all.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <functional>
#include <memory>
#include <string>

#include "bindings.h"
#include "collectives/algorithms.h"
#include "collectives/compressed.h"
#include "collectives/lowrank.h"
#include "engine/bucket_reducer.h"
#include "ops/codecs.h"
#include "transport/pg_transport.h"
#ifdef HETCOMM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "transport/nccl_transport.h"
#endif

namespace py = pybind11;

namespace hetcomm {
namespace bindings {

namespace {

// The 1-D float32 view the compressed all-reduce bindings work on, in place.
at::Tensor flat_float32(const at::Tensor& x) {
  ops::check_float_vector(x, "x");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && x.is_contiguous(), "hetcomm: x must be contiguous float32");
  return x.view({-1});
}

// A blocking call on any transport from Python. NCCL's: its stream first
// waits for the caller's (which made the inputs), the work (NCCL calls and the
// algorithms' own kernels) runs on its stream, and it returns once finished.
void blocking(Transport& t, const std::function<void()>& fn) {
#ifdef HETCOMM_WITH_CUDA
  if (auto* nccl = dynamic_cast<NcclTransport*>(&t)) {
    nccl->wait_for_current_stream();
    {
      c10::cuda::CUDAStreamGuard guard(nccl->stream());
      fn();
    }
    nccl->synchronize();
    return;
  }
#endif
  fn();
}

// The two-phase exchanges (onebit, fp8) share one Python signature; `run` is the collective.
using TwoPhase = void (*)(Transport&, at::Tensor&, double, int64_t, const at::Tensor&, const at::Tensor&,
                          collectives::CodecTimer&, int64_t, const collectives::MomentumFold*,
                          collectives::Finite*, bool);

auto two_phase_binding(TwoPhase run) {
  return [run](Transport& t, at::Tensor x, double divisor, int64_t chunk, c10::optional<at::Tensor> wres,
               c10::optional<at::Tensor> sres, int64_t pieces, c10::optional<at::Tensor> momentum,
               double momentum_alpha, double beta, bool finite, bool pack) {
    collectives::CodecTimer timer;
    at::Tensor flat = flat_float32(x);
    const collectives::MomentumFold fold{opt(momentum), momentum_alpha, beta};
    collectives::Finite f{finite};
    blocking(t, [&] {
      run(t, flat, divisor, chunk, opt(wres), opt(sres), timer, pieces, fold.m.defined() ? &fold : nullptr, &f, pack);
    });
    return f.everywhere;
  };
}

}  // namespace

void bind_transports(py::module_& m) {
  using T = Transport;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport")
      .def_property_readonly("rank", &T::rank)
      .def_property_readonly("size", &T::size)
      .def_property_readonly("name", &T::name)
      .def_property_readonly("device", &T::device)
      .def(
          "send", [](T& t, const at::Tensor& x, int dst, int tag) { blocking(t, [&] { t.send(x, dst, tag); }); },
          py::arg("tensor"), py::arg("dst"), py::arg("tag") = 0, nogil)
      .def(
          "recv", [](T& t, at::Tensor x, int src, int tag) { blocking(t, [&] { t.recv(x, src, tag); }); },
          py::arg("tensor"), py::arg("src"), py::arg("tag") = 0, nogil)
      .def(
          "send_recv",
          [](T& t, const at::Tensor& out, int dst, at::Tensor in, int src, int tag) {
            blocking(t, [&] { t.send_recv(out, dst, in, src, tag); });
          },
          py::arg("out"), py::arg("dst"), py::arg("input"), py::arg("src"), py::arg("tag") = 0, nogil)
      .def(
          "all_reduce_sum", [](T& t, at::Tensor x) { blocking(t, [&] { t.all_reduce_sum(x); }); }, py::arg("tensor"),
          nogil)
      .def(
          "all_gather",
          [](T& t, at::Tensor out, const at::Tensor& in) { blocking(t, [&] { t.all_gather(out, in); }); },
          py::arg("out"), py::arg("input"), nogil)
      .def(
          "all_to_all",
          [](T& t, at::Tensor out, const at::Tensor& in) { blocking(t, [&] { t.all_to_all(out, in); }); },
          py::arg("out"), py::arg("input"), nogil)
      .def(
          "reduce_scatter_sum",
          [](T& t, at::Tensor out, const at::Tensor& in, const std::string& algorithm) {
            TORCH_CHECK_VALUE(algorithm == "native" || algorithm == "ring",
                              "hetcomm: algorithm must be 'native' or 'ring', got '", algorithm, "'");
            blocking(t, [&] {
              if (algorithm == "native")
                t.reduce_scatter_sum(out, in);
              else
                collectives::reduce_scatter_ring(t, out, in);
            });
          },
          py::arg("out"), py::arg("input"), py::arg("algorithm") = "native", nogil,
          "out = this rank's block of the sum over ranks of input (world_size equal blocks).")
      .def("barrier", [](T& t) { blocking(t, [&] { t.barrier(); }); }, nogil)
      .def("allreduce_onebit", two_phase_binding(&collectives::allreduce_onebit), py::arg("x"), py::arg("divisor"),
           py::arg("chunk") = 32, py::arg("worker_residual") = py::none(), py::arg("server_residual") = py::none(),
           py::arg("pieces") = 0, py::arg("momentum") = py::none(), py::arg("momentum_alpha") = 0.0,
           py::arg("beta") = 0.0, py::arg("finite") = true, py::arg("pack") = false, nogil,
           "Two-phase 1-bit all-reduce of x in place (x = sum_i x_i / divisor_i, approximately), pipelined in "
           "`pieces` (0: by the bucket's size). With `momentum` m: x += momentum_alpha * m before, and the "
           "hand-over (ops.momentum_handoff with beta) after, piece by piece. `finite`: this rank's input is "
           "(False: it sends a flag, encodes nothing). Returns whether every rank's was; where not, nothing was "
           "decoded into x (the others' residuals and an owner's server residual written: the caller's to put back). "
           "`pack` (the same on every rank): each round's messages zstd-compressed where every rank can, the same "
           "bits in fewer bytes where the codes are peaked.")
      .def("allreduce_fp8", two_phase_binding(&collectives::allreduce_fp8), py::arg("x"), py::arg("divisor"),
           py::arg("chunk") = 256, py::arg("worker_residual") = py::none(), py::arg("server_residual") = py::none(),
           py::arg("pieces") = 0, py::arg("momentum") = py::none(), py::arg("momentum_alpha") = 0.0,
           py::arg("beta") = 0.0, py::arg("finite") = true, py::arg("pack") = false, nogil,
           "Two-phase fp8 (e4m3, power-of-two scale per chunk) all-reduce of x in place, pipelined in `pieces`; "
           "`finite` and the result as for allreduce_onebit.")
      .def("allreduce_int3", two_phase_binding(&collectives::allreduce_int3), py::arg("x"), py::arg("divisor"),
           py::arg("chunk") = 32, py::arg("worker_residual") = py::none(), py::arg("server_residual") = py::none(),
           py::arg("pieces") = 0, py::arg("momentum") = py::none(), py::arg("momentum_alpha") = 0.0,
           py::arg("beta") = 0.0, py::arg("finite") = true, py::arg("pack") = false, nogil,
           "Two-phase 3-bit linear (bf16 scale per chunk) all-reduce of x in place, pipelined in `pieces`; "
           "`finite` and the result as for allreduce_onebit.")
      .def(
          "allreduce_topk",
          [](T& t, at::Tensor x, double divisor, double ratio, bool exact, c10::optional<at::Tensor> res,
             c10::optional<at::Tensor> denominator, bool finite) {
            collectives::CodecTimer timer;
            at::Tensor flat = flat_float32(x);
            collectives::Finite f{finite};
            blocking(t, [&] {
              collectives::allreduce_topk(t, flat, divisor, ratio, exact, opt(res), timer, opt(denominator), &f);
            });
            return f.everywhere;
          },
          py::arg("x"), py::arg("divisor"), py::arg("ratio"), py::arg("exact") = true, py::arg("residual") = py::none(),
          py::arg("denominator") = py::none(), py::arg("finite") = true,
          nogil, "Top-k all-gather all-reduce of x in place; `finite` and the result as for allreduce_onebit.")
      .def(
          "allreduce_lowrank",
          [](T& t, at::Tensor x, double divisor, const at::Tensor& layout, at::Tensor q_state,
             c10::optional<at::Tensor> res, std::vector<int> node_of, const std::string& wire_name) {
            collectives::CodecTimer timer;
            at::Tensor flat = flat_float32(x);
            const at::ScalarType wire = lowrank_wire_named(wire_name);
            bool reduced = false;
            blocking(t, [&] {
              if (node_of.empty())
                reduced = collectives::allreduce_lowrank(t, flat, divisor, layout, q_state, opt(res), timer, -1.0, wire);
              else
                reduced = collectives::allreduce_lowrank_hierarchical(t, flat, divisor, layout, q_state, opt(res),
                                                                      node_of, timer, -1.0, wire);
            });
            return reduced;
          },
          py::arg("x"), py::arg("divisor"), py::arg("layout"), py::arg("q_state"), py::arg("residual") = py::none(),
          py::arg("node_of") = std::vector<int>{}, py::arg("wire") = "fp32", nogil,
          "Low-rank (PowerSGD-style) all-reduce of x in place; wire 'fp32' or 'bf16' (the factors and dense parts "
          "sent in bfloat16, the rounding kept in the residual). False (x, residual and Q untouched) where x held a "
          "NaN or an infinity on some rank.")
      .def(
          "allreduce",
          [](T& t, at::Tensor x, const std::string& algorithm, std::vector<int> order, std::vector<int> node_of,
             const std::string& inter, c10::optional<at::Tensor> res, c10::optional<at::Tensor> sres, int64_t chunk,
             double ratio, int64_t pieces) {
            TORCH_CHECK_VALUE(x.is_contiguous(), "hetcomm: x must be contiguous");
            TORCH_CHECK_VALUE(inter == "ring" || inter == "none" || inter == "fp16" || inter == "bf16" ||
                                  inter == "onebit" || inter == "fp8" || inter == "int3" || inter == "topk",
                              "hetcomm: inter must be 'ring' (or 'none'), 'fp16', 'bf16', 'onebit', 'fp8', 'int3' or "
                              "'topk', got '", inter, "'");
            TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || (inter != "fp16" && inter != "bf16"),
                              "hetcomm: x must be float32 for inter '", inter, "', got ", x.scalar_type());
            BucketReducer::check_topology(order, node_of, t.size());
            const collectives::Codec codec = inter == "ring" ? collectives::Codec::kNone : codec_named(inter);
            const bool coded = codec != collectives::Codec::kNone && codec != collectives::Codec::kFP16 &&
                               codec != collectives::Codec::kBF16;
            if (coded) ops::check_chunk(chunk);
            at::Tensor flat = x.view({-1});
            const Algo algo = algo_named(algorithm);
            collectives::InterOptions o;
            o.codec = codec;
            o.residual = opt(res);
            o.server_residual = opt(sres);
            o.chunk = chunk;
            o.topk_ratio = ratio;
            o.pieces = pieces;
            blocking(t, [&] { collectives::allreduce_by(t, flat, algo, order, node_of, o); });
          },
          py::arg("x"), py::arg("algorithm"), py::arg("order") = std::vector<int>{},
          py::arg("node_of") = std::vector<int>{}, py::arg("inter") = "ring", py::arg("residual") = py::none(),
          py::arg("server_residual") = py::none(), py::arg("chunk") = 2048, py::arg("topk_ratio") = 0.01,
          py::arg("pieces") = 0, nogil,
          "Sum of x over ranks, in place, by the named algorithm; inter: the hierarchical algorithm's stage across nodes "
          "(pieces: of a onebit / fp8 / int3 one).")
      .def("counters", [](T& t) {
        py::dict d;
        d["bytes_sent"] = t.counters().bytes_sent.load();
        d["bytes_recv"] = t.counters().bytes_recv.load();
        d["comm_s"] = t.counters().comm_ns.load() * 1e-9;
        d["calls"] = t.counters().calls.load();
        d["bytes_sent_across_nodes"] = t.counters().bytes_sent_across.load();
        d["bytes_recv_across_nodes"] = t.counters().bytes_recv_across.load();
        d["packed_rounds"] = t.counters().packed_rounds.load();
        d["unpacked_rounds"] = t.counters().unpacked_rounds.load();
        return d;
      })
      .def("set_nodes", &T::set_nodes, py::arg("node_of"),
           "Which node each rank is on (empty: unknown), for the counters' bytes across nodes.");
  py::class_<ProcessGroupTransport, Transport, std::shared_ptr<ProcessGroupTransport>>(m, "ProcessGroupTransport")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, at::Device>(), py::arg("process_group"),
           py::arg("device") = at::Device(at::kCPU));

#ifdef HETCOMM_WITH_CUDA
  // NCCL matches point-to-point calls by order, not tags.
  py::class_<NcclTransport, Transport, std::shared_ptr<NcclTransport>>(m, "NcclTransport")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, int rank, int size,
                       int device, double timeout_s) {
             return std::make_shared<NcclTransport>(store, key, rank, size, device,
                                                    std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
           }),
           py::arg("store"), py::arg("key"), py::arg("rank"), py::arg("size"), py::arg("device"),
           py::arg("timeout_s") = 600.0, nogil);
#endif
}

}  // namespace bindings
}  // namespace hetcomm
