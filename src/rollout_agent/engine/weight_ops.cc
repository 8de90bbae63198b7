#include "rollout_agent/engine/weight_ops.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/format/int4_format.h"
#include "rollout_agent/engine/ops.h"

namespace wsync::engine {
namespace {

namespace fmt = kernels::format;

constexpr int kLanes = 32;      // tile words per (row pair, slot): 16q + 4rr + v, q < 8, v < 4
constexpr int kTileFloats = 1024;
constexpr int kAccFloats = 512;  // per token and 64-column block: [rr 4][parity 2][half 2][lane 32]
// Slots with rows r, r+1 first, then r+8, r+9, so that every accumulator sees increasing k.
constexpr int kSlotOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// Column (within its width-block) of the permuted scales that holds un-permuted column c.
struct InversePerms {
  int grouped[fmt::kScalePermGroupedWidth];
  int channel[fmt::kScalePermChannelWidth];
};
const InversePerms& Inverse() {
  static const InversePerms inv = [] {
    InversePerms p{};
    for (int q = 0; q < fmt::kScalePermGroupedWidth; ++q) p.grouped[fmt::ScalePermGrouped(q)] = q;
    for (int q = 0; q < fmt::kScalePermChannelWidth; ++q) p.channel[fmt::ScalePermChannel(q)] = q;
    return p;
  }();
  return inv;
}

// BF16ToF32(F32ToBF16(p)) for every p, written so that it vectorizes (NaN quieted as dtype.h does).
inline float RoundToBf16(float p) {
  const uint32_t u = std::bit_cast<uint32_t>(p);
  const int32_t abs = static_cast<int32_t>(u & 0x7fffffffu);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet = (u | 0x00400000u) & 0xffff0000u;
  return std::bit_cast<float>(abs > 0x7f800000 ? quiet : rounded);
}

// The scales of 64-column block nt of expert e for every group, in word order:
// sw[(g * 2 + half) * 32 + q * 4 + v] = scale of column 64 nt + 16 v + q + 8 half.
void BlockScales(const MarlinRef& m, int64_t e, int64_t nt, float* sw) {
  const int64_t groups = m.groups();
  for (int64_t g = 0; g < groups; ++g)
    for (int half = 0; half < 2; ++half)
      for (int q = 0; q < 8; ++q)
        for (int v = 0; v < 4; ++v)
          sw[(g * 2 + half) * kLanes + q * 4 + v] = m.Scale(e, g, 64 * nt + 16 * v + q + 8 * half);
}

// Dequantizes the 128 words of tile (kt, ·) into dq[(rr * 8 + s) * 32 + lane] = the value in slot
// s of word 16q + 4rr + v (lane = 4q + v), i.e. element (16 kt + 2 rr + SlotDk(s),
// 16 v + q + SlotDn(s)) of the tile's block.
void DecodeTile(const uint32_t* words, const float* sw, int64_t kt, int64_t group, float* dq) {
  uint32_t wt[4][kLanes];
  for (int q = 0; q < 8; ++q)
    for (int rr = 0; rr < 4; ++rr)
      for (int v = 0; v < 4; ++v) wt[rr][q * 4 + v] = words[16 * q + 4 * rr + v];
  for (int rr = 0; rr < 4; ++rr) {
    for (int s = 0; s < 8; ++s) {
      const int64_t row = 16 * kt + 2 * rr + fmt::SlotDk(s);
      const float* sc = sw + ((row / group) * 2 + fmt::SlotDn(s) / 8) * kLanes;
      float* out = dq + (rr * 8 + s) * kLanes;
      const uint32_t* w = wt[rr];
      const int shift = 4 * s;
      for (int l = 0; l < kLanes; ++l) {
        const int u = static_cast<int>((w[l] >> shift) & 0xfu);
        out[l] = RoundToBf16(static_cast<float>(u - fmt::kNibbleBias) * sc[l]);
      }
    }
  }
}

// acc[(rr * 4 + parity * 2 + half) * 32 + lane] += x[2 rr + dk] * value, for one token (x points
// at the tile's first K row).
void AccumulateTile(const float* x, const float* dq, float* acc) {
  for (int rr = 0; rr < 4; ++rr) {
    for (int s : kSlotOrder) {
      const int dk = fmt::SlotDk(s);
      const float xv = x[2 * rr + dk];
      const float* w = dq + (rr * 8 + s) * kLanes;
      float* a = acc + (rr * 4 + (dk & 1) * 2 + fmt::SlotDn(s) / 8) * kLanes;
      for (int l = 0; l < kLanes; ++l) a[l] += xv * w[l];
    }
  }
}

// y[c] for the 64 columns of a block: partial sum j = 2 rr + parity, combined as ops.h Dot does.
void CombineBlock(const float* acc, float* y) {
  for (int half = 0; half < 2; ++half)
    for (int q = 0; q < 8; ++q)
      for (int v = 0; v < 4; ++v) {
        const int l = q * 4 + v;
        float a[8];
        for (int j = 0; j < 8; ++j) a[j] = acc[((j >> 1) * 4 + (j & 1) * 2 + half) * kLanes + l];
        y[16 * v + q + 8 * half] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
      }
}

const uint32_t* TileWords(const MarlinRef& m, int64_t e, int64_t kt, int64_t nt) {
  return m.packed + e * (m.k / 16) * 2 * m.n + fmt::TileOffset(kt, nt, m.n);
}

void MarlinMatMul(const float* x, int64_t n, const MarlinRef& m, float* y) {
  const int64_t K = m.k, N = m.n, kts = K / 16, nts = N / 64;
  std::vector<float> sw(static_cast<size_t>(m.groups() * 64)), dq(kTileFloats),
      acc(static_cast<size_t>(n * kAccFloats));
  for (int64_t nt = 0; nt < nts; ++nt) {
    BlockScales(m, 0, nt, sw.data());
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t kt = 0; kt < kts; ++kt) {
      DecodeTile(TileWords(m, 0, kt, nt), sw.data(), kt, m.group, dq.data());
      for (int64_t t = 0; t < n; ++t) AccumulateTile(x + t * K + 16 * kt, dq.data(), acc.data() + t * kAccFloats);
    }
    for (int64_t t = 0; t < n; ++t) CombineBlock(acc.data() + t * kAccFloats, y + t * N + 64 * nt);
  }
}

template <typename T>
T Load(const std::byte* p, int64_t i) {
  T v;
  std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}

}  // namespace

float MarlinRef::Scale(int64_t e, int64_t g, int64_t col) const {
  const int width = grouped_perm ? fmt::kScalePermGroupedWidth : fmt::kScalePermChannelWidth;
  const int64_t within = col % width;
  const int q = grouped_perm ? Inverse().grouped[within] : Inverse().channel[within];
  const uint16_t bits = scales[(e * groups() + g) * n + (col - within) + q];
  return scales_f16 ? F16ToF32(bits) : BF16ToF32(bits);
}

WeightRef WeightRef::Expert(int64_t e, int64_t num_experts) const {
  WeightRef out = *this;
  const int64_t per = rows / num_experts;
  out.rows = per;
  out.shape = {per, cols};
  switch (form) {
    case WeightForm::kF32:
      out.data = f32() + e * per * cols;
      break;
    case WeightForm::kBF16:
      out.data = static_cast<const uint16_t*>(data) + e * per * cols;
      break;
    case WeightForm::kMarlin:
      out.marlin.packed = marlin.packed + e * (marlin.k / 16) * 2 * marlin.n;
      out.marlin.scales = marlin.scales + e * marlin.groups() * marlin.n;
      out.marlin.experts = 1;
      break;
    case WeightForm::kNone:
      break;
  }
  return out;
}

void MatMul(const float* x, int64_t n, const WeightRef& w, float* y) {
  switch (w.form) {
    case WeightForm::kF32:
      for (int64_t i = 0; i < w.rows; ++i) {
        const float* row = w.f32() + i * w.cols;
        for (int64_t t = 0; t < n; ++t) y[t * w.rows + i] = Dot(x + t * w.cols, row, w.cols);
      }
      return;
    case WeightForm::kBF16:
      for (int64_t i = 0; i < w.rows; ++i) {
        const uint16_t* row = static_cast<const uint16_t*>(w.data) + i * w.cols;
        for (int64_t t = 0; t < n; ++t) y[t * w.rows + i] = DotBf16(x + t * w.cols, row, w.cols);
      }
      return;
    case WeightForm::kMarlin:
      MarlinMatMul(x, n, w.marlin, y);
      return;
    case WeightForm::kNone:
      return;
  }
}

float RowDot(const WeightRef& w, int64_t i, const float* x) {
  if (w.form == WeightForm::kBF16) return DotBf16(x, static_cast<const uint16_t*>(w.data) + i * w.cols, w.cols);
  return Dot(w.f32() + i * w.cols, x, w.cols);
}

void RowAxpy(const WeightRef& w, int64_t i, float alpha, float* y) {
  if (w.form == WeightForm::kBF16) {
    const uint16_t* row = static_cast<const uint16_t*>(w.data) + i * w.cols;
    for (int64_t j = 0; j < w.cols; ++j) y[j] += alpha * BF16ToF32(row[j]);
    return;
  }
  Axpy(alpha, w.f32() + i * w.cols, y, w.cols);
}

void RowToFloats(const WeightRef& w, int64_t i, float* out) {
  if (w.form == WeightForm::kBF16) {
    const uint16_t* row = static_cast<const uint16_t*>(w.data) + i * w.cols;
    for (int64_t j = 0; j < w.cols; ++j) out[j] = BF16ToF32(row[j]);
    return;
  }
  std::memcpy(out, w.f32() + i * w.cols, static_cast<size_t>(w.cols) * sizeof(float));
}

void DecodeMarlinTile(const MarlinRef& m, int64_t e, int64_t kt, int64_t nt, float* out) {
  std::vector<float> sw(static_cast<size_t>(m.groups() * 64)), dq(kTileFloats);
  BlockScales(m, e, nt, sw.data());
  DecodeTile(TileWords(m, e, kt, nt), sw.data(), kt, m.group, dq.data());
  for (int rr = 0; rr < 4; ++rr)
    for (int s = 0; s < 8; ++s)
      for (int q = 0; q < 8; ++q)
        for (int v = 0; v < 4; ++v) {
          const int kl = 2 * rr + fmt::SlotDk(s), cl = 16 * v + q + fmt::SlotDn(s);
          out[kl * 64 + cl] = dq[(rr * 8 + s) * kLanes + q * 4 + v];
        }
}

void MaterializeWeight(const WeightRef& w, float* out) {
  switch (w.form) {
    case WeightForm::kF32:
      std::memcpy(out, w.data, static_cast<size_t>(w.rows * w.cols) * sizeof(float));
      return;
    case WeightForm::kBF16:
      for (int64_t i = 0; i < w.rows; ++i) RowToFloats(w, i, out + i * w.cols);
      return;
    case WeightForm::kMarlin: {
      const MarlinRef& m = w.marlin;
      const int64_t K = m.k, N = m.n;
      std::vector<float> sw(static_cast<size_t>(m.groups() * 64)), dq(kTileFloats);
      for (int64_t e = 0; e < m.experts; ++e)
        for (int64_t nt = 0; nt < N / 64; ++nt) {
          BlockScales(m, e, nt, sw.data());
          for (int64_t kt = 0; kt < K / 16; ++kt) {
            DecodeTile(TileWords(m, e, kt, nt), sw.data(), kt, m.group, dq.data());
            for (int rr = 0; rr < 4; ++rr)
              for (int s = 0; s < 8; ++s)
                for (int q = 0; q < 8; ++q)
                  for (int v = 0; v < 4; ++v) {
                    const int64_t k = 16 * kt + 2 * rr + fmt::SlotDk(s);
                    const int64_t c = 64 * nt + 16 * v + q + fmt::SlotDn(s);
                    out[(e * N + c) * K + k] = dq[(rr * 8 + s) * kLanes + q * 4 + v];
                  }
          }
        }
      return;
    }
    case WeightForm::kNone:
      return;
  }
}

std::optional<int64_t> FirstNonFinite(DType dtype, const std::byte* data, int64_t begin, int64_t end) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kF16: {
      const uint16_t mask = dtype == DType::kBF16 ? 0x7f80u : 0x7c00u;
      uint32_t bad = 0;
      for (int64_t i = begin; i < end; ++i) bad |= (Load<uint16_t>(data, i) & mask) == mask;
      if (!bad) return std::nullopt;
      for (int64_t i = begin; i < end; ++i)
        if ((Load<uint16_t>(data, i) & mask) == mask) return i;
      return std::nullopt;
    }
    case DType::kF32: {
      uint32_t bad = 0;
      for (int64_t i = begin; i < end; ++i) bad |= (Load<uint32_t>(data, i) & 0x7f800000u) == 0x7f800000u;
      if (!bad) return std::nullopt;
      for (int64_t i = begin; i < end; ++i)
        if ((Load<uint32_t>(data, i) & 0x7f800000u) == 0x7f800000u) return i;
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

float FloatAt(DType dtype, const std::byte* data, int64_t i) {
  switch (dtype) {
    case DType::kBF16: return BF16ToF32(Load<uint16_t>(data, i));
    case DType::kF16: return F16ToF32(Load<uint16_t>(data, i));
    case DType::kF32: return Load<float>(data, i);
    default: return 0.0f;
  }
}

bool MarlinScalesCertainlyFinite(const std::byte* scales, bool f16, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    const uint16_t h = Load<uint16_t>(scales, static_cast<int64_t>(i));
    const float top = 8.0f * std::fabs(f16 ? F16ToF32(h) : BF16ToF32(h));  // |u - 8| <= 8
    if (!std::isfinite(top) || !std::isfinite(RoundToBf16(top))) return false;
  }
  return true;
}

}  // namespace wsync::engine
