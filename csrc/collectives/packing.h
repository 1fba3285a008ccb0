// Lossless packing of the two-phase codecs' messages (int3's bit planes are
// peaked: zstd level 1 takes them to 0.61-0.80x on digits, the wide MLP and the
// cnn task, bench/README "Digits with a core per rank: int3's bytes are its
// step"). zstd is the system's libzstd, loaded at run time (dlopen): a fresh
// machine may have the library and not its headers, and hetcomm builds and
// runs without it, sending raw blocks.
//
// A packed round: each rank compresses its blocks, one small all-gather hands
// every rank every block's compressed length (or -1: this rank cannot pack,
// it has no zstd or its blocks are not on the host), and where every rank can
// and the longest is shorter than a raw block, the blocks travel at the
// longest length; otherwise raw, as an unpacked round. Every rank decompresses
// the same bytes into the raw blocks: the result is the raw round's, bit for
// bit, and a round costs one small all-gather more.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "transport/transport.h"

namespace hetcomm {
namespace collectives {

// Whether libzstd was found and HETCOMM_ZSTD is not 0 (then this rank sends -1 and every rank sends raw).
bool zstd_available();

// One round's outgoing blocks: k blocks of `ints` int32s side by side in raw.
class PackedRound {
 public:
  // Compresses raw's k blocks (the codec's time: nothing is sent).
  PackedRound(const at::Tensor& raw, int k, int64_t ints);
  // Learns every rank's lengths (blocking: the lengths' all-gather) and lays
  // out wire(). Every rank of t calls it for the same round, before wire().
  void agree(Transport& t);
  // What this rank sends: raw itself where not packed, else k blocks of the
  // longest compressed length (in int32s), each rank's the same size.
  const at::Tensor& wire() const { return wire_; }
  // Received blocks (block i from rank i, each its sender's block `slot`) ->
  // raw blocks of ints each (got itself where not packed).
  at::Tensor unpack(const at::Tensor& got, int slot) const;

 private:
  int k_ = 1;
  int64_t ints_ = 0, cap_ = 0;
  bool packed_ = false;
  std::vector<std::vector<uint8_t>> out_;  // this rank's compressed blocks (empty: it cannot pack)
  std::vector<int32_t> lengths_;  // bytes of block j of rank r at r * k + j
  at::Tensor wire_;
};

}  // namespace collectives
}  // namespace hetcomm
