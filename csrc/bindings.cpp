// Binds the core for Python (with engine/engine.cpp, which completes Python
// futures, the only file that sees pybind11). C++ errors leave here as
// Python exceptions (c10::ValueError -> ValueError, c10::TypeError -> TypeError,
// anything else -> RuntimeError, through torch's translators); input checks
// inside name the argument and the rule.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <torch/version.h>

#include <memory>
#include <string>

#include "collectives/algorithms.h"
#include "collectives/compressed.h"
#include "collectives/lowrank.h"
#include "engine/engine.h"
#include "ops/codecs.h"
#include "transport/pg_transport.h"
#ifdef HETCOMM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "transport/nccl_transport.h"
#endif

namespace py = pybind11;
using namespace hetcomm;

namespace {

at::Tensor opt(const c10::optional<at::Tensor>& t) { return t.value_or(at::Tensor()); }

// The 1-D float32 view the compressed all-reduce bindings work on, in place.
at::Tensor flat_float32(const at::Tensor& x) {
  ops::check_float_vector(x, "x");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && x.is_contiguous(), "hetcomm: x must be contiguous float32");
  return x.view({-1});
}

py::object wrap_future(const FuturePtr& fut) {
  return py::cast(std::make_shared<torch::jit::PythonFutureWrapper>(fut));
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

// The names Python uses for the enums (py::enum_ exports them as _C.Algo / _C.Codec).
const std::vector<std::pair<const char*, Algo>> kAlgoNames = {{"native", Algo::kNative},
                                                                {"ring", Algo::kRing},
                                                                {"halving_doubling", Algo::kHalvingDoubling},
                                                                {"tree", Algo::kTree},
                                                                {"hierarchical", Algo::kHierarchical}};
const std::vector<std::pair<const char*, Codec>> kCodecNames = {{"none", Codec::kNone},   {"fp16", Codec::kFP16},
                                                                  {"bf16", Codec::kBF16},   {"onebit", Codec::kOneBit},
                                                                  {"topk", Codec::kTopK},   {"lowrank", Codec::kLowRank},
                                                                  {"fp8", Codec::kFP8}};

Algo algo_named(const std::string& name) {
  std::string all;
  for (const auto& [n, a] : kAlgoNames) {
    if (name == n) return a;
    all += (all.empty() ? "" : ", ") + std::string(n);
  }
  TORCH_CHECK_VALUE(false, "hetcomm: algorithm must be one of ", all, ", got '", name, "'");
}

py::dict totals_dict(const ReduceTotals& t) {
  py::dict d;
  d["bytes_sent"] = t.bytes_sent;
  d["bytes_recv"] = t.bytes_recv;
  d["comm_s"] = t.comm_ns * 1e-9;
  d["codec_s"] = t.codec_ns * 1e-9;
  d["numel"] = t.numel;
  d["buckets"] = t.buckets;
  d["fp32_bytes"] = t.fp32_bytes;
  d["compression_ratio"] = t.bytes_sent > 0 ? static_cast<double>(t.fp32_bytes) / t.bytes_sent : 1.0;
  return d;
}

py::dict build_info() {
  py::dict d;
  const std::string cuda = HETCOMM_CUDA_STATE;
  d["cuda"] = cuda == "linked";
  d["cuda_compiled"] = cuda != "none";
  d["cuda_state"] = cuda;
  d["cuda_archs"] = std::string(HETCOMM_CUDA_ARCHS);
  d["nccl_version"] = std::string(HETCOMM_NCCL_VERSION);
  d["torch_version"] = std::string(TORCH_VERSION);
  return d;
}

at::ScalarType wire_dtype(const std::string& name) {
  if (name == "float16" || name == "fp16") return at::kHalf;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  throw c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                        "hetcomm: wire must be 'float16' or 'bfloat16', got '" + name + "'");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hetcomm C++ core: torch-free kernels, transports, the comm engine";
  m.def("build_info", &build_info, "What this build of hetcomm contains (cuda, archs, nccl version).");

  // ---- kernels -------------------------------------------------------------
  m.def(
      "sign_encode",
      [](const at::Tensor& grad, c10::optional<at::Tensor> residual, double divisor, int64_t chunk) {
        return ops::sign_encode(grad, opt(residual), divisor, chunk);
      },
      py::arg("grad"), py::arg("residual") = py::none(), py::arg("divisor") = 1.0, py::arg("chunk") = 2048,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "sign_decode",
      [](const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
         c10::optional<at::Tensor> out, bool accumulate) {
        return ops::sign_decode(words, scales, n, chunk, alpha, opt(out), accumulate);
      },
      py::arg("words"), py::arg("scales"), py::arg("n"), py::arg("chunk") = 2048, py::arg("alpha") = 1.0,
      py::arg("out") = py::none(), py::arg("accumulate") = false, py::call_guard<py::gil_scoped_release>());
  m.def(
      "fp8_encode",
      [](const at::Tensor& grad, c10::optional<at::Tensor> residual, double divisor, int64_t chunk) {
        return ops::fp8_encode(grad, opt(residual), divisor, chunk);
      },
      py::arg("grad"), py::arg("residual") = py::none(), py::arg("divisor") = 1.0, py::arg("chunk") = 256,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "fp8_decode",
      [](const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
         c10::optional<at::Tensor> out, bool accumulate) {
        return ops::fp8_decode(codes, scales, n, chunk, alpha, opt(out), accumulate);
      },
      py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("chunk") = 256, py::arg("alpha") = 1.0,
      py::arg("out") = py::none(), py::arg("accumulate") = false, py::call_guard<py::gil_scoped_release>());
  m.def(
      "topk_encode",
      [](const at::Tensor& grad, c10::optional<at::Tensor> residual, double divisor, int64_t k, bool exact) {
        return ops::topk_encode(grad, opt(residual), divisor, k, exact);
      },
      py::arg("grad"), py::arg("residual") = py::none(), py::arg("divisor") = 1.0, py::arg("k") = 1,
      py::arg("exact") = true, py::call_guard<py::gil_scoped_release>());
  m.def("topk_count", &ops::topk_count, py::arg("n"), py::arg("ratio"));
  m.def("scatter_add", &ops::scatter_add, py::arg("idx"), py::arg("val"), py::arg("out"), py::arg("alpha") = 1.0,
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "cast_encode",
      [](const at::Tensor& x, double divisor, const std::string& wire) {
        return ops::cast_encode(x, divisor, wire_dtype(wire));
      },
      py::arg("x"), py::arg("divisor") = 1.0, py::arg("wire") = "float16", py::call_guard<py::gil_scoped_release>());
  m.def(
      "cast_decode",
      [](const at::Tensor& h, double mul, c10::optional<at::Tensor> out) { return ops::cast_decode(h, mul, opt(out)); },
      py::arg("h"), py::arg("mul") = 1.0, py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def(
      "lowrank_outer",
      [](const at::Tensor& p, const at::Tensor& qt, c10::optional<at::Tensor> out) {
        return ops::lowrank_outer(p, qt, opt(out));
      },
      py::arg("p"), py::arg("qt"), py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def(
      "orthonormalize_columns", [](at::Tensor p, double eps) { ops::orthonormalize_columns(p, eps); return p; },
      py::arg("p"), py::arg("eps") = 1e-8, py::call_guard<py::gil_scoped_release>());
  m.def("hierarchical_shard_numel", &collectives::hierarchical_shard_numel, py::arg("n"), py::arg("node_of"),
        py::arg("rank"));
  m.def("lowrank_q_numel", &collectives::lowrank_q_numel, py::arg("layout"));
  m.def("onebit_segment_numel", &collectives::onebit_segment_numel, py::arg("n"), py::arg("world"), py::arg("rank"));
  m.def("state_offsets", &collectives::state_offsets, py::arg("n"), py::arg("world"), py::arg("rank"),
        py::arg("node_of"), py::arg("hierarchical"),
        "(worker residual offset, server residual offset) of a bucket's error-feedback state, in the bucket");

  // ---- transports (blocking calls; the GIL is released around every one) ----
  // Defined once on the base class, so every transport has them all.
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
      .def(
          "allreduce_onebit",
          [](T& t, at::Tensor x, double divisor, int64_t chunk, c10::optional<at::Tensor> wres,
             c10::optional<at::Tensor> sres) {
            collectives::CodecTimer timer;
            at::Tensor flat = flat_float32(x);
            blocking(t, [&] { collectives::allreduce_onebit(t, flat, divisor, chunk, opt(wres), opt(sres), timer); });
          },
          py::arg("x"), py::arg("divisor"), py::arg("chunk") = 2048, py::arg("worker_residual") = py::none(),
          py::arg("server_residual") = py::none(), nogil,
          "Two-phase 1-bit all-reduce of x in place (x = sum_i x_i / divisor_i, approximately).")
      .def(
          "allreduce_fp8",
          [](T& t, at::Tensor x, double divisor, int64_t chunk, c10::optional<at::Tensor> wres,
             c10::optional<at::Tensor> sres) {
            collectives::CodecTimer timer;
            at::Tensor flat = flat_float32(x);
            blocking(t, [&] { collectives::allreduce_fp8(t, flat, divisor, chunk, opt(wres), opt(sres), timer); });
          },
          py::arg("x"), py::arg("divisor"), py::arg("chunk") = 256, py::arg("worker_residual") = py::none(),
          py::arg("server_residual") = py::none(), nogil,
          "Two-phase fp8 (e4m3, power-of-two scale per chunk) all-reduce of x in place.")
      .def(
          "allreduce_topk",
          [](T& t, at::Tensor x, double divisor, double ratio, bool exact, c10::optional<at::Tensor> res) {
            collectives::CodecTimer timer;
            at::Tensor flat = flat_float32(x);
            blocking(t, [&] { collectives::allreduce_topk(t, flat, divisor, ratio, exact, opt(res), timer); });
          },
          py::arg("x"), py::arg("divisor"), py::arg("ratio"), py::arg("exact") = true, py::arg("residual") = py::none(),
          nogil, "Top-k all-gather all-reduce of x in place.")
      .def(
          "allreduce_lowrank",
          [](T& t, at::Tensor x, double divisor, const at::Tensor& layout, at::Tensor q_state,
             c10::optional<at::Tensor> res, std::vector<int> node_of) {
            collectives::CodecTimer timer;
            at::Tensor flat = flat_float32(x);
            blocking(t, [&] {
              if (node_of.empty())
                collectives::allreduce_lowrank(t, flat, divisor, layout, q_state, opt(res), timer);
              else
                collectives::allreduce_lowrank_hierarchical(t, flat, divisor, layout, q_state, opt(res), node_of,
                                                            timer);
            });
          },
          py::arg("x"), py::arg("divisor"), py::arg("layout"), py::arg("q_state"), py::arg("residual") = py::none(),
          py::arg("node_of") = std::vector<int>{}, nogil, "Low-rank (PowerSGD-style) all-reduce of x in place.")
      .def(
          "allreduce",
          [](T& t, at::Tensor x, const std::string& algorithm, std::vector<int> order, std::vector<int> node_of,
             const std::string& inter, c10::optional<at::Tensor> res, c10::optional<at::Tensor> sres, int64_t chunk,
             double ratio) {
            TORCH_CHECK_VALUE(x.is_contiguous(), "hetcomm: x must be contiguous");
            TORCH_CHECK_VALUE(inter == "ring" || inter == "onebit" || inter == "fp8" || inter == "topk",
                              "hetcomm: inter must be 'ring', 'onebit', 'fp8' or 'topk', got '", inter, "'");
            BucketReducer::check_topology(order, node_of, t.size());
            if (inter != "ring") ops::check_chunk(chunk);
            at::Tensor flat = x.view({-1});
            const Algo algo = algo_named(algorithm);
            collectives::InterOptions o;
            o.codec = inter == "ring"     ? collectives::InterCodec::kRing
                      : inter == "onebit" ? collectives::InterCodec::kOneBit
                      : inter == "fp8"    ? collectives::InterCodec::kFP8
                                          : collectives::InterCodec::kTopK;
            o.residual = opt(res);
            o.server_residual = opt(sres);
            o.chunk = chunk;
            o.topk_ratio = ratio;
            blocking(t, [&] { collectives::allreduce_by(t, flat, algo, order, node_of, o); });
          },
          py::arg("x"), py::arg("algorithm"), py::arg("order") = std::vector<int>{},
          py::arg("node_of") = std::vector<int>{}, py::arg("inter") = "ring", py::arg("residual") = py::none(),
          py::arg("server_residual") = py::none(), py::arg("chunk") = 2048, py::arg("topk_ratio") = 0.01, nogil,
          "Sum of x over ranks, in place, by the named algorithm.")
      .def("counters", [](T& t) {
        py::dict d;
        d["bytes_sent"] = t.counters().bytes_sent.load();
        d["bytes_recv"] = t.counters().bytes_recv.load();
        d["comm_s"] = t.counters().comm_ns.load() * 1e-9;
        d["calls"] = t.counters().calls.load();
        return d;
      });
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

  // ---- engine ----------------------------------------------------------------
  py::enum_<Algo> algo_enum(m, "Algo", "How a sum is computed (csrc/collectives/algorithms.h)");
  for (const auto& [n, a] : kAlgoNames) algo_enum.value(n, a);
  py::enum_<Codec> codec_enum(m, "Codec", "A bucket's wire format (csrc/engine/bucket_reducer.h)");
  for (const auto& [n, c] : kCodecNames) codec_enum.value(n, c);
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, at::Device>(), py::arg("process_group"),
           py::arg("device") = at::Device(at::kCPU))
#ifdef HETCOMM_WITH_CUDA
      .def_static(
          "with_nccl", [](std::shared_ptr<NcclTransport> t) { return std::make_shared<Engine>(std::static_pointer_cast<Transport>(t)); },
          py::arg("transport"))
#endif
      .def(
          "submit_bucket",
          [](Engine& e, int64_t index, at::Tensor buffer, Codec codec, int64_t chunk, double ratio, bool exact,
             c10::optional<at::Tensor> residual, c10::optional<at::Tensor> server_residual, bool last,
             c10::optional<at::Tensor> layout, c10::optional<at::Tensor> q_state, Algo algo,
             c10::optional<at::Tensor> momentum, double beta, c10::optional<at::Tensor> carry) {
            BucketJob job;
            job.index = index;
            job.buffer = buffer;
            job.codec = codec;
            job.algo = algo;
            job.chunk = chunk;
            job.topk_ratio = ratio;
            job.topk_exact = exact;
            job.residual = opt(residual);
            job.server_residual = opt(server_residual);
            job.last = last;
            job.layout = opt(layout);
            job.q_state = opt(q_state);
            job.momentum = opt(momentum);
            job.beta = beta;
            job.carry = opt(carry);
            return wrap_future(e.submit_bucket(std::move(job)));
          },
          py::arg("index"), py::arg("buffer"), py::arg("codec"), py::arg("chunk"), py::arg("topk_ratio"),
          py::arg("topk_exact"), py::arg("residual"), py::arg("server_residual"), py::arg("last"),
          py::arg("layout") = py::none(), py::arg("q_state") = py::none(), py::arg("algorithm") = Algo::kNative,
          py::arg("momentum") = py::none(), py::arg("beta") = 0.0, py::arg("carry") = py::none())
      .def("set_topology", &Engine::set_topology, py::arg("ring_order"), py::arg("node_of"))
      .def("set_loss_scale", &Engine::set_loss_scale, py::arg("scale"))
      .def(
          "submit_batch_size", [](Engine& e, double local) { return wrap_future(e.submit_batch_size(local)); },
          py::arg("local_batch_size"))
      .def(
          "submit_config", [](Engine& e, at::Tensor config) { return wrap_future(e.submit_config(config)); },
          py::arg("config"))
      .def("drain", &Engine::drain, py::call_guard<py::gil_scoped_release>())
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def("nonfinite_steps", &Engine::nonfinite_steps)
      .def("carry_holds", &Engine::carry_holds)
      .def("stats",
           [](const Engine& e) {
             const EngineStats s = e.stats();
             py::dict d;
             d["nonfinite_steps"] = s.nonfinite_steps;
             d["nonfinite_buckets"] = s.nonfinite_buckets;
             d["total"] = totals_dict(s.total);
             d["last_step"] = totals_dict(s.last_step);
             return d;
           })
      .def("last_step_buckets", &Engine::last_step_buckets);
}
