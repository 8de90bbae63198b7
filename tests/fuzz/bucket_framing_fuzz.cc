// libFuzzer target: a bucket's framing as a receiver decodes it (bucket_format.h DecodeManifest),
// the one untrusted input of the data plane. Input: 8 bytes of the header's data_bytes
// (little-endian), then the manifest bytes (the header's manifest_bytes is their count). Every
// input must be refused with kDataLoss, or give a manifest whose every entry lies inside the data
// and whose sizes agree with the header; never crash, hang or over-read (ASan/UBSan watch).
// Run: build-asan/bin/wsync-fuzz-bucket_framing tests/fuzz/corpus/bucket_framing
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "comm/bucket/bucket_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(uint64_t)) return 0;
  wsync::comm::BucketHeader header;
  std::memcpy(&header.data_bytes, data, sizeof(uint64_t));
  header.manifest_bytes = size - sizeof(uint64_t);
  absl::string_view manifest(reinterpret_cast<const char*>(data) + sizeof(uint64_t), header.manifest_bytes);
  auto m = wsync::comm::DecodeManifest(header, manifest, 0);
  if (!m.ok()) {
    if (!absl::IsDataLoss(m.status())) std::abort();  // a corrupt framing must be DATA_LOSS
    return 0;
  }
  if (m->nbytes() != header.data_bytes || m->index() != 0) std::abort();
  for (const auto& e : m->entries()) {
    if (e.offset() > header.data_bytes || e.nbytes() > header.data_bytes - e.offset()) std::abort();  // escaped
    if (e.tensor().name().empty()) std::abort();
  }
  return 0;
}
