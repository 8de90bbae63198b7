// Test helper: byte patterns for the data-plane tests and the bandwidth benchmark's #wrong column:
// every byte depends on (seed, offset), so a misplaced, missing or duplicated piece is found, and
// the first wrong offset is reported. Pure functions over caller-owned memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace wsync::comm::testing {

inline uint64_t PatternWord(uint64_t seed, uint64_t word) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + word * 0xBF58476D1CE4E5B9ull + 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  return x ^ (x >> 32);
}

inline void FillPattern(void* data, size_t n, uint64_t seed) {
  auto* p = static_cast<unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t w = PatternWord(seed, i / 8);
    std::memcpy(p + i, &w, 8);
  }
  if (i < n) {
    const uint64_t w = PatternWord(seed, i / 8);
    std::memcpy(p + i, &w, n - i);
  }
}

// Number of wrong bytes (0 when the buffer holds the pattern); `first` gets the first bad offset.
inline size_t CountWrong(const void* data, size_t n, uint64_t seed, size_t* first = nullptr) {
  const auto* p = static_cast<const unsigned char*>(data);
  size_t wrong = 0;
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t w = PatternWord(seed, i / 8);
    const size_t len = n - i < 8 ? n - i : 8;
    if (std::memcmp(p + i, &w, len) != 0) {
      const auto* e = reinterpret_cast<const unsigned char*>(&w);
      for (size_t j = 0; j < len; ++j) {
        if (p[i + j] != e[j]) {
          if (wrong == 0 && first) *first = i + j;
          ++wrong;
        }
      }
    }
  }
  return wrong;
}

}  // namespace wsync::comm::testing
