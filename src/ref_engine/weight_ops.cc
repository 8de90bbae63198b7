#include "ref_engine/weight_ops.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/format/awq_format.h"
#include "kernels/format/fp8_format.h"
#include "kernels/format/int4_format.h"
#include "ref_engine/ops.h"

namespace wsync::ref_engine {
namespace {

namespace fmt = kernels::format;

// The hot loops are compiled twice, for AVX2 and for the x86-64 baseline, and picked at load time
// (ifunc). Both compute the same bits: the loops are per lane (no reassociation), and FMA
// contraction is off (-ffp-contract=off), so a wider vector only does more lanes at once.
// Not under ThreadSanitizer: the ifunc resolver would be instrumented, and it runs at relocation
// time, before the TSan runtime is initialized (a crash at load).
#if defined(__SANITIZE_THREAD__)  // gcc
#define WSYNC_UNDER_TSAN 1
#elif defined(__has_feature)  // clang
#if __has_feature(thread_sanitizer)
#define WSYNC_UNDER_TSAN 1
#endif
#endif
#if defined(__x86_64__) && !defined(WSYNC_UNDER_TSAN)
#define WSYNC_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define WSYNC_SIMD_CLONES
#endif
#define WSYNC_INLINE inline __attribute__((always_inline))

constexpr int kWords = fmt::kTileWords;  // 128 words per 16 x 64 tile
constexpr int kTileFloats = 1024;        // dequantized tile: [slot 8][word 128]
constexpr int kAccFloats = 512;          // per token and 64-column block: [parity 2][half 2][word 128]
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
WSYNC_INLINE float RoundToBf16(float p) {
  const uint32_t u = std::bit_cast<uint32_t>(p);
  const int32_t abs = static_cast<int32_t>(u & 0x7fffffffu);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet = (u | 0x00400000u) & 0xffff0000u;
  return std::bit_cast<float>(abs > 0x7f800000 ? quiet : rounded);
}

// Where, in the permuted scales of a 64-column block, the scale of word w's column (+ 8 half)
// sits: index[half * 128 + w], for scale_perm (grouped) and scale_perm_single (channel).
struct WordScaleIndex {
  int16_t grouped[2 * kWords];
  int16_t channel[2 * kWords];
};
const WordScaleIndex& ScaleIndex() {
  static const WordScaleIndex idx = [] {
    WordScaleIndex t{};
    for (int half = 0; half < 2; ++half)
      for (int w = 0; w < kWords; ++w) {
        const int c = fmt::WordCol(w) + 8 * half;
        t.grouped[half * kWords + w] = static_cast<int16_t>(Inverse().grouped[c]);
        t.channel[half * kWords + w] = static_cast<int16_t>((c & 32) + Inverse().channel[c & 31]);
      }
    return t;
  }();
  return idx;
}

// The scales of 64-column block nt of expert e for every group, in word order:
// sw[(g * 2 + half) * 128 + w] = scale of column 64 nt + WordCol(w) + 8 half.
void BlockScales(const MarlinRef& m, int64_t e, int64_t nt, float* sw) {
  const int16_t* idx = m.grouped_perm ? ScaleIndex().grouped : ScaleIndex().channel;
  const int64_t groups = m.groups();
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t* row = m.scales + (e * groups + g) * m.n + 64 * nt;
    float* out = sw + g * 2 * kWords;
    if (m.scales_f16) {
      for (int i = 0; i < 2 * kWords; ++i) out[i] = F16ToF32(row[idx[i]]);
    } else {
      for (int i = 0; i < 2 * kWords; ++i) out[i] = BF16ToF32(row[idx[i]]);
    }
  }
}

// The zero points of 64-column block nt of expert e for every group, in the word order of
// BlockScales: 8 (GPTQ's bias) without AWQ zero points.
void BlockZeros(const MarlinRef& m, int64_t e, int64_t nt, float* zw) {
  const int64_t groups = m.groups();
  if (m.zeros == nullptr) {
    std::fill(zw, zw + groups * 2 * kWords, static_cast<float>(fmt::kNibbleBias));
    return;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t* row = m.zeros + (e * groups + g) * (m.n / 8);
    float* out = zw + g * 2 * kWords;
    for (int half = 0; half < 2; ++half)
      for (int w = 0; w < kWords; ++w)
        out[half * kWords + w] = static_cast<float>(fmt::MarlinZeroOf(row, 64 * nt + fmt::WordCol(w) + 8 * half));
  }
}

// The group of every row of tile kt, or -1 when the group changes inside the tile (G < 16 or not
// a multiple of 16).
std::vector<int64_t> TileGroups(const MarlinRef& m) {
  std::vector<int64_t> out(static_cast<size_t>(m.k / 16));
  for (int64_t kt = 0; kt < m.k / 16; ++kt) {
    const int64_t first = (16 * kt) / m.group;
    out[static_cast<size_t>(kt)] = first == (16 * kt + 15) / m.group ? first : -1;
  }
  return out;
}

// The same for a finite p (no NaN branch): what the forward pass uses, since Prepare admitted only
// weights whose every value is finite, so every product is.
WSYNC_INLINE float RoundFiniteToBf16(float p) {
  const uint32_t u = std::bit_cast<uint32_t>(p);
  return std::bit_cast<float>((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

// The scales (or zero points) slot s of tile kt uses, one per word: sw's row for the tile's group
// `g`, or, for g == -1, gathered row by row into `mixed`.
WSYNC_INLINE const float* SlotScales(const float* sw, int64_t kt, int64_t g, int64_t group, int s, float* mixed) {
  const int half = fmt::SlotDn(s) / 8;
  if (g >= 0) return sw + (g * 2 + half) * kWords;
  for (int w = 0; w < kWords; ++w)
    mixed[w] = sw[(((16 * kt + fmt::WordRow(w) + fmt::SlotDk(s)) / group) * 2 + half) * kWords + w];
  return mixed;
}

// Dequantizes slot s of the tile's 128 words: out[w] = element (16 kt + WordRow(w) + SlotDk(s),
// WordCol(w) + SlotDn(s)) of the tile's 64-column block, (u - z) * s with z from `zc` (u - z is an
// exact small integer, so the GPTQ bias z = 8 gives the bits of (u - 8) * s). kFinite: the
// weights are known to be finite.
template <bool kFinite>
WSYNC_INLINE void DecodeSlot(const uint32_t* words, const float* sc, const float* zc, int s, float* out) {
  const int shift = 4 * s;
  for (int w = 0; w < kWords; ++w) {
    const float u = static_cast<float>(static_cast<int>((words[w] >> shift) & 0xfu));
    const float p = (u - zc[w]) * sc[w];
    out[w] = kFinite ? RoundFiniteToBf16(p) : RoundToBf16(p);
  }
}

// The whole tile: dq[s * 128 + w] for the 8 slots.
template <bool kFinite>
WSYNC_INLINE void DecodeTile(const uint32_t* words, const float* sw, const float* zw, int64_t kt, int64_t g,
                             int64_t group, float* dq) {
  float mixed[kWords], mixed_z[kWords];
  for (int s = 0; s < 8; ++s)
    DecodeSlot<kFinite>(words, SlotScales(sw, kt, g, group, s, mixed), SlotScales(zw, kt, g, group, s, mixed_z), s,
                        dq + s * kWords);
}

// acc[(parity * 2 + half) * 128 + w] += x[WordRow(w) + SlotDk(s)] * value[w] for one slot of one
// token (x points at the tile's first K row). WordRow(w) = 2 ((w >> 2) & 3) repeats every 16 words.
WSYNC_INLINE void AccumulateSlot(const float* x, const float* value, int s, float* acc) {
  const int dk = fmt::SlotDk(s);
  float xs[16];
  for (int i = 0; i < 16; ++i) xs[i] = x[fmt::WordRow(i) + dk];
  float* a = acc + ((dk & 1) * 2 + fmt::SlotDn(s) / 8) * kWords;
  for (int b = 0; b < kWords; b += 16)
    for (int i = 0; i < 16; ++i) a[b + i] += xs[i] * value[b + i];
}

// Every slot of a decoded tile, in kSlotOrder.
WSYNC_INLINE void AccumulateTile(const float* x, const float* dq, float* acc) {
  for (int s : kSlotOrder) AccumulateSlot(x, dq + s * kWords, s, acc);
}

// y[c] for the 64 columns of a block: column 16 v + q + 8 half sums words 16 q + 4 rr + v, partial
// sum j = 2 rr + parity, combined as ops.h Dot does.
WSYNC_INLINE void CombineBlock(const float* acc, float* y) {
  for (int half = 0; half < 2; ++half)
    for (int q = 0; q < 8; ++q)
      for (int v = 0; v < 4; ++v) {
        float a[8];
        for (int j = 0; j < 8; ++j) a[j] = acc[((j & 1) * 2 + half) * kWords + 16 * q + 4 * (j >> 1) + v];
        y[16 * v + q + 8 * half] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
      }
}

const uint32_t* TileWords(const MarlinRef& m, int64_t e, int64_t kt, int64_t nt) {
  return m.packed + e * (m.k / 16) * 2 * m.n + fmt::TileOffset(kt, nt, m.n);
}

WSYNC_SIMD_CLONES void MarlinMatMul(const float* x, int64_t n, const MarlinRef& m, float* y) {
  const int64_t K = m.k, N = m.n, kts = K / 16, nts = N / 64;
  const std::vector<int64_t> groups = TileGroups(m);
  std::vector<float> sw(static_cast<size_t>(m.groups() * 2 * kWords)), zw(sw.size()), dq(kTileFloats),
      acc(static_cast<size_t>(n * kAccFloats));
  float mixed[kWords], mixed_z[kWords];
  for (int64_t nt = 0; nt < nts; ++nt) {
    BlockScales(m, 0, nt, sw.data());
    BlockZeros(m, 0, nt, zw.data());
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t kt = 0; kt < kts; ++kt) {
      const uint32_t* words = TileWords(m, 0, kt, nt);
      const int64_t g = groups[static_cast<size_t>(kt)];
      if (n == 1) {  // decode each slot straight into the accumulators
        for (int s : kSlotOrder) {
          DecodeSlot<true>(words, SlotScales(sw.data(), kt, g, m.group, s, mixed),
                           SlotScales(zw.data(), kt, g, m.group, s, mixed_z), s, dq.data());
          AccumulateSlot(x + 16 * kt, dq.data(), s, acc.data());
        }
        continue;
      }
      DecodeTile<true>(words, sw.data(), zw.data(), kt, g, m.group, dq.data());
      for (int64_t t = 0; t < n; ++t) AccumulateTile(x + t * K + 16 * kt, dq.data(), acc.data() + t * kAccFloats);
    }
    for (int64_t t = 0; t < n; ++t) CombineBlock(acc.data() + t * kAccFloats, y + t * N + 64 * nt);
  }
}

WSYNC_SIMD_CLONES void MatMulF32(const float* x, int64_t n, const WeightRef& w, float* y) {
  for (int64_t i = 0; i < w.rows; ++i) {
    const float* row = w.f32() + i * w.cols;
    for (int64_t t = 0; t < n; ++t) y[t * w.rows + i] = Dot(x + t * w.cols, row, w.cols);
  }
}

WSYNC_SIMD_CLONES void MatMulBf16(const float* x, int64_t n, const WeightRef& w, float* y) {
  for (int64_t i = 0; i < w.rows; ++i) {
    const uint16_t* row = static_cast<const uint16_t*>(w.data) + i * w.cols;
    for (int64_t t = 0; t < n; ++t) y[t * w.rows + i] = DotBf16(x + t * w.cols, row, w.cols);
  }
}

// The f32 value of every E4M3 code (FP8.md §1; NaN for 0x7F / 0xFF).
const std::array<float, 256>& Fp8Values() {
  static const std::array<float, 256> v = [] {
    std::array<float, 256> a{};
    for (int c = 0; c < 256; ++c) a[static_cast<size_t>(c)] = kernels::format::E4m3Value(static_cast<uint8_t>(c));
    return a;
  }();
  return v;
}

// Row i (expert i / n, row i % n) of an FP8 weight as f32.
void Fp8Row(const Fp8Ref& f, int64_t i, float* out) {
  const std::array<float, 256>& value = Fp8Values();
  const int64_t e = i / f.n, r = i % f.n, sr = f.scale_rows(), sc = f.scale_cols();
  const uint8_t* codes = f.codes + i * f.k;
  const float* scales = f.scales + (e * sr + (f.bn > 0 ? r / f.bn : r)) * sc;
  if (f.bk <= 0) {
    const float s = scales[0];
    for (int64_t c = 0; c < f.k; ++c) out[c] = value[codes[c]] * s;
    return;
  }
  for (int64_t c0 = 0, b = 0; c0 < f.k; c0 += f.bk, ++b) {
    const float s = scales[b];
    const int64_t c1 = std::min(f.k, c0 + f.bk);
    for (int64_t c = c0; c < c1; ++c) out[c] = value[codes[c]] * s;
  }
}

WSYNC_SIMD_CLONES void MatMulFp8(const float* x, int64_t n, const WeightRef& w, float* y) {
  std::vector<float> row(static_cast<size_t>(w.cols));
  for (int64_t i = 0; i < w.rows; ++i) {
    Fp8Row(w.fp8, i, row.data());
    for (int64_t t = 0; t < n; ++t) y[t * w.rows + i] = Dot(x + t * w.cols, row.data(), w.cols);
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

int MarlinRef::Zero(int64_t e, int64_t g, int64_t col) const {
  if (zeros == nullptr) return fmt::kNibbleBias;
  return static_cast<int>(fmt::MarlinZeroOf(zeros + (e * groups() + g) * (n / 8), col));
}

WeightRef WeightRef::Expert(int64_t e, int64_t num_experts) const {
  WeightRef out = *this;
  const int64_t per = rows / num_experts;
  out.rows = per;
  out.shape = {per, cols};
  switch (form) {
    case WeightForm::kF32: out.data = f32() + e * per * cols; break;
    case WeightForm::kBF16: out.data = static_cast<const uint16_t*>(data) + e * per * cols; break;
    case WeightForm::kMarlin:
      out.marlin.packed = marlin.packed + e * (marlin.k / 16) * 2 * marlin.n;
      out.marlin.scales = marlin.scales + e * marlin.groups() * marlin.n;
      if (marlin.zeros != nullptr) out.marlin.zeros = marlin.zeros + e * marlin.groups() * (marlin.n / 8);
      out.marlin.experts = 1;
      break;
    case WeightForm::kFp8:
      out.fp8.codes = fp8.codes + e * per * cols;
      out.fp8.scales = fp8.scales + e * fp8.scale_rows() * fp8.scale_cols();
      out.fp8.experts = 1;
      break;
    case WeightForm::kNone: break;
  }
  return out;
}

void MatMul(const float* x, int64_t n, const WeightRef& w, float* y) {
  switch (w.form) {
    case WeightForm::kF32: MatMulF32(x, n, w, y); return;
    case WeightForm::kBF16: MatMulBf16(x, n, w, y); return;
    case WeightForm::kMarlin: MarlinMatMul(x, n, w.marlin, y); return;
    case WeightForm::kFp8: MatMulFp8(x, n, w, y); return;
    case WeightForm::kNone: return;
  }
}

float RowDot(const WeightRef& w, int64_t i, const float* x) {
  if (w.form == WeightForm::kFp8) {
    std::vector<float> row(static_cast<size_t>(w.cols));
    Fp8Row(w.fp8, i, row.data());
    return Dot(row.data(), x, w.cols);
  }
  if (w.form == WeightForm::kBF16) return DotBf16(x, static_cast<const uint16_t*>(w.data) + i * w.cols, w.cols);
  return Dot(w.f32() + i * w.cols, x, w.cols);
}

void RowAxpy(const WeightRef& w, int64_t i, float alpha, float* y) {
  if (w.form == WeightForm::kFp8) {
    std::vector<float> row(static_cast<size_t>(w.cols));
    Fp8Row(w.fp8, i, row.data());
    Axpy(alpha, row.data(), y, w.cols);
    return;
  }
  if (w.form == WeightForm::kBF16) {
    const uint16_t* row = static_cast<const uint16_t*>(w.data) + i * w.cols;
    for (int64_t j = 0; j < w.cols; ++j) y[j] += alpha * BF16ToF32(row[j]);
    return;
  }
  Axpy(alpha, w.f32() + i * w.cols, y, w.cols);
}

void RowToFloats(const WeightRef& w, int64_t i, float* out) {
  if (w.form == WeightForm::kFp8) {
    Fp8Row(w.fp8, i, out);
    return;
  }
  if (w.form == WeightForm::kBF16) {
    const uint16_t* row = static_cast<const uint16_t*>(w.data) + i * w.cols;
    for (int64_t j = 0; j < w.cols; ++j) out[j] = BF16ToF32(row[j]);
    return;
  }
  std::memcpy(out, w.f32() + i * w.cols, static_cast<size_t>(w.cols) * sizeof(float));
}

void DecodeMarlinTile(const MarlinRef& m, int64_t e, int64_t kt, int64_t nt, float* out) {
  std::vector<float> sw(static_cast<size_t>(m.groups() * 2 * kWords)), zw(sw.size()), dq(kTileFloats);
  BlockScales(m, e, nt, sw.data());
  BlockZeros(m, e, nt, zw.data());
  DecodeTile<false>(TileWords(m, e, kt, nt), sw.data(), zw.data(), kt, TileGroups(m)[static_cast<size_t>(kt)], m.group,
                    dq.data());
  for (int s = 0; s < 8; ++s)
    for (int w = 0; w < kWords; ++w)
      out[(fmt::WordRow(w) + fmt::SlotDk(s)) * 64 + fmt::WordCol(w) + fmt::SlotDn(s)] = dq[s * kWords + w];
}

void MaterializeWeight(const WeightRef& w, float* out) {
  switch (w.form) {
    case WeightForm::kF32: std::memcpy(out, w.data, static_cast<size_t>(w.rows * w.cols) * sizeof(float)); return;
    case WeightForm::kBF16:
    case WeightForm::kFp8:
      for (int64_t i = 0; i < w.rows; ++i) RowToFloats(w, i, out + i * w.cols);
      return;
    case WeightForm::kMarlin: {
      const MarlinRef& m = w.marlin;
      const int64_t K = m.k, N = m.n;
      std::vector<float> sw(static_cast<size_t>(m.groups() * 2 * kWords)), zw(sw.size()), dq(kTileFloats);
      const std::vector<int64_t> groups = TileGroups(m);
      for (int64_t e = 0; e < m.experts; ++e)
        for (int64_t nt = 0; nt < N / 64; ++nt) {
          BlockScales(m, e, nt, sw.data());
          BlockZeros(m, e, nt, zw.data());
          for (int64_t kt = 0; kt < K / 16; ++kt) {
            DecodeTile<false>(TileWords(m, e, kt, nt), sw.data(), zw.data(), kt, groups[static_cast<size_t>(kt)],
                              m.group, dq.data());
            for (int s = 0; s < 8; ++s)
              for (int w = 0; w < kWords; ++w) {
                const int64_t k = 16 * kt + fmt::WordRow(w) + fmt::SlotDk(s);
                const int64_t c = 64 * nt + fmt::WordCol(w) + fmt::SlotDn(s);
                out[(e * N + c) * K + k] = dq[s * kWords + w];
              }
          }
        }
      return;
    }
    case WeightForm::kNone: return;
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
    default: return std::nullopt;
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

bool MarlinScalesCertainlyFinite(const std::byte* scales, bool f16, size_t count, bool zero_points) {
  const float c = zero_points ? 15.0f : 8.0f;  // |u - 8| <= 8; |u - z| <= 15
  for (size_t i = 0; i < count; ++i) {
    const uint16_t h = Load<uint16_t>(scales, static_cast<int64_t>(i));
    const float top = c * std::fabs(f16 ? F16ToF32(h) : BF16ToF32(h));
    if (!std::isfinite(top) || !std::isfinite(RoundToBf16(top))) return false;
  }
  return true;
}

}  // namespace wsync::ref_engine
