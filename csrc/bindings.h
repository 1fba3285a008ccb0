// What the two binding files share: bindings.cpp (the module: build info,
// kernels, engine) and bindings_transport.cpp (the transports' blocking calls).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <utility>
#include <vector>

#include "collectives/algorithms.h"

namespace hetcomm {
namespace bindings {

using collectives::Algo;
using collectives::Codec;

inline at::Tensor opt(const c10::optional<at::Tensor>& t) { return t.value_or(at::Tensor()); }

// The names Python uses for the enums (py::enum_ exports them as _C.Algo / _C.Codec).
inline const std::vector<std::pair<const char*, Algo>> kAlgoNames = {{"native", Algo::kNative},
                                                                {"ring", Algo::kRing},
                                                                {"halving_doubling", Algo::kHalvingDoubling},
                                                                {"tree", Algo::kTree},
                                                                {"hierarchical", Algo::kHierarchical}};
inline const std::vector<std::pair<const char*, Codec>> kCodecNames = {{"none", Codec::kNone},   {"fp16", Codec::kFP16},
                                                                  {"bf16", Codec::kBF16},   {"onebit", Codec::kOneBit},
                                                                  {"topk", Codec::kTopK},   {"lowrank", Codec::kLowRank},
                                                                  {"fp8", Codec::kFP8},     {"int3", Codec::kInt3}};

// The value of `table` Python names `name` (an error listing the names otherwise).
template <typename E>
E named(const std::vector<std::pair<const char*, E>>& table, const std::string& name, const char* what) {
  std::string all;
  for (const auto& [n, value] : table) {
    if (name == n) return value;
    all += (all.empty() ? "" : ", ") + std::string(n);
  }
  TORCH_CHECK_VALUE(false, "hetcomm: ", what, " must be one of ", all, ", got '", name, "'");
}
inline Algo algo_named(const std::string& name) { return named(kAlgoNames, name, "algorithm"); }
inline Codec codec_named(const std::string& name) { return named(kCodecNames, name, "codec"); }
// lowrank's wire dtype by its HookState name (lowrank_wire).
inline const std::vector<std::pair<const char*, at::ScalarType>> kLowrankWires = {
    {"fp32", at::kFloat}, {"bf16", at::kBFloat16}, {"fp8", at::kFloat8_e4m3fn}};
inline at::ScalarType lowrank_wire_named(const std::string& name) { return named(kLowrankWires, name, "lowrank_wire"); }

// Transport, ProcessGroupTransport and (CUDA builds) NcclTransport.
void bind_transports(pybind11::module_& m);

}  // namespace bindings
}  // namespace hetcomm
