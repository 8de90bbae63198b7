#include "comm/bucket/bucket_mac.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <memory>

#include "absl/strings/str_cat.h"

namespace wsync::comm {
namespace {

absl::Status OpenSslError(absl::string_view what) {
  char buf[256] = {};
  ERR_error_string_n(ERR_get_error(), buf, sizeof(buf));
  return absl::InternalError(absl::StrCat("OpenSSL: ", what, ": ", buf));
}

struct CtxFree {
  void operator()(EVP_MAC_CTX* c) const { EVP_MAC_CTX_free(c); }
};

// The algorithms, fetched once per process (an EVP_MAC may be shared by threads).
EVP_MAC* Gmac() {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "GMAC", nullptr);
  return mac;
}
EVP_MAC* Hmac() {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  return mac;
}

constexpr std::string_view kStreamLabel{"wsync bucket stream v1\0", 23};

void PutU64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

}  // namespace

absl::StatusOr<std::string> NewSyncMacKey() {
  std::string key(kBucketMacKeyBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(key.data()), static_cast<int>(key.size())) != 1)
    return OpenSslError("RAND_bytes for a sync's bucket key");
  return key;
}

absl::StatusOr<BucketMac> BucketMac::ForStream(std::string_view sync_key, std::string_view group) {
  if (sync_key.size() != kBucketMacKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a sync's bucket key has ", kBucketMacKeyBytes, " bytes, not ", sync_key.size()));
  }
  EVP_MAC* hmac = Hmac();
  if (hmac == nullptr) return OpenSslError("fetching HMAC");
  std::unique_ptr<EVP_MAC_CTX, CtxFree> ctx(EVP_MAC_CTX_new(hmac));
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                         OSSL_PARAM_construct_end()};
  std::array<unsigned char, 32> key;
  size_t len = 0;
  if (ctx == nullptr ||
      EVP_MAC_init(ctx.get(), reinterpret_cast<const unsigned char*>(sync_key.data()), sync_key.size(), params) != 1 ||
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(kStreamLabel.data()), kStreamLabel.size()) !=
          1 ||
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(group.data()), group.size()) != 1 ||
      EVP_MAC_final(ctx.get(), key.data(), &len, key.size()) != 1 || len != key.size()) {
    return OpenSslError("deriving a stream's bucket key");
  }
  return BucketMac(key);
}

absl::StatusOr<BucketTag> BucketMac::Tag(uint64_t index, std::string_view manifest,
                                         std::span<const std::byte> data) const {
  EVP_MAC* gmac = Gmac();
  if (gmac == nullptr) return OpenSslError("fetching GMAC");
  std::unique_ptr<EVP_MAC_CTX, CtxFree> ctx(EVP_MAC_CTX_new(gmac));
  unsigned char iv[12] = {};
  PutU64(iv + 4, index);
  unsigned char sizes[16];
  PutU64(sizes, manifest.size());
  PutU64(sizes + 8, data.size());
  char cipher[] = "AES-256-GCM";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_CIPHER, cipher, 0),
                         OSSL_PARAM_construct_octet_string(OSSL_MAC_PARAM_IV, iv, sizeof(iv)),
                         OSSL_PARAM_construct_end()};
  BucketTag tag;
  size_t len = 0;
  if (ctx == nullptr || EVP_MAC_init(ctx.get(), key_.data(), key_.size(), params) != 1 ||
      EVP_MAC_update(ctx.get(), sizes, sizeof(sizes)) != 1 ||
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(manifest.data()), manifest.size()) != 1 ||
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(data.data()), data.size()) != 1 ||
      EVP_MAC_final(ctx.get(), reinterpret_cast<unsigned char*>(tag.data()), &len, tag.size()) != 1 ||
      len != tag.size()) {
    return OpenSslError("computing a bucket's GMAC");
  }
  return tag;
}

absl::StatusOr<bool> BucketMac::Verify(uint64_t index, std::string_view manifest, std::span<const std::byte> data,
                                       const BucketTag& tag) const {
  auto want = Tag(index, manifest, data);
  if (!want.ok()) return want.status();
  return CRYPTO_memcmp(want->data(), tag.data(), tag.size()) == 0;
}

}  // namespace wsync::comm
