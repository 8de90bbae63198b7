// libFuzzer target: the safetensors validator on arbitrary file images. It must return an error
// or a layout whose every record lies inside the input, and never crash, hang or over-read
// (ASan/UBSan watch). Run: build-asan/bin/wsync-fuzz-safetensors tests/fuzz/corpus/safetensors
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  auto layout = wsync::ParseSafetensors(file, "fuzz");
  if (layout.ok()) {
    for (const auto& r : layout->records) {
      if (r.begin > r.end || layout->data_offset + r.end > size) std::abort();  // validator let an escape through
    }
  }
  return 0;
}
