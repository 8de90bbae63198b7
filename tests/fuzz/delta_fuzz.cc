// libFuzzer target: a delta payload as a rollout agent applies it (delta.h ApplyDelta, and
// ApplyDeltaToBlock into a block of the tensor), untrusted bytes from the data plane. Input: byte 0
// the encoding (0 dense, 1 indices, 2 runs, else unknown), byte 1 the item size (1 << (byte & 3))
// and, in its upper bits, the block's shape, bytes 2-3 the tensor's items (little-endian u16), then
// the payload. Every input must be refused with kDataLoss leaving the tensor (the block) untouched,
// or apply; never crash, hang or write outside the tensor (ASan/UBSan watch). ApplyDeltaChecked
// must agree with ApplyDeltaToBlock on the same block kept transposed in place.
// Run: build-asan/bin/wsync-fuzz-delta tests/fuzz/corpus/delta
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kernels/checksum.h"
#include "kernels/delta.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const auto encoding = static_cast<wsync::kernels::DeltaEncoding>(data[0]);
  const uint32_t item = 1u << (data[1] & 3);
  const size_t items = data[2] | (size_t{data[3]} << 8);
  const std::vector<uint8_t> base(items * item, 0xa5);
  std::vector<uint8_t> tensor = base;
  absl::Status s = wsync::kernels::ApplyDelta("fuzz", encoding, item, std::span(data + 4, size - 4), tensor);
  if (!s.ok() && (!absl::IsDataLoss(s) || tensor != base)) std::abort();  // refused: DATA_LOSS, nothing written
  if (items == 0) return 0;
  // The tensor as a [rows, items / rows] matrix (rows from byte 1's upper bits, dividing items), and
  // the block of its second half of rows and columns: every applied item must land in the block.
  size_t rows = 1 + (data[1] >> 2);
  while (items % rows != 0) --rows;
  const size_t cols = items / rows;
  const wsync::kernels::DeltaBlock b{rows, cols, rows / 2, rows - rows / 2, cols / 2, cols - cols / 2};
  const std::vector<uint8_t> block_base(b.rows * b.cols * item, 0x3c);
  std::vector<uint8_t> block = block_base;
  s = wsync::kernels::ApplyDeltaToBlock("fuzz", encoding, item, std::span(data + 4, size - 4), b, block);
  if (!s.ok() && (!absl::IsDataLoss(s) || block != block_base)) std::abort();
  // ApplyDeltaChecked onto the same block kept transposed in place: refused exactly when
  // ApplyDeltaToBlock refused (the sum it is given is that result's), else the same items.
  std::vector<uint8_t> mem(block_base.size(), 0x3c);
  const std::vector<uint8_t> mem_base = mem;
  const uint64_t sum = wsync::kernels::Sum64Host(std::as_bytes(std::span(block)));
  const uint64_t base_sum = wsync::kernels::Sum64Host(std::as_bytes(std::span(block_base)));
  absl::Status c = wsync::kernels::ApplyDeltaChecked("fuzz", encoding, item, std::span(data + 4, size - 4), b,
                                                     {mem.data(), 1, b.rows}, base_sum, sum);
  if (c.ok() != s.ok()) std::abort();
  if (!c.ok()) return (absl::IsDataLoss(c) && mem == mem_base) ? 0 : (std::abort(), 0);
  for (size_t r = 0; r < b.rows; ++r)
    for (size_t k = 0; k < b.cols; ++k)
      if (std::memcmp(&mem[(k * b.rows + r) * item], &block[(r * b.cols + k) * item], item) != 0) std::abort();
  return 0;
}
