// The delta encoding (delta.h) against a scalar reference written from delta.h's spec: item by item,
// the changed indices, the runs merged by the pair-cost rule, each encoding's bytes built by
// appending, the smallest chosen. Seeded random tensors at changed fractions from none to all, every
// item size, odd lengths; the edges (no change, every item, the first and last, alternating items
// merged into one run); every malformed payload refused with the tensor untouched.
#include "kernels/delta.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace wsync::kernels {
namespace {

using Bytes = std::vector<uint8_t>;

void AppendIndex(Bytes& out, uint64_t v, uint64_t width) {
  for (uint64_t b = 0; b < width; ++b) out.push_back(static_cast<uint8_t>(v >> (8 * b)));
}

// The reference: the payload of each encoding, and the one PlanDelta must choose.
struct Reference {
  Bytes dense, indices, runs;
  uint64_t changed = 0, run_count = 0;
  DeltaEncoding best = DeltaEncoding::kDense;
  const Bytes& Payload() const {
    return best == DeltaEncoding::kDense ? dense : best == DeltaEncoding::kRuns ? runs : indices;
  }
};

Reference Encode(const Bytes& base, const Bytes& next, uint32_t item) {
  const uint64_t items = next.size() / item, width = items < (uint64_t{1} << 32) ? 4 : 8;
  std::vector<uint64_t> changed;
  for (uint64_t i = 0; i < items; ++i)
    if (std::memcmp(&base[i * item], &next[i * item], item) != 0) changed.push_back(i);
  Reference r;
  r.changed = changed.size();
  r.dense = next;
  AppendIndex(r.indices, changed.size(), 8);
  for (uint64_t i : changed) AppendIndex(r.indices, i, width);
  for (uint64_t i : changed) r.indices.insert(r.indices.end(), &next[i * item], &next[(i + 1) * item]);
  // Runs: a gap of g unchanged items is merged when g items cost no more than a (start, length) pair.
  std::vector<std::pair<uint64_t, uint64_t>> runs;  // [first, last]
  for (uint64_t i : changed) {
    if (!runs.empty() && (i - runs.back().second - 1) * item <= 2 * width)
      runs.back().second = i;
    else
      runs.push_back({i, i});
  }
  r.run_count = runs.size();
  AppendIndex(r.runs, runs.size(), 8);
  for (auto [first, last] : runs) {
    AppendIndex(r.runs, first, width);
    AppendIndex(r.runs, last - first + 1, width);
  }
  for (auto [first, last] : runs) r.runs.insert(r.runs.end(), &next[first * item], &next[(last + 1) * item]);
  r.best = DeltaEncoding::kDense;
  size_t best = r.dense.size();
  if (r.runs.size() < best) r.best = DeltaEncoding::kRuns, best = r.runs.size();
  if (r.indices.size() < best) r.best = DeltaEncoding::kIndices;
  return r;
}

Bytes Random(std::mt19937_64& rng, size_t n) {
  Bytes b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

// next = base with each item changed with probability p (a changed item differs in one random byte).
Bytes Change(std::mt19937_64& rng, const Bytes& base, uint32_t item, double p) {
  Bytes next = base;
  std::bernoulli_distribution flip(p);
  for (size_t i = 0; i < base.size() / item; ++i)
    if (flip(rng)) next[i * item + rng() % item] ^= static_cast<uint8_t>(1 + rng() % 255);
  return next;
}

// Plans, writes and applies base -> next, checking each step against the reference.
void RoundTrip(const Bytes& base, const Bytes& next, uint32_t item, const std::string& what) {
  const Reference want = Encode(base, next, item);
  auto plan = PlanDelta(base, next, item);
  ASSERT_TRUE(plan.ok()) << what << ": " << plan.status();
  EXPECT_EQ(plan->changed_items, want.changed) << what;
  EXPECT_EQ(plan->runs, want.run_count) << what;
  EXPECT_EQ(plan->dense_bytes, want.dense.size()) << what;
  EXPECT_EQ(plan->indices_bytes, want.indices.size()) << what;
  EXPECT_EQ(plan->runs_bytes, want.runs.size()) << what;
  ASSERT_EQ(plan->encoding, want.best) << what;
  Bytes payload(plan->payload_bytes);
  ASSERT_TRUE(WriteDelta(*plan, base, next, payload).ok()) << what;
  ASSERT_EQ(payload, want.Payload()) << what << " (" << DeltaEncodingName(plan->encoding) << ")";
  // Every encoding applies, not only the chosen one.
  for (auto [enc, bytes] :
       {std::pair{DeltaEncoding::kDense, &want.dense}, std::pair{DeltaEncoding::kIndices, &want.indices},
        std::pair{DeltaEncoding::kRuns, &want.runs}}) {
    Bytes got = base;
    ASSERT_TRUE(ApplyDelta(what, enc, item, *bytes, got).ok()) << what << " " << DeltaEncodingName(enc);
    ASSERT_EQ(got, next) << what << " " << DeltaEncodingName(enc);
  }
}

TEST(Delta, SeededTensorsRoundTripAndEncodeAsTheReferenceDoes) {
  const uint64_t seed = 20261130;
  std::mt19937_64 rng(seed);
  for (uint32_t item : {1u, 2u, 4u, 8u})
    for (size_t items : {1ul, 7ul, 31ul, 32ul, 33ul, 1000ul, 4099ul})
      for (double p : {0.0, 0.001, 0.01, 0.02, 0.2, 0.6, 1.0}) {
        const Bytes base = Random(rng, items * item);
        RoundTrip(base, Change(rng, base, item, p), item,
                  "seed " + std::to_string(seed) + " item " + std::to_string(item) + " items " + std::to_string(items) +
                      " p " + std::to_string(p));
      }
}

TEST(Delta, TheEncodingFollowsTheDensity) {
  std::mt19937_64 rng(7);
  const Bytes base = Random(rng, 2 << 20);  // 1 Mi bf16 items
  auto plan = PlanDelta(base, base, 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->changed_items, 0u);
  EXPECT_EQ(plan->payload_bytes, 8u);  // a count of zero
  for (auto [p, want] : {std::pair{0.01, DeltaEncoding::kIndices}, std::pair{1.0, DeltaEncoding::kDense}}) {
    const Bytes next = Change(rng, base, 2, p);
    plan = PlanDelta(base, next, 2);
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->encoding, want) << p;
    RoundTrip(base, next, 2, "p " + std::to_string(p));
  }
  Bytes next = base;  // one contiguous changed range: one run
  for (size_t i = 1000; i < 3000; ++i) next[i] ^= 0xff;
  plan = PlanDelta(base, next, 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->encoding, DeltaEncoding::kRuns);
  EXPECT_EQ(plan->runs, 1u);
  EXPECT_EQ(plan->payload_bytes, 8u + 8u + 2000u);
}

// ScatteredDeltaBytes (the planner's estimate) is the reference's index list or dense payload,
// whichever is smaller, and never less than what PlanDelta chooses.
TEST(Delta, TheScatteredEstimateIsTheIndexListOrDenseBytes) {
  std::mt19937_64 rng(11);
  for (uint32_t item : {1u, 2u, 4u, 8u}) {
    const Bytes base = Random(rng, 4096 * item + item);
    for (double p : {0.0, 0.001, 0.01, 0.1, 0.5, 1.0}) {
      const Bytes next = Change(rng, base, item, p);
      const Reference r = Encode(base, next, item);
      const uint64_t est = ScatteredDeltaBytes(next.size() / item, item, r.changed);
      EXPECT_EQ(est, std::min(r.dense.size(), r.indices.size())) << "item " << item << ", p " << p;
      auto plan = PlanDelta(base, next, item);
      ASSERT_TRUE(plan.ok());
      EXPECT_LE(plan->payload_bytes, est) << "item " << item << ", p " << p;
    }
  }
  EXPECT_EQ(ScatteredDeltaBytes(100, 2, 1000), 200u) << "more changed than there are items: dense";
}

TEST(Delta, Edges) {
  std::mt19937_64 rng(11);
  const Bytes base = Random(rng, 4 * 257);
  Bytes next = base;
  next[0] ^= 1;                // the first item
  next[next.size() - 1] ^= 1;  // the last
  RoundTrip(base, next, 4, "first and last");
  next = base;
  for (size_t i = 0; i < 257; i += 2) next[4 * i] ^= 1;  // every other item: merged into one run
  auto plan = PlanDelta(base, next, 4);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->runs, 1u);
  RoundTrip(base, next, 4, "alternating");
  RoundTrip(base, Change(rng, base, 4, 1.0), 4, "every item");
  RoundTrip(Bytes{}, Bytes{}, 2, "empty");
  // A gap of exactly one pair's bytes merges; one item more does not (bf16: pair = 8 bytes = 4 items).
  Bytes b2(64, 0), n2 = b2;
  n2[0] = n2[10] = 1;  // items 0 and 5: 4 unchanged items between
  plan = PlanDelta(b2, n2, 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->runs, 1u);
  n2[10] = 0;
  n2[12] = 1;  // items 0 and 6: 5 between
  plan = PlanDelta(b2, n2, 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->runs, 2u);
}

TEST(Delta, BadTensorsAreRefused) {
  Bytes a(10), b(12), c(9);
  EXPECT_EQ(PlanDelta(a, b, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanDelta(c, c, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanDelta(a, a, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyDelta("t", DeltaEncoding::kDense, 2, c, c).code(), absl::StatusCode::kInvalidArgument);
  // A plan applied to other tensors, or into a payload of the wrong size.
  Bytes base(64, 0), next = base, other = base;
  next[3] = 1;
  other[40] = 1;
  other[50] = 1;
  auto plan = PlanDelta(base, next, 1);
  ASSERT_TRUE(plan.ok());
  Bytes out(plan->payload_bytes);
  EXPECT_EQ(WriteDelta(*plan, base, other, out).code(), absl::StatusCode::kInvalidArgument);
  Bytes small(plan->payload_bytes - 1);
  EXPECT_EQ(WriteDelta(*plan, base, next, small).code(), absl::StatusCode::kInvalidArgument);
}

// The block [row0, +rows) x [col0, +cols) of a [.., cols] matrix of items, cut item by item.
Bytes Cut(const Bytes& t, uint32_t item, uint64_t tensor_cols, const DeltaBlock& b) {
  Bytes out;
  for (uint64_t r = b.row0; r < b.row0 + b.rows; ++r)
    for (uint64_t c = b.col0; c < b.col0 + b.cols; ++c)
      out.insert(out.end(), &t[(r * tensor_cols + c) * item], &t[(r * tensor_cols + c + 1) * item]);
  return out;
}

// A receiver holding one block (an engine rank's slice) applies the whole tensor's payload, every
// encoding, to its block of the base and gets the block of the new version: row and column slices,
// the whole tensor, a single item, an empty block; dense rows and scattered items.
TEST(Delta, ABlockOfTheTensorGetsTheBlockOfTheNewVersion) {
  const uint64_t seed = 20261201;
  std::mt19937_64 rng(seed);
  for (uint32_t item : {1u, 2u, 4u}) {
    for (auto [rows, cols] : {std::pair<uint64_t, uint64_t>{1, 37}, {37, 1}, {16, 24}, {33, 65}}) {
      const Bytes base = Random(rng, rows * cols * item);
      for (double p : {0.01, 0.3, 1.0}) {
        const Bytes next = Change(rng, base, item, p);
        const Reference ref = Encode(base, next, item);
        std::vector<DeltaBlock> blocks = {
            {rows, cols, 0, rows, 0, cols}, {rows, cols, 0, 0, 0, cols}, {rows, cols, rows - 1, 1, cols - 1, 1}};
        for (int k = 0; k < 6; ++k) {
          const uint64_t r0 = rng() % rows, c0 = rng() % cols;
          blocks.push_back({rows, cols, r0, 1 + rng() % (rows - r0), c0, 1 + rng() % (cols - c0)});
        }
        for (const DeltaBlock& b : blocks) {
          const std::string what = "seed " + std::to_string(seed) + " item " + std::to_string(item) + " [" +
                                   std::to_string(rows) + ", " + std::to_string(cols) + "] p " + std::to_string(p) +
                                   " block [" + std::to_string(b.row0) + ", +" + std::to_string(b.rows) + ") x [" +
                                   std::to_string(b.col0) + ", +" + std::to_string(b.cols) + ")";
          for (auto [enc, payload] :
               {std::pair{DeltaEncoding::kDense, &ref.dense}, std::pair{DeltaEncoding::kIndices, &ref.indices},
                std::pair{DeltaEncoding::kRuns, &ref.runs}}) {
            Bytes got = Cut(base, item, cols, b);
            absl::Status s = ApplyDeltaToBlock(what, enc, item, *payload, b, got);
            ASSERT_TRUE(s.ok()) << what << " " << DeltaEncodingName(enc) << ": " << s;
            ASSERT_EQ(got, Cut(next, item, cols, b)) << what << " " << DeltaEncodingName(enc);
          }
        }
      }
    }
  }
}

// Sum64 of bytes, written here from format/sum64.h's definition (not through Sum64Host or the
// update ApplyDeltaChecked makes), one byte at a time.
uint64_t DefinedSum64(const Bytes& b) {
  auto mix = [](uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  };
  uint64_t s = 0;
  for (size_t i = 0; i * 8 < b.size(); ++i) {
    uint64_t w = 0;
    for (size_t k = 0; k < 8 && 8 * i + k < b.size(); ++k) w |= uint64_t{b[8 * i + k]} << (8 * k);
    s += mix(w ^ (i * 0x9E3779B97F4A7C15ull));
  }
  return mix(s ^ (b.size() * 0xC2B2AE3D27D4EB4Full));
}

// Where a test keeps a block: inside a larger [mem_rows, mem_cols] matrix of filler bytes, at
// (r0, c0), as sent or transposed.
struct Placement {
  const char* name;
  bool transposed;
  uint64_t pad_rows, pad_cols, r0, c0;
};
// Writes `dense` (a [rows, cols] block, item bytes each) into mem where placement p keeps it;
// returns the StridedItems that describe it.
StridedItems Place(Bytes& mem, uint64_t mem_cols, const Placement& p, const Bytes& dense, uint64_t rows, uint64_t cols,
                   uint32_t item) {
  uint8_t* at = mem.data() + (p.r0 * mem_cols + p.c0) * item;
  for (uint64_t r = 0; r < rows; ++r)
    for (uint64_t c = 0; c < cols; ++c) {
      const uint64_t mr = p.transposed ? c : r, mc = p.transposed ? r : c;
      std::memcpy(at + (mr * mem_cols + mc) * item, &dense[(r * cols + c) * item], item);
    }
  return p.transposed ? StridedItems{at, 1, mem_cols} : StridedItems{at, mem_cols, 1};
}

// ApplyDeltaChecked writes the new version's block where the receiver keeps it (as sent, inside a
// wider matrix, transposed), every encoding, and nothing else; a wrong new checksum, a wrong base
// checksum (the delta's words are not the base's), a base the memory does not hold where the
// delta reads, and every malformed payload are refused, the memory left as it was. The checksums come
// from DefinedSum64 over the cut blocks, the expected memory from the placement above.
TEST(Delta, CheckedInPlaceWritesTheNewVersionOnlyWhenItsSumIsRight) {
  const uint64_t seed = 20261202;
  std::mt19937_64 rng(seed);
  const Placement placements[] = {
      {"as sent", false, 0, 0, 0, 0}, {"in a wider matrix", false, 3, 5, 2, 3}, {"transposed", true, 2, 3, 1, 2}};
  for (uint32_t item : {1u, 2u, 4u, 8u}) {
    for (auto [rows, cols] : {std::pair<uint64_t, uint64_t>{1, 37}, {37, 1}, {16, 24}, {33, 65}}) {
      const Bytes base = Random(rng, rows * cols * item);
      for (double p : {0.0, 0.002, 0.05, 0.3, 1.0}) {
        const Bytes next = Change(rng, base, item, p);
        const Reference ref = Encode(base, next, item);
        std::vector<DeltaBlock> blocks = {{rows, cols, 0, rows, 0, cols}, {rows, cols, rows - 1, 1, cols - 1, 1}};
        for (int k = 0; k < 3; ++k) {
          const uint64_t r0 = rng() % rows, c0 = rng() % cols;
          blocks.push_back({rows, cols, r0, 1 + rng() % (rows - r0), c0, 1 + rng() % (cols - c0)});
        }
        for (const DeltaBlock& b : blocks) {
          const Bytes was = Cut(base, item, cols, b), want = Cut(next, item, cols, b);
          for (const Placement& pl : placements) {
            const uint64_t mem_rows = (pl.transposed ? b.cols : b.rows) + pl.pad_rows,
                           mem_cols = (pl.transposed ? b.rows : b.cols) + pl.pad_cols;
            Bytes mem = Random(rng, mem_rows * mem_cols * item);
            const StridedItems at = Place(mem, mem_cols, pl, was, b.rows, b.cols, item);
            const Bytes before = mem;
            Bytes expected = mem;
            Place(expected, mem_cols, pl, want, b.rows, b.cols, item);
            const std::string what = "seed " + std::to_string(seed) + " item " + std::to_string(item) + " [" +
                                     std::to_string(rows) + ", " + std::to_string(cols) + "] p " + std::to_string(p) +
                                     " block [" + std::to_string(b.row0) + ", +" + std::to_string(b.rows) + ") x [" +
                                     std::to_string(b.col0) + ", +" + std::to_string(b.cols) + ") " + pl.name;
            for (auto [enc, payload] :
                 {std::pair{DeltaEncoding::kDense, &ref.dense}, std::pair{DeltaEncoding::kIndices, &ref.indices},
                  std::pair{DeltaEncoding::kRuns, &ref.runs}}) {
              const std::string w = what + " " + std::string(DeltaEncodingName(enc));
              // The wrong new sum: refused, the memory as it was.
              mem = before;
              absl::Status s =
                  ApplyDeltaChecked(w, enc, item, *payload, b, at, DefinedSum64(was), DefinedSum64(want) ^ 1);
              ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << w << ": " << s;
              ASSERT_EQ(mem, before) << w << ": changed though refused";
              // A sparse delta onto a base whose checksum is another's: its words do not add up.
              if (enc != DeltaEncoding::kDense) {
                s = ApplyDeltaChecked(w, enc, item, *payload, b, at, DefinedSum64(was) + 1, DefinedSum64(want));
                ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << w << ": " << s;
                ASSERT_EQ(mem, before) << w << ": changed though refused";
              }
              s = ApplyDeltaChecked(w, enc, item, *payload, b, at, DefinedSum64(was), DefinedSum64(want));
              ASSERT_TRUE(s.ok()) << w << ": " << s;
              ASSERT_EQ(mem, expected) << w;
            }
          }
        }
      }
    }
  }
}

// Where the memory is not the base in a word the delta changes, the result's sum is not the new
// one: refused, the memory as it was. (A word the delta does not touch is not read: the caller's
// base_sum vouches for it, engine_model::Staging's known sums.)
TEST(Delta, CheckedInPlaceRefusesAMemoryThatIsNotTheBaseWhereTheDeltaReads) {
  std::mt19937_64 rng(17);
  const Bytes base = Random(rng, 2 * 512);
  Bytes next = base;
  for (size_t i : {3, 100, 101, 102, 400}) next[2 * i] ^= 1;
  const Reference r = Encode(base, next, 2);
  const DeltaBlock whole{1, 512, 0, 1, 0, 512};
  for (auto [enc, payload] :
       {std::pair{DeltaEncoding::kIndices, &r.indices}, std::pair{DeltaEncoding::kRuns, &r.runs}}) {
    for (size_t other : {2, 3, 101, 103}) {  // items sharing a word with a changed one, or changed
      Bytes mem = base;
      mem[2 * other + 1] ^= 0x10;
      const Bytes held = mem;
      absl::Status s =
          ApplyDeltaChecked("t", enc, 2, *payload, whole, {mem.data(), 512, 1}, DefinedSum64(base), DefinedSum64(next));
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << DeltaEncodingName(enc) << " item " << other << ": " << s;
      EXPECT_EQ(mem, held);
    }
  }
}

TEST(Delta, ABlockOutsideTheTensorOrOfAnotherSizeIsRefused) {
  Bytes payload(8, 0);  // indices: a count of zero
  Bytes block(2 * 4);   // 2 x 2 bf16
  for (const DeltaBlock& b : {DeltaBlock{4, 4, 3, 2, 0, 2}, DeltaBlock{4, 4, 0, 2, 3, 2}, DeltaBlock{4, 0, 0, 2, 0, 2},
                              DeltaBlock{~uint64_t{0}, 2, 0, 2, 0, 2}}) {
    absl::Status s = ApplyDeltaToBlock("t", DeltaEncoding::kIndices, 2, payload, b, block);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  EXPECT_EQ(ApplyDeltaToBlock("t", DeltaEncoding::kIndices, 2, payload, {4, 4, 0, 2, 0, 3}, block).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ApplyDeltaToBlock("t", DeltaEncoding::kIndices, 2, payload, {4, 4, 2, 2, 2, 2}, block).ok());
}

// Each damage to a well-formed payload is refused (kDataLoss) and leaves the tensor as it was.
TEST(Delta, MalformedPayloadsAreRefusedAndChangeNothing) {
  std::mt19937_64 rng(13);
  const Bytes base = Random(rng, 2 * 512);
  Bytes next = base;
  for (size_t i : {3, 100, 101, 102, 400}) next[2 * i] ^= 1;
  const Reference r = Encode(base, next, 2);
  auto put32 = [](Bytes p, size_t at, uint32_t v) {
    std::memcpy(&p[at], &v, 4);
    return p;
  };
  auto put64 = [](Bytes p, size_t at, uint64_t v) {
    std::memcpy(&p[at], &v, 8);
    return p;
  };
  Bytes truncated = r.indices;
  truncated.pop_back();
  Bytes longer = r.runs;
  longer.push_back(0);
  Bytes past_the_end;  // one run [510, +4) of 512 items, with its 4 values: only the range is wrong
  for (uint64_t v : {uint64_t{1}}) AppendIndex(past_the_end, v, 8);
  for (uint64_t v : {510, 4}) AppendIndex(past_the_end, v, 4);
  past_the_end.resize(past_the_end.size() + 4 * 2, 0x5a);
  const std::vector<std::tuple<std::string, DeltaEncoding, Bytes>> bad = {
      {"dense, one byte short", DeltaEncoding::kDense, Bytes(base.size() - 1)},
      {"indices, truncated", DeltaEncoding::kIndices, truncated},
      {"indices, under its count", DeltaEncoding::kIndices, Bytes(5)},
      {"indices, a huge count", DeltaEncoding::kIndices, put64(r.indices, 0, uint64_t{1} << 62)},
      {"indices, not ascending", DeltaEncoding::kIndices, put32(r.indices, 8 + 4, 3)},
      {"indices, past the end", DeltaEncoding::kIndices, put32(r.indices, 8 + 4 * 4, 512)},
      {"runs, a byte too many", DeltaEncoding::kRuns, longer},
      {"runs, an empty run", DeltaEncoding::kRuns, put32(r.runs, 8 + 4, 0)},
      {"runs, overlapping", DeltaEncoding::kRuns, put32(r.runs, 8 + 8, 3)},
      {"runs, past the end", DeltaEncoding::kRuns, put32(r.runs, 8 + 2 * 8 + 4, 200)},
      {"runs, a count beyond its pairs", DeltaEncoding::kRuns, put64(r.runs, 0, 400)},
      {"runs, past the end and sized to match", DeltaEncoding::kRuns, past_the_end},
      {"unknown encoding", static_cast<DeltaEncoding>(7), r.runs},
  };
  for (const auto& [what, enc, payload] : bad) {
    Bytes tensor = base;
    absl::Status s = ApplyDelta("model.layers.0.mlp.down_proj.weight", enc, 2, payload, tensor);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << what << ": " << s;
    EXPECT_NE(s.message().find("model.layers.0.mlp.down_proj.weight"), std::string::npos) << what << ": " << s;
    EXPECT_EQ(tensor, base) << what << ": the tensor changed";
    // The same payload into the block a receiver keeps (rows 8..15 of the tensor as [16, 32]).
    const DeltaBlock b{16, 32, 8, 8, 0, 32};
    Bytes block = Cut(base, 2, 32, b);
    s = ApplyDeltaToBlock("down_proj", enc, 2, payload, b, block);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << what << " (block): " << s;
    EXPECT_EQ(block, Cut(base, 2, 32, b)) << what << ": the block changed";
    // And in place, checked (a dense payload one byte short is malformed too).
    Bytes mem = base;
    s = ApplyDeltaChecked("down_proj", enc, 2, payload, {1, 512, 0, 1, 0, 512}, {mem.data(), 512, 1},
                          DefinedSum64(base), DefinedSum64(next));
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << what << " (checked): " << s;
    EXPECT_EQ(mem, base) << what << ": the memory changed";
  }
  // A damaged value is well-formed: it applies, and the result is not the new version (what the
  // checksum of the result, around the delta, is there to catch).
  Bytes damaged = r.indices;
  damaged.back() ^= 1;
  Bytes tensor = base;
  ASSERT_TRUE(ApplyDelta("t", DeltaEncoding::kIndices, 2, damaged, tensor).ok());
  EXPECT_NE(tensor, next);
}

}  // namespace
}  // namespace wsync::kernels
