// Binds the core for Python: build info, kernels and the engine here, the
// transports in bindings_transport.cpp (these two and engine/engine.cpp, which
// completes Python futures, are the files that see pybind11). C++ errors leave as
// Python exceptions (c10::ValueError -> ValueError, c10::TypeError -> TypeError,
// anything else -> RuntimeError, through torch's translators); input checks
// inside name the argument and the rule.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <torch/version.h>

#include <unistd.h>

#include <memory>
#include <string>
#include <utility>

#include "bindings.h"
#include "collectives/algorithms.h"
#include "collectives/compressed.h"
#include "collectives/lowrank.h"
#include "collectives/packing.h"
#include "engine/engine.h"
#include "engine/worker.h"
#include "ops/codecs.h"
#include "transport/pg_transport.h"
#ifdef HETCOMM_WITH_CUDA
#include "transport/nccl_transport.h"
#endif

namespace py = pybind11;
using namespace hetcomm;
using namespace hetcomm::bindings;

namespace {

py::object wrap_future(const FuturePtr& fut) {
  return py::cast(std::make_shared<torch::jit::PythonFutureWrapper>(fut));
}

// Every Engine Python holds is made here. Dropped in a child forked from the
// process that made it (a DataLoader worker's garbage collection freeing a
// HookState the parent had dropped), it is let go of without its destructor:
// that would wait for a comm thread the fork did not copy (and on a condition
// variable that thread waited on), and free a process group's or NCCL's
// resources that are the parent's.
template <class... Args>
std::shared_ptr<Engine> make_engine(Args&&... args) {
  return std::shared_ptr<Engine>(new Engine(std::forward<Args>(args)...), [owner = getpid()](Engine* e) {
    if (getpid() == owner) delete e;
  });
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
  d["collectives"] = t.collectives;
  d["bytes_sent_across_nodes"] = t.bytes_sent_across;
  d["bytes_recv_across_nodes"] = t.bytes_recv_across;
  d["packed_rounds"] = t.packed_rounds;
  d["unpacked_rounds"] = t.unpacked_rounds;
  d["compression_ratio"] = t.bytes_sent > 0 ? static_cast<double>(t.fp32_bytes) / t.bytes_sent : 1.0;
  return d;
}

// An engine's stats(): its totals over the run and of its last complete step.
py::dict stats_dict(const EngineStats& s) {
  py::dict d;
  d["nonfinite_steps"] = s.nonfinite_steps;
  d["nonfinite_buckets"] = s.nonfinite_buckets;
  d["total"] = totals_dict(s.total);
  d["last_step"] = totals_dict(s.last_step);
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
  d["zstd"] = collectives::zstd_available();  // libzstd found at run time (packed messages)
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
  m.def(
      "stats_before_any_step", [] { return stats_dict(EngineStats{}); },
      "Engine.stats() of an engine that has reduced nothing: every count 0 (a HookState's before its first bucket)");
  // each HookState's comm thread carries this name (/proc/PID/task/*/comm, top -H, py-spy)
  m.attr("COMM_THREAD_NAME") = Worker::kThreadName;

  // ---- kernels -------------------------------------------------------------
  m.def(
      "sign_encode",
      [](const at::Tensor& grad, c10::optional<at::Tensor> residual, double divisor, int64_t chunk) {
        return ops::sign_encode(grad, opt(residual), divisor, chunk);
      },
      py::arg("grad"), py::arg("residual") = py::none(), py::arg("divisor") = 1.0, py::arg("chunk") = 32,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "sign_decode",
      [](const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
         c10::optional<at::Tensor> out, bool accumulate) {
        return ops::sign_decode(words, scales, n, chunk, alpha, opt(out), accumulate);
      },
      py::arg("words"), py::arg("scales"), py::arg("n"), py::arg("chunk") = 32, py::arg("alpha") = 1.0,
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
      "int3_encode",
      [](const at::Tensor& grad, c10::optional<at::Tensor> residual, double divisor, int64_t chunk) {
        return ops::int3_encode(grad, opt(residual), divisor, chunk);
      },
      py::arg("grad"), py::arg("residual") = py::none(), py::arg("divisor") = 1.0, py::arg("chunk") = 32,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "int3_decode",
      [](const at::Tensor& words, const at::Tensor& scales, int64_t n, int64_t chunk, double alpha,
         c10::optional<at::Tensor> out, bool accumulate) {
        return ops::int3_decode(words, scales, n, chunk, alpha, opt(out), accumulate);
      },
      py::arg("words"), py::arg("scales"), py::arg("n"), py::arg("chunk") = 32, py::arg("alpha") = 1.0,
      py::arg("out") = py::none(), py::arg("accumulate") = false, py::call_guard<py::gil_scoped_release>());
  m.def(
      "topk_encode",
      [](const at::Tensor& grad, c10::optional<at::Tensor> residual, double divisor, int64_t k, bool exact,
         c10::optional<at::Tensor> denominator) {
        return ops::topk_encode(grad, opt(residual), divisor, k, exact, opt(denominator));
      },
      py::arg("grad"), py::arg("residual") = py::none(), py::arg("divisor") = 1.0, py::arg("k") = 1,
      py::arg("exact") = true, py::arg("denominator") = py::none(), py::call_guard<py::gil_scoped_release>());
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
      "lowrank_project",
      [](const at::Tensor& x, c10::optional<at::Tensor> residual, double divisor, const at::Tensor& qt) {
        return ops::lowrank_project(x, opt(residual), divisor, qt, at::Tensor());
      },
      py::arg("x"), py::arg("residual") = py::none(), py::arg("divisor") = 1.0, py::arg("qt"),
      py::call_guard<py::gil_scoped_release>(),
      "lowrank's P = (x / divisor + residual) @ qt.T (x rows x cols, qt r x cols), M never stored.");
  m.def(
      "lowrank_back_project",
      [](const at::Tensor& x, c10::optional<at::Tensor> residual, double divisor, const at::Tensor& p) {
        return ops::lowrank_back_project(x, opt(residual), divisor, p, at::Tensor());
      },
      py::arg("x"), py::arg("residual") = py::none(), py::arg("divisor") = 1.0, py::arg("p"),
      py::call_guard<py::gil_scoped_release>(),
      "lowrank's Q^T = p.T @ (x / divisor + residual) (x rows x cols, p rows x r), M never stored.");
  m.def(
      "lowrank_finish",
      [](const at::Tensor& p, const at::Tensor& qt, at::Tensor x, c10::optional<at::Tensor> residual, double divisor,
         double share) { ops::lowrank_finish(p, qt, x, opt(residual), divisor, share); },
      py::arg("p"), py::arg("qt"), py::arg("x"), py::arg("residual") = py::none(), py::arg("divisor") = 1.0,
      py::arg("share") = 1.0, py::call_guard<py::gil_scoped_release>(),
      "In place, one pass: x (rows x cols) becomes lowrank_outer(p, qt); with residual, residual becomes "
      "x / divisor + residual - share * lowrank_outer(p, qt), from the old x.");
  m.def(
      "take_q", [](at::Tensor q, const at::Tensor& qt) { ops::take_q(q, qt); return q; }, py::arg("q"),
      py::arg("qt"), py::call_guard<py::gil_scoped_release>(),
      "In place: q (cols x rank) takes qt's rows (rank x cols) as its columns, except where a row of qt is all "
      "zero: that column of q stays. Returns q.");
  m.def(
      "momentum_fold_in", [](at::Tensor x, const at::Tensor& m, double alpha) { ops::momentum_fold_in(x, m, alpha); },
      py::arg("x"), py::arg("m"), py::arg("alpha"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "momentum_handoff", [](at::Tensor x, at::Tensor m, double beta) { ops::momentum_handoff(x, m, beta); },
      py::arg("x"), py::arg("m"), py::arg("beta"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "orthonormalize_columns", [](at::Tensor p, double eps) { ops::orthonormalize_columns(p, eps); return p; },
      py::arg("p"), py::arg("eps") = 1e-8, py::call_guard<py::gil_scoped_release>());
  m.def(
      "orthonormalize_blocks",
      [](at::Tensor flat, const std::vector<std::tuple<int64_t, int64_t, int64_t>>& blocks, double eps) {
        std::vector<kernels::ColumnBlock> b;
        for (const auto& [offset, rows, cols] : blocks) b.push_back({offset, rows, cols});
        ops::orthonormalize_blocks(flat, b, eps);
        return flat;
      },
      py::arg("flat"), py::arg("blocks"), py::arg("eps") = 1e-8, py::call_guard<py::gil_scoped_release>());
  m.def("hierarchical_shard_numel", &collectives::hierarchical_shard_numel, py::arg("n"), py::arg("node_of"),
        py::arg("rank"));
  m.def("lowrank_q_numel", &collectives::lowrank_q_numel, py::arg("layout"));
  m.def("onebit_segment_numel", &collectives::onebit_segment_numel, py::arg("n"), py::arg("world"), py::arg("rank"));
  m.def("server_residual_numel", &collectives::server_residual_numel, py::arg("n"), py::arg("world"),
        py::arg("rank"));
  m.def("state_offsets", &collectives::state_offsets, py::arg("n"), py::arg("world"), py::arg("rank"),
        py::arg("node_of"), py::arg("hierarchical"),
        "(worker residual offset, server residual offset) of a bucket's error-feedback state, in the bucket");

  bind_transports(m);


  // ---- engine ----------------------------------------------------------------
  py::enum_<Algo> algo_enum(m, "Algo", "How a sum is computed (csrc/collectives/algorithms.h)");
  for (const auto& [n, a] : kAlgoNames) algo_enum.value(n, a);
  py::enum_<Codec> codec_enum(m, "Codec", "A bucket's wire format (csrc/collectives/algorithms.h)");
  for (const auto& [n, c] : kCodecNames) codec_enum.value(n, c);
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device) {
             return make_engine(std::move(pg), device);
           }),
           py::arg("process_group"), py::arg("device") = at::Device(at::kCPU))
#ifdef HETCOMM_WITH_CUDA
      .def_static(
          "with_nccl", [](std::shared_ptr<NcclTransport> t) { return make_engine(std::static_pointer_cast<Transport>(t)); },
          py::arg("transport"))
#endif
      .def(
          "submit_bucket",
          [](Engine& e, int64_t index, at::Tensor buffer, Codec codec, int64_t chunk, double ratio, bool exact,
             c10::optional<at::Tensor> residual, c10::optional<at::Tensor> server_residual, bool last,
             c10::optional<at::Tensor> layout, c10::optional<at::Tensor> q_state, Algo algo,
             c10::optional<at::Tensor> momentum, double beta, c10::optional<at::Tensor> carry,
             c10::optional<at::Tensor> update_denominator, bool pipeline, const std::string& lowrank_wire, bool hold,
             c10::optional<at::Tensor> sum_first, bool pack) {
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
            job.lowrank_wire = lowrank_wire_named(lowrank_wire);
            job.momentum = opt(momentum);
            job.beta = beta;
            job.carry = opt(carry);
            job.update_denominator = opt(update_denominator);
            job.pipeline = pipeline;
            job.hold = hold;
            job.sum_first = opt(sum_first);
            job.pack = pack;
            return wrap_future(e.submit_bucket(std::move(job)));
          },
          py::arg("index"), py::arg("buffer"), py::arg("codec"), py::arg("chunk"), py::arg("topk_ratio"),
          py::arg("topk_exact"), py::arg("residual"), py::arg("server_residual"), py::arg("last"),
          py::arg("layout") = py::none(), py::arg("q_state") = py::none(), py::arg("algorithm") = Algo::kNative,
          py::arg("momentum") = py::none(), py::arg("beta") = 0.0, py::arg("carry") = py::none(),
          py::arg("update_denominator") = py::none(), py::arg("pipeline") = false, py::arg("lowrank_wire") = "fp32",
          py::arg("hold") = false, py::arg("sum_first") = py::none(), py::arg("pack") = false)
      .def("set_topology", &Engine::set_topology, py::arg("ring_order"), py::arg("node_of"))
      .def("set_nodes", &Engine::set_nodes, py::arg("node_of"))
      .def("set_loss_scale", &Engine::set_loss_scale, py::arg("scale"))
      .def(
          "submit_batch_size", [](Engine& e, double local) { return wrap_future(e.submit_batch_size(local)); },
          py::arg("local_batch_size"))
      .def(
          "submit_config", [](Engine& e, at::Tensor config) { return wrap_future(e.submit_config(config)); },
          py::arg("config"))
      .def(
          "submit_sum", [](Engine& e, at::Tensor x) { return wrap_future(e.submit_sum(x)); }, py::arg("x"))
      .def("finish_sum", [](Engine& e) { return wrap_future(e.finish_sum()); })
      .def("drain", &Engine::drain, py::call_guard<py::gil_scoped_release>())
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def("nonfinite_steps", &Engine::nonfinite_steps)
      .def("carry_holds", &Engine::carry_holds)
      .def("stats", [](const Engine& e) { return stats_dict(e.stats()); })
      .def("last_step_buckets", &Engine::last_step_buckets);
}
