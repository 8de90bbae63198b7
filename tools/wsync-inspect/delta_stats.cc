#include "tools/wsync-inspect/delta_stats.h"

#include <bit>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <span>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/delta.h"
#include "model/hf_checkpoint.h"

namespace wsync::tools {
namespace {

std::string ClassOf(const std::string& name, DType dtype, const model::HfCheckpoint& ckpt) {
  if (absl::EndsWith(name, ".weight_packed") && dtype == DType::kI32) return "int4 words";
  if (absl::EndsWith(name, ".weight_scale")) {
    const std::string stem = name.substr(0, name.size() - std::string(".weight_scale").size());
    if (ckpt.Contains(stem + ".weight_packed")) return "int4 scales";
  }
  if (absl::EndsWith(name, ".weight_scale_inv")) return "fp8 scales";
  if (dtype == DType::kF8E4M3) return "fp8";
  if (dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF32) return "bf16";
  return "other";
}

// 4-bit codes that differ between two int32 words.
uint64_t ChangedCodes(std::span<const std::byte> a, std::span<const std::byte> b) {
  uint64_t n = 0;
  for (size_t i = 0; i + 4 <= a.size(); i += 4) {
    uint32_t x, y;
    std::memcpy(&x, a.data() + i, 4);
    std::memcpy(&y, b.data() + i, 4);
    for (uint32_t d = x ^ y; d != 0; d >>= 4) n += (d & 0xf) != 0;
  }
  return n;
}

}  // namespace

absl::StatusOr<std::map<std::string, DeltaClassStats>> DeltaStatsBetween(const std::string& base_dir,
                                                                         const std::string& next_dir) {
  ASSIGN_OR_RETURN(const model::HfCheckpoint base, model::HfCheckpoint::Open(base_dir));
  ASSIGN_OR_RETURN(const model::HfCheckpoint next, model::HfCheckpoint::Open(next_dir));
  std::map<std::string, DeltaClassStats> out;
  for (const std::string& name : base.Names())
    if (!next.Contains(name))
      return absl::InvalidArgumentError(absl::StrCat(name, " is in ", base_dir, " but not in ", next_dir));
  for (const std::string& name : next.Names()) {
    ASSIGN_OR_RETURN(const TensorView n, next.Get(name));
    if (!base.Contains(name))
      return absl::InvalidArgumentError(absl::StrCat(name, " is in ", next_dir, " but not in ", base_dir));
    ASSIGN_OR_RETURN(const TensorView b, base.Get(name));
    if (b.dtype() != n.dtype() || b.shape() != n.shape())
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", SafetensorsName(b.dtype()), ShapeToString(b.shape()),
                                                     " in ", base_dir, ", ", SafetensorsName(n.dtype()),
                                                     ShapeToString(n.shape()), " in ", next_dir));
    const auto as_u8 = [](const TensorView& t) {
      return std::span(reinterpret_cast<const uint8_t*>(t.bytes().data()), t.nbytes());
    };
    ASSIGN_OR_RETURN(const kernels::DeltaPlan plan,
                     kernels::PlanDelta(as_u8(b), as_u8(n), static_cast<uint32_t>(ItemSize(n.dtype()))));
    for (const std::string& cls : {ClassOf(name, n.dtype(), next), std::string("total")}) {
      DeltaClassStats& s = out[cls];
      ++s.tensors;
      s.items += plan.items;
      s.changed_items += plan.changed_items;
      s.full_bytes += n.nbytes();
      s.delta_bytes += plan.payload_bytes;
      if (ClassOf(name, n.dtype(), next) == "int4 words") {
        s.codes += plan.items * 8;
        if (plan.changed_items > 0) s.changed_codes += ChangedCodes(b.bytes(), n.bytes());
      }
    }
  }
  return out;
}

int PrintDeltaStats(const std::string& base_dir, const std::string& next_dir, bool json) {
  auto stats = DeltaStatsBetween(base_dir, next_dir);
  if (!stats.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(stats.status().message()).c_str());
    return 1;
  }
  auto pct = [](uint64_t a, uint64_t b) {
    return b == 0 ? 0.0 : 100.0 * static_cast<double>(a) / static_cast<double>(b);
  };
  if (json) {
    nlohmann::json j = {{"base", base_dir}, {"next", next_dir}, {"classes", nlohmann::json::object()}};
    for (const auto& [cls, s] : *stats) {
      j["classes"][cls] = {{"tensors", s.tensors},
                           {"items", s.items},
                           {"changed_items", s.changed_items},
                           {"full_bytes", s.full_bytes},
                           {"delta_bytes", s.delta_bytes}};
      if (s.codes > 0) j["classes"][cls]["codes"] = s.codes, j["classes"][cls]["changed_codes"] = s.changed_codes;
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("# delta %s -> %s\n", base_dir.c_str(), next_dir.c_str());
  std::printf("%-12s %8s %14s %14s %9s %14s %14s %8s\n", "class", "tensors", "elements", "changed", "changed%",
              "full bytes", "delta bytes", "delta%");
  for (const auto& [cls, s] : *stats) {
    std::printf("%-12s %8llu %14llu %14llu %8.3f%% %14llu %14llu %7.2f%%\n", cls.c_str(),
                static_cast<unsigned long long>(s.tensors), static_cast<unsigned long long>(s.items),
                static_cast<unsigned long long>(s.changed_items), pct(s.changed_items, s.items),
                static_cast<unsigned long long>(s.full_bytes), static_cast<unsigned long long>(s.delta_bytes),
                pct(s.delta_bytes, s.full_bytes));
    if (cls == "int4 words")
      std::printf("%-12s %8s %14llu %14llu %8.3f%%\n", "  int4 codes", "", static_cast<unsigned long long>(s.codes),
                  static_cast<unsigned long long>(s.changed_codes), pct(s.changed_codes, s.codes));
  }
  return 0;
}

}  // namespace wsync::tools
