// Per-thread bodies of the CUDA INT4 kernels (kernels/cuda/int4_kernels.cu), written once as
// WSYNC_HD functions so that a host test (int4_kernel_bodies_test.cc) can run them for every
// (block, thread) and compare with the CPU path byte for byte: the kernels' index arithmetic is
// tested on machines without a GPU. Only the launch shape, shared-memory declaration, barriers,
// warp shuffles and atomics stay in the .cu file (each body states which phase it is).
//
// Math and layout: kernels/format/int4_format.h. Device conversions use the CUDA intrinsics
// (__half2float, __float2bfloat16_rn, __float2half_rn: exact / round to nearest even), host ones
// the equivalent common/dtype.h functions.
// Thread-safety: pure functions of their arguments; each writes only its own outputs.
#pragma once

#include <cstdint>

#include "kernels/format/int4_format.h"
#include "kernels/int4_args.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#include "common/dtype.h"

namespace wsync::kernels::cuda_body {

namespace fmt = ::wsync::kernels::format;
using internal::Layout;

// 8 consecutive 16-bit values (element 2i in the low half of word i); 16-byte aligned so that the
// device copies it with one vector load/store.
struct alignas(16) Vec8 {
  uint32_t w[4];
};
// 4 packed words written with one 16-byte store.
struct alignas(16) Words4 {
  uint32_t w[4];
};

// f32 value of a bf16 or fp16 bit pattern (both exact).
template <bool kBf16>
WSYNC_HD float ToF32(uint32_t bits16) {
#if defined(__CUDA_ARCH__)
  if constexpr (kBf16) {
    return __uint_as_float(bits16 << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
  }
#else
  return kBf16 ? BF16ToF32(static_cast<uint16_t>(bits16)) : F16ToF32(static_cast<uint16_t>(bits16));
#endif
}

// The f32 scale narrowed to the weight dtype, round to nearest even.
template <bool kBf16>
WSYNC_HD uint16_t FromF32(float f) {
#if defined(__CUDA_ARCH__)
  if constexpr (kBf16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  } else {
    return __half_as_ushort(__float2half_rn(f));
  }
#else
  return kBf16 ? F32ToBF16(f) : F32ToF16(f);
#endif
}

// Running max of the 15-bit magnitudes of the 8 values of v.
WSYNC_HD uint32_t AbsMax8(const Vec8& v, uint32_t m) {
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = fmt::AbsBits16(v.w[i] & 0xFFFFu), hi = fmt::AbsBits16(v.w[i] >> 16);
    m = m > lo ? m : lo;
    m = m > hi ? m : hi;
  }
  return m;
}

// The packed word of the 8 values of v (value i -> nibble i).
template <bool kBf16>
WSYNC_HD uint32_t PackVec8(const Vec8& v, float scale) {
  uint32_t word = 0;
  for (int i = 0; i < 4; ++i) {
    word |= fmt::QuantizeNibble(ToF32<kBf16>(v.w[i] & 0xFFFFu), scale) << (8 * i);
    word |= fmt::QuantizeNibble(ToF32<kBf16>(v.w[i] >> 16), scale) << (8 * i + 4);
  }
  return word;
}

// ---- quantize, grouped: one thread per (row, group) item t ---------------------------------------

// Items are ordered (e, n, g) for compressed-tensors (a thread's G/8 words are contiguous) and
// (e, g, n) for GPTQ (consecutive threads write consecutive words of a qweight row). Returns the
// group index (row * ng + g) when the group holds Inf/NaN, else -1.
template <int kG, bool kBf16, Layout kLayout>
WSYNC_HD int64_t QuantizeGroupedItem(int64_t t, const uint16_t* w, int64_t n, int64_t k, fmt::Variant variant,
                                     uint32_t* packed, uint16_t* scales) {
  constexpr int kVecs = kG / 8;
  const int64_t ng = k / kG, kw = k / 8;
  int64_t e, row_n, g;
  if constexpr (kLayout == Layout::kGptq) {
    e = t / (ng * n);
    g = (t / n) % ng;
    row_n = t % n;
  } else {
    e = t / (ng * n);
    row_n = (t / ng) % n;
    g = t % ng;
  }
  const int64_t row = e * n + row_n;
  const Vec8* src = reinterpret_cast<const Vec8*>(w + row * k + g * kG);
  Vec8 v[kVecs];
  uint32_t m = 0;
  for (int i = 0; i < kVecs; ++i) {
    v[i] = src[i];
    m = AbsMax8(v[i], m);
  }
  const float scale = fmt::GroupScale(ToF32<kBf16>(m), variant);
  if constexpr (kLayout == Layout::kGptq) {
    scales[(e * ng + g) * n + row_n] = FromF32<kBf16>(scale);
    uint32_t* out = packed + (e * kw + g * kVecs) * n + row_n;
    for (int i = 0; i < kVecs; ++i) out[i * n] = PackVec8<kBf16>(v[i], scale);
  } else {
    scales[row * ng + g] = FromF32<kBf16>(scale);
    Words4* out = reinterpret_cast<Words4*>(packed + row * kw + g * kVecs);
    for (int i = 0; i < kVecs / 4; ++i) {
      Words4 o;
      for (int j = 0; j < 4; ++j) o.w[j] = PackVec8<kBf16>(v[4 * i + j], scale);
      out[i] = o;
    }
  }
  return m >= fmt::NonFiniteAbsBits16(kBf16) ? row * ng + g : -1;
}

// ---- quantize, channelwise: one block per row, `threads` threads ---------------------------------

// Phase 1 (thread tid): this thread's share of max |x| of row `row`, to be max-reduced over the block.
WSYNC_HD uint32_t RowAbsMaxPart(const uint16_t* w, int64_t row, int64_t k, int tid, int threads) {
  const Vec8* src = reinterpret_cast<const Vec8*>(w + row * k);
  uint32_t m = 0;
  for (int64_t i = tid; i < k / 8; i += threads) m = AbsMax8(src[i], m);
  return m;
}

// Phase 2 (after the reduction): the block's max bits -> scale (thread 0 stores it) and this
// thread's words. Returns the row index if the row holds Inf/NaN (thread 0 only), else -1.
template <bool kBf16, Layout kLayout>
WSYNC_HD int64_t RowQuantizePart(const uint16_t* w, int64_t row, int64_t n, int64_t k, fmt::Variant variant,
                                 uint32_t block_max, int tid, int threads, uint32_t* packed, uint16_t* scales) {
  const int64_t e = row / n, row_n = row % n, kw = k / 8;
  const Vec8* src = reinterpret_cast<const Vec8*>(w + row * k);
  const float scale = fmt::GroupScale(ToF32<kBf16>(block_max), variant);
  for (int64_t i = tid; i < kw; i += threads) {
    const uint32_t word = PackVec8<kBf16>(src[i], scale);
    if constexpr (kLayout == Layout::kGptq) {
      packed[(e * kw + i) * n + row_n] = word;
    } else {
      packed[row * kw + i] = word;
    }
  }
  if (tid != 0) return -1;
  scales[row] = FromF32<kBf16>(scale);  // [E, N, 1] and [E, 1, N] coincide
  return block_max >= fmt::NonFiniteAbsBits16(kBf16) ? row : -1;
}

// ---- repack / restore: one 128-thread block per 16x64 tile ---------------------------------------

struct TileIndex {
  int64_t e, kt, nt;
};
WSYNC_HD TileIndex TileOfBlock(int64_t block, int64_t k, int64_t n) {
  const int64_t ntiles = n / fmt::kTileN, ktiles = k / fmt::kTileK;
  return TileIndex{block / (ktiles * ntiles), (block / ntiles) % ktiles, block % ntiles};
}

// GPTQ word (row 2kt + h, column col) of tile ti as the repack consumes it: the word itself, or
// with perm the 8 nibbles of Marlin rows 16kt + 8h + j gathered from GPTQ rows perm[...].
WSYNC_HD uint32_t StagedGptqWord(const uint32_t* in, const int32_t* perm, int64_t k, int64_t n, TileIndex ti, int h,
                                 int64_t col) {
  const uint32_t* q = in + ti.e * (k / 8) * n;
  if (perm == nullptr) return q[(2 * ti.kt + h) * n + col];
  const int32_t* p = perm + ti.e * k + ti.kt * fmt::kTileK + 8 * h;
  uint32_t word = 0;
  for (int j = 0; j < 8; ++j) word |= fmt::GetNibble(q[(p[j] >> 3) * n + col], p[j] & 7) << (4 * j);
  return word;
}

// Column c = 16a + b of a tile (a = 0..3, b = 0..7) holds Marlin words a + 4rr + 16b (rr = 0..3):
// item i = 8a + b of a tile's 32 (consecutive items read neighbouring columns).
WSYNC_HD int GroupColumn(int i) { return 16 * (i >> 3) + (i & 7); }
WSYNC_HD int GroupWord(int i, int rr) { return (i >> 3) + 4 * rr + 16 * (i & 7); }

// GptqToMarlin in registers, item t = 32 * tile + i: the (staged) GPTQ words of rows 2kt, 2kt + 1
// at columns c and c + 8 -> byte planes -> Transpose4x4Bytes -> the column's four Marlin words.
WSYNC_HD void RepackGroupItem(int64_t t, const uint32_t* in, const int32_t* perm, int64_t k, int64_t n, uint32_t* out) {
  const int i = static_cast<int>(t & 31);
  const TileIndex ti = TileOfBlock(t >> 5, k, n);
  const int64_t col = ti.nt * fmt::kTileN + GroupColumn(i);
  const uint32_t a0 = StagedGptqWord(in, perm, k, n, ti, 0, col), b0 = StagedGptqWord(in, perm, k, n, ti, 1, col);
  const uint32_t a8 = StagedGptqWord(in, perm, k, n, ti, 0, col + 8);
  const uint32_t b8 = StagedGptqWord(in, perm, k, n, ti, 1, col + 8);
  uint32_t x0 = fmt::NibblePlaneLo(a0, b0), x1 = fmt::NibblePlaneLo(a8, b8);
  uint32_t x2 = fmt::NibblePlaneHi(a0, b0), x3 = fmt::NibblePlaneHi(a8, b8);
  fmt::Transpose4x4Bytes(x0, x1, x2, x3);
  uint32_t* o = out + ti.e * (k / fmt::kTileK) * 2 * n + fmt::TileOffset(ti.kt, ti.nt, n);
  o[GroupWord(i, 0)] = x0;
  o[GroupWord(i, 1)] = x1;
  o[GroupWord(i, 2)] = x2;
  o[GroupWord(i, 3)] = x3;
}

// MarlinToGptq without perm, the exact inverse of RepackGroupItem: four Marlin words in, the GPTQ
// words of rows 2kt, 2kt + 1 at columns c and c + 8 out.
WSYNC_HD void RestoreGroupItem(int64_t t, const uint32_t* in, int64_t k, int64_t n, uint32_t* out) {
  const int i = static_cast<int>(t & 31);
  const TileIndex ti = TileOfBlock(t >> 5, k, n);
  const uint32_t* m = in + ti.e * (k / fmt::kTileK) * 2 * n + fmt::TileOffset(ti.kt, ti.nt, n);
  uint32_t x0 = m[GroupWord(i, 0)], x1 = m[GroupWord(i, 1)], x2 = m[GroupWord(i, 2)], x3 = m[GroupWord(i, 3)];
  fmt::Transpose4x4Bytes(x0, x1, x2, x3);  // its own inverse: back to the byte planes
  uint32_t* q = out + ti.e * (k / 8) * n + 2 * ti.kt * n + ti.nt * fmt::kTileN + GroupColumn(i);
  q[0] = fmt::PlanesToA(x0, x2);
  q[n] = fmt::PlanesToB(x0, x2);
  q[8] = fmt::PlanesToA(x1, x3);
  q[n + 8] = fmt::PlanesToB(x1, x3);
}

// Restore phase 1: thread tid stages tile word tid.
WSYNC_HD void RestoreStage(const uint32_t* in, int64_t k, int64_t n, TileIndex ti, int tid, uint32_t* words) {
  words[tid] = in[ti.e * (k / fmt::kTileK) * 2 * n + fmt::TileOffset(ti.kt, ti.nt, n) + tid];
}

// Restore phase 2 with perm (output zeroed first): the nibbles of Marlin rows 16kt + 8h + j at
// column c go to GPTQ row perm[...] through `or_into(word_ptr, bits)` (atomicOr on the device).
template <typename OrInto>
WSYNC_HD void RestoreScatter(const int32_t* perm, int64_t k, int64_t n, TileIndex ti, int tid, const uint32_t* words,
                             uint32_t* out, OrInto or_into) {
  const int h = tid >> 6, c = tid & 63;
  const int32_t* p = perm + ti.e * k + ti.kt * fmt::kTileK + 8 * h;
  uint32_t* o = out + ti.e * (k / 8) * n;
  const int64_t col = ti.nt * fmt::kTileN + c;
  for (int j = 0; j < 8; ++j) {
    const fmt::TileSlot s = fmt::LocateInTile(8 * h + j, c);
    or_into(&o[(p[j] >> 3) * n + col], fmt::GetNibble(words[s.word], s.slot) << (4 * (p[j] & 7)));
  }
}

// ---- scale permutation: one thread per scale -----------------------------------------------------

WSYNC_HD void ScalePermItem(int64_t i, const uint16_t* in, uint16_t* out, bool channelwise, bool inverse) {
  const int width = channelwise ? fmt::kScalePermChannelWidth : fmt::kScalePermGroupedWidth;
  const int p = static_cast<int>(i % width);
  const int64_t src = i - p + (channelwise ? fmt::ScalePermChannel(p) : fmt::ScalePermGrouped(p));
  if (inverse) {
    out[src] = in[i];
  } else {
    out[i] = in[src];
  }
}

}  // namespace wsync::kernels::cuda_body
