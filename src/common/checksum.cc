#include "common/checksum.h"

#include <xxhash.h>

namespace wsync {

uint64_t Xxh3_64(std::span<const std::byte> bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

struct Xxh3Stream::State {
  XXH3_state_t* s = XXH3_createState();
  ~State() { XXH3_freeState(s); }
};

Xxh3Stream::Xxh3Stream() : state_(std::make_unique<State>()) { XXH3_64bits_reset(state_->s); }
Xxh3Stream::~Xxh3Stream() = default;
Xxh3Stream::Xxh3Stream(Xxh3Stream&&) noexcept = default;
Xxh3Stream& Xxh3Stream::operator=(Xxh3Stream&&) noexcept = default;
void Xxh3Stream::Update(std::span<const std::byte> bytes) { XXH3_64bits_update(state_->s, bytes.data(), bytes.size()); }
uint64_t Xxh3Stream::Digest() const { return XXH3_64bits_digest(state_->s); }

}  // namespace wsync
