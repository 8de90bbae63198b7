// libFuzzer target: HF config.json and quantization_config parsing on arbitrary text.
#include <cstddef>
#include <cstdint>

#include "common/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto c = wsync::ParseModelConfig(text, "fuzz");
  if (c.ok() && c->quantization) (void)c->quantization->IsIgnored("model.layers.0.mlp.gate.weight");
  (void)wsync::ParseQuantizationConfig(text, "fuzz");
  return 0;
}
