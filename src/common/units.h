// Human-readable sizes and rates for logs, errors and tables. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace wsync {

// "0 B", "812 B", "1.50 KiB", "512.00 MiB", "2.10 GiB" (binary units).
std::string FormatBytes(uint64_t n);

// "4096", "1K", "16M", "1.5G" (binary suffixes K/M/G, either case) -> bytes; kInvalidArgument
// for anything else (the benchmarks' -b/-e flags).
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// Decimal GB/s of `bytes` moved in `elapsed` ("-" when elapsed is zero).
std::string FormatRate(uint64_t bytes, absl::Duration elapsed);

}  // namespace wsync
