#include "tools/wsyncctl/reference/int4_scalar.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace wsync::tools::reference {
namespace {

// fl32(1/7) as slime's kernel writes it (SYM_CONS = 1.0f / 7.0f = 0x3E124925, FORMATS.md §1.2).
constexpr uint32_t kOneSeventhBits = 0x3E124925u;
constexpr float kScaleFloor = 1e-5f;

uint16_t StoreScale(float scale, DType dtype) { return dtype == DType::kF16 ? F32ToF16(scale) : F32ToBF16(scale); }

// x rounded to fp16 (round to nearest even, overflow to Inf), as a float.
float H(float x) { return F16ToF32(F32ToF16(x)); }

uint32_t LoadWord(const unsigned char* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

absl::Status CheckGroup(size_t row_len, int group) {
  if (row_len == 0) return absl::InvalidArgumentError("empty row");
  if (group != -1 && (group <= 0 || row_len % static_cast<size_t>(group) != 0))
    return absl::InvalidArgumentError(
        absl::StrCat("row of ", row_len, " elements is not a whole number of groups of ", group));
  return absl::OkStatus();
}

absl::Status CheckFinite(std::span<const float> w, size_t k0) {
  for (size_t k = 0; k < w.size(); ++k)
    if (!std::isfinite(w[k])) return absl::InvalidArgumentError(absl::StrCat("column ", k0 + k, " is ", w[k]));
  return absl::OkStatus();
}

}  // namespace

float ScaleValue(uint16_t bits, DType dtype) { return dtype == DType::kF16 ? F16ToF32(bits) : BF16ToF32(bits); }

absl::Status QuantizeRowSymmetric(std::span<const float> w, int group, SymmetricVariant variant, DType scale_dtype,
                                  uint8_t* codes, uint16_t* scales) {
  if (absl::Status s = CheckGroup(w.size(), group); !s.ok()) return s;
  const size_t g_len = group == -1 ? w.size() : static_cast<size_t>(group);
  const float one_seventh = std::bit_cast<float>(kOneSeventhBits);
  for (size_t g = 0; g * g_len < w.size(); ++g) {
    const std::span<const float> x = w.subspan(g * g_len, g_len);
    if (absl::Status s = CheckFinite(x, g * g_len); !s.ok()) return s;
    float amax = 0.0f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    float scale = variant == SymmetricVariant::kQat ? amax / 7.0f : amax * one_seventh;
    if (scale < kScaleFloor) scale = kScaleFloor;
    for (size_t i = 0; i < g_len; ++i) {
      float q = std::nearbyint(x[i] / scale);  // default rounding mode: ties to even
      q = std::min(7.0f, std::max(-7.0f, q));
      codes[g * g_len + i] = static_cast<uint8_t>(static_cast<int>(q) + 8);
    }
    scales[g] = StoreScale(scale, scale_dtype);
  }
  return absl::OkStatus();
}

absl::Status QuantizeRowAwq(std::span<const float> w, int group, AwqArith arith, DType scale_dtype, uint8_t* codes,
                            uint16_t* scales, uint8_t* zeros) {
  if (absl::Status s = CheckGroup(w.size(), group); !s.ok()) return s;
  const size_t g_len = group == -1 ? w.size() : static_cast<size_t>(group);
  const bool fp16 = arith == AwqArith::kFp16;
  // AutoAWQ's `.half()` of the layer first: every weight as fp16 (AWQ.md §1).
  auto in = [&](size_t k) { return fp16 ? H(w[k]) : w[k]; };
  for (size_t g = 0; g * g_len < w.size(); ++g) {
    const size_t k0 = g * g_len;
    if (absl::Status s = CheckFinite(w.subspan(k0, g_len), k0); !s.ok()) return s;
    float mx = -INFINITY, mn = INFINITY;
    for (size_t i = 0; i < g_len; ++i) {
      const float v = in(k0 + i);
      if (!std::isfinite(v))
        return absl::InvalidArgumentError(
            absl::StrCat("column ", k0 + i, " (", w[k0 + i], ") is beyond fp16's range (AWQ fp16 arithmetic)"));
      mx = std::max(mx, v);
      mn = std::min(mn, v);
    }
    float scale;
    if (fp16) {
      float range = H(mx - mn);  // a half op: computed in float, rounded once to fp16
      if (!std::isfinite(range))
        return absl::InvalidArgumentError(absl::StrCat("group ", g, " (columns ", k0, "..", k0 + g_len - 1,
                                                       "): its range ", mx, " - ", mn,
                                                       " is beyond fp16's range (AWQ fp16 arithmetic)"));
      const float floor16 = H(kScaleFloor);  // clamp(min=1e-5) on a half tensor: 168 * 2^-24
      if (range < floor16) range = floor16;
      // `/ 15` by a CPU scalar is `* fl32(1/15)` on CUDA (AWQ.md §1, P1), rounded to fp16.
      scale = H(range * (1.0f / 15.0f));
    } else {
      float range = mx - mn;
      if (range < kScaleFloor) range = kScaleFloor;
      scale = range / 15.0f;
    }
    float z = fp16 ? H(mn / scale) : mn / scale;
    z = -std::nearbyint(z);
    z = std::min(15.0f, std::max(0.0f, z));
    for (size_t i = 0; i < g_len; ++i) {
      const float v = in(k0 + i);
      float r = std::nearbyint(fp16 ? H(v / scale) : v / scale);
      float u = fp16 ? H(r + z) : r + z;
      u = std::min(15.0f, std::max(0.0f, u));
      codes[k0 + i] = static_cast<uint8_t>(u);
    }
    scales[g] = StoreScale(scale, scale_dtype);
    zeros[g] = static_cast<uint8_t>(z);
  }
  return absl::OkStatus();
}

void DecodeMarlinWeight(const unsigned char* words, int64_t k, int64_t n, uint8_t* codes_nk) {
  static constexpr int kDk[8] = {0, 8, 0, 8, 1, 9, 1, 9};
  static constexpr int kDn[8] = {0, 0, 8, 8, 0, 0, 8, 8};
  const int64_t row_words = 2 * n;  // a [k/16, 2n] array
  for (int64_t kt = 0; kt < k / 16; ++kt) {
    for (int64_t nt = 0; nt < n / 64; ++nt) {
      const unsigned char* tile = words + 4 * (kt * row_words + nt * 128);
      for (int t = 0; t < 32; ++t) {
        for (int v = 0; v < 4; ++v) {
          const uint32_t word = LoadWord(tile + 4 * (4 * t + v));
          const int64_t r = 16 * kt + 2 * (t % 4);
          const int64_t c = 64 * nt + 16 * v + t / 4;
          for (int j = 0; j < 8; ++j) {
            const int64_t kk = r + kDk[j], nn = c + kDn[j];
            codes_nk[nn * k + kk] = static_cast<uint8_t>((word >> (4 * j)) & 0xFu);
          }
        }
      }
    }
  }
}

void UnpermuteMarlinScales(const uint16_t* permuted, int64_t rows, int64_t n, bool grouped, uint16_t* out) {
  static constexpr int kSingle[8] = {0, 1, 8, 9, 16, 17, 24, 25};
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* in_row = permuted + r * n;
    uint16_t* out_row = out + r * n;
    if (grouped) {
      for (int64_t b = 0; b < n; b += 64)
        for (int i = 0; i < 8; ++i)
          for (int j = 0; j < 8; ++j) out_row[b + i + 8 * j] = in_row[b + 8 * i + j];
    } else {
      for (int64_t b = 0; b < n; b += 32)
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 8; ++j) out_row[b + 2 * i + kSingle[j]] = in_row[b + 8 * i + j];
    }
  }
}

void DecodeMarlinZeros(const unsigned char* words, int64_t rows, int64_t n, uint8_t* z) {
  static constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  const int64_t row_words = n / 8;
  for (int64_t g = 0; g < rows; ++g) {
    for (int64_t w = 0; w < row_words; ++w) {
      const uint32_t word = LoadWord(words + 4 * (g * row_words + w));
      for (int t = 0; t < 8; ++t)
        z[g * n + 64 * (w / 8) + (w % 8) + 8 * kOrder[t]] = static_cast<uint8_t>((word >> (4 * t)) & 0xFu);
    }
  }
}

void DecodeTrtllmWeight(const unsigned char* bytes, int64_t k, int64_t n, bool sm90_dense, uint8_t* codes_nk) {
  static constexpr int kPerm[32] = {0, 1, 8,  9,  16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
                                    4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31};
  static constexpr int kRegDst[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int64_t col = 0; col < n; ++col) {
    for (int64_t kp = 0; kp < k; ++kp) {
      const int64_t word =
          sm90_dense ? col * (k / 8) + kp / 8 : (col / 4) * (k / 2) + 32 * (kp / 64) + 8 * (col % 4) + (kp % 64) / 8;
      const int nibble = kRegDst[kp % 8];
      const unsigned char byte = bytes[4 * word + nibble / 2];
      const int64_t src_row = 32 * (kp / 32) + kPerm[kp % 32];
      codes_nk[col * k + src_row] = static_cast<uint8_t>(nibble % 2 == 0 ? byte & 0xFu : byte >> 4);
    }
  }
}

}  // namespace wsync::tools::reference
