// Per-target building block of the CPU quantizers (Highway "-inl" header: included once per SIMD
// target from a file that includes hwy/foreach_target.h): the largest |x| of a run of bf16 / fp16
// values, reduced exactly on their 15-bit magnitude patterns (whose order is that of |x| for every
// non-NaN value). Used by kernels/cpu/int4_cpu.cc and kernels/cpu/fp8_cpu.cc.
// Thread-safety: pure functions of their arguments.

// Per-target include guard (the Highway convention for -inl headers).
#if defined(WSYNC_KERNELS_CPU_ABS_MAX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef WSYNC_KERNELS_CPU_ABS_MAX_INL_H_
#undef WSYNC_KERNELS_CPU_ABS_MAX_INL_H_
#else
#define WSYNC_KERNELS_CPU_ABS_MAX_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "hwy/highway.h"
#include "kernels/format/int4_format.h"

HWY_BEFORE_NAMESPACE();
namespace wsync::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// max |x| as 15-bit magnitude pattern over n 16-bit values.
inline uint32_t AbsMaxBits(const uint16_t* HWY_RESTRICT x, int64_t n) {
  const hn::ScalableTag<uint16_t> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const auto mask = hn::Set(d, static_cast<uint16_t>(0x7FFF));
  auto m = hn::Zero(d);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) m = hn::Max(m, hn::And(hn::LoadU(d, x + i), mask));
  uint32_t r = 0;
#if HWY_TARGET == HWY_SCALAR
  r = hn::GetLane(m);
#else
  // Horizontal max: the two u16 halves of each u32 lane, then MaxOfLanes on u32.
  const hn::Repartition<uint32_t, decltype(d)> d32;
  const auto v32 = hn::BitCast(d32, m);
  const auto mm = hn::Max(hn::And(v32, hn::Set(d32, 0xFFFFu)), hn::ShiftRight<16>(v32));
  r = hn::GetLane(hn::MaxOfLanes(d32, mm));
#endif
  for (; i < n; ++i) r = std::max<uint32_t>(r, ::wsync::kernels::format::AbsBits16(x[i]));
  return r;
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace wsync::kernels::cpu
HWY_AFTER_NAMESPACE();

#endif  // WSYNC_KERNELS_CPU_ABS_MAX_INL_H_
