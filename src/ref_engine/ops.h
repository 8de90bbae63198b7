// Small float32 math shared by the reference engine (model.h) and its HF oracle (hf_reference.h):
// dot product, RMSNorm, SiLU, softmax, rotary embeddings, and reading a bf16/fp16/fp32 view into
// floats. Only "tiny math" lives here, so that the two models stay independent formulations.
//
// Numerics: float32 throughout; Dot keeps 8 independent partial sums (so the compiler vectorizes it
// without reassociation flags; the result is deterministic for a given length). RoPE angles are
// computed in double and rounded once. RMSNorm follows HF: x * rsqrt(mean(x^2) + eps) * w.
// Thread-safety: pure functions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/tensor.h"

namespace wsync::ref_engine {

// sum_i a[i] * b[i], with 8 interleaved partial sums combined pairwise at the end.
inline float Dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) acc[j] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// y += alpha * x.
inline void Axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// out = x / sqrt(mean(x^2) + eps) * w  (out may alias x).
inline void RmsNorm(const float* x, const float* w, int64_t n, double eps, float* out) {
  const float mean_sq = Dot(x, x, n) / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(mean_sq + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// In-place numerically stable softmax over n > 0 values.
inline void Softmax(float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Angle of frequency i (0 <= i < d/2) at position pos: pos * theta^(-2i/d).
inline double RopeAngle(int64_t pos, int64_t i, int64_t d, double theta) {
  return static_cast<double>(pos) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
}

// Rotary embedding, "rotate_half" / NeoX style (HF Llama/Qwen): pair (x[i], x[i + d/2]) rotates by
// frequency i. d must be even.
inline void RopeRotateHalf(float* x, int64_t d, int64_t pos, double theta) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const double a = RopeAngle(pos, i, d, theta);
    const float c = static_cast<float>(std::cos(a)), s = static_cast<float>(std::sin(a));
    const float x0 = x[i], x1 = x[i + h];
    x[i] = x0 * c - x1 * s;
    x[i + h] = x1 * c + x0 * s;
  }
}

// Rotary embedding, interleaved / GPT-J style (SGLang is_neox_style=False, used for DeepSeek):
// pair (x[2i], x[2i+1]) rotates by frequency i. d must be even.
inline void RopeInterleaved(float* x, int64_t d, int64_t pos, double theta) {
  for (int64_t i = 0; i < d / 2; ++i) {
    const double a = RopeAngle(pos, i, d, theta);
    const float c = static_cast<float>(std::cos(a)), s = static_cast<float>(std::sin(a));
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    x[2 * i] = x0 * c - x1 * s;
    x[2 * i + 1] = x1 * c + x0 * s;
  }
}

// Converts a BF16/F16/F32 view (any alignment) into out[0 .. numel). InvalidArgument naming `what`
// for any other dtype.
inline absl::Status ReadFloats(const TensorView& v, float* out, absl::string_view what) {
  const int64_t n = v.numel();
  const std::byte* p = v.bytes().data();
  switch (v.dtype()) {
    case DType::kF32:
      if (n > 0) std::memcpy(out, p, static_cast<size_t>(n) * 4);
      return absl::OkStatus();
    case DType::kBF16:
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = v.dtype() == DType::kBF16 ? BF16ToF32(h) : F16ToF32(h);
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dtype ", SafetensorsName(v.dtype()), " is not a float type (BF16, F16 or F32)"));
  }
}

}  // namespace wsync::ref_engine
