// Human-readable sizes and rates for logs, errors and tables. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace wsync {

// "0 B", "812 B", "1.50 KiB", "512.00 MiB", "2.10 GiB" (binary units).
std::string FormatBytes(uint64_t n);

// Decimal GB/s of `bytes` moved in `elapsed` ("-" when elapsed is zero).
std::string FormatRate(uint64_t bytes, absl::Duration elapsed);

}  // namespace wsync
