#include "collectives/packing.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace hetcomm {
namespace collectives {

namespace {

// The few calls of zstd's stable API hetcomm uses, resolved from libzstd at run time.
struct Zstd {
  using CompressBound = size_t (*)(size_t);
  using CreateCtx = void* (*)();
  using FreeCtx = size_t (*)(void*);
  using Compress = size_t (*)(void*, void*, size_t, const void*, size_t, int);
  using Decompress = size_t (*)(void*, void*, size_t, const void*, size_t);
  using IsError = unsigned (*)(size_t);
  using ErrorName = const char* (*)(size_t);
  CompressBound compress_bound = nullptr;
  CreateCtx create_cctx = nullptr, create_dctx = nullptr;
  FreeCtx free_cctx = nullptr, free_dctx = nullptr;
  Compress compress_cctx = nullptr;
  Decompress decompress_dctx = nullptr;
  IsError is_error = nullptr;
  ErrorName error_name = nullptr;
  bool ok = false;

  Zstd() {
    void* lib = nullptr;
    for (const char* name : {"libzstd.so.1", "libzstd.so", "libzstd.dylib", "libzstd.1.dylib"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) return;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      return fn != nullptr;
    };
    ok = sym(compress_bound, "ZSTD_compressBound") && sym(create_cctx, "ZSTD_createCCtx") &&
         sym(create_dctx, "ZSTD_createDCtx") && sym(free_cctx, "ZSTD_freeCCtx") && sym(free_dctx, "ZSTD_freeDCtx") &&
         sym(compress_cctx, "ZSTD_compressCCtx") && sym(decompress_dctx, "ZSTD_decompressDCtx") &&
         sym(is_error, "ZSTD_isError") && sym(error_name, "ZSTD_getErrorName");
  }
};

const Zstd& zstd() {
  static const Zstd z;  // loaded once (the library stays loaded)
  return z;
}

// A thread's compression and decompression contexts (zstd's contexts are not shared between threads).
struct Contexts {
  void* c = nullptr;
  void* d = nullptr;
  ~Contexts() {
    if (c != nullptr) zstd().free_cctx(c);
    if (d != nullptr) zstd().free_dctx(d);
  }
};

Contexts& contexts() {
  thread_local Contexts ctx;
  const Zstd& z = zstd();
  if (ctx.c == nullptr) ctx.c = z.create_cctx();
  if (ctx.d == nullptr) ctx.d = z.create_dctx();
  return ctx;
}

// Level 1: on int3's planes level 3 saved 2-4 % more bytes in twice the time (bench/int3_zstd.py).
constexpr int kLevel = 1;

}  // namespace

bool zstd_available() {
  const char* env = std::getenv("HETCOMM_ZSTD");  // read each round: a test turns one rank's off
  return zstd().ok && !(env != nullptr && std::string(env) == "0");
}

PackedRound::PackedRound(const at::Tensor& raw, int k, int64_t ints) : k_(k), ints_(ints), wire_(raw) {
  TORCH_CHECK_VALUE(k >= 1 && ints >= 1 && raw.numel() == k * ints && raw.scalar_type() == at::kInt,
                    "hetcomm: a packed round needs k >= 1 blocks of ints >= 1 int32s, got k = ", k, ", ints = ", ints,
                    " and ", raw.numel(), " elements of ", raw.scalar_type());
  const Zstd& z = zstd();
  if (!zstd_available() || !raw.is_cpu() || !raw.is_contiguous()) return;
  Contexts& ctx = contexts();
  if (ctx.c == nullptr || ctx.d == nullptr) return;
  const size_t raw_bytes = static_cast<size_t>(ints) * 4;
  const auto* src = reinterpret_cast<const uint8_t*>(raw.data_ptr<int32_t>());
  out_.resize(k);
  for (int j = 0; j < k; ++j) {
    out_[j].resize(z.compress_bound(raw_bytes));
    const size_t got = z.compress_cctx(ctx.c, out_[j].data(), out_[j].size(), src + j * raw_bytes, raw_bytes, kLevel);
    if (z.is_error(got) || got > static_cast<size_t>(INT32_MAX)) {
      out_.clear();
      return;
    }
    out_[j].resize(got);
  }
}

void PackedRound::agree(Transport& t) {
  const int w = t.size();
  at::Tensor mine = at::full({k_}, -1, at::dtype(at::kInt));
  for (size_t j = 0; j < out_.size(); ++j) mine.data_ptr<int32_t>()[j] = static_cast<int32_t>(out_[j].size());
  at::Tensor gathered = at::empty({w * k_}, at::dtype(at::kInt).device(t.device()));
  at::Tensor sent = mine.to(t.device());
  t.all_gather(gathered, sent);
  t.synchronize();
  gathered = gathered.cpu();
  lengths_.assign(gathered.data_ptr<int32_t>(), gathered.data_ptr<int32_t>() + w * k_);
  const bool every = std::all_of(lengths_.begin(), lengths_.end(), [](int32_t l) { return l >= 0; });
  const int64_t longest = *std::max_element(lengths_.begin(), lengths_.end());
  cap_ = (longest + 3) / 4;
  packed_ = every && cap_ < ints_;
  (packed_ ? t.counters().packed_rounds : t.counters().unpacked_rounds) += 1;
  if (!packed_) return;
  wire_ = at::zeros({k_ * cap_}, at::dtype(at::kInt));
  auto* dst = reinterpret_cast<uint8_t*>(wire_.data_ptr<int32_t>());
  for (int j = 0; j < k_; ++j) std::memcpy(dst + j * cap_ * 4, out_[j].data(), out_[j].size());
}

at::Tensor PackedRound::unpack(const at::Tensor& got, int slot) const {
  if (!packed_) return got;
  const int64_t w = static_cast<int64_t>(lengths_.size()) / k_;
  TORCH_CHECK(got.is_cpu() && got.numel() == w * cap_, "hetcomm: a packed round received ", got.numel(),
              " int32s where ", w * cap_, " were due");
  TORCH_CHECK(slot >= 0 && slot < k_, "hetcomm: a packed round has blocks 0..", k_ - 1, ", not ", slot);
  at::Tensor raw = at::empty({w * ints_}, at::dtype(at::kInt));
  const Zstd& z = zstd();
  Contexts& ctx = contexts();
  const auto* src = reinterpret_cast<const uint8_t*>(got.data_ptr<int32_t>());
  auto* dst = reinterpret_cast<uint8_t*>(raw.data_ptr<int32_t>());
  const size_t raw_bytes = static_cast<size_t>(ints_) * 4;
  for (int64_t r = 0; r < w; ++r) {
    const size_t len = static_cast<size_t>(lengths_[r * k_ + slot]);
    const size_t n = z.decompress_dctx(ctx.d, dst + r * raw_bytes, raw_bytes, src + r * cap_ * 4, len);
    TORCH_CHECK(!z.is_error(n) && n == raw_bytes, "hetcomm: the packed block from rank ", r, " did not decompress to ",
                raw_bytes, " bytes: ", z.is_error(n) ? z.error_name(n) : "a different size");
  }
  return raw;
}

}  // namespace collectives
}  // namespace hetcomm
