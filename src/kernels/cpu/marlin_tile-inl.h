// Per-target building blocks of the CPU Marlin kernels (Highway "-inl" header: included once per
// SIMD target from a file that includes hwy/foreach_target.h): streaming copies and the emission
// of one 16 x 64 Marlin tile from its two GPTQ rows. Used by kernels/cpu/int4_cpu.cc (GPTQ ->
// Marlin) and kernels/cpu/awq_cpu.cc (AWQ -> Marlin). Math: kernels/format/int4_format.h.
// Thread-safety: pure functions of their arguments.

// Per-target include guard (the Highway convention for -inl headers).
#if defined(WSYNC_KERNELS_CPU_MARLIN_TILE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WSYNC_KERNELS_CPU_MARLIN_TILE_INL_H_
#undef WSYNC_KERNELS_CPU_MARLIN_TILE_INL_H_
#else
#define WSYNC_KERNELS_CPU_MARLIN_TILE_INL_H_
#endif

#include <cstdint>
#include <cstring>

#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "kernels/format/int4_format.h"

HWY_BEFORE_NAMESPACE();
namespace wsync::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// dst[0..n) = src[0..n) with streaming (non-temporal) stores when dst is 64-byte aligned and n a
// multiple of 16: outputs are written once and not read back by the kernel, so skipping the
// read-for-ownership saves a third of the memory traffic (what memcpy does for large copies).
inline void StreamCopy(const uint32_t* HWY_RESTRICT src, int64_t n, uint32_t* HWY_RESTRICT dst) {
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<uint32_t> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0 && n % 16 == 0 && n % lanes == 0) {
    for (int64_t i = 0; i < n; i += lanes) hn::Stream(hn::LoadU(d, src + i), d, dst + i);
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(uint32_t));
}

#if HWY_TARGET != HWY_SCALAR
// Vector form of format::Transpose4x4Bytes, lanewise (the reference tests hold both to the same
// bits through RefMarlin).
template <class D, class V>
HWY_INLINE void Transpose4x4BytesV(D d, V& x0, V& x1, V& x2, V& x3) {
  const auto m0 = hn::Set(d, 0x00FF00FFu), m1 = hn::Set(d, 0xFF00FF00u);
  const auto lo16 = hn::Set(d, 0x0000FFFFu), hi16 = hn::Set(d, 0xFFFF0000u);
  const V t0 = hn::Or(hn::And(x0, m0), hn::ShiftLeft<8>(hn::And(x1, m0)));
  const V t1 = hn::Or(hn::And(hn::ShiftRight<8>(x0), m0), hn::And(x1, m1));
  const V t2 = hn::Or(hn::And(x2, m0), hn::ShiftLeft<8>(hn::And(x3, m0)));
  const V t3 = hn::Or(hn::And(hn::ShiftRight<8>(x2), m0), hn::And(x3, m1));
  x0 = hn::Or(hn::And(t0, lo16), hn::ShiftLeft<16>(t2));
  x1 = hn::Or(hn::And(t1, lo16), hn::ShiftLeft<16>(t3));
  x2 = hn::Or(hn::ShiftRight<16>(t0), hn::And(t2, hi16));
  x3 = hn::Or(hn::ShiftRight<16>(t1), hn::And(t3, hi16));
}
#endif

// One Marlin tile from its two GPTQ rows A = a[0..64), B = b[0..64) (perm-gathered or not).
// Word (cc, rr, v) = 16 cc + 4 rr + v is byte-transpose rr of the planes {Lo, Hi}[16 v + cc (+8)]
// of (A, B). Vector path: planes and transposes lanewise over cc (8 columns), giving t[q][cc] with
// q = 4 rr + v; the tile is the 16 x 8 transpose of t, done with one 16-lane gather per cc; the
// 512-byte tile is written with streaming stores.
inline void EmitTile(const uint32_t* HWY_RESTRICT a, const uint32_t* HWY_RESTRICT b, uint32_t* HWY_RESTRICT dst) {
  HWY_ALIGN uint32_t o[::wsync::kernels::format::kTileWords];
#if HWY_TARGET == HWY_SCALAR
  for (int cc = 0; cc < 8; ++cc) {
    for (int v = 0; v < 4; ++v) {
      const int c = 16 * v + cc;
      uint32_t x0 = ::wsync::kernels::format::NibblePlaneLo(a[c], b[c]),
               x1 = ::wsync::kernels::format::NibblePlaneLo(a[c + 8], b[c + 8]);
      uint32_t x2 = ::wsync::kernels::format::NibblePlaneHi(a[c], b[c]),
               x3 = ::wsync::kernels::format::NibblePlaneHi(a[c + 8], b[c + 8]);
      ::wsync::kernels::format::Transpose4x4Bytes(x0, x1, x2, x3);
      o[16 * cc + v] = x0;
      o[16 * cc + 4 + v] = x1;
      o[16 * cc + 8 + v] = x2;
      o[16 * cc + 12 + v] = x3;
    }
  }
#else
  HWY_ALIGN uint32_t t[::wsync::kernels::format::kTileWords];
  const hn::CappedTag<uint32_t, 8> d;
  const auto m4 = hn::Set(d, 0x0F0F0F0Fu), m4h = hn::Set(d, 0xF0F0F0F0u);
  const int lanes = static_cast<int>(hn::Lanes(d));
  for (int v = 0; v < 4; ++v) {
    for (int cc = 0; cc < 8; cc += lanes) {
      const auto a0 = hn::LoadU(d, a + 16 * v + cc), a1 = hn::LoadU(d, a + 16 * v + 8 + cc);
      const auto b0 = hn::LoadU(d, b + 16 * v + cc), b1 = hn::LoadU(d, b + 16 * v + 8 + cc);
      // Vector forms of format::NibblePlaneLo / NibblePlaneHi.
      auto x0 = hn::Or(hn::And(a0, m4), hn::ShiftLeft<4>(hn::And(b0, m4)));
      auto x1 = hn::Or(hn::And(a1, m4), hn::ShiftLeft<4>(hn::And(b1, m4)));
      auto x2 = hn::Or(hn::And(hn::ShiftRight<4>(a0), m4), hn::And(b0, m4h));
      auto x3 = hn::Or(hn::And(hn::ShiftRight<4>(a1), m4), hn::And(b1, m4h));
      Transpose4x4BytesV(d, x0, x1, x2, x3);
      hn::Store(x0, d, t + (0 + v) * 8 + cc);
      hn::Store(x1, d, t + (4 + v) * 8 + cc);
      hn::Store(x2, d, t + (8 + v) * 8 + cc);
      hn::Store(x3, d, t + (12 + v) * 8 + cc);
    }
  }
  const hn::CappedTag<uint32_t, 16> d16;
  const hn::RebindToSigned<decltype(d16)> di;
  const int lanes16 = static_cast<int>(hn::Lanes(d16));
  const auto idx = hn::Mul(hn::Iota(di, 0), hn::Set(di, 8));
  for (int cc = 0; cc < 8; ++cc) {
    for (int q = 0; q < 16; q += lanes16) {
      hn::Store(hn::GatherIndex(d16, t + q * 8 + cc, idx), d16, o + 16 * cc + q);
    }
  }
#endif
  StreamCopy(o, ::wsync::kernels::format::kTileWords, dst);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace wsync::kernels::cpu
HWY_AFTER_NAMESPACE();

#endif  // WSYNC_KERNELS_CPU_MARLIN_TILE_INL_H_
