// CPU AWQ kernels. Math and layout: kernels/format/awq_format.h (AWQ.md §1-§4).
//
// QuantizeAwq works on units of (expert, block of up to 128 rows): per group, each row's max and
// min are reduced in SIMD (the first touch of W), the group parameters of the block's rows follow
// lanewise across rows (the shared helpers' IEEE operations in the same order: fp16 roundings by
// F16C, one division per row; the scalar helpers for a remainder), and the G codes of each row
// are computed lanewise (widen to f32,
// round to fp16 for the fp16 arithmetic, IEEE division, round to fp16 again, round half to even,
// add the zero point, clamp) into a byte scratch [rows][G]; then every k of the group packs the
// block's codes into AWQ words (8 interleaved columns per word, 16 words = one 64-byte line of
// qweight [K, N/8] per k for a full block). The fp16 rounding is exact: (x + C) - C with C the
// float whose ulp is x's fp16 quantum (format::F16QuantumMagic), the same formula the scalar
// helper and the CUDA code use.
//
// With reuse (a.next_digests), each unit of 8 rows' group (one qzeros word) is hashed first
// (XXH3-64 chained over the 8 rows); an unchanged unit skips the range and codes, and its words,
// zero word and scales are copied from the earlier outputs after the group is packed.
//
// W is read a group column at a time (128 rows 2K bytes apart), which the hardware prefetchers
// do not follow: each row's next group is prefetched while the current one is coded.
//
// AwqToMarlin: per k-tile, the 16 AWQ rows become the tile's two GPTQ rows (8x8 nibble
// transposes, format::AwqBlockToGptq, lanewise: one block per lane), which the GPTQ -> Marlin tile
// emitter of kernels/cpu/marlin_tile-inl.h turns into Marlin tiles. The TensorRT-LLM
// preprocessing maps each column's 32-row blocks with format::TrtllmBlock (W4A16 lanewise over
// columns).

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/awq_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
// clang-format on

#include "kernels/cpu/awq_cpu.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/marlin_tile-inl.h"
#include "kernels/cpu/parallel.h"
#include "kernels/format/awq_format.h"
#include "kernels/format/int4_format.h"
#include "kernels/format/trtllm_format.h"

// The units' digests: XXH3-64 inlined (a call per 256-byte segment costs as much as the hash).
#define XXH_INLINE_ALL
#include <xxhash.h>  // NOLINT(build/include_order)

HWY_BEFORE_NAMESPACE();
namespace wsync::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace fmt = ::wsync::kernels::format;

constexpr float kInf = std::numeric_limits<float>::infinity();

float ToF32(uint16_t bits, bool bf16) { return bf16 ? BF16ToF32(bits) : F16ToF32(bits); }

#if HWY_TARGET != HWY_SCALAR
// Vector form of format::RoundToF16 (without NaN, which the kernel refuses beforehand).
template <class DF, class V>
HWY_INLINE V RoundToF16V(DF df, V v) {
  const hn::RebindToUnsigned<DF> du;
  const auto a = hn::And(hn::BitCast(du, v), hn::Set(du, 0x7FFFFFFFu));
  auto e = hn::ShiftRight<23>(a);
  e = hn::Min(hn::Max(e, hn::Set(du, 113u)), hn::Set(du, 142u));
  const auto c = hn::BitCast(df, hn::Or(hn::ShiftLeft<23>(hn::Add(e, hn::Set(du, 13u))), hn::Set(du, 0x00400000u)));
  const V r = hn::CopySign(hn::Sub(hn::Add(v, c), c), v);
  const auto overflow = hn::Ge(hn::Abs(v), hn::Set(df, 65520.0f));
  return hn::IfThenElse(overflow, hn::CopySign(hn::Set(df, kInf), v), r);
}

// The same rounding, by the hardware where every x86 target from AVX2 has it (F16C's vcvtps2ph with
// round-to-nearest-even, and back): two instructions instead of ten.
template <class DF, class V>
HWY_INLINE V RoundF16(DF df, V v) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(df, hn::DemoteTo(dh, v));
#else
  return RoundToF16V(df, v);
#endif
}
#endif

// codes[0..g) = the AWQ codes of one row's group x[0..g) with parameters p.
void GroupCodes(const uint16_t* HWY_RESTRICT x, int64_t g, bool bf16, fmt::AwqGroup p, fmt::AwqArith arith,
                uint8_t* HWY_RESTRICT codes) {
  int64_t i = 0;
  const bool f16 = arith == fmt::AwqArith::kFp16;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const hn::Rebind<uint32_t, decltype(df)> du32;
  const hn::Rebind<int32_t, decltype(df)> di32;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  const auto vs = hn::Set(df, p.scale), vz = hn::Set(df, p.zero);
  const auto lo = hn::Zero(df), hi = hn::Set(df, static_cast<float>(fmt::kAwqMaxCode));
  for (; i + lanes <= g; i += lanes) {
    auto v = bf16 ? hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(d16, x + i))))
                  : hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(x + i)));
    if (f16 && bf16) v = RoundF16(df, v);  // AutoAWQ converts the bf16 model to fp16 first
    auto q = hn::Div(v, vs);
    if (f16) q = RoundF16(df, q);
    auto u = hn::Add(hn::Round(q), vz);
    u = hn::Min(hn::Max(u, lo), hi);
    hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di32, u)), d8, codes + i);
  }
#endif
  for (; i < g; ++i) {
    float v = ToF32(x[i], bf16);
    if (f16) v = fmt::RoundToF16(v);
    codes[i] = static_cast<uint8_t>(fmt::AwqCode(v, p, arith));
  }
}

// Max, min and the largest |x| bit pattern of g 16-bit values.
struct GroupRange {
  float mx, mn;
  uint32_t abs_bits;
};
GroupRange Range(const uint16_t* HWY_RESTRICT x, int64_t g, bool bf16) {
  GroupRange r{-kInf, kInf, 0};
  int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const hn::Rebind<uint32_t, decltype(df)> du32;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  auto vmx = hn::Set(df, -kInf), vmn = hn::Set(df, kInf);
  auto vab = hn::Zero(du32);
  for (; i + lanes <= g; i += lanes) {
    const auto raw = hn::PromoteTo(du32, hn::LoadU(d16, x + i));
    vab = hn::Max(vab, hn::And(raw, hn::Set(du32, 0x7FFFu)));
    const auto v = bf16 ? hn::BitCast(df, hn::ShiftLeft<16>(raw))
                        : hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(x + i)));
    vmx = hn::Max(vmx, v);
    vmn = hn::Min(vmn, v);
  }
  if (i > 0) {
    r.mx = hn::GetLane(hn::MaxOfLanes(df, vmx));
    r.mn = hn::GetLane(hn::MinOfLanes(df, vmn));
    r.abs_bits = hn::GetLane(hn::MaxOfLanes(du32, vab));
  }
#endif
  for (; i < g; ++i) {
    const float v = ToF32(x[i], bf16);
    r.mx = std::max(r.mx, v);
    r.mn = std::min(r.mn, v);
    r.abs_bits = std::max<uint32_t>(r.abs_bits, fmt::AbsBits16(x[i]));
  }
  return r;
}

// qweight rows k = 0..g-1 (row stride ld words) of one group, word columns 0..nwords-1, from the code
// bytes codes[row][k] (row stride g): word (k, jw) nibble i = codes[8 jw + ORDER[i]][k]. The vector
// path builds the words lanewise over k into tmp[jw][k], then gathers each qweight row.
void PackGroup(const uint8_t* HWY_RESTRICT codes, int64_t nwords, int64_t g, uint32_t* HWY_RESTRICT out, int64_t ld,
               uint32_t* HWY_RESTRICT tmp) {
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<uint32_t> d;
  const hn::Rebind<uint8_t, decltype(d)> d8;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  if (g % lanes == 0 && nwords * g <= kAwqRowBlock / 8 * 256) {
    for (int64_t jw = 0; jw < nwords; ++jw) {
      for (int64_t k = 0; k < g; k += lanes) {
        auto w = hn::Zero(d);
        for (int i = 0; i < 8; ++i) {
          const auto v = hn::PromoteTo(d, hn::LoadU(d8, codes + (8 * jw + fmt::AwqOrder(i)) * g + k));
          w = hn::Or(w, hn::ShiftLeftSame(v, 4 * i));
        }
        hn::StoreU(w, d, tmp + jw * g + k);
      }
    }
    for (int64_t k = 0; k < g; ++k) {
      for (int64_t jw = 0; jw < nwords; ++jw) out[k * ld + jw] = tmp[jw * g + k];
    }
    return;
  }
#endif
  for (int64_t k = 0; k < g; ++k) {
    for (int64_t jw = 0; jw < nwords; ++jw) {
      const uint8_t* c = codes + (8 * jw) * g + k;
      uint32_t w = 0;
      for (int i = 0; i < 8; ++i) w |= static_cast<uint32_t>(c[fmt::AwqOrder(i) * g]) << (4 * i);
      out[k * ld + jw] = w;
    }
  }
}

// With reuse: the digests of group g of the `rows` rows from n0 (expert e), one per 8 rows, into
// a.next_digests, and which equal the earlier call's (kept[jw]). The units kept.
int64_t HashAwqGroup(const internal::AwqQuantizeArgs& a, int64_t e, int64_t n0, int64_t rows, int64_t g,
                     uint8_t* kept) {
  const int64_t ng = a.k / a.group, nw = a.n / 8;
  int64_t count = 0;
  for (int64_t jw = 0; jw < rows / 8; ++jw) {
    uint64_t h = 0;
    for (int64_t r = 8 * jw; r < 8 * jw + 8; ++r)
      h = XXH3_64bits_withSeed(a.w + (e * a.n + n0 + r) * a.k + g * a.group,
                               static_cast<size_t>(a.group) * sizeof(uint16_t), h);
    const int64_t u = (e * ng + g) * nw + n0 / 8 + jw;
    a.next_digests[u] = h;
    kept[jw] = a.digests != nullptr && a.digests[u] == h;
    count += kept[jw];
  }
  return count;
}

// Group g's outputs of the kept units (kept[jw]) of the `rows` rows from n0 copied from the earlier
// call's: G words of qweight's word column, the zero word, 8 scales each.
void CopyKeptAwqUnits(const internal::AwqQuantizeArgs& a, int64_t e, int64_t n0, int64_t rows, int64_t g,
                      const uint8_t* kept) {
  const int64_t ng = a.k / a.group, nw = a.n / 8;
  for (int64_t jw = 0; jw < rows / 8; ++jw) {
    if (!kept[jw]) continue;
    const int64_t col = n0 / 8 + jw;
    for (int64_t k = 0; k < a.group; ++k) {
      const int64_t at = (e * a.k + g * a.group + k) * nw + col;
      a.qweight[at] = a.prev_qweight[at];
    }
    a.qzeros[(e * ng + g) * nw + col] = a.prev_qzeros[(e * ng + g) * nw + col];
    const int64_t s0 = (e * ng + g) * a.n + n0 + 8 * jw;
    std::memcpy(a.scales + s0, a.prev_scales + s0, 8 * sizeof(uint16_t));
  }
}

// Units are (expert, block of kAwqRowBlock rows); scratch holds kAwqRowBlock * G code bytes. Adds
// the reused units (with reuse) to *reused.
// Returns the smallest refusal code (see internal::AwqRefusedError), or -1.
int64_t QuantizeAwqUnits(const internal::AwqQuantizeArgs& a, int64_t begin, int64_t end, uint8_t* scratch,
                         int64_t* reused) {
  const uint32_t nonfinite = fmt::NonFiniteAbsBits16(a.is_bf16);
  const bool f16 = a.arith == fmt::AwqArith::kFp16;
  const int64_t blocks = (a.n + kAwqRowBlock - 1) / kAwqRowBlock;
  const int64_t ng = a.k / a.group, nw = a.n / 8;
  int64_t bad = -1;
  auto refuse = [&](int64_t row, int64_t g, internal::AwqRefusal why) {
    const int64_t code = (row * ng + g) * 2 + static_cast<int>(why);
    if (bad < 0 || code < bad) bad = code;
  };
  uint8_t zeros[kAwqRowBlock] = {};
  float mxs[kAwqRowBlock], mns[kAwqRowBlock], scales[kAwqRowBlock], zps[kAwqRowBlock];
  HWY_ALIGN uint32_t words_tmp[kAwqRowBlock / 8 * 256];  // PackGroup's [jw][k] (groups up to 256 wide)
  uint8_t kept[kAwqRowBlock / 8] = {};                   // with reuse: the units copied, by word column
  const bool reuse = a.next_digests != nullptr;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t e = unit / blocks;
    const int64_t n0 = (unit % blocks) * kAwqRowBlock;
    const int64_t rows = std::min(a.n - n0, kAwqRowBlock);
    for (int64_t g = 0; g < ng; ++g) {
      if (reuse) *reused += HashAwqGroup(a, e, n0, rows, g, kept);
      // Each row's range (the first touch of W), then the group parameters of all the block's rows
      // (lanewise where the target has vectors: the same IEEE operations as format::AwqGroupParams,
      // so the same bits), then each row's codes. A kept unit's rows take a zero range, no codes.
      for (int64_t r = 0; r < rows; ++r) {
        if (reuse && kept[r / 8]) {
          mxs[r] = mns[r] = 0.0f;
          continue;
        }
        const uint16_t* x = a.w + (e * a.n + n0 + r) * a.k + g * a.group;
        // The block reads W a group column at a time (kAwqRowBlock rows 2K bytes apart), a pattern
        // the hardware prefetchers do not follow: fetch this row's next group meanwhile (2x here).
        if (g + 1 < ng) {
          for (int64_t b = 0; b < a.group * 2; b += 64) hwy::Prefetch(reinterpret_cast<const char*>(x + a.group) + b);
        }
        const GroupRange range = Range(x, a.group, a.is_bf16);
        mxs[r] = range.mx;
        mns[r] = range.mn;
        if (range.abs_bits >= nonfinite) {
          refuse(e * a.n + n0 + r, g, internal::AwqRefusal::kNonFinite);
          mxs[r] = mns[r] = 0.0f;  // keep going with finite values; the call fails anyway
        }
      }
      int64_t r = 0;
#if HWY_TARGET != HWY_SCALAR
      {
        const hn::ScalableTag<float> df;
        const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
        const auto zero = hn::Zero(df), max_code = hn::Set(df, static_cast<float>(fmt::kAwqMaxCode));
        for (; r + lanes <= rows; r += lanes) {
          auto mx = hn::LoadU(df, mxs + r), mn = hn::LoadU(df, mns + r);
          decltype(mx) scale, zp;
          if (f16) {
            mx = RoundF16(df, mx);
            mn = RoundF16(df, mn);
            const auto inf = hn::Set(df, kInf);
            const auto out = hn::Or(hn::Or(hn::Eq(hn::Abs(mx), inf), hn::Eq(hn::Abs(mn), inf)),
                                    hn::Eq(hn::Abs(RoundF16(df, hn::Sub(mx, mn))), inf));
            if (!hn::AllFalse(df, out)) {
              HWY_ALIGN float flags[hn::MaxLanes(df)];
              hn::Store(hn::VecFromMask(df, out), df, flags);
              for (int64_t l = 0; l < lanes; ++l)
                if (flags[l] != 0.0f) refuse(e * a.n + n0 + r + l, g, internal::AwqRefusal::kF16Range);
              mx = hn::IfThenZeroElse(out, mx);
              mn = hn::IfThenZeroElse(out, mn);
            }
            auto d = hn::Max(RoundF16(df, hn::Sub(mx, mn)), hn::Set(df, fmt::kF16ScaleFloor));
            scale = RoundF16(df, hn::Mul(d, hn::Set(df, fmt::kAwqInv15)));
            zp = hn::Neg(hn::Round(RoundF16(df, hn::Div(mn, scale))));
          } else {
            auto d = hn::Max(hn::Sub(mx, mn), hn::Set(df, fmt::kScaleFloor));
            scale = hn::Div(d, hn::Set(df, 15.0f));
            zp = hn::Neg(hn::Round(hn::Div(mn, scale)));
          }
          hn::StoreU(scale, df, scales + r);
          hn::StoreU(hn::Min(hn::Max(zp, zero), max_code), df, zps + r);
        }
      }
#endif
      for (; r < rows; ++r) {
        float mx = mxs[r], mn = mns[r];
        if (f16) {
          mx = fmt::RoundToF16(mx);
          mn = fmt::RoundToF16(mn);
          if (std::isinf(mx) || std::isinf(mn) || std::isinf(fmt::RoundToF16(mx - mn))) {
            refuse(e * a.n + n0 + r, g, internal::AwqRefusal::kF16Range);
            mx = mn = 0.0f;
          }
        }
        const fmt::AwqGroup p = fmt::AwqGroupParams(mx, mn, a.arith);
        scales[r] = p.scale;
        zps[r] = p.zero;
      }
      for (r = 0; r < rows; ++r) {
        if (reuse && kept[r / 8]) continue;
        const int64_t row = e * a.n + n0 + r;
        const uint16_t* x = a.w + row * a.k + g * a.group;
        a.scales[(e * ng + g) * a.n + n0 + r] = a.is_bf16 ? F32ToBF16(scales[r]) : F32ToF16(scales[r]);
        zeros[r] = static_cast<uint8_t>(zps[r]);
        GroupCodes(x, a.group, a.is_bf16, fmt::AwqGroup{scales[r], zps[r]}, a.arith, scratch + r * a.group);
      }
      // Pack: word (k, n0/8 + jw) nibble i = code of row 8 jw + ORDER[i].
      PackGroup(scratch, rows / 8, a.group, a.qweight + (e * a.k + g * a.group) * nw + n0 / 8, nw, words_tmp);
      uint32_t* zout = a.qzeros + (e * ng + g) * nw + n0 / 8;
      for (int64_t jw = 0; jw < rows / 8; ++jw) {
        uint32_t w = 0;
        for (int i = 0; i < 8; ++i) w |= static_cast<uint32_t>(zeros[8 * jw + fmt::AwqOrder(i)]) << (4 * i);
        zout[jw] = w;
      }
      if (reuse) CopyKeptAwqUnits(a, e, n0, rows, g, kept);
    }
  }
  return bad;
}

#if HWY_TARGET != HWY_SCALAR
// format::TransposeNibbles8x8 lanewise, round for round: lane l of m[0..8) is the l-th 8x8 block.
template <class D, class V>
HWY_INLINE void TransposeNibbles8x8V(D d, V* HWY_RESTRICT m) {
  const auto swap = [&](V& a, V& b, uint32_t keep_a, auto shift) {  // a's high part <-> b's low part
    constexpr int kShift = decltype(shift)::value;
    const V lo = hn::Set(d, keep_a);
    const V na = hn::Or(hn::And(a, lo), hn::ShiftLeft<kShift>(hn::And(b, lo)));
    b = hn::Or(hn::And(hn::ShiftRight<kShift>(a), lo), hn::AndNot(lo, b));
    a = na;
  };
  for (int r = 0; r < 4; ++r) swap(m[r], m[r + 4], 0x0000FFFFu, std::integral_constant<int, 16>());
  for (int r : {0, 1, 4, 5}) swap(m[r], m[r + 2], 0x00FF00FFu, std::integral_constant<int, 8>());
  for (int r = 0; r < 8; r += 2) swap(m[r], m[r + 1], 0x0F0F0F0Fu, std::integral_constant<int, 4>());
}
#endif

// GPTQ rows [8 rb, 8 rb + 8) of one expert's AWQ matrix [R, N/8] into dst[0..N) (one GPTQ row). The
// vector path transposes one 8x8 block per lane (8 contiguous loads, one per AWQ row), then writes
// each block's 8 words in GPTQ column order from a small buffer.
void AwqRowsToGptqRow(const uint32_t* HWY_RESTRICT awq, int64_t n, int64_t rb, uint32_t* HWY_RESTRICT dst) {
  const int64_t nw = n / 8;
  const uint32_t* src = awq + 8 * rb * nw;
  int64_t j = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<uint32_t> d;
  using V = hn::Vec<decltype(d)>;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  HWY_ALIGN uint32_t tmp[8 * HWY_LANES(uint32_t)];
  for (; j + lanes <= nw; j += lanes) {
    V m[8];
    for (int r = 0; r < 8; ++r) m[r] = hn::LoadU(d, src + r * nw + j);
    TransposeNibbles8x8V(d, m);
    for (int i = 0; i < 8; ++i) hn::Store(m[i], d, tmp + i * lanes);
    for (int64_t l = 0; l < lanes; ++l) {
      uint32_t* out = dst + 8 * (j + l);
      for (int i = 0; i < 8; ++i) out[fmt::AwqOrder(i)] = tmp[i * lanes + l];
    }
  }
#endif
  for (; j < nw; ++j) {
    uint32_t block[8];
    for (int r = 0; r < 8; ++r) block[r] = src[r * nw + j];
    fmt::AwqBlockToGptq(block, dst + 8 * j);
  }
}

// Units are (expert, k-tile); scratch holds 2N words (the tile's two GPTQ rows).
void AwqToMarlinUnits(const internal::AwqRepackArgs& a, int64_t begin, int64_t end, uint32_t* scratch) {
  const int64_t n = a.n, ktiles = a.rows / fmt::kTileK;
  uint32_t* HWY_RESTRICT ra = scratch;
  uint32_t* HWY_RESTRICT rb = scratch + n;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t e = unit / ktiles, kt = unit % ktiles;
    const uint32_t* awq = a.in + e * a.rows * (n / 8);
    AwqRowsToGptqRow(awq, n, 2 * kt, ra);
    AwqRowsToGptqRow(awq, n, 2 * kt + 1, rb);
    uint32_t* out = a.out + e * ktiles * 2 * n + fmt::TileOffset(kt, 0, n);
    for (int64_t nt = 0; nt < n / fmt::kTileN; ++nt) {
      EmitTile(ra + nt * fmt::kTileN, rb + nt * fmt::kTileN, out + nt * fmt::kTileWords);
    }
  }
  hwy::FlushStream();
}

#if HWY_TARGET != HWY_SCALAR
// format::UnzipNibbles lanewise.
template <class D, class V>
HWY_INLINE V UnzipNibblesV(D d, V x) {
  const auto m4 = hn::Set(d, 0x0F0F0F0Fu), m8 = hn::Set(d, 0x00FF00FFu), m16 = hn::Set(d, 0x0000FFFFu);
  V e = hn::And(x, m4), o = hn::And(hn::ShiftRight<4>(x), m4);
  e = hn::And(hn::Or(e, hn::ShiftRight<4>(e)), m8);
  o = hn::And(hn::Or(o, hn::ShiftRight<4>(o)), m8);
  e = hn::And(hn::Or(e, hn::ShiftRight<8>(e)), m16);
  o = hn::And(hn::Or(o, hn::ShiftRight<8>(o)), m16);
  return hn::Or(e, hn::ShiftLeft<16>(o));
}
#endif

// Tiles of (expert, 256 columns, 16 blocks of 32 rows) [begin, end) of format::TrtllmBlock (or its
// inverse): each code row is read 1 KiB at a time (sequential within a page, so the prefetchers
// follow), and per (column, block) the 4 code words map to 4 consecutive output words. The W4A16
// preprocessing (what syncs deliver) runs lanewise over columns: 4 contiguous loads, the byte
// transpose and the unzip of format::TrtllmBlock per lane, then each column's 4 words to its place.
// Columns are outermost there: with blocks outermost, every block wrote 16 bytes into each of 64
// output runs 8 KiB apart (one L1 set), half the speed (docs/kernels.md).
void TrtllmUnits(const internal::TrtllmArgs& a, int64_t begin, int64_t end) {
  const int64_t words = a.k * a.n / 8;  // per expert, in and out alike
  const int64_t blocks = a.k / fmt::kTrtllmRowBlock;
  const int64_t col_tiles = (a.n + kTrtllmTileCols - 1) / kTrtllmTileCols;
  const int64_t blk_tiles = (blocks + kTrtllmTileBlocks - 1) / kTrtllmTileBlocks;
  const int64_t per_expert = col_tiles * blk_tiles;
  [[maybe_unused]] const bool w4a16 =
      a.layout == fmt::TrtllmLayout::kSm80W4A16 || a.layout == fmt::TrtllmLayout::kSm90Dense;
  for (int64_t u = begin; u < end; ++u) {
    const int64_t x = u / per_expert, ct = (u % per_expert) / blk_tiles, bt = u % blk_tiles;
    const int64_t n0 = ct * kTrtllmTileCols, n1 = std::min(a.n, n0 + kTrtllmTileCols);
    const int64_t b0 = bt * kTrtllmTileBlocks, b1 = std::min(blocks, b0 + kTrtllmTileBlocks);
    uint32_t* codes = a.codes + x * words;
    uint32_t* bytes = a.bytes + x * words;
    int64_t n_scalar = n0;  // the columns left to the scalar loop
#if HWY_TARGET != HWY_SCALAR
    if (!a.inverse && w4a16) {
      // Columns outermost: the unit's 16 blocks of a vector of columns fill whole runs of output
      // (sm80: 1 KiB per 4 columns; sm90: 256 bytes per column) before the next columns start.
      const hn::ScalableTag<uint32_t> d;
      using V = hn::Vec<decltype(d)>;
      const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
      HWY_ALIGN uint32_t tmp[4 * HWY_LANES(uint32_t)];
      for (; n_scalar + lanes <= n1; n_scalar += lanes) {
        const int64_t n = n_scalar;
        for (int64_t blk = b0; blk < b1; ++blk) {
          const uint32_t* rows = codes + 4 * blk * a.n + n;  // code rows 4 blk .. 4 blk + 3
          V v0 = hn::LoadU(d, rows), v1 = hn::LoadU(d, rows + a.n);
          V v2 = hn::LoadU(d, rows + 2 * a.n), v3 = hn::LoadU(d, rows + 3 * a.n);
          Transpose4x4BytesV(d, v0, v1, v2, v3);
          hn::Store(UnzipNibblesV(d, v0), d, tmp);
          hn::Store(UnzipNibblesV(d, v1), d, tmp + lanes);
          hn::Store(UnzipNibblesV(d, v2), d, tmp + 2 * lanes);
          hn::Store(UnzipNibblesV(d, v3), d, tmp + 3 * lanes);
          for (int64_t l = 0; l < lanes; ++l) {
            uint32_t* dst = bytes + fmt::TrtllmWordOf(a.layout, n + l, 32 * blk, a.k);
            for (int t = 0; t < 4; ++t) dst[t] = tmp[t * lanes + l];
          }
        }
      }
    }
#endif
    for (int64_t blk = b0; blk < b1; ++blk) {
      uint32_t* rows = codes + 4 * blk * a.n;  // code rows 4 blk .. 4 blk + 3
      for (int64_t n = n_scalar; n < n1; ++n) {
        uint32_t in[4], out[4];
        // The 4 output words of a block are consecutive in every layout (k' = 32 blk + 8t).
        uint32_t* dst = bytes + fmt::TrtllmWordOf(a.layout, n, 32 * blk, a.k);
        if (!a.inverse) {
          for (int r = 0; r < 4; ++r) in[r] = rows[r * a.n + n];
          fmt::TrtllmBlock(a.layout, in, out);
          std::memcpy(dst, out, sizeof(out));
        } else {
          std::memcpy(out, dst, sizeof(out));
          fmt::TrtllmBlockInverse(a.layout, out, in);
          for (int r = 0; r < 4; ++r) rows[r * a.n + n] = in[r];
        }
      }
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace wsync::kernels::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace wsync::kernels::cpu {

HWY_EXPORT(QuantizeAwqUnits);
HWY_EXPORT(AwqToMarlinUnits);
HWY_EXPORT(TrtllmUnits);

namespace fmt = ::wsync::kernels::format;

absl::Status QuantizeAwq(const internal::AwqQuantizeArgs& args) {
  const int64_t blocks = (args.n + kAwqRowBlock - 1) / kAwqRowBlock;
  std::atomic<int64_t> bad{INT64_MAX};
  std::atomic<int64_t> reused{0};
  ParallelForBytes(args.experts * blocks, args.threads, kAwqRowBlock * args.k * 2, args.min_bytes_per_thread,
                   [&](int64_t b, int64_t e) {
                     std::vector<uint8_t> scratch(static_cast<size_t>(kAwqRowBlock * args.group));
                     int64_t mine_reused = 0;
                     const int64_t mine =
                         HWY_DYNAMIC_DISPATCH(QuantizeAwqUnits)(args, b, e, scratch.data(), &mine_reused);
                     reused.fetch_add(mine_reused, std::memory_order_relaxed);
                     if (mine < 0) return;
                     AtomicMin(bad, mine);
                   });
  if (args.reused != nullptr) *args.reused = reused.load();
  if (bad.load() != INT64_MAX) return internal::AwqRefusedError(args, bad.load());
  return absl::OkStatus();
}

absl::Status AwqToGptq(const internal::AwqRepackArgs& a) {
  const int64_t nw = a.n / 8, rblocks = a.rows / 8;
  ParallelForBytes(a.experts * rblocks, a.threads, 32 * a.n, a.min_bytes_per_thread, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      const int64_t x = u / rblocks, rb = u % rblocks;
      const uint32_t* src = a.in + (x * a.rows + 8 * rb) * nw;
      uint32_t* dst = a.out + (x * rblocks + rb) * a.n;
      for (int64_t j = 0; j < nw; ++j) {
        uint32_t block[8];
        for (int r = 0; r < 8; ++r) block[r] = src[r * nw + j];
        fmt::AwqBlockToGptq(block, dst + 8 * j);
      }
    }
  });
  return absl::OkStatus();
}

absl::Status GptqToAwq(const internal::AwqRepackArgs& a) {
  const int64_t nw = a.n / 8, rblocks = a.rows / 8;
  ParallelForBytes(a.experts * rblocks, a.threads, 32 * a.n, a.min_bytes_per_thread, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      const int64_t x = u / rblocks, rb = u % rblocks;
      const uint32_t* src = a.in + (x * rblocks + rb) * a.n;
      uint32_t* dst = a.out + (x * a.rows + 8 * rb) * nw;
      for (int64_t j = 0; j < nw; ++j) {
        uint32_t block[8];
        fmt::GptqBlockToAwq(src + 8 * j, block);
        for (int r = 0; r < 8; ++r) dst[r * nw + j] = block[r];
      }
    }
  });
  return absl::OkStatus();
}

absl::Status AwqToMarlin(const internal::AwqRepackArgs& args) {
  ParallelForBytes(args.experts * (args.rows / fmt::kTileK), args.threads, 8 * args.n, args.min_bytes_per_thread,
                   [&](int64_t b, int64_t e) {
                     std::vector<uint32_t> scratch(static_cast<size_t>(2 * args.n));
                     HWY_DYNAMIC_DISPATCH(AwqToMarlinUnits)(args, b, e, scratch.data());
                   });
  return absl::OkStatus();
}

namespace {
// Zero points in either direction: output word (row, w) = word(input row, w), rows split over threads.
absl::Status ZeroWords(const internal::AwqRepackArgs& a, uint32_t (*word)(const uint32_t*, int64_t)) {
  const int64_t nw = a.n / 8;
  ParallelForBytes(a.experts * a.rows, a.threads, a.n / 2, a.min_bytes_per_thread, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t w = 0; w < nw; ++w) a.out[r * nw + w] = word(a.in + r * nw, w);
    }
  });
  return absl::OkStatus();
}
}  // namespace

absl::Status AwqZerosToMarlin(const internal::AwqRepackArgs& a) { return ZeroWords(a, &fmt::MarlinZeroWord); }

absl::Status MarlinZerosToAwq(const internal::AwqRepackArgs& a) { return ZeroWords(a, &fmt::AwqZeroWordFromMarlin); }

absl::Status Trtllm(const internal::TrtllmArgs& a) {
  // Units never share an output (TrtllmUnits).
  const int64_t blocks = a.k / fmt::kTrtllmRowBlock;
  const int64_t units = a.experts * ((a.n + kTrtllmTileCols - 1) / kTrtllmTileCols) *
                        ((blocks + kTrtllmTileBlocks - 1) / kTrtllmTileBlocks);
  ParallelForBytes(units, a.threads, kTrtllmTileCols * kTrtllmTileBlocks * 16, a.min_bytes_per_thread,
                   [&](int64_t b, int64_t e) {
                     HWY_DYNAMIC_DISPATCH(TrtllmUnits)
                     (a, b, e);
                   });
  return absl::OkStatus();
}

absl::Status TrtllmScales(const internal::TrtllmScaleArgs& a) {
  const int il = a.interleave;
  ParallelForBytes(a.experts * a.rows, a.threads, 2 * a.n, a.min_bytes_per_thread, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const uint16_t* in = a.in + r * a.n;
      switch (a.mode) {
        case internal::TrtllmScaleMode::kCopy: std::memcpy(a.out + r * a.n, in, static_cast<size_t>(a.n) * 2); break;
        case internal::TrtllmScaleMode::kToF16:
          for (int64_t c = 0; c < a.n; ++c)
            a.out[r * a.n + c] = F32ToF16(a.in_bf16 ? BF16ToF32(in[c]) : F16ToF32(in[c]));
          break;
        case internal::TrtllmScaleMode::kToBf16Interleaved: {
          // Input row r = (expert x, row g) goes to output row g / I, columns n I + g % I.
          const int64_t x = r / a.rows, g = r % a.rows;
          uint16_t* out = a.out + (x * (a.rows / il) + g / il) * a.n * il + g % il;
          for (int64_t c = 0; c < a.n; ++c) {
            out[c * il] = F32ToBF16(a.in_bf16 ? BF16ToF32(in[c]) : F16ToF32(in[c]));
          }
          break;
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status TrtllmZeros(const internal::TrtllmScaleArgs& a) {
  const int64_t nw = a.n / 8;
  ParallelForBytes(a.experts * a.rows, a.threads, 2 * a.n, a.min_bytes_per_thread, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t c = 0; c < a.n; ++c) {
        const float z = static_cast<float>(fmt::AwqNibble(a.qzeros[r * nw + c / 8], c));
        const float s = a.in_bf16 ? BF16ToF32(a.in[r * a.n + c]) : F16ToF32(a.in[r * a.n + c]);
        const float zero = (8.0f - z) * s;  // exact in f32 (4-bit times 11-bit): one rounding below
        a.out[r * a.n + c] = a.in_bf16 ? F32ToBF16(zero) : F32ToF16(zero);
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace wsync::kernels::cpu
#endif  // HWY_ONCE
