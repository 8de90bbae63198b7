#include "common/dtype.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace wsync {
namespace {

struct DTypeNames {
  DType type;
  absl::string_view safetensors;
  absl::string_view torch;
};
constexpr DTypeNames kNames[] = {
    {DType::kBF16, "BF16", "bfloat16"}, {DType::kF16, "F16", "float16"},
    {DType::kF32, "F32", "float32"},    {DType::kI32, "I32", "int32"},
    {DType::kI64, "I64", "int64"},      {DType::kI8, "I8", "int8"},
    {DType::kU8, "U8", "uint8"},        {DType::kF8E4M3, "F8_E4M3", "float8_e4m3fn"},
};

}  // namespace

absl::string_view SafetensorsName(DType t) {
  for (const auto& n : kNames)
    if (n.type == t) return n.safetensors;
  return "?";
}

absl::string_view TorchName(DType t) {
  for (const auto& n : kNames)
    if (n.type == t) return n.torch;
  return "?";
}

absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name) {
  for (const auto& n : kNames)
    if (n.safetensors == name) return n.type;
  return absl::InvalidArgumentError(absl::StrCat("unsupported safetensors dtype \"", name,
                                                 "\" (wsync handles BF16, F16, F32, I32, I64, I8, U8, F8_E4M3)"));
}

absl::StatusOr<DType> ParseTorchDType(absl::string_view name) {
  absl::string_view bare = absl::StripPrefix(name, "torch.");
  for (const auto& n : kNames)
    if (n.torch == bare) return n.type;
  if (bare == "bf16") return DType::kBF16;
  if (bare == "half" || bare == "fp16") return DType::kF16;
  if (bare == "float" || bare == "fp32") return DType::kF32;
  return absl::InvalidArgumentError(absl::StrCat("unsupported torch dtype \"", name, "\""));
}

void ConvertBF16ToF32(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = BF16ToF32(src[i]);
}
void ConvertF32ToBF16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F32ToBF16(src[i]);
}
void ConvertF16ToF32(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F16ToF32(src[i]);
}
void ConvertF32ToF16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F32ToF16(src[i]);
}

}  // namespace wsync
