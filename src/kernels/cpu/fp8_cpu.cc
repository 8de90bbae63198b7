// CPU FP8 kernels. Math: kernels/format/fp8_format.h (docs/spec/FP8.md).
//
// Block-wise: the work unit is one block row of one expert (bn rows x K), read row by row twice
// (the second time from cache: 1 MiB at 128 x 4096). Pass 1 keeps one vector of maxima of the
// 16-bit magnitude patterns per column block (exact); a block whose maximum is Inf / NaN is
// refused; the scale and its reciprocal follow the variant in scalar float32. Pass 2 widens each
// vector to f32, multiplies it by its block's reciprocal, clamps to +/-448, encodes it (E4m3Codes:
// the spec's bit form, lanewise) and narrows it to bytes.
// Per channel: one row per unit, the same two passes with a division by the row's scale (slime);
// the compressed-tensors variant rounds through the 16-bit type twice and runs the scalar helpers.
// Dequantize (checks only): a 256-entry table of code values, times the scale, per element.
//
// With reuse (a.next_digests), each block's or row's input is hashed first (XXH3-64; a block's row
// segments in order, each seeded with the digest so far) and an unchanged one's codes and scale
// are copied from the earlier outputs instead of computed.
//
// Threads: std::thread partitioning of units (block rows, or rows); no allocation in the loops;
// the smallest non-finite unit is collected across threads (AtomicMin).

// Highway's dynamic dispatch: foreach_target.h re-includes this file once per target, and must
// come before highway.h.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/fp8_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
// clang-format on

#include "kernels/cpu/fp8_cpu.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/abs_max-inl.h"
#include "kernels/cpu/parallel.h"
#include "kernels/format/fp8_format.h"
#include "kernels/format/int4_format.h"

// The units' digests: XXH3-64 inlined (a call per 256-byte segment costs as much as the hash).
#define XXH_INLINE_ALL
#include <xxhash.h>  // NOLINT(build/include_order)

HWY_BEFORE_NAMESPACE();
namespace wsync::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace fmt = ::wsync::kernels::format;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;
using D16 = hn::Rebind<uint16_t, DF>;
using D8 = hn::Rebind<uint8_t, DF>;

// f32 lanes of n = Lanes(DF) 16-bit patterns (bf16: the pattern is the top half of the f32; fp16:
// Highway's exact conversion).
HWY_INLINE hn::VFromD<DF> Widen(const uint16_t* HWY_RESTRICT p, bool bf16) {
  const DF df;
  const DU du;
  const D16 d16;
  const auto h = hn::LoadU(d16, p);
  if (bf16) return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, h)));
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(df, hn::BitCast(dh, h));
}

// The E4M3FN codes of |x| <= 448 (fmt::E4m3Code, lanewise), as u32 lanes.
HWY_INLINE hn::VFromD<DU> E4m3Codes(hn::VFromD<DF> x) {
  const DF df;
  const DU du;
  const DI di;
  const auto sign = hn::And(hn::ShiftRight<24>(hn::BitCast(du, x)), hn::Set(du, 0x80u));
  const auto a = hn::Abs(x);
  const auto b = hn::BitCast(du, a);
  const auto normal =
      hn::ShiftRight<20>(hn::Add(hn::Sub(b, hn::Set(du, 120u << 23)),
                                 hn::Add(hn::Set(du, 0x7FFFFu), hn::And(hn::ShiftRight<20>(b), hn::Set(du, 1u)))));
  const auto is_sub = hn::Lt(a, hn::Set(df, 0x1p-6f));
  if (HWY_LIKELY(hn::AllFalse(df, is_sub))) return hn::Or(normal, sign);  // subnormal codes are rare
  const auto sub = hn::BitCast(du, hn::ConvertTo(di, hn::Round(hn::Mul(a, hn::Set(df, 512.0f)))));
  return hn::Or(hn::IfThenElse(hn::RebindMask(du, is_sub), sub, normal), sign);
}

// q[0..n) of x[0..n): E4m3(clamp(x * r)) when `divide` is false, else E4m3(clamp(x / r)).
void QuantizeRun(const uint16_t* HWY_RESTRICT x, int64_t n, bool bf16, float r, bool divide, uint8_t* HWY_RESTRICT q) {
  const DF df;
  const D8 d8;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  const auto vr = hn::Set(df, r);
  const auto lo = hn::Set(df, -fmt::kFp8Max), hi = hn::Set(df, fmt::kFp8Max);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto v = Widen(x + i, bf16);
    const auto y = hn::Min(hn::Max(divide ? hn::Div(v, vr) : hn::Mul(v, vr), lo), hi);
    hn::StoreU(hn::TruncateTo(d8, E4m3Codes(y)), d8, q + i);
  }
  for (; i < n; ++i) {
    const float v = bf16 ? fmt::Bf16BitsToF32(x[i]) : fmt::F16BitsToF32(x[i]);
    q[i] = fmt::E4m3Code(fmt::ClampFp8(divide ? v / r : v * r));
  }
}

float BitsToFloat(uint32_t abs_bits, bool bf16) {
  return bf16 ? fmt::Bf16BitsToF32(static_cast<uint16_t>(abs_bits))
              : fmt::F16BitsToF32(static_cast<uint16_t>(abs_bits));
}

// Per-thread scratch of the block-wise quantizer, sized once per call of a thread's range.
struct BlockScratch {
  std::vector<uint16_t> acc;   // [kb][lanes] running maxima of the 16-bit magnitude patterns
  std::vector<uint32_t> tail;  // [kb] the same for a column block's last, partial vector
  std::vector<float> mul;      // [kb] the blocks' multipliers
  std::vector<uint64_t> hash;  // [kb] with reuse: the blocks' digests so far
  std::vector<uint8_t> kept;   // [kb] with reuse: 1 for a block copied from the earlier outputs
  int64_t reused = 0;          // the units this thread copied
};

// With reuse (a.next_digests): block row (e, bi)'s kb digests (sc.hash, hashed in pass 1) into
// a.next_digests, and which of them equal the earlier call's (sc.kept; their scales copied). The
// blocks kept.
int64_t KeepUnchangedBlocks(const internal::Fp8QuantizeArgs& a, int64_t e, int64_t bi, int64_t kb, BlockScratch& sc) {
  sc.kept.assign(static_cast<size_t>(kb), 0);
  const int64_t nb = (a.n + a.bn - 1) / a.bn, first = (e * nb + bi) * kb;
  int64_t kept = 0;
  for (int64_t bj = 0; bj < kb; ++bj) {
    a.next_digests[first + bj] = sc.hash[bj];
    if (a.digests == nullptr || a.digests[first + bj] != sc.hash[bj]) continue;
    sc.kept[bj] = 1;
    static_cast<float*>(a.scales)[first + bj] = static_cast<const float*>(a.prev_scales)[first + bj];
    ++kept;
  }
  return kept;
}

// One block row (expert e, block row bi) of the block-wise quantizer, row by row (sequential
// reads): pass 1 keeps one vector of maxima per column block (with reuse, it also chains each
// row's segment into its block's digest, seeded with the digest so far), pass 2 quantizes each
// row's segments with their block's multiplier, or copies a kept block's. The first non-finite
// block index, or -1.
int64_t QuantizeBlockRow(const internal::Fp8QuantizeArgs& a, int64_t e, int64_t bi, BlockScratch& sc) {
  const hn::ScalableTag<uint16_t> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t nb = (a.n + a.bn - 1) / a.bn, kb = (a.k + a.bk - 1) / a.bk;
  const int64_t r0 = bi * a.bn, r1 = std::min(a.n, r0 + a.bn);
  sc.acc.assign(static_cast<size_t>(kb * lanes), 0);
  sc.tail.assign(static_cast<size_t>(kb), 0);
  sc.mul.resize(static_cast<size_t>(kb));
  const bool reuse = a.next_digests != nullptr;
  if (reuse) sc.hash.assign(static_cast<size_t>(kb), 0);
  const auto mask = hn::Set(d, static_cast<uint16_t>(0x7FFF));
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* row = a.w + (e * a.n + r) * a.k;
    for (int64_t bj = 0; bj < kb; ++bj) {
      const int64_t c0 = bj * a.bk, w = std::min(a.k, c0 + a.bk) - c0;
      if (reuse) sc.hash[bj] = XXH3_64bits_withSeed(row + c0, static_cast<size_t>(w) * sizeof(uint16_t), sc.hash[bj]);
      auto m = hn::LoadU(d, sc.acc.data() + bj * lanes);
      int64_t i = 0;
      for (; i + lanes <= w; i += lanes) m = hn::Max(m, hn::And(hn::LoadU(d, row + c0 + i), mask));
      hn::StoreU(m, d, sc.acc.data() + bj * lanes);
      for (; i < w; ++i) sc.tail[bj] = std::max(sc.tail[bj], fmt::AbsBits16(row[c0 + i]));
    }
  }
  if (reuse) sc.reused += KeepUnchangedBlocks(a, e, bi, kb, sc);
  auto* scales = static_cast<float*>(a.scales) + (e * nb + bi) * kb;
  for (int64_t bj = 0; bj < kb; ++bj) {
    if (reuse && sc.kept[bj]) continue;
    uint32_t m = sc.tail[bj];
    for (int64_t l = 0; l < lanes; ++l) m = std::max<uint32_t>(m, sc.acc[bj * lanes + l]);
    if (m >= fmt::NonFiniteAbsBits16(a.is_bf16)) return (e * nb + bi) * kb + bj;
    scales[bj] = fmt::BlockScale(BitsToFloat(m, a.is_bf16), a.block_variant);
    sc.mul[bj] = fmt::BlockMultiplier(scales[bj]);
  }
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t off = (e * a.n + r) * a.k;
    for (int64_t bj = 0; bj < kb; ++bj) {
      const int64_t c0 = bj * a.bk, w = std::min(a.k, c0 + a.bk) - c0;
      if (reuse && sc.kept[bj])
        std::memcpy(a.q + off + c0, a.prev_q + off + c0, static_cast<size_t>(w));
      else
        QuantizeRun(a.w + off + c0, w, a.is_bf16, sc.mul[bj], /*divide=*/false, a.q + off + c0);
    }
  }
  return -1;
}

// One row (expert e, row r) of the per-channel quantizer; the row's index if non-finite, or -1.
// With reuse, a row whose digest is unchanged is copied (and counted in *reused).
int64_t QuantizeChannelRow(const internal::Fp8QuantizeArgs& a, int64_t row, int64_t* reused) {
  const uint16_t* x = a.w + row * a.k;
  uint8_t* q = a.q + row * a.k;
  if (a.next_digests != nullptr) {
    const uint64_t digest = XXH3_64bits(x, static_cast<size_t>(a.k) * sizeof(uint16_t));
    a.next_digests[row] = digest;
    if (a.digests != nullptr && a.digests[row] == digest) {
      std::memcpy(q, a.prev_q + row * a.k, static_cast<size_t>(a.k));
      if (a.channel_variant == fmt::Fp8ChannelVariant::kSlime)
        static_cast<float*>(a.scales)[row] = static_cast<const float*>(a.prev_scales)[row];
      else
        static_cast<uint16_t*>(a.scales)[row] = static_cast<const uint16_t*>(a.prev_scales)[row];
      ++*reused;
      return -1;
    }
  }
  const uint32_t m = AbsMaxBits(x, a.k);
  if (m >= fmt::NonFiniteAbsBits16(a.is_bf16)) return row;
  const float amax = BitsToFloat(m, a.is_bf16);
  if (a.channel_variant == fmt::Fp8ChannelVariant::kSlime) {
    const float s = fmt::ChannelScaleSlime(amax);
    static_cast<float*>(a.scales)[row] = s;
    QuantizeRun(x, a.k, a.is_bf16, s, /*divide=*/true, q);
    return -1;
  }
  const float s = fmt::ChannelScaleCompressedTensors(amax, a.is_bf16);
  static_cast<uint16_t*>(a.scales)[row] = a.is_bf16 ? fmt::F32ToBf16Bits(s) : fmt::F32ToF16Bits(s);
  for (int64_t i = 0; i < a.k; ++i) {
    const float v = a.is_bf16 ? fmt::Bf16BitsToF32(x[i]) : fmt::F16BitsToF32(x[i]);
    q[i] = fmt::QuantizeChannelElementCompressedTensors(v, s, a.is_bf16);
  }
  return -1;
}

absl::Status QuantizeFp8Impl(const internal::Fp8QuantizeArgs& a) {
  const int64_t nb = (a.n + a.bn - 1) / a.bn;
  const int64_t units = a.block ? a.experts * nb : a.experts * a.n;
  const int64_t unit_bytes = (a.block ? a.bn : 1) * a.k * 2;
  std::atomic<int64_t> first_bad{std::numeric_limits<int64_t>::max()};
  std::atomic<int64_t> reused{0};
  ParallelForBytes(units, a.threads, unit_bytes, a.min_bytes_per_thread, [&](int64_t begin, int64_t end) {
    BlockScratch scratch;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t bad =
          a.block ? QuantizeBlockRow(a, u / nb, u % nb, scratch) : QuantizeChannelRow(a, u, &scratch.reused);
      if (bad >= 0) {
        AtomicMin(first_bad, bad);
        break;
      }
    }
    reused.fetch_add(scratch.reused, std::memory_order_relaxed);
  });
  if (a.reused != nullptr) *a.reused = reused.load();
  if (first_bad.load() != std::numeric_limits<int64_t>::max()) return internal::Fp8NonFiniteError(a, first_bad.load());
  return absl::OkStatus();
}

absl::Status DequantizeFp8Impl(const internal::Fp8DequantizeArgs& a) {
  float table[256];
  for (int c = 0; c < 256; ++c) table[c] = fmt::E4m3Value(static_cast<uint8_t>(c));
  const int64_t nb = (a.n + a.bn - 1) / std::max<int64_t>(a.bn, 1), kb = (a.k + a.bk - 1) / std::max<int64_t>(a.bk, 1);
  auto scale_at = [&](int64_t i) {
    if (a.scale_kind == 0) return static_cast<const float*>(a.scales)[i];
    const uint16_t h = static_cast<const uint16_t*>(a.scales)[i];
    return a.scale_kind == 1 ? fmt::Bf16BitsToF32(h) : fmt::F16BitsToF32(h);
  };
  ParallelForBytes(a.experts * a.n, a.threads, a.k * 5, a.min_bytes_per_thread, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t e = row / a.n, r = row % a.n;
      for (int64_t c = 0; c < a.k; ++c) {
        const float s = a.block ? scale_at((e * nb + r / a.bn) * kb + c / a.bk) : scale_at(row);
        const float v = table[a.q[row * a.k + c]] * s;
        if (a.out_bf16)
          static_cast<uint16_t*>(a.out)[row * a.k + c] =
              v != v ? static_cast<uint16_t>(0x7FC0u) : fmt::F32ToBf16Bits(v);
        else
          static_cast<float*>(a.out)[row * a.k + c] = v;
      }
    }
  });
  return absl::OkStatus();
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace wsync::kernels::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace wsync::kernels::cpu {

HWY_EXPORT(QuantizeFp8Impl);
HWY_EXPORT(DequantizeFp8Impl);

absl::Status QuantizeFp8(const internal::Fp8QuantizeArgs& args) { return HWY_DYNAMIC_DISPATCH(QuantizeFp8Impl)(args); }
absl::Status DequantizeFp8(const internal::Fp8DequantizeArgs& args) {
  return HWY_DYNAMIC_DISPATCH(DequantizeFp8Impl)(args);
}

}  // namespace wsync::kernels::cpu
#endif  // HWY_ONCE
