// Checksums of byte ranges: XXH3-64 (libxxhash), the checksum of bucket manifests and of
// `wsync-inspect --checksum`. Fast (> 10 GB/s per core), not cryptographic: it detects corruption,
// not tampering (the control plane's TLS and tokens cover that).
// Thread-safety: pure functions; Xxh3Stream is a value owned by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace wsync {

uint64_t Xxh3_64(std::span<const std::byte> bytes);

// Incremental XXH3-64 over several ranges; equal to Xxh3_64 of their concatenation.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(Xxh3Stream&&) noexcept;
  Xxh3Stream& operator=(Xxh3Stream&&) noexcept;
  void Update(std::span<const std::byte> bytes);
  uint64_t Digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace wsync
