// Sum64: the checksum of a bucket that stays in device memory (the NCCL data plane), computed
// where the bytes are: by a CUDA kernel on the GPU, by the same arithmetic on the host. XXH3
// (common/checksum.h) is sequential within a stripe and has no device code; Sum64 is a sum of
// independent per-word terms, so any number of threads can add them in any order and get the
// same bits. It detects damage (a changed, lost, duplicated or moved word), not forgery.
//
// Definition (version 1), for n bytes b[0, n):
//   word i   w_i = b[8i .. 8i+7] as a little-endian uint64, the last one zero-padded, i < ceil(n/8);
//   term i   Mix(w_i XOR (i * 0x9E3779B97F4A7C15))        (mod 2^64)
//   Sum64    Mix(S XOR (n * 0xC2B2AE3D27D4EB4F)), S = the sum of every term (mod 2^64)
//   Mix      the SplitMix64 finalizer: x ^= x >> 30; x *= 0xBF58476D1CE4E5B9; x ^= x >> 27;
//            x *= 0x94D049BB133111EB; x ^= x >> 31 (a bijection of uint64).
// Mix being a bijection, a change of any one word changes its term, hence S; the index in every
// term makes moved words count; n in the final step tells trailing zero bytes from none.
// Being a sum, it can be updated: from a block's Sum64 (Sum64Unfinal recovers S), replacing word
// i's old value by a new one changes S by Term(new, i) - Term(old, i), so a few changed words cost
// a few terms, not a pass over the block (kernels/delta.h ApplyDeltaChecked).
//
// Thread-safety: pure functions and constants.
#pragma once

#include <cstdint>

#include "kernels/format/host_device.h"

namespace wsync::kernels::format {

inline constexpr uint64_t kSum64Step = 0x9E3779B97F4A7C15ull;
inline constexpr uint64_t kSum64Length = 0xC2B2AE3D27D4EB4Full;

WSYNC_HD uint64_t Sum64Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}
// The term of word `w` at word index `i`.
WSYNC_HD uint64_t Sum64Term(uint64_t w, uint64_t i) { return Sum64Mix(w ^ (i * kSum64Step)); }
// The checksum from the sum of every term and the byte count.
WSYNC_HD uint64_t Sum64Final(uint64_t sum, uint64_t nbytes) { return Sum64Mix(sum ^ (nbytes * kSum64Length)); }
// The inverse of Sum64Mix: Sum64Unmix(Sum64Mix(x)) == x for every x.
WSYNC_HD uint64_t Sum64Unmix(uint64_t x) {
  // x * 0xBF58476D1CE4E5B9 and x * 0x94D049BB133111EB are undone by the multipliers' inverses mod
  // 2^64; x ^= x >> s (s >= 22) by x ^= x >> s ^ x >> 2s.
  x ^= (x >> 31) ^ (x >> 62);
  x *= 0x319642B2D24D8EC3ull;
  x ^= (x >> 27) ^ (x >> 54);
  x *= 0x96DE1B173F119089ull;
  x ^= (x >> 30) ^ (x >> 60);
  return x;
}
// The sum of every term of a checksum `sum` of `nbytes` bytes: Sum64Final(Sum64Unfinal(s, n), n) == s.
WSYNC_HD uint64_t Sum64Unfinal(uint64_t sum, uint64_t nbytes) { return Sum64Unmix(sum) ^ (nbytes * kSum64Length); }
// Word `i` of `p[0, n)`, byte by byte (any alignment; zero past n). Little-endian.
WSYNC_HD uint64_t Sum64WordAt(const unsigned char* p, uint64_t n, uint64_t i) {
  uint64_t w = 0;
  for (uint64_t k = 0; k < 8 && 8 * i + k < n; ++k) w |= static_cast<uint64_t>(p[8 * i + k]) << (8 * k);
  return w;
}

}  // namespace wsync::kernels::format
