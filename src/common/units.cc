#include "common/units.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace wsync {

std::string FormatBytes(uint64_t n) {
  if (n >= (uint64_t{1} << 30)) return absl::StrFormat("%.2f GiB", static_cast<double>(n) / (1 << 30));
  if (n >= (uint64_t{1} << 20)) return absl::StrFormat("%.2f MiB", static_cast<double>(n) / (1 << 20));
  if (n >= 1024) return absl::StrFormat("%.2f KiB", static_cast<double>(n) / 1024);
  return absl::StrFormat("%d B", n);
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  double scale = 1;
  absl::string_view digits = text;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K':
      case 'k': scale = 1024.0; break;
      case 'M':
      case 'm': scale = 1024.0 * 1024; break;
      case 'G':
      case 'g': scale = 1024.0 * 1024 * 1024; break;
      default: break;
    }
    if (scale != 1) digits.remove_suffix(1);
  }
  double v = 0;
  if (!absl::SimpleAtod(digits, &v) || !(v >= 0) || v * scale > 1.8e19) {
    return absl::InvalidArgumentError(absl::StrCat("bad size \"", text, "\" (e.g. 4096, 1K, 16M, 1G)"));
  }
  return static_cast<uint64_t>(v * scale);
}

std::string FormatRate(uint64_t bytes, absl::Duration elapsed) {
  const double s = absl::ToDoubleSeconds(elapsed);
  if (s <= 0) return "-";
  return absl::StrFormat("%.2f GB/s", static_cast<double>(bytes) / s / 1e9);
}

}  // namespace wsync
