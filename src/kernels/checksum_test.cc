// Sum64 (kernels/checksum.h): the host function against values computed from the definition by
// an independent script (Python, big integers), against a byte-by-byte reimplementation in the
// test on random inputs (seeded), its sensitivity to every kind of damage it is meant to catch,
// and the CUDA kernel bit-equal to the host on the same bytes (skipped without a GPU).
#include "kernels/checksum.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/memory_space.h"
#include "kernels/dispatch.h"
#include "kernels/format/sum64.h"

namespace wsync::kernels {
namespace {

uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// The definition, one byte at a time.
uint64_t Reference(const std::vector<std::byte>& b) {
  uint64_t s = 0;
  for (size_t i = 0; i * 8 < b.size(); ++i) {
    uint64_t w = 0;
    for (size_t k = 0; k < 8 && 8 * i + k < b.size(); ++k) w |= uint64_t(b[8 * i + k]) << (8 * k);
    s += Mix(w ^ (i * 0x9E3779B97F4A7C15ull));
  }
  return Mix(s ^ (b.size() * 0xC2B2AE3D27D4EB4Full));
}
std::vector<std::byte> Bytes(const std::string& s) {
  std::vector<std::byte> b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}
std::vector<std::byte> Random(size_t n, std::mt19937_64& rng) {
  std::vector<std::byte> b(n);
  for (auto& x : b) x = std::byte(rng() & 0xFF);
  return b;
}
uint64_t Host(const std::vector<std::byte>& b) { return Sum64Host(b); }

TEST(Sum64Test, KnownValuesFromTheDefinition) {
  // Computed by a Python transcription of kernels/format/sum64.h.
  EXPECT_EQ(Host({}), 0x0ull);
  EXPECT_EQ(Host(Bytes("a")), 0x4106dec211560279ull);
  EXPECT_EQ(Host(Bytes("wsync sum64")), 0xc189770103f98d31ull);
  std::vector<std::byte> ramp(256);
  for (int i = 0; i < 256; ++i) ramp[i] = std::byte(i);
  EXPECT_EQ(Host(ramp), 0xd572d99b7e6950ddull);
  EXPECT_EQ(Host(std::vector<std::byte>(1000)), 0xe8cb67b6f09dcf4ull);
}

TEST(Sum64Test, EqualsTheByteByByteDefinitionOnRandomInputs) {
  const uint64_t seed = 20261127;
  std::mt19937_64 rng(seed);
  for (size_t n : {0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 1000, 4096 + 5, (1 << 20) + 3}) {
    std::vector<std::byte> b = Random(n, rng);
    EXPECT_EQ(Host(b), Reference(b)) << "n " << n << " seed " << seed;
    // Any alignment of the same bytes: copy them to an offset.
    std::vector<std::byte> shifted(n + 8);
    for (size_t off = 1; off < 8; ++off) {
      if (n > 0) std::memcpy(shifted.data() + off, b.data(), n);
      EXPECT_EQ(Sum64Host({shifted.data() + off, n}), Reference(b)) << "n " << n << " offset " << off;
    }
  }
}

// Sum64Unmix undoes the mixer (the multipliers' inverses in sum64.h are the point), and
// Sum64Unfinal gives back the sum of the terms the definition adds: what an update from a block's
// checksum (delta.h ApplyDeltaChecked) starts from.
TEST(Sum64Test, UnmixUndoesTheMixerAndUnfinalRecoversTheSumOfTerms) {
  const uint64_t seed = 20261201;
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> xs = {0, 1, ~uint64_t{0}, uint64_t{1} << 63, 0x9E3779B97F4A7C15ull};
  for (int i = 0; i < 10000; ++i) xs.push_back(rng());
  for (uint64_t x : xs) {
    ASSERT_EQ(format::Sum64Unmix(Mix(x)), x) << std::hex << x << " seed " << std::dec << seed;
    ASSERT_EQ(Mix(format::Sum64Unmix(x)), x) << std::hex << x;
  }
  for (size_t n : {0, 1, 8, 13, 64, 1000}) {
    const std::vector<std::byte> b = Random(n, rng);
    uint64_t s = 0;  // the definition's sum of terms, one byte at a time
    for (size_t i = 0; i * 8 < n; ++i) {
      uint64_t w = 0;
      for (size_t k = 0; k < 8 && 8 * i + k < n; ++k) w |= uint64_t(b[8 * i + k]) << (8 * k);
      s += Mix(w ^ (i * 0x9E3779B97F4A7C15ull));
    }
    EXPECT_EQ(format::Sum64Unfinal(Host(b), n), s) << "n " << n;
  }
}

TEST(Sum64Test, EveryFlippedBitMovedWordAndTrailingZeroChangesTheSum) {
  std::mt19937_64 rng(7);
  std::vector<std::byte> b = Random(257, rng);
  const uint64_t base = Host(b);
  for (size_t i = 0; i < b.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      b[i] ^= std::byte(1 << bit);
      EXPECT_NE(Host(b), base) << "byte " << i << " bit " << bit;
      b[i] ^= std::byte(1 << bit);
    }
  // Two words swapped (a reordered transfer), a word duplicated over its neighbour.
  std::vector<std::byte> swapped = b;
  std::memcpy(swapped.data(), b.data() + 64, 8);
  std::memcpy(swapped.data() + 64, b.data(), 8);
  EXPECT_NE(Host(swapped), base);
  std::vector<std::byte> dup = b;
  std::memcpy(dup.data() + 8, b.data(), 8);
  EXPECT_NE(Host(dup), base);
  // All-zero data of different lengths, and a trailing zero byte added or dropped.
  std::set<uint64_t> zeros;
  for (size_t n = 0; n <= 64; ++n) zeros.insert(Host(std::vector<std::byte>(n)));
  EXPECT_EQ(zeros.size(), 65u);
  std::vector<std::byte> longer = b;
  longer.push_back(std::byte{0});
  EXPECT_NE(Host(longer), base);
}

TEST(Sum64Test, HostSpaceIsTheHostFunction) {
  std::mt19937_64 rng(3);
  std::vector<std::byte> b = Random(1001, rng);
  absl::StatusOr<uint64_t> s = Sum64(MemorySpace::Host(), b.data(), b.size());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, Reference(b));
}

TEST(Sum64Test, CudaKernelEqualsTheHost) {
  if (!GpuAvailable()) {
    // Without CUDA compiled in, device memory is refused by name; with it but no device, skip.
    if (!CudaCompiledIn()) {
      absl::StatusOr<uint64_t> s = Sum64(MemorySpace::Cuda(0), reinterpret_cast<const void*>(64), 8);
      EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
    }
    GTEST_SKIP() << "no CUDA device";
  }
  const MemorySpace dev = MemorySpace::Cuda(0);
  const uint64_t seed = 11;
  std::mt19937_64 rng(seed);
  for (size_t n : {0, 1, 7, 8, 9, 255, 256, 257, 4096 + 5, (1 << 20) + 3, (64 << 20) + 1}) {
    std::vector<std::byte> b = Random(n, rng);
    absl::StatusOr<Buffer> d = dev.Allocate(n + 8);
    ASSERT_TRUE(d.ok()) << d.status();
    for (size_t off : {0, 1, 3, 8}) {
      ASSERT_TRUE(dev.Copy(d->data() + off, b.data(), n).ok());
      absl::StatusOr<uint64_t> s = Sum64(dev, d->data() + off, n);
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(*s, Host(b)) << "n " << n << " offset " << off << " seed " << seed;
    }
    // Summed in a word of the caller's (what the bucket streams pass) rather than the thread's.
    absl::StatusOr<Buffer> word = dev.Allocate(8);
    ASSERT_TRUE(word.ok()) << word.status();
    ASSERT_TRUE(dev.Copy(d->data(), b.data(), n).ok());
    absl::StatusOr<uint64_t> s = Sum64(dev, d->data(), n, word->data());
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(*s, Host(b)) << "n " << n << " (caller's word)";
  }
}

}  // namespace
}  // namespace wsync::kernels
