// The top-k all-reduce (compressed.h): every rank's k largest entries, in a
// fixed-size message all ranks gather and sum in rank order.
#include <algorithm>

#include "collectives/compressed.h"
#include "ops/codecs.h"

namespace hetcomm {
namespace collectives {

namespace {

// Top-k's message, one per rank, all-gathered (fixed size):
//   [count int32 (-1: the sender's input was not finite, see Finite) |
//    per block of 2^16 elements, how many entries lie in it (int32) |
//    k low halves of the indices (uint16; padded to a multiple of 4 bytes) | k values (bf16)]
// The indices come in ascending order (ops::topk_encode), so a block's count
// and the low 16 bits give the index back: 4 bytes an entry, not the 8 of an
// int32 index and a float32 value. The value's rounding to bf16 stays in the
// residual (error feedback), as every other codec's error does. With k == n
// (ratio 1) every value goes as float32: nothing is left to save, and top-k
// is then a lossless codec.
constexpr int kTopkBlockBits = 16;

struct TopkLayout {
  int64_t k, blocks;
  at::ScalarType value_type;
  int64_t header_bytes() const { return 4 * (1 + blocks); }
  int64_t lows_offset() const { return header_bytes(); }
  int64_t values_offset() const { return header_bytes() + 4 * ((k + 1) / 2); }  // the lows padded to 4 bytes
  int64_t bytes() const { return values_offset() + k * static_cast<int64_t>(c10::elementSize(value_type)); }
};

TopkLayout topk_layout(int64_t n, int64_t k) {
  return {k, std::max<int64_t>(1, (n + (int64_t{1} << kTopkBlockBits) - 1) >> kTopkBlockBits),
          k < n ? at::kBFloat16 : at::kFloat};
}

// A view of bytes [offset, offset + count * size) of a byte tensor as `type`.
at::Tensor bytes_as(const at::Tensor& bytes, int64_t offset, int64_t count, at::ScalarType type) {
  return bytes.narrow(0, offset, count * static_cast<int64_t>(c10::elementSize(type))).view(type);
}

}  // namespace

void allreduce_topk(Transport& t, at::Tensor& x, double divisor, double ratio, bool exact, const at::Tensor& residual,
                    CodecTimer& timer, const at::Tensor& denominator, Finite* finite) {
  const int w = t.size();
  const int64_t n = x.numel();
  const TopkLayout lay = topk_layout(n, ops::topk_count(n, ratio));
  at::Tensor msg = at::zeros({lay.bytes()}, x.options().dtype(at::kByte));
  if (finite != nullptr && !finite->here) {
    bytes_as(msg, 0, 1, at::kInt).fill_(-1);
  } else {
    Timed _(timer);
    auto [idx, val] = ops::topk_encode(x, residual, divisor, lay.k, exact, denominator);
    const int64_t count = idx.numel();
    const at::Tensor header = bytes_as(msg, 0, 1 + lay.blocks, at::kInt);
    header.narrow(0, 0, 1).fill_(static_cast<int32_t>(count));
    header.narrow(0, 1, lay.blocks).copy_(at::bincount(at::bitwise_right_shift(idx, kTopkBlockBits), {}, lay.blocks));
    // the low 16 bits, as int16 (two's complement), so the cast is exact
    bytes_as(msg, lay.lows_offset(), count, at::kShort)
        .copy_(idx.bitwise_and(0xFFFF).bitwise_xor_(0x8000).sub_(0x8000));
    const at::Tensor sent = val.to(lay.value_type);
    bytes_as(msg, lay.values_offset(), count, lay.value_type).copy_(sent);
    if (residual.defined() && lay.value_type != at::kFloat)
      residual.index_copy_(0, idx.to(at::kLong), val - sent.to(at::kFloat));
  }
  at::Tensor all = at::empty({w * lay.bytes()}, x.options().dtype(at::kByte));
  t.all_gather(all, msg);
  t.synchronize();  // the host reads the counts next: NCCL errors raise here rather than hang the copy
  Timed _(timer);
  // every rank's header to the host at once (a few bytes a block)
  const at::Tensor headers = all.view({w, lay.bytes()}).narrow(1, 0, lay.header_bytes()).cpu().contiguous();
  // flatten(): each rank's 4 count bytes in a row of their own (with one rank contiguous() would keep the
  // header's row stride, which a view as int32 refuses unless it is a multiple of 4)
  const bool flagged = (headers.narrow(1, 0, 4).flatten().view(at::kInt) == -1).any().item<bool>();
  check_none_flagged(finite, !flagged);
  if (finite != nullptr) finite->everywhere = !flagged;
  if (flagged) return;  // x as it came
  x.zero_();
  const at::Tensor blocks = at::arange(lay.blocks, x.options().dtype(at::kInt)).mul_(1 << kTopkBlockBits);
  for (int r = 0; r < w; ++r) {
    const at::Tensor head = headers.select(0, r).view(at::kInt);
    const int64_t count = head[0].item<int32_t>();
    const at::Tensor per_block = head.narrow(0, 1, lay.blocks);
    TORCH_CHECK(count >= 0 && count <= lay.k && per_block.min().item<int32_t>() >= 0 &&
                    per_block.sum().item<int64_t>() == count,
                "hetcomm: corrupt top-k message from rank ", r);
    if (count == 0) continue;
    const at::Tensor block = all.narrow(0, r * lay.bytes(), lay.bytes());
    const at::Tensor idx = blocks.repeat_interleave(per_block.to(x.device()), 0, count)
                               .add_(bytes_as(block, lay.lows_offset(), count, at::kShort).to(at::kInt).bitwise_and_(0xFFFF));
    ops::scatter_add(idx, bytes_as(block, lay.values_offset(), count, lay.value_type).to(at::kFloat), x, 1.0);
  }
}

}  // namespace collectives
}  // namespace hetcomm
