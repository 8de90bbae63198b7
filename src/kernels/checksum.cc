#include "kernels/checksum.h"

#include <cstring>

#include "kernels/format/sum64.h"

namespace wsync::kernels {

uint64_t Sum64Host(std::span<const std::byte> bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const uint64_t n = bytes.size(), whole = n / 8;
  // Four independent sums keep the multipliers busy; their total is the same sum mod 2^64.
  uint64_t s[4] = {0, 0, 0, 0};
  uint64_t i = 0;
  for (; i + 4 <= whole; i += 4) {
    for (uint64_t k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + 8 * (i + k), 8);
      s[k] += format::Sum64Term(w, i + k);
    }
  }
  for (; i < (n + 7) / 8; ++i) s[0] += format::Sum64Term(format::Sum64WordAt(p, n, i), i);
  return format::Sum64Final(s[0] + s[1] + s[2] + s[3], n);
}

// Sum64(space, ...) is in dispatch.cc, with the other choices between the CPU and CUDA paths.

}  // namespace wsync::kernels
