#include "common/units.h"

#include "absl/strings/str_format.h"

namespace wsync {

std::string FormatBytes(uint64_t n) {
  if (n >= (uint64_t{1} << 30)) return absl::StrFormat("%.2f GiB", static_cast<double>(n) / (1 << 30));
  if (n >= (uint64_t{1} << 20)) return absl::StrFormat("%.2f MiB", static_cast<double>(n) / (1 << 20));
  if (n >= 1024) return absl::StrFormat("%.2f KiB", static_cast<double>(n) / 1024);
  return absl::StrFormat("%d B", n);
}

std::string FormatRate(uint64_t bytes, absl::Duration elapsed) {
  const double s = absl::ToDoubleSeconds(elapsed);
  if (s <= 0) return "-";
  return absl::StrFormat("%.2f GB/s", static_cast<double>(bytes) / s / 1e9);
}

}  // namespace wsync
