#include "tools/wsyncctl/reference/fp8_scalar.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace wsync::tools::reference {
namespace {

// §1: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m/8 * 2^-6);
// 0x7F is NaN, so 0x7E = 448 is the largest value.
float MagnitudeOf(int code) {
  const int e = (code >> 3) & 0xF, m = code & 7;
  return e == 0 ? std::ldexp(static_cast<float>(m) / 8.0f, -6) : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
}

const std::array<float, 127>& PositiveValues() {  // codes 0x00..0x7E, increasing
  static const std::array<float, 127> v = [] {
    std::array<float, 127> a{};
    for (int c = 0; c < 127; ++c) a[static_cast<size_t>(c)] = MagnitudeOf(c);
    return a;
  }();
  return v;
}

float Wide(const TensorView& w, int64_t i) {
  uint16_t h;
  std::memcpy(&h, w.bytes().data() + 2 * i, 2);
  return w.dtype() == DType::kBF16 ? BF16ToF32(h) : F16ToF32(h);
}

}  // namespace

float E4m3ValueOf(uint8_t code) {
  if ((code & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const float m = MagnitudeOf(code & 0x7F);
  return (code & 0x80) ? -m : m;
}

uint8_t E4m3CodeOf(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (std::isnan(x) || a >= 464.0f) return sign | 0x7F;
  if (a >= 448.0f) return sign | 0x7E;
  const auto& v = PositiveValues();
  // The codes whose values bracket a: v[lo] <= a < v[lo + 1].
  const size_t hi = static_cast<size_t>(std::upper_bound(v.begin(), v.end(), a) - v.begin());
  const size_t lo = hi - 1;
  // Exact (Sterbenz) for lo >= 1; for lo == 0 rounding keeps the order, and a tie (a = v[1] / 2) is exact.
  const float below = a - v[lo], above = v[hi] - a;
  size_t pick = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);  // tie: even mantissa
  return sign | static_cast<uint8_t>(pick);
}

absl::Status QuantizeFp8Scalar(const TensorView& w, int64_t bn, int64_t bk, bool ue8m0, std::vector<uint8_t>* codes,
                               std::vector<float>* scales) {
  if (w.rank() != 2 || (w.dtype() != DType::kBF16 && w.dtype() != DType::kF16))
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 reference: want a 2-D BF16 / F16 weight, got ", w.DebugString()));
  const int64_t N = w.dim(0), K = w.dim(1);
  for (int64_t i = 0; i < N * K; ++i)
    if (!std::isfinite(Wide(w, i)))
      return absl::InvalidArgumentError(absl::StrCat("FP8 reference: element ", i, " is not finite"));
  codes->assign(static_cast<size_t>(N * K), 0);
  if (bn == 0) {  // §3.1: s = max(amax, float(bf16(1e-12))) / 448, q = e4m3(clamp(w / s))
    scales->assign(static_cast<size_t>(N), 0.0f);
    float floor_value;
    const uint32_t floor_bits = 0x2B8D0000u;
    std::memcpy(&floor_value, &floor_bits, 4);
    for (int64_t n = 0; n < N; ++n) {
      float amax = 0.0f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(Wide(w, n * K + k)));
      const float s = std::max(amax, floor_value) / 448.0f;
      (*scales)[static_cast<size_t>(n)] = s;
      for (int64_t k = 0; k < K; ++k)
        (*codes)[static_cast<size_t>(n * K + k)] = E4m3CodeOf(std::clamp(Wide(w, n * K + k) / s, -448.0f, 448.0f));
    }
    return absl::OkStatus();
  }
  const int64_t nb = (N + bn - 1) / bn, kb = (K + bk - 1) / bk;
  scales->assign(static_cast<size_t>(nb * kb), 0.0f);
  for (int64_t i = 0; i < nb; ++i)
    for (int64_t j = 0; j < kb; ++j) {
      const int64_t n1 = std::min(N, (i + 1) * bn), k1 = std::min(K, (j + 1) * bk);
      float amax = 0.0f;
      for (int64_t n = i * bn; n < n1; ++n)
        for (int64_t k = j * bk; k < k1; ++k) amax = std::max(amax, std::fabs(Wide(w, n * K + k)));
      float s;
      if (ue8m0) {  // §2.3: t = max(amax, 1e-4) / 448, s = the least power of two >= t
        const float t = std::max(amax, 1e-4f) / 448.0f;
        int e = 0;
        const float m = std::frexp(t, &e);  // t = m * 2^e, m in [0.5, 1)
        s = m == 0.5f ? t : std::ldexp(1.0f, e);
      } else {  // §2.1: s = max(amax, 1e-10) / 448
        s = std::max(amax, 1e-10f) / 448.0f;
      }
      (*scales)[static_cast<size_t>(i * kb + j)] = s;
      const float r = 1.0f / s;
      for (int64_t n = i * bn; n < n1; ++n)
        for (int64_t k = j * bk; k < k1; ++k) {
          const float v = Wide(w, n * K + k) * r;
          (*codes)[static_cast<size_t>(n * K + k)] = E4m3CodeOf(ue8m0 ? v : std::clamp(v, -448.0f, 448.0f));
        }
    }
  return absl::OkStatus();
}

}  // namespace wsync::tools::reference
