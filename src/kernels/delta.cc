#include "kernels/delta.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/checksum.h"
#include "kernels/format/sum64.h"

namespace wsync::kernels {
namespace {

constexpr uint64_t kCountBytes = 8;
constexpr uint64_t kBlock = 64;  // bytes compared at once first (ScanRuns)

bool ItemSizeOk(uint32_t item_bytes) {
  return item_bytes == 1 || item_bytes == 2 || item_bytes == 4 || item_bytes == 8;
}

// Bytes of one index, start or length: u32 below 2^32 items (a run may be 2^32 - 1 items long), else u64.
uint64_t IndexBytes(uint64_t items) { return items < (uint64_t{1} << 32) ? 4 : 8; }

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Calls on_run(start, length) for each run of changed items in order, two runs merged when at most
// merge_gap unchanged items lie between them; returns the number of changed items. Compares 64-byte
// blocks as eight XORed words (most blocks of a delta did not change), then, in a block that did,
// the item lanes of each changed word (little-endian: lane k of the word at byte w is item w/size+k).
template <typename Item, typename OnRun>
uint64_t ScanRuns(const uint8_t* a, const uint8_t* b, uint64_t items, uint64_t merge_gap, OnRun&& on_run) {
  constexpr uint64_t kLanes = 8 / sizeof(Item);
  constexpr uint64_t kLaneMask = sizeof(Item) == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * sizeof(Item))) - 1;
  const uint64_t bytes = items * sizeof(Item);
  uint64_t changed = 0, start = 0, end = 0;  // the open run: [start, end), end = its last changed item + 1
  bool open = false;
  auto item_changed = [&](uint64_t i) {
    ++changed;
    if (open && i - end <= merge_gap) {
      end = i + 1;
      return;
    }
    if (open) on_run(start, end - start);
    open = true;
    start = i;
    end = i + 1;
  };
  auto word = [&](uint64_t off, uint64_t x) {
    for (uint64_t k = 0; k < kLanes; ++k)
      if ((x >> (8 * sizeof(Item) * k)) & kLaneMask) item_changed(off / sizeof(Item) + k);
  };
  uint64_t off = 0;
  for (; off + kBlock <= bytes; off += kBlock) {
    uint64_t x[kBlock / 8], any = 0;
    for (uint64_t w = 0; w < kBlock / 8; ++w)
      any |= x[w] = Load<uint64_t>(a + off + 8 * w) ^ Load<uint64_t>(b + off + 8 * w);
    if (any == 0) continue;
    for (uint64_t w = 0; w < kBlock / 8; ++w)
      if (x[w] != 0) word(off + 8 * w, x[w]);
  }
  for (; off + 8 <= bytes; off += 8)
    if (const uint64_t x = Load<uint64_t>(a + off) ^ Load<uint64_t>(b + off); x != 0) word(off, x);
  for (; off < bytes; off += sizeof(Item))
    if (Load<Item>(a + off) != Load<Item>(b + off)) item_changed(off / sizeof(Item));
  if (open) on_run(start, end - start);
  return changed;
}

template <typename OnRun>
uint64_t Scan(uint32_t item_bytes, const uint8_t* a, const uint8_t* b, uint64_t items, uint64_t merge_gap,
              OnRun&& on_run) {
  switch (item_bytes) {
    case 1: return ScanRuns<uint8_t>(a, b, items, merge_gap, on_run);
    case 2: return ScanRuns<uint16_t>(a, b, items, merge_gap, on_run);
    case 4: return ScanRuns<uint32_t>(a, b, items, merge_gap, on_run);
    default: return ScanRuns<uint64_t>(a, b, items, merge_gap, on_run);
  }
}

// Merging two runs costs the gap's items as values and saves one (start, length) pair.
uint64_t MergeGap(uint64_t items, uint32_t item_bytes) { return 2 * IndexBytes(items) / item_bytes; }

void PutIndex(uint8_t*& p, uint64_t v, uint64_t width) {
  if (width == 4) {
    const auto v32 = static_cast<uint32_t>(v);
    std::memcpy(p, &v32, 4);
  } else {
    std::memcpy(p, &v, 8);
  }
  p += width;
}

uint64_t GetIndex(const uint8_t* p, uint64_t width) { return width == 4 ? Load<uint32_t>(p) : Load<uint64_t>(p); }

// Calls seg(j, n, values) for the items of [start, start + n) of the whole tensor (values: n items)
// that fall inside `b`, in order: j is the first one's index in the block's dense row-major items.
// Each call stays within one block row, but for a block of the whole tensor: then it is one call.
template <typename Seg>
void ForBlockItems(const DeltaBlock& b, uint32_t item, uint64_t start, uint64_t n, const uint8_t* values, Seg&& seg) {
  if (b.rows == b.tensor_rows && b.cols == b.tensor_cols) {  // all of it: one piece
    seg(start, n, values);
    return;
  }
  while (n > 0) {
    const uint64_t r = start / b.tensor_cols, c = start % b.tensor_cols;
    const uint64_t in_row = std::min(n, b.tensor_cols - c);
    if (r >= b.row0 && r - b.row0 < b.rows) {
      const uint64_t lo = std::max(c, b.col0), hi = std::min(c + in_row, b.col0 + b.cols);
      if (lo < hi) seg((r - b.row0) * b.cols + (lo - b.col0), hi - lo, values + (lo - c) * item);
    }
    start += in_row;
    values += in_row * item;
    n -= in_row;
  }
}

// Where the applied items go: the whole tensor (a block of every row and column), or the block of
// it a receiver keeps, dense row-major at `data`.
struct Target {
  uint8_t* data = nullptr;
  uint32_t item = 0;
  uint64_t items = 0;  // of the whole tensor
  DeltaBlock block;

  static Target Whole(std::span<uint8_t> tensor, uint32_t item) {
    const uint64_t items = tensor.size() / item;
    return {tensor.data(), item, items, {1, items, 0, 1, 0, items}};
  }
  // Items [start, start + n) of the whole tensor, from values (n items), where they fall in the block.
  void Put(uint64_t start, uint64_t n, const uint8_t* values) const {
    ForBlockItems(block, item, start, n, values,
                  [&](uint64_t j, uint64_t m, const uint8_t* v) { std::memcpy(data + j * item, v, m * item); });
  }
};

absl::Status CheckTensor(uint64_t bytes, uint32_t item_bytes) {
  if (!ItemSizeOk(item_bytes))
    return absl::InvalidArgumentError(absl::StrCat("delta: item size ", item_bytes, " bytes, want 1, 2, 4 or 8"));
  if (bytes % item_bytes != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("delta: ", bytes, " bytes are not whole ", item_bytes, "-byte items"));
  return absl::OkStatus();
}

// The u64 count at the head of an indices / runs payload, and the size the payload must then have
// (per_entry index bytes per counted entry, plus values); kDataLoss when it cannot be that size.
absl::StatusOr<uint64_t> ReadCount(absl::string_view what, std::span<const uint8_t> payload, uint64_t limit,
                                   uint64_t per_entry) {
  if (payload.size() < kCountBytes)
    return absl::DataLossError(absl::StrCat("delta of ", what, ": ", payload.size(), " bytes, under its count"));
  const uint64_t count = Load<uint64_t>(payload.data());
  // Bounded by the items and by the bytes it needs (so no size computed from it can wrap).
  if (count > limit || count > (payload.size() - kCountBytes) / per_entry)
    return absl::DataLossError(
        absl::StrCat("delta of ", what, ": ", count, " entries for ", limit, " items in ", payload.size(), " bytes"));
  return count;
}

// The runs of an indices / runs payload over a tensor of `items` items, checked whole first (a
// payload that fails is kDataLoss and fn is never called): fn(start, n, values) per run, in order.
template <typename Fn>
absl::Status DecodeIndices(absl::string_view what, std::span<const uint8_t> payload, uint64_t items, uint32_t item,
                           Fn&& fn) {
  const uint64_t width = IndexBytes(items);
  auto count = ReadCount(what, payload, items, width + item);
  if (!count.ok()) return count.status();
  const uint64_t want = kCountBytes + *count * (width + item);
  if (payload.size() != want)
    return absl::DataLossError(
        absl::StrCat("delta of ", what, ": ", payload.size(), " bytes for ", *count, " indices, want ", want));
  const uint8_t* idx = payload.data() + kCountBytes;
  for (uint64_t k = 0, prev = 0; k < *count; ++k) {
    const uint64_t i = GetIndex(idx + k * width, width);
    if (i >= items || (k > 0 && i <= prev))
      return absl::DataLossError(
          absl::StrCat("delta of ", what, ": index ", k, " is ", i, " (after ", prev, ", of ", items, " items)"));
    prev = i;
  }
  const uint8_t* values = idx + *count * width;
  for (uint64_t k = 0; k < *count; ++k) fn(GetIndex(idx + k * width, width), 1, values + k * item);
  return absl::OkStatus();
}

template <typename Fn>
absl::Status DecodeRuns(absl::string_view what, std::span<const uint8_t> payload, uint64_t items, uint32_t item,
                        Fn&& fn) {
  const uint64_t width = IndexBytes(items);
  auto count = ReadCount(what, payload, items, 2 * width);
  if (!count.ok()) return count.status();
  if (payload.size() < kCountBytes + *count * 2 * width)
    return absl::DataLossError(
        absl::StrCat("delta of ", what, ": ", payload.size(), " bytes, under its ", *count, " runs"));
  const uint8_t* pairs = payload.data() + kCountBytes;
  uint64_t covered = 0;
  for (uint64_t k = 0, prev_end = 0; k < *count; ++k) {
    const uint64_t start = GetIndex(pairs + 2 * k * width, width),
                   length = GetIndex(pairs + (2 * k + 1) * width, width);
    if (length == 0 || start < prev_end || start >= items || length > items - start)
      return absl::DataLossError(absl::StrCat("delta of ", what, ": run ", k, " is [", start, ", +", length,
                                              ") (after item ", prev_end, ", of ", items, ")"));
    prev_end = start + length;
    covered += length;
  }
  const uint64_t want = kCountBytes + *count * 2 * width + covered * item;
  if (payload.size() != want)
    return absl::DataLossError(absl::StrCat("delta of ", what, ": ", payload.size(), " bytes for ", *count, " runs of ",
                                            covered, " items, want ", want));
  const uint8_t* values = pairs + *count * 2 * width;
  for (uint64_t k = 0; k < *count; ++k) {
    const uint64_t start = GetIndex(pairs + 2 * k * width, width),
                   length = GetIndex(pairs + (2 * k + 1) * width, width);
    fn(start, length, values);
    values += length * item;
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view DeltaEncodingName(DeltaEncoding e) {
  switch (e) {
    case DeltaEncoding::kDense: return "dense";
    case DeltaEncoding::kIndices: return "indices";
    case DeltaEncoding::kRuns: return "runs";
  }
  return "unknown";
}

uint64_t ScatteredDeltaBytes(uint64_t items, uint32_t item_bytes, uint64_t changed) {
  return std::min(items * item_bytes, kCountBytes + std::min(changed, items) * (IndexBytes(items) + item_bytes));
}

absl::StatusOr<DeltaPlan> PlanDelta(std::span<const uint8_t> base, std::span<const uint8_t> next, uint32_t item_bytes) {
  if (base.size() != next.size())
    return absl::InvalidArgumentError(absl::StrCat("delta: a base of ", base.size(), " bytes for ", next.size()));
  if (absl::Status s = CheckTensor(next.size(), item_bytes); !s.ok()) return s;
  DeltaPlan p;
  p.item_bytes = item_bytes;
  p.items = next.size() / item_bytes;
  const uint64_t width = IndexBytes(p.items);
  uint64_t covered = 0;
  p.changed_items = Scan(item_bytes, base.data(), next.data(), p.items, MergeGap(p.items, item_bytes),
                         [&](uint64_t, uint64_t length) {
                           ++p.runs;
                           covered += length;
                         });
  p.dense_bytes = next.size();
  p.indices_bytes = kCountBytes + p.changed_items * (width + item_bytes);
  p.runs_bytes = kCountBytes + p.runs * 2 * width + covered * item_bytes;
  p.encoding = DeltaEncoding::kDense;
  p.payload_bytes = p.dense_bytes;
  if (p.runs_bytes < p.payload_bytes) {
    p.encoding = DeltaEncoding::kRuns;
    p.payload_bytes = p.runs_bytes;
  }
  if (p.indices_bytes < p.payload_bytes) {
    p.encoding = DeltaEncoding::kIndices;
    p.payload_bytes = p.indices_bytes;
  }
  return p;
}

absl::Status WriteDelta(const DeltaPlan& plan, std::span<const uint8_t> base, std::span<const uint8_t> next,
                        std::span<uint8_t> out) {
  if (base.size() != next.size() || next.size() != plan.items * plan.item_bytes || !ItemSizeOk(plan.item_bytes))
    return absl::InvalidArgumentError("delta: the tensors are not those the plan was made from");
  if (out.size() != plan.payload_bytes)
    return absl::InvalidArgumentError(
        absl::StrCat("delta: ", out.size(), " bytes for a payload of ", plan.payload_bytes));
  const uint32_t item = plan.item_bytes;
  if (plan.encoding == DeltaEncoding::kDense) {
    if (!next.empty()) std::memcpy(out.data(), next.data(), next.size());
    return absl::OkStatus();
  }
  const bool runs = plan.encoding == DeltaEncoding::kRuns;
  const uint64_t width = IndexBytes(plan.items), count = runs ? plan.runs : plan.changed_items;
  std::memcpy(out.data(), &count, kCountBytes);
  uint8_t* idx = out.data() + kCountBytes;
  uint8_t* values = idx + count * (runs ? 2 : 1) * width;
  const uint8_t* end = out.data() + out.size();
  uint64_t written = 0;   // entries
  bool overflow = false;  // tensors other than the plan's: nothing more is written
  const uint64_t changed =
      Scan(item, base.data(), next.data(), plan.items, runs ? MergeGap(plan.items, item) : 0,
           [&](uint64_t start, uint64_t length) {
             written += runs ? 1 : length;
             overflow = overflow || written > count || length * item > static_cast<uint64_t>(end - values);
             if (overflow) return;
             if (runs) {
               PutIndex(idx, start, width);
               PutIndex(idx, length, width);
             } else {
               for (uint64_t i = start; i < start + length; ++i) PutIndex(idx, i, width);
             }
             std::memcpy(values, next.data() + start * item, length * item);
             values += length * item;
           });
  if (overflow || changed != plan.changed_items || written != count || values != end)
    return absl::InvalidArgumentError("delta: the tensors are not those the plan was made from");
  return absl::OkStatus();
}

namespace {

absl::Status CheckBlock(absl::string_view what, const DeltaBlock& b, uint32_t item_bytes) {
  const uint64_t limit = ~uint64_t{0} / item_bytes;
  if (b.tensor_cols == 0 || b.tensor_rows > limit / b.tensor_cols || b.row0 > b.tensor_rows ||
      b.rows > b.tensor_rows - b.row0 || b.col0 > b.tensor_cols || b.cols > b.tensor_cols - b.col0)
    return absl::InvalidArgumentError(absl::StrCat("delta of ", what, ": block rows [", b.row0, ", +", b.rows,
                                                   ") x columns [", b.col0, ", +", b.cols, ") of a [", b.tensor_rows,
                                                   ", ", b.tensor_cols, "] tensor"));
  return absl::OkStatus();
}

// The words of a block (its dense row-major bytes as sent, 8 at a time, Sum64's words) where they
// live in memory: gathered from and scattered to `at`, one item at a time unless the block is
// stored as sent (then 8 bytes at once). Bytes past the block's end read as zero, and are not written.
template <typename Item>
struct BlockWords {
  const DeltaBlock& b;
  StridedItems at;
  uint64_t nbytes;

  bool contiguous() const { return at.col_stride == 1 && at.row_stride == b.cols; }
  uint8_t* ItemAt(uint64_t k) const {
    const uint64_t r = k / b.cols, c = k % b.cols;
    return at.data + (r * at.row_stride + c * at.col_stride) * sizeof(Item);
  }
  uint64_t Read(uint64_t w) const {
    uint64_t x = 0;
    if (contiguous()) {
      if (8 * w + 8 <= nbytes) {
        std::memcpy(&x, at.data + 8 * w, 8);
      } else {
        std::memcpy(&x, at.data + 8 * w, nbytes - 8 * w);
      }
      return x;
    }
    auto* out = reinterpret_cast<uint8_t*>(&x);
    const uint64_t first = 8 * w / sizeof(Item), last = std::min(8 * w + 8, nbytes) / sizeof(Item);
    for (uint64_t k = first; k < last; ++k) std::memcpy(out + (k - first) * sizeof(Item), ItemAt(k), sizeof(Item));
    return x;
  }
  void Write(uint64_t w, uint64_t x) const {
    if (contiguous()) {
      if (8 * w + 8 <= nbytes) {
        std::memcpy(at.data + 8 * w, &x, 8);
      } else {
        std::memcpy(at.data + 8 * w, &x, nbytes - 8 * w);
      }
      return;
    }
    const auto* in = reinterpret_cast<const uint8_t*>(&x);
    const uint64_t first = 8 * w / sizeof(Item), last = std::min(8 * w + 8, nbytes) / sizeof(Item);
    for (uint64_t k = first; k < last; ++k) std::memcpy(ItemAt(k), in + (k - first) * sizeof(Item), sizeof(Item));
  }
};

// The Sum64 of a block after a delta, fed the changed items in ascending dense order (Item, one
// per call of Segment's loop: an item is never split between words). It keeps the one word they
// are in and, when they move past it, adds that word's term to the sum. In place (sparse
// payloads): the word is read when first touched, its old term subtracted from the base's sum,
// the new word written back at once (one visit of each changed word) and the old one logged, so
// that Undo puts every word back. Fresh (a dense payload, which replaces every word): nothing is
// read or written, the sum starts from zero, and the caller writes once the sum is right.
template <typename Item>
class WordSum {
 public:
  // `most`: at most how many words the payload can change (the undo log is reserved for them).
  WordSum(const DeltaBlock& b, StridedItems at, bool fresh, uint64_t most)
      : words_{b, at, b.rows * b.cols * sizeof(Item)}, fresh_(fresh) {
    if (!fresh) undo_.reserve(std::min<uint64_t>(most, (words_.nbytes + 7) / 8));
  }

  void Segment(uint64_t j, uint64_t n, const uint8_t* values) {
    for (uint64_t k = j; k < j + n; ++k, values += sizeof(Item)) {
      const uint64_t byte = k * sizeof(Item), w = byte / 8;
      if (!open_ || w != word_) Open(w);
      std::memcpy(reinterpret_cast<uint8_t*>(&next_) + (byte - 8 * w), values, sizeof(Item));
    }
  }
  // The result's Sum64, given the block's before (ignored when fresh).
  uint64_t Finish(uint64_t base_sum) {
    Close();
    const uint64_t s = fresh_ ? 0 : format::Sum64Unfinal(base_sum, words_.nbytes);
    return format::Sum64Final(s + delta_, words_.nbytes);
  }
  // Puts back every word written (in place), newest first.
  void Undo() {
    for (auto it = undo_.rbegin(); it != undo_.rend(); ++it) words_.Write(it->first, it->second);
    undo_.clear();
  }

 private:
  void Open(uint64_t w) {
    Close();
    open_ = true;
    word_ = w;
    old_ = fresh_ ? 0 : words_.Read(w);
    next_ = old_;
  }
  void Close() {
    if (!open_) return;
    open_ = false;
    delta_ += format::Sum64Term(next_, word_);
    if (fresh_) return;
    delta_ -= format::Sum64Term(old_, word_);
    if (next_ == old_) return;
    undo_.emplace_back(word_, old_);
    words_.Write(word_, next_);
  }

  const BlockWords<Item> words_;
  const bool fresh_;
  bool open_ = false;
  uint64_t word_ = 0, delta_ = 0, old_ = 0, next_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> undo_;  // (word, its old value)
};

// Decodes any encoding (kDense: one run of every item) for a tensor of `items` items.
template <typename Fn>
absl::Status Decode(absl::string_view what, DeltaEncoding encoding, std::span<const uint8_t> payload, uint64_t items,
                    uint32_t item, Fn&& fn) {
  switch (encoding) {
    case DeltaEncoding::kDense:
      if (payload.size() != items * item)
        return absl::DataLossError(
            absl::StrCat("delta of ", what, ": ", payload.size(), " dense bytes for a tensor of ", items * item));
      if (items > 0) fn(uint64_t{0}, items, payload.data());
      return absl::OkStatus();
    case DeltaEncoding::kIndices: return DecodeIndices(what, payload, items, item, fn);
    case DeltaEncoding::kRuns: return DecodeRuns(what, payload, items, item, fn);
  }
  return absl::DataLossError(absl::StrCat("delta of ", what, ": unknown encoding ", static_cast<int>(encoding)));
}

absl::Status Apply(absl::string_view what, DeltaEncoding encoding, std::span<const uint8_t> payload, const Target& t) {
  return Decode(what, encoding, payload, t.items, t.item,
                [&](uint64_t start, uint64_t n, const uint8_t* values) { t.Put(start, n, values); });
}

}  // namespace

absl::Status ApplyDelta(absl::string_view what, DeltaEncoding encoding, uint32_t item_bytes,
                        std::span<const uint8_t> payload, std::span<uint8_t> tensor) {
  if (absl::Status s = CheckTensor(tensor.size(), item_bytes); !s.ok()) return s;
  return Apply(what, encoding, payload, Target::Whole(tensor, item_bytes));
}

absl::Status ApplyDeltaToBlock(absl::string_view what, DeltaEncoding encoding, uint32_t item_bytes,
                               std::span<const uint8_t> payload, const DeltaBlock& block, std::span<uint8_t> bytes) {
  if (absl::Status s = CheckTensor(bytes.size(), item_bytes); !s.ok()) return s;
  if (absl::Status s = CheckBlock(what, block, item_bytes); !s.ok()) return s;
  const DeltaBlock& b = block;
  if (bytes.size() != b.rows * b.cols * item_bytes)
    return absl::InvalidArgumentError(absl::StrCat("delta of ", what, ": ", bytes.size(), " bytes for a block of ",
                                                   b.rows, " x ", b.cols, " items of ", item_bytes));
  return Apply(what, encoding, payload, {bytes.data(), item_bytes, b.tensor_rows * b.tensor_cols, b});
}

namespace {

template <typename Item>
absl::Status ApplyChecked(absl::string_view what, DeltaEncoding encoding, std::span<const uint8_t> payload,
                          const DeltaBlock& b, StridedItems at, uint64_t base_sum, uint64_t sum) {
  const uint64_t items = b.tensor_rows * b.tensor_cols;
  const bool fresh = encoding == DeltaEncoding::kDense;
  // Sparse: applied and summed in one visit of each changed word (Decode checks the whole payload
  // before the first run), undone when the sum is wrong. Dense: summed from the payload alone.
  // The undo log's room is reserved up front, so that no allocation can fail once words are
  // written: a changed word brings one item at least, and in an index list a (u32 or wider) index.
  const uint64_t most = payload.size() / (sizeof(Item) + (encoding == DeltaEncoding::kIndices ? 4 : 0));
  WordSum<Item> words(b, at, fresh, most);
  auto summed = [&](uint64_t start, uint64_t n, const uint8_t* values) {
    ForBlockItems(b, sizeof(Item), start, n, values,
                  [&](uint64_t j, uint64_t m, const uint8_t* v) { words.Segment(j, m, v); });
  };
  // A dense payload's block of whole rows is one range of it, summed as any bytes are.
  const uint64_t first = (b.row0 * b.tensor_cols + b.col0) * sizeof(Item), nbytes = b.rows * b.cols * sizeof(Item);
  const bool one_range = fresh && b.cols == b.tensor_cols;
  auto nothing = [](uint64_t, uint64_t, const uint8_t*) {};
  const absl::Status decoded = one_range ? Decode(what, encoding, payload, items, sizeof(Item), nothing)
                                         : Decode(what, encoding, payload, items, sizeof(Item), summed);
  if (!decoded.ok()) return decoded;
  const uint64_t got = one_range ? Sum64Host(std::as_bytes(payload.subspan(first, nbytes))) : words.Finish(base_sum);
  if (got != sum) {
    words.Undo();
    return absl::DataLossError(absl::StrFormat(
        "delta of %s: applied to its base it is not the new version (Sum64 of the kept block %016x, want %016x)", what,
        got, sum));
  }
  if (!fresh) return absl::OkStatus();
  // Dense: every item of the block, row by row, where it lives.
  for (uint64_t r = 0; r < b.rows; ++r) {
    const uint8_t* row = payload.data() + first + r * b.tensor_cols * sizeof(Item);
    uint8_t* dst = at.data + r * at.row_stride * sizeof(Item);
    if (at.col_stride == 1) {
      std::memcpy(dst, row, b.cols * sizeof(Item));
      continue;
    }
    for (uint64_t c = 0; c < b.cols; ++c)
      std::memcpy(dst + c * at.col_stride * sizeof(Item), row + c * sizeof(Item), sizeof(Item));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyDeltaChecked(absl::string_view what, DeltaEncoding encoding, uint32_t item_bytes,
                               std::span<const uint8_t> payload, const DeltaBlock& block, StridedItems at,
                               uint64_t base_sum, uint64_t sum) {
  if (absl::Status s = CheckTensor(0, item_bytes); !s.ok()) return s;
  if (absl::Status s = CheckBlock(what, block, item_bytes); !s.ok()) return s;
  switch (item_bytes) {
    case 1: return ApplyChecked<uint8_t>(what, encoding, payload, block, at, base_sum, sum);
    case 2: return ApplyChecked<uint16_t>(what, encoding, payload, block, at, base_sum, sum);
    case 4: return ApplyChecked<uint32_t>(what, encoding, payload, block, at, base_sum, sum);
    default: return ApplyChecked<uint64_t>(what, encoding, payload, block, at, base_sum, sum);
  }
}

}  // namespace wsync::kernels
