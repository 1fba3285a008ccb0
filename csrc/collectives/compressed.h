// Bucket all-reduce with a wire format, written once against a Transport.
// Every function leaves the same bytes on every rank: the dense paths use the
// transport's sum; the compressed paths have every rank decode identical
// gathered messages in rank order.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <functional>

#include "transport/transport.h"

namespace hetcomm {
namespace collectives {

// Time spent in encode/decode kernels, added to by every call below.
struct CodecTimer {
  std::atomic<int64_t> ns{0};
};

// Adds the time of its scope to a CodecTimer.
class Timed {
 public:
  explicit Timed(CodecTimer& t) : timer_(t), start_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    timer_.ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  CodecTimer& timer_;
  std::chrono::steady_clock::time_point start_;
};

// How the (weighted, wire-format) tensor is summed over ranks.
using SumFn = std::function<void(Transport&, at::Tensor&)>;

// x = sum_i x_i / divisor_i in the wire dtype (float32, float16 or bfloat16),
// summed by `sum` (default: the transport's own all-reduce).
void allreduce_dense(Transport& t, at::Tensor& x, double divisor, at::ScalarType wire, CodecTimer& timer,
                     const SumFn& sum = nullptr);

// Momentum compression (HookState.attach_optimizer) inside the two phases,
// piece by piece: before a piece of x is encoded, x += add_alpha * m on it
// (what this rank sends: its weighted local momentum); once it is decoded, the
// hand-over (ops::momentum_handoff with beta) on it. The same bits as doing
// both over the whole bucket around the exchange, but hidden behind the wire
// of the other pieces. m: float32, x's numel, beside it.
struct MomentumFold {
  at::Tensor m;
  double add_alpha = 0.0;
  double beta = 0.0;
};

// The ranks' finiteness, carried in the compressed messages instead of an
// all-reduce of a flag before them (without it digits' fp8 step on the 2 x 2
// testbed went from 16.9 to 14.4 ms flat). Piece 0 of every message ends in a
// flag; a rank whose input is not finite encodes nothing (its residual stays
// as it was) and sends zeros flagged. Where any message is flagged every rank
// learns it, the same everywhere, and nothing is decoded into x; the worker
// residual of the others, and an owner's server residual, were written by
// then: the caller puts them back (BucketReducer keeps a copy).
struct Finite {
  bool here = true;        // in: this rank's input is finite
  bool everywhere = true;  // out: every rank's was (false: x as it came, save the momentum fold)
};

// Every rank passes a Finite to a reduction or none does: where this one's
// caller passed none, no rank may have flagged its input.
inline void check_none_flagged(const Finite* given, bool everywhere) {
  TORCH_CHECK(given != nullptr || everywhere,
              "hetcomm: a rank flagged its input as not finite where this one's caller did not pass Finite");
}

// Two-phase 1-bit all-reduce (x float32, contiguous). worker_residual: numel
// x.numel(); server_residual: numel server_residual_numel(...) for this rank.
// Either may be undefined (no error feedback). pieces: how many pieces the
// exchange is pipelined in (0: one per 2^17 elements of a message, a segment
// or on two ranks the whole x, up to 4, where the transport overlaps(), else 1); any number gives the same bytes
// and the same result. fold: momentum compression folded in (or none).
// On one or two ranks the phases are one exchange: every rank's whole
// message all-gathered (on two ranks the phases' bytes, in one round), each
// rank's sum decoded in rank order, nothing encoded twice and no server
// residual.
void allreduce_onebit(Transport& t, at::Tensor& x, double divisor, int64_t chunk, const at::Tensor& worker_residual,
                      const at::Tensor& server_residual, CodecTimer& timer, int64_t pieces = 0,
                      const MomentumFold* fold = nullptr, Finite* finite = nullptr, bool pack = false);
// The same two phases with fp8 e4m3 codes and a power-of-two scale per chunk
// (kernels/fp8.h): 8 bits per element, residuals laid out as for onebit.
void allreduce_fp8(Transport& t, at::Tensor& x, double divisor, int64_t chunk, const at::Tensor& worker_residual,
                   const at::Tensor& server_residual, CodecTimer& timer, int64_t pieces = 0,
                   const MomentumFold* fold = nullptr, Finite* finite = nullptr, bool pack = false);
// The same two phases with 3-bit linear codes and a bf16 scale per chunk
// (kernels/int3.h): 3 bits per element, residuals laid out as for onebit.
void allreduce_int3(Transport& t, at::Tensor& x, double divisor, int64_t chunk, const at::Tensor& worker_residual,
                    const at::Tensor& server_residual, CodecTimer& timer, int64_t pieces = 0,
                    const MomentumFold* fold = nullptr, Finite* finite = nullptr, bool pack = false);
// Elements of the segment this rank averages in the two phases.
int64_t onebit_segment_numel(int64_t n, int world, int rank);
// Its server residual's size: the segment's, or 0 on one or two ranks (one exchange).
int64_t server_residual_numel(int64_t n, int world, int rank);
// Where that segment starts in x.
int64_t onebit_segment_offset(int64_t n, int world, int rank);

// Top-k all-gather all-reduce (x float32, contiguous). residual may be undefined; denominator
// (undefined, or one float32 per element of x) ranks the entries by |x| / denominator (ops::topk_encode).
// Each rank sends 4 + 4 * ceil(n / 2^16) + 4 * ceil(k / 2) + 2 * k bytes: its k entries as a 16-bit index
// inside a block of 2^16 elements (with a count per block) and a bf16 value; the residual keeps the values'
// rounding. With ratio 1 (k == n) the values go as float32 (6 bytes an entry): top-k is then lossless.
// A rank whose input is not finite sends the count -1 (finite: as for the two phases).
void allreduce_topk(Transport& t, at::Tensor& x, double divisor, double ratio, bool exact, const at::Tensor& residual,
                    CodecTimer& timer, const at::Tensor& denominator = at::Tensor(), Finite* finite = nullptr);

}  // namespace collectives
}  // namespace hetcomm
