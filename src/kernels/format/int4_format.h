// Bit-level INT4 formats shared by the CPU (kernels/cpu/*.cc) and CUDA (kernels/cuda/*.cu) code:
// the one source of truth for nibble order, Marlin tile offsets and the scale permutations
// (STYLE.md §5, FORMATS.md §1-§5). Nothing here allocates; everything is a pure function usable on
// the host and, under nvcc, on the device.
//
// Math (FORMATS.md §1, §2):
//   amax[n,g] = max_{k in group g} |W[n,k]|                  exact (bf16/fp16 -> f32 is exact)
//   scale     = max(fl32(amax / 7.0f), 1e-5f)                 variant qat   (§1.1)
//             = max(fl32(amax * 0x1.24924ap-3f), 1e-5f)       variant slime (§1.2, fl32(1/7))
//   q         = clamp(rint(fl32(f32(W) / scale)), -7, 7)      IEEE division, round half to even
//   u         = q + 8                                         uint4b8 nibble, 0..15
//   word j    = OR_i u[8j+i] << 4i                            smaller K index in the lower bits
//
// Marlin tile (FORMATS.md §4.2): the GPTQ weight u[K, N] (qweight[K/8, N] packed along K) is cut
// into 16 (K) x 64 (N) tiles; tile (kt, nt) becomes the 128 words at (kt*(N/64) + nt)*128 of the
// [K/16, 2N] output. Word w = 4t + v (lane t, warp v), r = 2(t%4), c = 16v + t/4; nibble j holds
// u[16kt + r + kDk[j], 64nt + c + kDn[j]].
//
// Thread-safety: pure functions and constants.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/format/host_device.h"

namespace wsync::kernels::format {

// ---- nibbles (§2) --------------------------------------------------------------------------------

inline constexpr int kNibbleBias = 8;                      // uint4b8: stored u = q + 8
inline constexpr int kNibblesPerWord = 8;                  // 8 K-consecutive values per int32 word
inline constexpr int kQMax = 7;                            // symmetric range produced by both variants: -7..7
inline constexpr uint32_t kSymmetricQZeros = 0x77777777u;  // GPTQ qzeros for symmetric 4 bit (§3)

// Nibble i (bits 4i..4i+3) of a packed word.
WSYNC_HD uint32_t GetNibble(uint32_t word, int i) { return (word >> (4 * i)) & 0xFu; }

// ---- quantization scalars (§1) -------------------------------------------------------------------

enum class Variant : int { kQat = 0, kSlime = 1 };

inline constexpr float kScaleFloor = 1e-5f;        // the clamp(min=1e-5) of both variants
inline constexpr float kSymCons = 0x1.24924ap-3f;  // fl32(1/7) = 0x3E124925 (§1.2 SYM_CONS)

// Group scale from the group's absolute maximum, in float32, exactly as the variant computes it.
// max(a, floor) is written as a comparison so that a NaN amax stays NaN on host and device alike.
WSYNC_HD float GroupScale(float amax, Variant variant) {
  const float s = variant == Variant::kQat ? amax / 7.0f : amax * kSymCons;
  return s < kScaleFloor ? kScaleFloor : s;
}

// Round half to even of an already-divided value, clamped to [-7, 7]; NaN maps to -7 (the x86
// maxps / CUDA fmaxf convention "max(NaN, b) = b" that the vector CPU path also follows).
WSYNC_HD int QuantizeRatio(float ratio) {
  float r = rintf(ratio);
  r = fmaxf(r, -static_cast<float>(kQMax));
  r = fminf(r, static_cast<float>(kQMax));
  return static_cast<int>(r);
}

// The stored nibble u = q + 8 of one value.
WSYNC_HD uint32_t QuantizeNibble(float x, float scale) {
  return static_cast<uint32_t>(QuantizeRatio(x / scale) + kNibbleBias);
}

// |x| of a bf16 or fp16 bit pattern as an integer whose order equals the order of |x| for all
// non-NaN values (sign-magnitude formats): the CPU and CUDA amax reduce these, then convert once.
WSYNC_HD uint32_t AbsBits16(uint32_t bits16) { return bits16 & 0x7FFFu; }
// Smallest |x| pattern that is Inf or NaN: a group whose AbsBits16 max reaches it is non-finite.
WSYNC_HD uint32_t NonFiniteAbsBits16(bool bf16) { return bf16 ? 0x7F80u : 0x7C00u; }

// ---- Marlin tile (§4) ----------------------------------------------------------------------------

inline constexpr int kTileK = 16;       // marlin tile_k_size
inline constexpr int kTileN = 64;       // marlin tile_n_size
inline constexpr int kTileWords = 128;  // 16 * 64 nibbles / 8

// Bits [4s, 4s+4) of a Marlin word hold the element of the thread's B fragment at ElementAtSlot(s)
// (vLLM repack pack_idx; the FasterTransformer interleave that lets lop3 dequantize pairs).
WSYNC_HD int ElementAtSlot(int s) { return 2 * (s & 3) + (s >> 2); }  // (0, 2, 4, 6, 1, 3, 5, 7), no table
// K offset (from row r) and N offset (from column c) of fragment element e = 0..7:
// rows r, r+1, r+8, r+9 for e%4, column c for e < 4 and c + 8 for e >= 4 (mma.m16n8k16 B fragment).
WSYNC_HD int FragmentDk(int e) { return (e & 1) + 8 * ((e >> 1) & 1); }  // (0, 1, 8, 9) for e % 4
WSYNC_HD int FragmentDn(int e) { return e < 4 ? 0 : 8; }
// Combined: slot s of the word holds u[r + SlotDk(s), c + SlotDn(s)];
// SlotDk = (0, 8, 0, 8, 1, 9, 1, 9), SlotDn = (0, 0, 8, 8, 0, 0, 8, 8).
WSYNC_HD int SlotDk(int s) { return FragmentDk(ElementAtSlot(s)); }
WSYNC_HD int SlotDn(int s) { return FragmentDn(ElementAtSlot(s)); }

// Base row r (0, 2, 4, 6) and base column c (0..63) inside the tile of tile word w (0..127).
WSYNC_HD int WordRow(int w) { return 2 * ((w >> 2) & 3); }
WSYNC_HD int WordCol(int w) { return 16 * (w & 3) + (w >> 4); }

// Inverse map: the tile word and slot holding element (kl, cl) of a tile (kl < 16, cl < 64).
struct TileSlot {
  int word;
  int slot;
};
WSYNC_HD TileSlot LocateInTile(int kl, int cl) {
  const int dn = cl & 8;
  const int c0 = cl - dn;  // 16v + t/4
  const int v = c0 >> 4;
  const int r = (kl & 7) & ~1;  // rows r, r+1, r+8, r+9 share one word
  const int dk = kl - r;        // 0, 1, 8 or 9
  const int t = 4 * (c0 & 15) + r / 2;
  // slot s with SlotDk(s) == dk and SlotDn(s) == dn: s = (dk >= 8) + 2*(dn == 8) + 4*(dk & 1).
  const int slot = ((dk >> 3) & 1) + (dn ? 2 : 0) + 4 * (dk & 1);
  return TileSlot{4 * t + v, slot};
}

// Flat word offset of tile (kt, nt) in the Marlin [K/16, 2N] output.
WSYNC_HD int64_t TileOffset(int64_t kt, int64_t nt, int64_t n) { return (kt * (n / kTileN) + nt) * kTileWords; }

// One Marlin word of a tile from the two (possibly perm-gathered) GPTQ rows of that tile:
// a_lo/a_hi = GPTQ row 2kt / 2kt+1 at column c, b_lo/b_hi the same at column c + 8, rr = r / 2.
// Nibbles r and r+1 of each source word land in slots m and m + 4 (m = 0 a_lo, 1 a_hi, 2 b_lo,
// 3 b_hi), which is the closed form above with ElementAtSlot folded in.
WSYNC_HD uint32_t MarlinWord(uint32_t a_lo, uint32_t a_hi, uint32_t b_lo, uint32_t b_hi, int rr) {
  const int sh = 8 * rr;
  const uint32_t x0 = (a_lo >> sh) & 0xFFu, x1 = (a_hi >> sh) & 0xFFu;
  const uint32_t x2 = (b_lo >> sh) & 0xFFu, x3 = (b_hi >> sh) & 0xFFu;
  const uint32_t lo = (x0 & 0xFu) | ((x1 & 0xFu) << 4) | ((x2 & 0xFu) << 8) | ((x3 & 0xFu) << 12);
  const uint32_t hi = (x0 >> 4) | ((x1 >> 4) << 4) | ((x2 >> 4) << 8) | ((x3 >> 4) << 12);
  return lo | (hi << 16);
}

// Byte-plane form of the same map, used by the vectorizable CPU path. For GPTQ rows A (2kt) and
// B (2kt+1) at one column, byte rr of NibblePlaneLo holds (A nibble 2rr) | (B nibble 2rr) << 4 and
// byte rr of NibblePlaneHi holds (A nibble 2rr+1) | (B nibble 2rr+1) << 4.
WSYNC_HD uint32_t NibblePlaneLo(uint32_t a, uint32_t b) { return (a & 0x0F0F0F0Fu) | ((b & 0x0F0F0F0Fu) << 4); }
WSYNC_HD uint32_t NibblePlaneHi(uint32_t a, uint32_t b) { return ((a >> 4) & 0x0F0F0F0Fu) | (b & 0xF0F0F0F0u); }
// Inverse of the two planes: the GPTQ words A and B.
WSYNC_HD uint32_t PlanesToA(uint32_t lo, uint32_t hi) { return (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4); }
WSYNC_HD uint32_t PlanesToB(uint32_t lo, uint32_t hi) { return ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u); }
// 4x4 byte transpose: byte m of x[rr] <-> byte rr of x[m] (its own inverse). With
// x = {Lo(c), Lo(c+8), Hi(c), Hi(c+8)} it yields the Marlin words rr = 0..3 of column c, i.e.
// MarlinWord(A[c], B[c], A[c+8], B[c+8], rr).
WSYNC_HD void Transpose4x4Bytes(uint32_t& x0, uint32_t& x1, uint32_t& x2, uint32_t& x3) {
  const uint32_t t0 = (x0 & 0x00FF00FFu) | ((x1 & 0x00FF00FFu) << 8);  // bytes rr=0,2 of x0,x1
  const uint32_t t1 = ((x0 >> 8) & 0x00FF00FFu) | (x1 & 0xFF00FF00u);  // bytes rr=1,3
  const uint32_t t2 = (x2 & 0x00FF00FFu) | ((x3 & 0x00FF00FFu) << 8);
  const uint32_t t3 = ((x2 >> 8) & 0x00FF00FFu) | (x3 & 0xFF00FF00u);
  x0 = (t0 & 0xFFFFu) | (t2 << 16);
  x1 = (t1 & 0xFFFFu) | (t3 << 16);
  x2 = (t0 >> 16) | (t2 & 0xFFFF0000u);
  x3 = (t1 >> 16) | (t3 & 0xFFFF0000u);
}

// ---- Marlin scale permutation (§5) ---------------------------------------------------------------

inline constexpr int kScalePermGroupedWidth = 64;  // scale_perm: 64 columns
inline constexpr int kScalePermChannelWidth = 32;  // scale_perm_single: 32 columns

// Source column (within its 64-block) of grouped output column p: out[8i + j] = in[i + 8j].
WSYNC_HD int ScalePermGrouped(int p) { return (p >> 3) + 8 * (p & 7); }
// Source column (within its 32-block) of channelwise output column p:
// out[8i + j] = in[2i + (0, 1, 8, 9, 16, 17, 24, 25)[j]].
WSYNC_HD int ScalePermChannel(int p) {
  constexpr int k[8] = {0, 1, 8, 9, 16, 17, 24, 25};
  return 2 * (p >> 3) + k[p & 7];
}

}  // namespace wsync::kernels::format
