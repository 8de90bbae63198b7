#include "comm/bucket/bucket_mac.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"

namespace wsync::comm {
namespace {

// GCM with no plaintext through OpenSSL's cipher interface (not the EVP_MAC one BucketMac uses): the
// tag of `aad` under `key` and a 12-byte `iv`.
std::string GcmTagOfAad(const std::string& key, const std::string& iv, const std::string& aad) {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  int len = 0;
  unsigned char tag[16];
  EXPECT_EQ(EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, nullptr, nullptr), 1);
  EXPECT_EQ(EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_IVLEN, static_cast<int>(iv.size()), nullptr), 1);
  EXPECT_EQ(EVP_EncryptInit_ex(ctx, nullptr, nullptr, reinterpret_cast<const unsigned char*>(key.data()),
                               reinterpret_cast<const unsigned char*>(iv.data())),
            1);
  if (!aad.empty()) {
    EXPECT_EQ(EVP_EncryptUpdate(ctx, nullptr, &len, reinterpret_cast<const unsigned char*>(aad.data()),
                                static_cast<int>(aad.size())),
              1);
  }
  EXPECT_EQ(EVP_EncryptFinal_ex(ctx, tag, &len), 1);
  EXPECT_EQ(EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, 16, tag), 1);
  EVP_CIPHER_CTX_free(ctx);
  return std::string(reinterpret_cast<char*>(tag), 16);
}

std::string U64le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// The construction of bucket_mac.h written out from its comment: stream key by HMAC-SHA256 of the
// label and the group, then GMAC with IV 0^4 || index over the sizes, the manifest and the data.
std::string ReferenceTag(const std::string& sync_key, const std::string& group, uint64_t index,
                         const std::string& manifest, const std::string& data) {
  const std::string msg = std::string("wsync bucket stream v1", 23) + group;
  unsigned char stream_key[32];
  unsigned int n = 0;
  HMAC(EVP_sha256(), sync_key.data(), static_cast<int>(sync_key.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), stream_key, &n);
  EXPECT_EQ(n, 32u);
  const std::string iv = std::string(4, '\0') + U64le(index);
  return GcmTagOfAad(std::string(reinterpret_cast<char*>(stream_key), 32), iv,
                     U64le(manifest.size()) + U64le(data.size()) + manifest + data);
}

std::string TagString(const BucketTag& t) { return std::string(reinterpret_cast<const char*>(t.data()), t.size()); }
std::span<const std::byte> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

TEST(BucketMacTest, TheReferenceIsGcmAsNistGivesIt) {
  // McGrew & Viega, "The Galois/Counter Mode of Operation", test case 13: AES-256, zero key and IV,
  // no plaintext, no AAD.
  EXPECT_EQ(absl::BytesToHexString(GcmTagOfAad(std::string(32, '\0'), std::string(12, '\0'), "")),
            "530f8afbc74536b9a963b4f1c4cb738b");
}

TEST(BucketMacTest, TagsEqualTheReferenceOnRandomBuckets) {
  std::mt19937_64 rng(20261126);  // seed recorded
  for (int trial = 0; trial < 40; ++trial) {
    std::string key(kBucketMacKeyBytes, '\0'), manifest(rng() % 300, '\0'), data(rng() % 70000, '\0');
    for (auto* s : {&key, &manifest, &data})
      for (char& c : *s) c = static_cast<char>(rng());
    // Edge cases among the random ones: empty manifest and data, an all-zero key, the largest index.
    if (trial == 0) manifest.clear(), data.clear();
    if (trial == 1) key.assign(kBucketMacKeyBytes, '\0');
    const uint64_t index = trial == 2 ? ~uint64_t{0} : rng() % 1000;
    const std::string group = "sync-" + std::to_string(trial) + "/pp" + std::to_string(trial % 3);
    auto mac = BucketMac::ForStream(key, group);
    ASSERT_TRUE(mac.ok()) << mac.status();
    auto tag = mac->Tag(index, manifest, Bytes(data));
    ASSERT_TRUE(tag.ok()) << tag.status();
    EXPECT_EQ(TagString(*tag), ReferenceTag(key, group, index, manifest, data)) << "trial " << trial;
    auto good = mac->Verify(index, manifest, Bytes(data), *tag);
    ASSERT_TRUE(good.ok());
    EXPECT_TRUE(*good);
  }
}

TEST(BucketMacTest, AnyChangeGivesAnotherTag) {
  const std::string key(kBucketMacKeyBytes, '\x11'), manifest = "manifest bytes", data(5000, '\x42');
  auto mac = *BucketMac::ForStream(key, "sync-1/pp0");
  const BucketTag tag = *mac.Tag(7, manifest, Bytes(data));
  std::set<std::string> tags = {TagString(tag)};
  tags.insert(TagString(*mac.Tag(8, manifest, Bytes(data))));                                       // index
  tags.insert(TagString(*BucketMac::ForStream(key, "sync-1/pp1")->Tag(7, manifest, Bytes(data))));  // group
  std::string other_key = key;
  other_key[0] ^= 1;
  tags.insert(TagString(*BucketMac::ForStream(other_key, "sync-1/pp0")->Tag(7, manifest, Bytes(data))));  // key
  std::string d = data;
  d[4999] ^= 0x80;
  tags.insert(TagString(*mac.Tag(7, manifest, Bytes(d))));             // one data bit
  tags.insert(TagString(*mac.Tag(7, "manifest bytez", Bytes(data))));  // the manifest
  // The boundary between manifest and data moved: the sizes in front keep these apart.
  tags.insert(TagString(*mac.Tag(7, manifest + "\x42", Bytes(data.substr(1)))));
  EXPECT_EQ(tags.size(), 7u);
  EXPECT_FALSE(*mac.Verify(7, manifest, Bytes(d), tag));
  BucketTag flipped = tag;
  flipped[15] ^= std::byte{1};
  EXPECT_FALSE(*mac.Verify(7, manifest, Bytes(data), flipped));
  EXPECT_FALSE(*mac.Verify(7, manifest, Bytes(data), BucketTag{}));
}

TEST(BucketMacTest, AKeyOfAnotherSizeIsRefusedNamingIt) {
  for (size_t n : {0, 16, 31, 33, 64}) {
    auto mac = BucketMac::ForStream(std::string(n, 'k'), "g");
    ASSERT_FALSE(mac.ok());
    EXPECT_TRUE(absl::IsInvalidArgument(mac.status()));
    EXPECT_NE(mac.status().message().find("32 bytes, not " + std::to_string(n)), std::string::npos) << mac.status();
  }
}

TEST(BucketMacTest, SyncKeysAreFreshAndFullSize) {
  std::set<std::string> keys;
  for (int i = 0; i < 64; ++i) {
    auto k = NewSyncMacKey();
    ASSERT_TRUE(k.ok()) << k.status();
    EXPECT_EQ(k->size(), kBucketMacKeyBytes);
    keys.insert(*k);
  }
  EXPECT_EQ(keys.size(), 64u);
}

}  // namespace
}  // namespace wsync::comm
