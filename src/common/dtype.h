// Element types of the tensors wsync moves, their safetensors names, and exact conversions.
//
// bf16 and fp16 are stored as their raw 16-bit patterns (uint16_t). Conversions are exact where
// the target can represent the value, and otherwise round to nearest, ties to even (IEEE 754
// default), as PyTorch does; NaN stays NaN (sign and the high payload bits are kept, the quiet bit
// is set), infinities stay infinities, fp32 -> fp16 overflow gives infinity.
// Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wsync {

// kF8E4M3: FP8 E4M3FN (docs/spec/FP8.md §1), moved as its raw bytes; no conversion here.
enum class DType : uint8_t { kBF16, kF16, kF32, kI32, kI64, kI8, kU8, kF8E4M3 };
inline constexpr DType kAllDTypes[] = {DType::kBF16, DType::kF16, DType::kF32, DType::kI32,
                                       DType::kI64,  DType::kI8,  DType::kU8,  DType::kF8E4M3};

// Bytes per element: 2, 2, 4, 4, 8, 1, 1, 1.
constexpr size_t ItemSize(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kI8:
    case DType::kU8:
    case DType::kF8E4M3: return 1;
  }
  return 0;
}
constexpr bool IsFloating(DType t) { return t == DType::kBF16 || t == DType::kF16 || t == DType::kF32; }

// The safetensors header name: "BF16", "F16", "F32", "I32", "I64", "I8", "U8", "F8_E4M3".
absl::string_view SafetensorsName(DType t);
// Parses a safetensors dtype name; any other name (including valid safetensors types wsync does
// not move, e.g. "F64", "BOOL", "F8_E5M2") is InvalidArgument naming it.
absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name);
// PyTorch-style name ("bfloat16", "float16", "float32", "int32", "int64", "int8", "uint8",
// "float8_e4m3fn").
absl::string_view TorchName(DType t);
// Parses a torch name, with or without "torch." (as in HF config.json "torch_dtype").
absl::StatusOr<DType> ParseTorchDType(absl::string_view name);

// --- scalar conversions --------------------------------------------------------------------------

constexpr float BF16ToF32(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

// fp32 -> bf16, round to nearest even; NaN preserved as a quiet NaN of the same sign.
constexpr uint16_t F32ToBF16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// fp16 -> fp32, exact (subnormals, infinities and NaN payloads included).
constexpr float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return std::bit_cast<float>(sign);
  // Subnormal: normalize. value = mant * 2^-24.
  int e = -1;
  do {
    mant <<= 1;
    ++e;
  } while ((mant & 0x400u) == 0);
  mant &= 0x3ffu;
  return std::bit_cast<float>(sign | static_cast<uint32_t>(112 - e) << 23 | (mant << 13));
}

// fp32 -> fp16, round to nearest even, overflow to infinity, gradual underflow; NaN stays NaN.
constexpr uint16_t F32ToF16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: rounds to inf
  if (abs < 0x38800000u) {                                               // below 2^-14: subnormal
    if (abs < 0x33000000u) return sign;  // below 2^-25: rounds to zero (2^-25 itself ties to 0)
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // value = mant * 2^(exp-150); unit = 2^-24
    const uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    const uint32_t r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t rounding_bias = 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((abs - 0x38000000u + rounding_bias) >> 13));
}

// Bulk conversions of n elements (n may be 0). dst and src must not overlap.
void ConvertBF16ToF32(const uint16_t* src, float* dst, size_t n);
void ConvertF32ToBF16(const float* src, uint16_t* dst, size_t n);
void ConvertF16ToF32(const uint16_t* src, float* dst, size_t n);
void ConvertF32ToF16(const float* src, uint16_t* dst, size_t n);

}  // namespace wsync
