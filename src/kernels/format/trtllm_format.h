// Bit-level TensorRT-LLM INT4 mixed-GEMM weight layouts (docs/spec/TRTLLM_INT4.md, cited as §n),
// shared by the CPU (kernels/cpu/) and CUDA (kernels/cuda/) code. Pure functions, host and device.
//
// preprocess_weights_for_mixed_gemm of one [K, N] int4 matrix q (per expert; §1) is a fixed
// permutation of nibbles plus a bias; its closed form (§1.1), with k' the row after the LDSM row
// permutation (src(k') = 32 (k'/32) + PERM[k' % 32]):
//   value  = (q[src(k'), n] + 8) & 0xF                       (W4AFP8 on sm90: q & 0xF, no perm)
//   word W = (n/4)(K/2) + 32(k'/64) + 8(n%4) + (k'%64)/8       sm80 layout, W4A16 (RPT 64, I 4)
//          = (n/2)(K/4) + 32(k'/128) + 16(n%2) + (k'%128)/8    sm80 layout, W4AFP8 (RPT 128, I 2)
//          = n (K/8) + k'/8                                    sm90 dense (no column interleave)
//   nibble = kRegDst[k' % 8] of word W                         register interleave (step 4)
// W4AFP8 on sm90 is the plain transpose: word n (K/8) + k/8, nibble k % 8, signed nibbles.
// Inputs here are unsigned codes u (compressed-tensors uint4b8 u = q + 8, or AWQ u with zero point
// z, which TRT-LLM takes as q = u - 8 and zero = (8 - z) s, §3.1), so value = u (W4A16) or u ^ 8.
//
// The kernels work per output word: TrtllmWordSource gives its column n and first row k'0, and
// nibble j then holds source row Src(k'0 + kRegSrc[j]).
// Thread-safety: pure functions and constants.
#pragma once

#include <cstdint>

#include "kernels/format/int4_format.h"

namespace wsync::kernels::format {

// Which of the §2 byte layouts a weight gets.
enum class TrtllmLayout : int {
  kSm80W4A16 = 0,   // MoE on every arch, dense off sm90 (steps 1-4)
  kSm80W4AFp8 = 1,  // MoE W4AFP8 on sm89 (steps 1-4 with the W4_AFP8 constants)
  kSm90Dense = 2,   // dense W4A16 on sm90 (steps 1, 2, 4)
  kSm90W4AFp8 = 3,  // MoE W4AFP8 on sm90 (transpose only, signed nibbles): [E, N, K/2]
};

inline constexpr int kTrtllmRowBlock = 32;  // B_ROWS_PER_MMA: the LDSM permutation acts per 32 rows

// Row of the source (within its 32-row block) that lands at position t after step 1.
WSYNC_HD int TrtllmRowPerm(TrtllmLayout layout, int t) {
  constexpr int kW4A16[32] = {0, 1, 8,  9,  16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
                              4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31};
  constexpr int kW4AFp8[32] = {0, 1, 2,  3,  16, 17, 18, 19, 4,  5,  6,  7,  20, 21, 22, 23,
                               8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  switch (layout) {
    case TrtllmLayout::kSm80W4AFp8: return kW4AFp8[t];
    case TrtllmLayout::kSm90W4AFp8: return t;
    default: return kW4A16[t];
  }
}

// Step 4, the register interleave inside a word: destination nibble j takes source nibble
// kRegSrc[j] (0 2 4 6 1 3 5 7; the same interleave as Marlin's pack_idx); none for sm90 W4AFP8.
WSYNC_HD int TrtllmRegSrc(TrtllmLayout layout, int j) {
  return layout == TrtllmLayout::kSm90W4AFp8 ? j : ElementAtSlot(j);
}

// XOR applied to every unsigned code u: 0 (value u = q + 8) or 8 (signed nibble q & 0xF).
WSYNC_HD uint32_t TrtllmCodeXor(TrtllmLayout layout) { return layout == TrtllmLayout::kSm90W4AFp8 ? 8u : 0u; }

// Rows per tile (RPT) of the column interleave; 0 where there is none.
WSYNC_HD int TrtllmRowsPerTile(TrtllmLayout layout) {
  return layout == TrtllmLayout::kSm80W4A16 ? 64 : (layout == TrtllmLayout::kSm80W4AFp8 ? 128 : 0);
}

// Output word of (column n, permuted row k'0 with k'0 % 8 == 0) in a K-row matrix.
WSYNC_HD int64_t TrtllmWordOf(TrtllmLayout layout, int64_t n, int64_t kp, int64_t k) {
  switch (layout) {
    case TrtllmLayout::kSm80W4A16: return (n / 4) * (k / 2) + 32 * (kp / 64) + 8 * (n % 4) + (kp % 64) / 8;
    case TrtllmLayout::kSm80W4AFp8: return (n / 2) * (k / 4) + 32 * (kp / 128) + 16 * (n % 2) + (kp % 128) / 8;
    default: return n * (k / 8) + kp / 8;
  }
}

struct TrtllmSource {
  int64_t n;   // column
  int64_t kp;  // first permuted row k'0 of the word (a multiple of 8)
};

// Inverse of TrtllmWordOf: the column and first row held by output word w.
WSYNC_HD TrtllmSource TrtllmWordSource(TrtllmLayout layout, int64_t w, int64_t k) {
  switch (layout) {
    case TrtllmLayout::kSm80W4A16: {
      const int64_t block = w / (k / 2), rem = w % (k / 2);
      const int64_t within = rem % 32;
      return TrtllmSource{4 * block + within / 8, 64 * (rem / 32) + 8 * (within % 8)};
    }
    case TrtllmLayout::kSm80W4AFp8: {
      const int64_t block = w / (k / 4), rem = w % (k / 4);
      const int64_t within = rem % 32;
      return TrtllmSource{2 * block + within / 16, 128 * (rem / 32) + 8 * (within % 16)};
    }
    default: return TrtllmSource{w / (k / 8), 8 * (w % (k / 8))};
  }
}

// Source row of permuted row kp (step 1).
WSYNC_HD int64_t TrtllmSrcRow(TrtllmLayout layout, int64_t kp) {
  return (kp & ~int64_t{kTrtllmRowBlock - 1}) + TrtllmRowPerm(layout, static_cast<int>(kp & (kTrtllmRowBlock - 1)));
}

// Inverse of TrtllmSrcRow: the permuted row k' that source row `row` lands at.
WSYNC_HD int64_t TrtllmPermutedRow(TrtllmLayout layout, int64_t row) {
  const int r = static_cast<int>(row & (kTrtllmRowBlock - 1));
  int t = 0;
  while (TrtllmRowPerm(layout, t) != r) ++t;  // 32 entries; a fixed permutation
  return (row & ~int64_t{kTrtllmRowBlock - 1}) + t;
}
// Inverse of TrtllmRegSrc: the destination nibble of source nibble s (0 4 1 5 2 6 3 7).
WSYNC_HD int TrtllmRegDst(TrtllmLayout layout, int s) {
  return layout == TrtllmLayout::kSm90W4AFp8 ? s : (s & 1) * 4 + (s >> 1);
}

// Output word w of a layout from a code accessor code(k, n) -> u (0..15).
template <typename CodeAt>
WSYNC_HD uint32_t TrtllmWord(TrtllmLayout layout, int64_t w, int64_t k, CodeAt code) {
  const TrtllmSource s = TrtllmWordSource(layout, w, k);
  const uint32_t x = TrtllmCodeXor(layout);
  uint32_t out = 0;
  for (int j = 0; j < 8; ++j) {
    const int64_t row = TrtllmSrcRow(layout, s.kp + TrtllmRegSrc(layout, j));
    out |= ((code(row, s.n) ^ x) & 0xFu) << (4 * j);
  }
  return out;
}

// The unsigned code u of (row, column n) read back from a preprocessed weight (words of 8 nibbles).
WSYNC_HD uint32_t TrtllmCodeAt(TrtllmLayout layout, const uint32_t* words, int64_t row, int64_t n, int64_t k) {
  const int64_t kp = TrtllmPermutedRow(layout, row);
  const uint32_t word = words[TrtllmWordOf(layout, n, kp & ~int64_t{7}, k)];
  return GetNibble(word, TrtllmRegDst(layout, static_cast<int>(kp & 7))) ^ TrtllmCodeXor(layout);
}

// ---- whole 32-row blocks (the vectorizable CPU form of the same map) --------------------------------

// Step 4's interleave of one word: even nibbles to the low half, odd ones to the high half.
WSYNC_HD uint32_t UnzipNibbles(uint32_t x) {
  uint32_t e = x & 0x0F0F0F0Fu, o = (x >> 4) & 0x0F0F0F0Fu;
  e = (e | (e >> 4)) & 0x00FF00FFu;
  o = (o | (o >> 4)) & 0x00FF00FFu;
  e = (e | (e >> 8)) & 0x0000FFFFu;
  o = (o | (o >> 8)) & 0x0000FFFFu;
  return e | (o << 16);
}
// Inverse of UnzipNibbles.
WSYNC_HD uint32_t ZipNibbles(uint32_t x) {
  uint32_t e = x & 0xFFFFu, o = x >> 16;
  e = (e | (e << 8)) & 0x00FF00FFu;
  o = (o | (o << 8)) & 0x00FF00FFu;
  e = (e | (e << 4)) & 0x0F0F0F0Fu;
  o = (o | (o << 4)) & 0x0F0F0F0Fu;
  return e | (o << 4);
}

// One column's 32-row block b: in[r] = code word of rows 32b + 8r .. 32b + 8r + 7 (row i at nibble
// i); out[t] = the output word holding k' = 32b + 8t .. + 7 (at TrtllmWordOf(layout, n, 32b + 8t, K)).
// W4A16: step 1 takes byte t of every input word (PERM pairs rows 8r + 2t, 8r + 2t + 1), a 4x4
// byte transpose; W4AFP8 (sm89): half t % 2 of words t / 2 and 2 + t / 2; then step 4's unzip.
WSYNC_HD void TrtllmBlock(TrtllmLayout layout, const uint32_t in[4], uint32_t out[4]) {
  if (layout == TrtllmLayout::kSm90W4AFp8) {
    for (int t = 0; t < 4; ++t) out[t] = in[t] ^ 0x88888888u;
    return;
  }
  uint32_t x[4] = {in[0], in[1], in[2], in[3]};
  if (layout == TrtllmLayout::kSm80W4AFp8) {
    for (int t = 0; t < 4; ++t) {
      const int sh = 16 * (t & 1);
      x[t] = ((in[t >> 1] >> sh) & 0xFFFFu) | (((in[2 + (t >> 1)] >> sh) & 0xFFFFu) << 16);
    }
  } else {
    Transpose4x4Bytes(x[0], x[1], x[2], x[3]);
  }
  for (int t = 0; t < 4; ++t) out[t] = UnzipNibbles(x[t]);
}

// Inverse of TrtllmBlock.
WSYNC_HD void TrtllmBlockInverse(TrtllmLayout layout, const uint32_t out[4], uint32_t in[4]) {
  if (layout == TrtllmLayout::kSm90W4AFp8) {
    for (int t = 0; t < 4; ++t) in[t] = out[t] ^ 0x88888888u;
    return;
  }
  uint32_t x[4];
  for (int t = 0; t < 4; ++t) x[t] = ZipNibbles(out[t]);
  if (layout == TrtllmLayout::kSm80W4AFp8) {
    for (int r = 0; r < 4; ++r) {  // word r (< 2) = halves of x[2r], x[2r+1] low; word 2 + r: their high
      const int w = r & 1, hi = r >> 1;
      in[r] = ((x[2 * w] >> (16 * hi)) & 0xFFFFu) | (((x[2 * w + 1] >> (16 * hi)) & 0xFFFFu) << 16);
    }
  } else {
    Transpose4x4Bytes(x[0], x[1], x[2], x[3]);
    for (int r = 0; r < 4; ++r) in[r] = x[r];
  }
}

// W4AFP8 on sm90 (§3.2): scales [K/G, N] -> [K/G/I, N I] with I = 4, 2 or 1 as K % 4G, 2G.
WSYNC_HD int TrtllmScaleInterleave(int64_t k, int64_t g) { return k % (4 * g) == 0 ? 4 : (k % (2 * g) == 0 ? 2 : 1); }
// Source (row, column) of output scale (a, c) of that interleave: out[a, n I + i] = s[a I + i, n].
WSYNC_HD void TrtllmInterleavedScaleSource(int64_t a, int64_t c, int il, int64_t* row, int64_t* col) {
  *row = a * il + c % il;
  *col = c / il;
}

}  // namespace wsync::kernels::format
