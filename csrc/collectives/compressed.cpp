#include "collectives/compressed.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>
#include <vector>

#include "collectives/packing.h"
#include "kernels/int3.h"
#include "kernels/sign.h"
#include "ops/codecs.h"

namespace hetcomm {
namespace collectives {

namespace {

// Segment r of the bucket is [r * seg, min(n, (r + 1) * seg)); seg is a
// multiple of 32 so each segment's sign words start on a word boundary.
int64_t segment_stride(int64_t n, int world) {
  const int64_t per = (n + world - 1) / world;
  return std::max<int64_t>(32, (per + 31) / 32 * 32);
}

// One or two ranks exchange whole messages once instead of the two phases
// (two ranks: the phases' bytes in one round, nothing encoded twice).
bool one_exchange(int world) { return world <= 2; }

int64_t segment_len(int64_t n, int64_t seg, int r) {
  const int64_t begin = std::min<int64_t>(n, r * seg);
  return std::min<int64_t>(n, begin + seg) - begin;
}

// A chunked codec with error feedback, as the two-phase all-reduce uses it:
// a segment of len elements travels as [payload (payload_ints(len) int32) |
// scales (ceil(len/chunk) of scale_type: bf16 for onebit and int3, float32 for fp8) |
// flag (int32: 1 where the input was not finite on the sender, see Finite)].
struct SegmentCodec {
  std::function<int64_t(int64_t)> payload_ints;
  at::ScalarType scale_type;
  int64_t scales_per_int() const { return 4 / static_cast<int64_t>(c10::elementSize(scale_type)); }
  // payload, scales <- x / divisor + residual; the residual keeps what they miss.
  std::function<void(const at::Tensor& x, const at::Tensor& residual, double divisor, int64_t chunk,
                     at::Tensor payload, at::Tensor scales)>
      encode;
  // out (+)= decoded.
  std::function<void(const at::Tensor& payload, const at::Tensor& scales, int64_t len, int64_t chunk, at::Tensor out,
                     bool accumulate)>
      decode;
};

// The bit-packed codecs (sign, int3; kernels/sign.h, kernels/int3.h): their
// words are the payload, a bf16 scale per chunk.
template <int64_t (*NumWords)(int64_t),
          void (*EncodeInto)(const at::Tensor&, const at::Tensor&, double, int64_t, at::Tensor&, at::Tensor&),
          at::Tensor (*Decode)(const at::Tensor&, const at::Tensor&, int64_t, int64_t, double, at::Tensor, bool)>
const SegmentCodec& packed_codec() {
  static const SegmentCodec c{
      NumWords, at::kBFloat16,
      [](const at::Tensor& x, const at::Tensor& res, double d, int64_t chunk, at::Tensor words, at::Tensor scales) {
        EncodeInto(x, res, d, chunk, words, scales);
      },
      [](const at::Tensor& words, const at::Tensor& scales, int64_t len, int64_t chunk, at::Tensor out, bool acc) {
        Decode(words, scales, len, chunk, 1.0, out, acc);
      }};
  return c;
}

const SegmentCodec& sign_codec() {
  return packed_codec<kernels::sign_num_words, ops::sign_encode_into, ops::sign_decode>();
}

const SegmentCodec& int3_codec() {
  return packed_codec<kernels::int3_num_words, ops::int3_encode_into, ops::int3_decode>();
}

// fp8 codes travel four to an int32 (segments are multiples of 32 elements).
const SegmentCodec& fp8_codec() {
  static const SegmentCodec c{
      [](int64_t len) { return (len + 3) / 4; },
      at::kFloat,
      [](const at::Tensor& x, const at::Tensor& res, double d, int64_t chunk, at::Tensor payload, at::Tensor scales) {
        at::Tensor codes = payload.view(at::kByte).narrow(0, 0, x.numel());
        ops::fp8_encode_into(x, res, d, chunk, codes, scales);
      },
      [](const at::Tensor& payload, const at::Tensor& scales, int64_t len, int64_t chunk, at::Tensor out, bool acc) {
        ops::fp8_decode(payload.view(at::kByte).narrow(0, 0, len), scales, len, chunk, 1.0, out, acc);
      }};
  return c;
}

// One segment's message in a fixed-size block (the longest segment's), so
// all-to-all and all-gather work. Piece 0's blocks end in the flag (the same
// for every piece: the pieces send the bytes one piece sends).
struct Block {
  const SegmentCodec& codec;
  int64_t payload_cap, scales_cap;  // in int32s
  bool flagged;                     // ends in the flag
  Block(const SegmentCodec& c, int64_t cap, int64_t chunk, bool with_flag)
      : codec(c),
        payload_cap(c.payload_ints(cap)),
        scales_cap(scale_ints(c, kernels::sign_num_chunks(cap, chunk))),
        flagged(with_flag) {}
  static int64_t scale_ints(const SegmentCodec& c, int64_t nchunks) {
    return (nchunks + c.scales_per_int() - 1) / c.scales_per_int();
  }
  int64_t ints() const { return payload_cap + scales_cap + (flagged ? 1 : 0); }
  at::Tensor payload(at::Tensor& block, int64_t len) const { return block.narrow(0, 0, codec.payload_ints(len)); }
  at::Tensor scales(at::Tensor& block, int64_t len, int64_t chunk) const {
    const int64_t nchunks = kernels::sign_num_chunks(len, chunk);
    return block.narrow(0, payload_cap, scale_ints(codec, nchunks)).view(codec.scale_type).narrow(0, 0, nchunks);
  }
  // The flags of w such blocks side by side (a view: [w, 1]; piece 0's blocks only).
  at::Tensor flags(const at::Tensor& blocks, int w) const {
    TORCH_CHECK(flagged, "hetcomm: only piece 0's blocks carry the finiteness flag");
    return blocks.view({w, ints()}).narrow(1, ints() - 1, 1);
  }
};

// Whether any of the w blocks in `blocks` is flagged (read on the host).
bool any_flagged(Transport& t, const Block& blk, const at::Tensor& blocks, int w) {
  t.synchronize();  // a stream transport wrote them
  return blk.flags(blocks, w).max().item<int32_t>() != 0;
}

// What a round sends: raw's k blocks of `ints`, or with pack those blocks
// compressed (the codec's time) where every rank can (round: agreed on, the
// lengths' all-gather; see collectives/packing.h).
at::Tensor pack_round(Transport& t, std::optional<PackedRound>& round, const at::Tensor& raw, int k, int64_t ints,
                      bool pack, CodecTimer& timer) {
  if (!pack) return raw;
  {
    Timed _(timer);
    round.emplace(raw, k, ints);
  }
  round->agree(t);
  return round->wire();
}

// The raw blocks of what a round received (block i from rank i, its block `slot`).
at::Tensor unpack_round(const std::optional<PackedRound>& round, const at::Tensor& got, int slot, CodecTimer& timer) {
  if (!round) return got;
  Timed _(timer);
  return round->unpack(got, slot);
}

at::Tensor narrow_or_empty(const at::Tensor& t, int64_t begin, int64_t len) {
  return t.defined() ? t.narrow(0, begin, len) : at::Tensor();
}

}  // namespace

void allreduce_dense(Transport& t, at::Tensor& x, double divisor, at::ScalarType wire, CodecTimer& timer,
                     const SumFn& sum_fn) {
  auto sum = [&](at::Tensor& y) {
    if (sum_fn)
      sum_fn(t, y);
    else
      t.all_reduce_sum(y);
  };
  if (wire == at::kFloat || wire == x.scalar_type()) {
    // Same op as PyTorch's allreduce_hook (div_ then sum): equal batches match it bit for bit.
    if (divisor != 1.0) x.div_(divisor);
    sum(x);
    return;
  }
  TORCH_CHECK_VALUE(wire == at::kHalf || wire == at::kBFloat16, "hetcomm: wire dtype must be float32, float16 or bfloat16");
  at::Tensor h = at::empty({x.numel()}, x.options().dtype(wire));  // on x's device
  {
    Timed _(timer);
    ops::cast_encode_into(x, divisor, h);
  }
  sum(h);
  Timed _(timer);
  if (x.scalar_type() == at::kFloat) {
    ops::cast_decode(h, 1.0, x);
  } else {
    x.copy_(h);
  }
}

int64_t onebit_segment_numel(int64_t n, int world, int rank) {
  TORCH_CHECK_VALUE(n >= 0, "hetcomm: n must be >= 0, got ", n);
  TORCH_CHECK_VALUE(world >= 1, "hetcomm: world must be >= 1, got ", world);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world, "hetcomm: rank must be in [0, world = ", world, "), got ", rank);
  return segment_len(n, segment_stride(n, world), rank);
}

int64_t onebit_segment_offset(int64_t n, int world, int rank) {
  onebit_segment_numel(n, world, rank);  // checks the arguments
  return std::min<int64_t>(n, rank * segment_stride(n, world));
}

int64_t server_residual_numel(int64_t n, int world, int rank) {
  const int64_t len = onebit_segment_numel(n, world, rank);  // checks the arguments
  return one_exchange(world) ? 0 : len;
}

namespace {

// Pieces of a large bucket: enough that encoding one piece overlaps the
// previous piece's exchange, few enough that each message stays large. On
// the testbed at 100 Mbit (2 ranks, onebit / fp8 time against one piece):
// 5M elements in 4 pieces 0.63 / 0.66, 1M in 3 0.88 / 0.73; 600K in 4
// (75K-element pieces, 10 KB onebit messages) 1.47 / 0.66, 300K in 4 3.6 / 0.81.
constexpr int64_t kPieceNumel = 1 << 17;  // least elements of a segment per piece
constexpr int64_t kMaxPieces = 4;

// Elements of a segment in each piece (the last may be shorter): a multiple of
// `unit` (the chunk times the scales an int32 holds), so a piece's chunks,
// scales and sign words are the segment's own and its scales fill whole int32s
// (the pieces send the bytes one piece sends).
int64_t piece_stride(int64_t seg, int64_t unit, int64_t pieces, bool overlaps) {
  TORCH_CHECK_VALUE(pieces >= 0, "hetcomm: pieces must be >= 0 (0: chosen by the bucket's size), got ", pieces);
  if (pieces == 0) pieces = overlaps ? std::clamp<int64_t>(seg / kPieceNumel, 1, kMaxPieces) : 1;
  const int64_t per = (seg + pieces - 1) / pieces;
  return std::max<int64_t>(unit, (per + unit - 1) / unit * unit);
}

// One exchange, for one or two ranks: every rank encodes its whole x (worker
// residual) and one all-gather hands each rank every rank's message; all
// decode them in rank order, so all hold the same bits. On two ranks the two
// phases send these bytes too (half of the message in each), in two rounds
// and with the owner's sum encoded a second time; here in one round and once.
// Pieces as in the two phases: piece p is elements [p * ps, (p + 1) * ps) of
// x, on the wire while piece p + 1 is encoded.
void allreduce_exchange(Transport& t, at::Tensor& x, double divisor, int64_t chunk, const at::Tensor& worker_residual,
                        CodecTimer& timer, const SegmentCodec& codec, int64_t pieces, const MomentumFold* fold,
                        Finite& finite, bool pack) {
  const int w = t.size();
  const int64_t n = x.numel();
  if (n == 0) return;  // every rank's bucket has x's size
  const at::Tensor m = fold != nullptr ? fold->m.view({-1}) : at::Tensor();  // checked by the caller
  const int64_t ps = piece_stride(n, chunk * codec.scales_per_int(), pieces, t.overlaps());
  const int np = static_cast<int>(std::max<int64_t>(1, (n + ps - 1) / ps));
  auto piece_len = [&](int p) { return std::clamp<int64_t>(n - p * ps, 0, ps); };
  const auto ints = x.options().dtype(at::kInt);
  std::vector<at::Tensor> all(np), keep(np);
  std::vector<Pending> gathered(np);
  std::vector<std::optional<PackedRound>> rounds(np);
  for (int p = 0; p < np; ++p) {
    const int64_t len = piece_len(p);
    const Block blk(codec, len, chunk, p == 0);
    at::Tensor mine = at::zeros({blk.ints()}, ints);
    if (!finite.here) {
      if (p == 0) blk.flags(mine, 1).fill_(1);
    } else if (len > 0) {
      Timed _(timer);
      at::Tensor part = x.narrow(0, p * ps, len);
      if (fold != nullptr) ops::momentum_fold_in(part, m.narrow(0, p * ps, len), fold->add_alpha);
      codec.encode(part, narrow_or_empty(worker_residual, p * ps, len), divisor, chunk, blk.payload(mine, len),
                   blk.scales(mine, len, chunk));
    }
    keep[p] = pack_round(t, rounds[p], mine, 1, blk.ints(), pack, timer);
    all[p] = at::empty({w * keep[p].numel()}, ints);
    gathered[p] = t.start_all_gather(all[p], keep[p]);
  }
  for (int p = 0; p < np; ++p) {
    const int64_t len = piece_len(p);
    const Block blk(codec, len, chunk, p == 0);
    gathered[p].wait();
    all[p] = unpack_round(rounds[p], all[p], 0, timer);
    if (p == 0) finite.everywhere = !any_flagged(t, blk, all[0], w);
    if (len == 0 || !finite.everywhere) continue;
    Timed _(timer);
    at::Tensor part = x.narrow(0, p * ps, len);
    for (int r = 0; r < w; ++r) {
      at::Tensor block = all[p].narrow(0, r * blk.ints(), blk.ints());
      codec.decode(blk.payload(block, len), blk.scales(block, len, chunk), len, chunk, part, r > 0);
    }
    if (fold != nullptr) {
      at::Tensor m_part = m.narrow(0, p * ps, len);
      ops::momentum_handoff(part, m_part, fold->beta);
    }
  }
}

// Two phases: every rank encodes segment r (worker residual) and sends it to
// rank r; rank r decodes and sums its segment in rank order, encodes the sum
// (server residual) and all-gather hands every rank the same messages. A
// large bucket goes in pieces (piece p: elements [p * ps, (p + 1) * ps) of
// every segment), each started as soon as it is encoded, so the codec works
// while the previous piece is on the wire; the pieces' chunks are the
// segments' own, so the result is bit for bit the one of a single piece.
void two_phases(Transport& t, at::Tensor& x, double divisor, int64_t chunk, const at::Tensor& worker_residual,
                const at::Tensor& server_residual, CodecTimer& timer, const SegmentCodec& codec, int64_t pieces,
                const MomentumFold* fold, Finite& finite, bool pack) {
  const int w = t.size();
  const int me = t.rank();
  const int64_t n = x.numel();
  const int64_t seg = segment_stride(n, w);
  const at::Tensor m = fold != nullptr ? fold->m.view({-1}) : at::Tensor();
  const int64_t ps = piece_stride(seg, chunk * codec.scales_per_int(), pieces, t.overlaps());
  const int np = static_cast<int>((seg + ps - 1) / ps);
  // Piece p of segment r, and the block that carries piece p of any segment
  // (sized by the longest: segment 0's, so the pieces' blocks add up to one
  // segment's block).
  auto piece_len = [&](int r, int p) { return std::clamp<int64_t>(segment_len(n, seg, r) - p * ps, 0, ps); };
  auto block_of = [&](int p) {
    const int64_t cap = std::min(ps, seg - p * ps);
    return Block(codec, cap, chunk, p == 0);
  };

  const auto ints = x.options().dtype(at::kInt);  // on the bucket's device
  std::vector<at::Tensor> recv(np), all(np), keep(2 * np);  // keep: what a started collective reads
  std::vector<Pending> scattered(np), gathered(np);
  std::vector<std::optional<PackedRound>> scatter_rounds(np), gather_rounds(np);  // where packed
  auto scatter = [&](int p) {  // phase 1 of piece p: each segment's piece to the segment's owner
    const Block blk = block_of(p);
    at::Tensor send = at::zeros({w * blk.ints()}, ints);
    if (!finite.here) {
      if (p == 0) blk.flags(send, w).fill_(1);
    } else {
      Timed _(timer);
      for (int r = 0; r < w; ++r) {
        const int64_t len = piece_len(r, p);
        if (len == 0) continue;
        at::Tensor block = send.narrow(0, r * blk.ints(), blk.ints());
        const int64_t at = r * seg + p * ps;
        at::Tensor part = x.narrow(0, at, len);
        if (fold != nullptr) ops::momentum_fold_in(part, m.narrow(0, at, len), fold->add_alpha);
        codec.encode(part, narrow_or_empty(worker_residual, at, len), divisor, chunk, blk.payload(block, len),
                     blk.scales(block, len, chunk));
      }
    }
    send = pack_round(t, scatter_rounds[p], send, w, blk.ints(), pack, timer);
    recv[p] = at::empty_like(send);
    keep[2 * p] = send;
    scattered[p] = t.start_all_to_all(recv[p], send);
  };
  auto reduce = [&](int p) {  // phase 2: the owner sums its piece, encodes it and all-gathers it
    const Block blk = block_of(p);
    scattered[p].wait();
    recv[p] = unpack_round(scatter_rounds[p], recv[p], me, timer);
    at::Tensor mine = at::zeros({blk.ints()}, ints);
    const int64_t len = piece_len(me, p);
    if (len > 0) {
      Timed _(timer);
      at::Tensor acc = at::zeros({len}, x.options());
      for (int r = 0; r < w; ++r) {
        at::Tensor block = recv[p].narrow(0, r * blk.ints(), blk.ints());
        codec.decode(blk.payload(block, len), blk.scales(block, len, chunk), len, chunk, acc, true);
      }
      codec.encode(acc, narrow_or_empty(server_residual, p * ps, len), 1.0, chunk, blk.payload(mine, len),
                   blk.scales(mine, len, chunk));
    }
    // A flagged sender sent zeros: the sum is finite, and wrong; the flag goes on to every rank (on the device:
    // the host learns it once, before decoding).
    if (p == 0) blk.flags(mine, 1).copy_(at::amax(blk.flags(recv[p], w), {0}));
    mine = pack_round(t, gather_rounds[p], mine, 1, blk.ints(), pack, timer);
    all[p] = at::empty({w * mine.numel()}, ints);
    keep[2 * p + 1] = mine;
    gathered[p] = t.start_all_gather(all[p], mine);
  };
  auto decode = [&](int p) {  // every rank decodes the same messages
    const Block blk = block_of(p);
    gathered[p].wait();
    all[p] = unpack_round(gather_rounds[p], all[p], 0, timer);
    if (p == 0) finite.everywhere = !any_flagged(t, blk, all[0], w);
    if (!finite.everywhere) return;
    Timed _(timer);
    for (int r = 0; r < w; ++r) {
      const int64_t len = piece_len(r, p);
      if (len == 0) continue;
      at::Tensor block = all[p].narrow(0, r * blk.ints(), blk.ints());
      at::Tensor part = x.narrow(0, r * seg + p * ps, len);
      codec.decode(blk.payload(block, len), blk.scales(block, len, chunk), len, chunk, part, false);
      if (fold != nullptr) {
        at::Tensor m_part = m.narrow(0, r * seg + p * ps, len);
        ops::momentum_handoff(part, m_part, fold->beta);
      }
    }
  };
  // Every rank starts the collectives in one order: scatter 0, scatter 1, gather 0, scatter 2, gather 1, ...
  for (int p = 0; p < np; ++p) {
    scatter(p);
    if (p > 0) reduce(p - 1);
  }
  reduce(np - 1);
  for (int p = 0; p < np; ++p) decode(p);  // x is written only after every piece was encoded
}

// Checks the arguments, then one exchange on one or two ranks, else the two phases.
void allreduce_two_phase(Transport& t, at::Tensor& x, double divisor, int64_t chunk, const at::Tensor& worker_residual,
                         const at::Tensor& server_residual, CodecTimer& timer, const SegmentCodec& codec,
                         int64_t pieces, const MomentumFold* fold, Finite* finite_out, bool pack) {
  Finite here_only;
  Finite& finite = finite_out != nullptr ? *finite_out : here_only;
  const int w = t.size();
  const int me = t.rank();
  const int64_t n = x.numel();
  ops::check_chunk(chunk);
  ops::check_divisor(divisor);
  TORCH_CHECK_VALUE(!worker_residual.defined() || worker_residual.numel() == n,
                    "hetcomm: worker residual must have the bucket's ", n, " elements, got ", worker_residual.numel());
  const int64_t server_len = server_residual_numel(n, w, me);
  TORCH_CHECK_VALUE(!server_residual.defined() || server_residual.numel() == server_len,
                    "hetcomm: server residual must have ", server_len, " elements (server_residual_numel; none on ",
                    "two ranks, which exchange whole messages and re-encode no sum), got ", server_residual.numel());
  // Checked before anything is sent: an error half-way would leave the other ranks waiting.
  if (fold != nullptr) ops::check_momentum(x, fold->m, "momentum", fold->add_alpha, fold->beta);
  if (one_exchange(w)) {
    allreduce_exchange(t, x, divisor, chunk, worker_residual, timer, codec, pieces, fold, finite, pack);
  } else {
    two_phases(t, x, divisor, chunk, worker_residual, server_residual, timer, codec, pieces, fold, finite, pack);
  }
  check_none_flagged(finite_out, finite.everywhere);
}

}  // namespace

void allreduce_onebit(Transport& t, at::Tensor& x, double divisor, int64_t chunk, const at::Tensor& worker_residual,
                      const at::Tensor& server_residual, CodecTimer& timer, int64_t pieces, const MomentumFold* fold,
                      Finite* finite, bool pack) {
  allreduce_two_phase(t, x, divisor, chunk, worker_residual, server_residual, timer, sign_codec(), pieces, fold,
                      finite, pack);
}

void allreduce_fp8(Transport& t, at::Tensor& x, double divisor, int64_t chunk, const at::Tensor& worker_residual,
                   const at::Tensor& server_residual, CodecTimer& timer, int64_t pieces, const MomentumFold* fold,
                   Finite* finite, bool pack) {
  allreduce_two_phase(t, x, divisor, chunk, worker_residual, server_residual, timer, fp8_codec(), pieces, fold,
                      finite, pack);
}

void allreduce_int3(Transport& t, at::Tensor& x, double divisor, int64_t chunk, const at::Tensor& worker_residual,
                    const at::Tensor& server_residual, CodecTimer& timer, int64_t pieces, const MomentumFold* fold,
                    Finite* finite, bool pack) {
  allreduce_two_phase(t, x, divisor, chunk, worker_residual, server_residual, timer, int3_codec(), pieces, fold,
                      finite, pack);
}

}  // namespace collectives
}  // namespace hetcomm
