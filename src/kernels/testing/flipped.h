// Test helper for the quantizers' reuse tests (QuantizeReuse, kernels/int4.h): 16-bit weights
// changed as one optimizer step at an RL learning rate changes them.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace wsync::kernels::testing {

// `w` (bf16 or fp16 bit patterns) with the lowest bit of `count` elements flipped, drawn with
// std::mt19937_64(seed): one ulp each, never Inf or NaN from a finite value below the largest.
inline std::vector<uint16_t> Flipped(std::vector<uint16_t> w, int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> at(0, w.size() - 1);
  for (int64_t i = 0; i < count; ++i) w[at(rng)] ^= 1;
  return w;
}

}  // namespace wsync::kernels::testing
