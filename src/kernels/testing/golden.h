// Test helpers for the kernels' golden files (tests/data/golden/, written by
// tools/golden/int4_golden.py): the case lists in their metadata and copies of their tensors.
// Thread-safety: pure functions.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/safetensors.h"

namespace wsync::kernels::testing {

// The path of a golden file: $WSYNC_GOLDEN_DIR/<name> when that is set (the device bundle moves the
// files), else the source tree's tests/data/golden/<name> (WSYNC_GOLDEN_DIR, compiled in).
inline std::string GoldenPath(const std::string& name) {
  const char* dir = std::getenv("WSYNC_GOLDEN_DIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : WSYNC_GOLDEN_DIR) + "/" + name;
}

// The strings of a flat JSON list of names ("[\"a\", \"b\"]"), as the golden metadata holds them.
inline std::vector<std::string> JsonNames(const std::string& json) {
  std::vector<std::string> out;
  std::string cur;
  bool in = false;
  for (char c : json) {
    if (c == '"') {
      if (in) out.push_back(cur);
      cur.clear();
      in = !in;
    } else if (in) {
      cur += c;
    }
  }
  return out;
}

// An aligned copy of a tensor's elements (safetensors data need not be aligned).
template <typename T>
std::vector<T> CopyOf(const SafetensorsEntry& e) {
  std::vector<T> v(e.view.nbytes() / sizeof(T));
  std::memcpy(v.data(), e.view.data(), e.view.nbytes());
  return v;
}

}  // namespace wsync::kernels::testing
