#include "common/checksum.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace wsync {
namespace {

TEST(ChecksumTest, KnownValuesAndStreaming) {
  // XXH3-64 of the empty input with seed 0 (xxHash reference value).
  EXPECT_EQ(Xxh3_64({}), 0x2D06800538D394C2ull);
  std::vector<std::byte> data(100000);
  std::mt19937 rng(3);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  const uint64_t whole = Xxh3_64(data);
  Xxh3Stream s;
  s.Update(std::span(data).first(1));
  s.Update(std::span(data).subspan(1, 4999));
  s.Update(std::span(data).subspan(5000));
  EXPECT_EQ(s.Digest(), whole);
  data[777] ^= std::byte{1};
  EXPECT_NE(Xxh3_64(data), whole);  // a single flipped bit is detected
}

}  // namespace
}  // namespace wsync
