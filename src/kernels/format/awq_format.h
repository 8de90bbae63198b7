// Bit-level AWQ W4 format (docs/spec/AWQ.md, cited as §n) shared by the CPU (kernels/cpu/) and
// CUDA (kernels/cuda/) code: the quantization arithmetic of both variants, the AWQ column
// interleave, and the Marlin zero-point layout. Pure functions, host and device (WSYNC_HD).
//
// Math (§1), per weight row n and group g of G columns, u = unsigned code, z = zero point:
//   fp16 (AutoAWQ on CUDA, every op rounded to fp16 as torch's half ops do):
//     wh = fp16(w); mx, mn = max/min(wh); d = fp16(mx - mn); d = d < fp16(1e-5) ? fp16(1e-5) : d
//     s  = fp16(fl32(d * fl32(1/15)))            torch turns `/ 15` into `* fl32(1/15)` (§1, P1)
//     z  = clamp(-rint(fp16(mn / s)), 0, 15);    u = clamp(rint(fp16(wh / s)) + z, 0, 15)
//   fp32 (wsync's float32 variant, every op rounded to float32):
//     s  = max(mx - mn, 1e-5f) / 15.0f;  z = clamp(-rint(mn / s), 0, 15);  u = clamp(rint(w / s) + z, 0, 15)
// rint is round half to even. fp16(x) of a float32 x equals the correctly rounded fp16 result of
// the exact operation (24 >= 2 * 11 + 2: double rounding is innocuous for + - * /), which is how
// torch's CUDA half ops compute (float opmath, one rounding to half).
//
// Packing (§2): AWQ words pack 8 N-consecutive codes: nibble i of word (k, j) holds column
// n = 8j + kAwqOrder[i]; qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N].
// Marlin zero points (§3.3): nibble t of word (g, w) holds z[g, 64(w/8) + (w%8) + 8 kAwqOrder[t]].
//
// Thread-safety: pure functions and constants.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/format/int4_format.h"

namespace wsync::kernels::format {

// ---- AWQ column interleave (§2) --------------------------------------------------------------------

// Column (within its 8) held by nibble i of an AWQ word: ORDER = (0, 2, 4, 6, 1, 3, 5, 7).
WSYNC_HD int AwqOrder(int i) { return ElementAtSlot(i); }  // the same interleave as Marlin's pack_idx
// Nibble holding column c % 8: REV = argsort(ORDER) = (0, 4, 1, 5, 2, 6, 3, 7).
WSYNC_HD int AwqReverse(int c) { return (c >> 1) + 4 * (c & 1); }  // closed form: no table in device local memory

// Transposes an 8x8 matrix of nibbles held in 8 words in place: nibble i of word r <-> nibble r
// of word i. Three rounds of masked swaps (4x4 blocks, 2x2 blocks, single nibbles).
WSYNC_HD void TransposeNibbles8x8(uint32_t m[8]) {
  for (int r = 0; r < 4; ++r) {  // 4x4 blocks: high half of word r <-> low half of word r + 4
    const uint32_t a = m[r], b = m[r + 4];
    m[r] = (a & 0x0000FFFFu) | (b << 16);
    m[r + 4] = (a >> 16) | (b & 0xFFFF0000u);
  }
  for (int r = 0; r < 8; r += (r % 4 == 1) ? 3 : 1) {  // r = 0, 1, 4, 5: bytes 1, 3 of r <-> bytes 0, 2 of r + 2
    const uint32_t a = m[r], b = m[r + 2];
    m[r] = (a & 0x00FF00FFu) | ((b & 0x00FF00FFu) << 8);
    m[r + 2] = ((a >> 8) & 0x00FF00FFu) | (b & 0xFF00FF00u);
  }
  for (int r = 0; r < 8; r += 2) {  // odd nibbles of r <-> even nibbles of r + 1
    const uint32_t a = m[r], b = m[r + 1];
    m[r] = (a & 0x0F0F0F0Fu) | ((b & 0x0F0F0F0Fu) << 4);
    m[r + 1] = ((a >> 4) & 0x0F0F0F0Fu) | (b & 0xF0F0F0F0u);
  }
}

// An 8 (K) x 8 (N) block, AWQ -> GPTQ orientation: awq[r] = AWQ word of row k0 + r (8 columns,
// interleaved); on return gptq[c] = GPTQ word of column 8j + c (rows k0..k0+7, row r at nibble r).
WSYNC_HD void AwqBlockToGptq(const uint32_t awq[8], uint32_t gptq[8]) {
  uint32_t m[8];
  for (int r = 0; r < 8; ++r) m[r] = awq[r];
  TransposeNibbles8x8(m);  // m[i] = nibble i of every row = column AwqOrder(i)
  for (int i = 0; i < 8; ++i) gptq[AwqOrder(i)] = m[i];
}
// The inverse: gptq[c] (column c, 8 rows) -> awq[r] (row r, 8 interleaved columns).
WSYNC_HD void GptqBlockToAwq(const uint32_t gptq[8], uint32_t awq[8]) {
  for (int i = 0; i < 8; ++i) awq[i] = gptq[AwqOrder(i)];
  TransposeNibbles8x8(awq);
}

// Code of column c of an AWQ row given the word holding it (word c / 8).
WSYNC_HD uint32_t AwqNibble(uint32_t word, int64_t c) { return GetNibble(word, AwqReverse(static_cast<int>(c & 7))); }

// Marlin zero-point word (g, w) from the AWQ qzeros row g (§3.3): nibble t = z[64(w/8) + (w%8) + 8 ORDER[t]],
// i.e. nibble REV[w % 8] of AWQ word 8(w/8) + ORDER[t].
WSYNC_HD uint32_t MarlinZeroWord(const uint32_t* awq_row, int64_t w) {
  const int64_t base = 8 * (w >> 3);
  const int sh = 4 * AwqReverse(static_cast<int>(w & 7));
  uint32_t out = 0;
  for (int t = 0; t < 8; ++t) out |= ((awq_row[base + AwqOrder(t)] >> sh) & 0xFu) << (4 * t);
  return out;
}
// The inverse, as a gather: z of column n from a Marlin zero-point row is nibble REV[(n % 64) / 8]
// of word 8 (n / 64) + n % 8.
WSYNC_HD uint32_t MarlinZeroOf(const uint32_t* marlin_row, int64_t n) {
  return GetNibble(marlin_row[8 * (n >> 6) + (n & 7)], AwqReverse(static_cast<int>((n & 63) >> 3)));
}
// AWQ qzeros word j of a row from the Marlin zero-point row: nibble i = z[8j + ORDER[i]].
WSYNC_HD uint32_t AwqZeroWordFromMarlin(const uint32_t* marlin_row, int64_t j) {
  uint32_t out = 0;
  for (int i = 0; i < 8; ++i) out |= MarlinZeroOf(marlin_row, 8 * j + AwqOrder(i)) << (4 * i);
  return out;
}

// ---- quantization arithmetic (§1) ------------------------------------------------------------------

enum class AwqArith : int { kFp16 = 0, kFp32 = 1 };

inline constexpr int kAwqMaxCode = 15;               // 2^4 - 1
inline constexpr float kAwqInv15 = 0x1.111112p-4f;   // fl32(1/15) = 0x3D888889 (§1, P1)
inline constexpr float kF16ScaleFloor = 0x1.5p-17f;  // fp16(1e-5) = 168 * 2^-24 (a subnormal)
inline constexpr float kF16Max = 65504.0f;
inline constexpr uint32_t kF16OverflowBits = 0x477FF000u;  // |x| >= 65520 rounds to inf in fp16

WSYNC_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
WSYNC_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// True for +-inf (host and device alike, without <cmath>'s overload set).
WSYNC_HD bool IsInfF(float f) { return (FloatBits(f) & 0x7FFFFFFFu) == 0x7F800000u; }

// The float32 constant C = 1.5 * 2^(E - 127), E = e + 13, whose ulp is the fp16 quantum of a value
// with biased float exponent e (clamped to the fp16 subnormal quantum 2^-24 below 2^-14 = e 113):
// (x + C) - C rounds x to that quantum, half to even, for every |x| < 2^16.
WSYNC_HD float F16QuantumMagic(uint32_t abs_bits) {
  uint32_t e = abs_bits >> 23;
  e = e < 113u ? 113u : (e > 142u ? 142u : e);
  return BitsFloat(((e + 13u) << 23) | 0x00400000u);
}

// x rounded to the nearest fp16 value (half to even), returned as float: exact IEEE float -> half
// rounding including subnormals and overflow to +-inf (|x| >= 65520); NaN stays NaN.
WSYNC_HD float RoundToF16(float x) {
  const uint32_t a = FloatBits(x) & 0x7FFFFFFFu;
  if (a >= kF16OverflowBits) return a > 0x7F800000u ? x : copysignf(INFINITY, x);
  const float c = F16QuantumMagic(a);
  const float r = (x + c) - c;
  return copysignf(r, x);
}

// Group parameters: the scale used for the codes (an fp16 value for kFp16), its zero point.
struct AwqGroup {
  float scale;
  float zero;  // 0..15, integral
};

// §1 from the group's max and min (the float values of the weights; for kFp16 already fp16 values).
WSYNC_HD AwqGroup AwqGroupParams(float mx, float mn, AwqArith arith) {
  AwqGroup p;
  if (arith == AwqArith::kFp16) {
    float d = RoundToF16(mx - mn);
    d = d < kF16ScaleFloor ? kF16ScaleFloor : d;  // clamp(min=1e-5) against fp16(1e-5)
    p.scale = RoundToF16(d * kAwqInv15);
    p.zero = -rintf(RoundToF16(mn / p.scale));
  } else {
    float d = mx - mn;
    d = d < kScaleFloor ? kScaleFloor : d;
    p.scale = d / 15.0f;
    p.zero = -rintf(mn / p.scale);
  }
  p.zero = fminf(fmaxf(p.zero, 0.0f), static_cast<float>(kAwqMaxCode));
  return p;
}

// The code u of one weight value x (for kFp16: x already an fp16 value).
WSYNC_HD uint32_t AwqCode(float x, AwqGroup p, AwqArith arith) {
  float q = x / p.scale;
  if (arith == AwqArith::kFp16) q = RoundToF16(q);
  float u = rintf(q) + p.zero;  // exact in float wherever the clamp does not decide
  u = fminf(fmaxf(u, 0.0f), static_cast<float>(kAwqMaxCode));
  return static_cast<uint32_t>(u);
}

}  // namespace wsync::kernels::format
