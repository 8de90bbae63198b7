// Bit-level FP8 E4M3 helpers shared by the CPU (kernels/cpu/fp8_cpu.cc) and CUDA
// (kernels/cuda/fp8_kernels.cu) quantizers: the code, the scale of every variant and the
// quantization of one value, exactly as docs/spec/FP8.md (cited as §n) defines them. Pure
// functions, usable on the host and, under nvcc, on the device.
//
//   block  (§2)  slime  s = fl32(max(amax, 1e-10f) / 448), q = e4m3(clamp(fl32(x * fl32(1 / s))))
//                vllm   s = fl32(max(amax, 1e-4f) / 448),  q = e4m3(fl32(x * fl32(1 / s)))
//                ue8m0  s = the power of two >= fl32(max(amax, 1e-4f) / 448), q = e4m3(x * (1 / s))
//   channel (§3) slime  s = fl32(max(amax, bf16(1e-12)) / 448), q = e4m3(clamp(fl32(x / s)))
//                compressed-tensors: in the weight's 16-bit type T, s = T(amax / 448) (eps(T) for 0),
//                       q = e4m3(clamp(T(x / s)))
//
// Thread-safety: pure functions and constants.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/format/host_device.h"

namespace wsync::kernels::format {

inline constexpr float kFp8Max = 448.0f;                         // largest finite E4M3FN value (code 0x7E)
inline constexpr uint8_t kFp8MaxCode = 0x7E;                     //
inline constexpr float kSlimeBlockFloor = 1e-10f;                // §2.1, 0x2EDBE6FF
inline constexpr float kVllmBlockFloor = 1e-4f;                  // §2.2 / §2.3, 0x38D1B717
inline constexpr uint32_t kSlimeChannelFloorBits = 0x2B8D0000u;  // §3.1: float(bf16(1e-12))

enum class Fp8BlockVariant : int { kSlime = 0, kVllm = 1, kUe8m0 = 2 };
enum class Fp8ChannelVariant : int { kSlime = 0, kCompressedTensors = 1 };

WSYNC_HD uint32_t F32Bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
WSYNC_HD float BitsF32(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---- the code (§1) -----------------------------------------------------------------------------

// The E4M3FN code of `a` (0 <= a <= 448, not NaN): round to nearest, ties to the even code.
WSYNC_HD uint32_t E4m3MagnitudeCode(float a) {
  if (a < 0x1p-6f) return static_cast<uint32_t>(rintf(a * 512.0f));  // subnormals 0..7 (8: min normal)
  const uint32_t b = F32Bits(a);
  return (b - (120u << 23) + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;
}

// The E4M3FN code of x, |x| <= 448 (the callers clamp or bound it); the sign of -0.0 kept.
WSYNC_HD uint8_t E4m3Code(float x) {
  const uint32_t sign = (F32Bits(x) >> 24) & 0x80u;
  return static_cast<uint8_t>(sign | E4m3MagnitudeCode(fabsf(x)));
}

// The value of an E4M3FN code (NaN for 0x7F / 0xFF).
WSYNC_HD float E4m3Value(uint8_t code) {
  const uint32_t e = (code >> 3) & 0xFu, m = code & 7u;
  float v;
  if (e == 15 && m == 7)
    v = NAN;
  else if (e == 0)
    v = static_cast<float>(m) * 0x1p-9f;
  else
    v = BitsF32(((e + 120u) << 23) | (m << 20));
  return (code & 0x80u) ? -v : v;
}

WSYNC_HD float ClampFp8(float x) { return fminf(fmaxf(x, -kFp8Max), kFp8Max); }

// ---- block scales (§2) -------------------------------------------------------------------------

// The smallest power of two >= t (t > 0 finite), by its bits, clamped to exponents 1..254 (§2.3).
WSYNC_HD float CeilPowerOfTwo(float t) {
  const uint32_t b = F32Bits(t);
  uint32_t e = ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0 ? 1u : 0u);
  e = e < 1u ? 1u : (e > 254u ? 254u : e);
  return BitsF32(e << 23);
}

// The stored scale (weight_scale_inv) of a block whose largest |x| is `amax`.
WSYNC_HD float BlockScale(float amax, Fp8BlockVariant v) {
  if (v == Fp8BlockVariant::kSlime) return fmaxf(amax, kSlimeBlockFloor) / kFp8Max;
  const float t = fmaxf(amax, kVllmBlockFloor) / kFp8Max;
  return v == Fp8BlockVariant::kVllm ? t : CeilPowerOfTwo(t);
}

// The multiplier every element of the block is quantized with: fl32(1 / s).
WSYNC_HD float BlockMultiplier(float scale) { return 1.0f / scale; }

// One element's code in a block (r = BlockMultiplier(s)). The clamp is the spec's for slime and a
// no-op for the others (|x * r| <= 448 (1 + 2^-22), which encodes as 448 either way).
WSYNC_HD uint8_t QuantizeBlockElement(float x, float r) { return E4m3Code(ClampFp8(x * r)); }

// ---- channel scales (§3) -----------------------------------------------------------------------

// slime's per-row scale (float32).
WSYNC_HD float ChannelScaleSlime(float amax) { return fmaxf(amax, BitsF32(kSlimeChannelFloorBits)) / kFp8Max; }
WSYNC_HD uint8_t QuantizeChannelElementSlime(float x, float s) { return E4m3Code(ClampFp8(x / s)); }

// 16-bit float rounding of the compressed-tensors variant (RNE; bf16 or fp16).
WSYNC_HD uint16_t F32ToBf16Bits(float f) {
  const uint32_t u = F32Bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // finite inputs only
}
WSYNC_HD float Bf16BitsToF32(uint16_t h) { return BitsF32(static_cast<uint32_t>(h) << 16); }
// fp16 RNE of a finite float whose magnitude is below 65520 (no overflow here: |x / s| <= 448 and
// amax / 448 < 147); gradual underflow.
WSYNC_HD uint16_t F32ToF16Bits(float f) {
  const uint32_t u = F32Bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const float a = fabsf(f);
  if (a < 0x1p-14f) return static_cast<uint16_t>(sign | static_cast<uint32_t>(rintf(a * 0x1p24f)));
  const uint32_t b = F32Bits(a);
  return static_cast<uint16_t>(sign | ((b - (112u << 23) + 0xFFFu + ((b >> 13) & 1u)) >> 13));
}
WSYNC_HD float F16BitsToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  const float a = e == 0 ? static_cast<float>(m) * 0x1p-24f : BitsF32(((e + 112u) << 23) | (m << 13));
  return BitsF32(F32Bits(a) | sign);
}
// Rounds a float32 to the 16-bit type (bf16 when `bf16`) and back.
WSYNC_HD float Round16(float x, bool bf16) {
  return bf16 ? Bf16BitsToF32(F32ToBf16Bits(x)) : F16BitsToF32(F32ToF16Bits(x));
}

// compressed-tensors' per-row scale, as a float holding a value of the 16-bit type.
WSYNC_HD float ChannelScaleCompressedTensors(float amax, bool bf16) {
  const float s = Round16(amax / kFp8Max, bf16);
  return s == 0.0f ? (bf16 ? 0x1p-7f : 0x1p-10f) : s;
}
WSYNC_HD uint8_t QuantizeChannelElementCompressedTensors(float x, float s, bool bf16) {
  return E4m3Code(ClampFp8(Round16(x / s, bf16)));
}

}  // namespace wsync::kernels::format
