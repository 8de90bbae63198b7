// CPU INT4 kernels. Math and layout: kernels/format/int4_format.h (FORMATS.md §1-§6).
//
// Quantize (one pass over W): per row and group, the absolute maximum is reduced on the 16-bit
// patterns (|x| bits, exact; W is prefetched ahead since this is its first touch) and converted
// once to f32; the scale follows the variant in scalar f32; then each vector of W is widened to
// f32, divided by the broadcast scale (IEEE division, no reciprocal), rounded half-to-even
// (hn::Round), clamped to [-7, 7] and biased by 8 through the mantissa of q + 2^23 + 8; pairs of
// lanes are OR-ed into bytes on u64 lanes and narrowed, so each vector stores its packed words
// directly. Rows are processed in blocks of 16 so that the GPTQ orientation ([K/8, N], words of
// 16 consecutive rows side by side) is written 64 bytes at a time: no separate transpose pass.
// Outputs that the kernel does not read back are written with streaming stores. With reuse
// (compressed-tensors), each group's input is hashed first (XXH3-64) and an unchanged group's
// words and scale are copied from the earlier outputs instead of computed.
//
// Repack: per k-tile, the two GPTQ rows A (2kt), B (2kt+1) (gathered through perm if given) are
// read tile by tile; for each 64-column tile the byte planes Lo = NibblePlaneLo(A, B),
// Hi = NibblePlaneHi(A, B) and the 4x4 byte transposes of {Lo(c), Lo(c+8), Hi(c), Hi(c+8)} run
// lanewise over cc (c = 64nt + 16v + cc), giving Marlin word 16*cc + 4*rr + v in a [16][8] block
// that 16-lane gathers from L1 turn into tile order; the 512-byte tile is written with streaming
// stores. Restore runs the same steps backwards (the byte transpose is an involution).
// With a perm, restore first restores in Marlin row order into a temporary, then gathers GPTQ row
// p from temporary row inv[p] (rare path; allocates the temporary).
//
// Threads: std::thread partitioning of independent units (16-row blocks, k-tiles, scale rows);
// each thread sizes its scratch once before its loop; no allocation inside the loops.

// Highway's dynamic dispatch: foreach_target.h re-includes this file once per target, and must
// come before highway.h.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/int4_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/cache_control.h"
#include "hwy/highway.h"
// clang-format on

#include "kernels/cpu/int4_cpu.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <span>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/abs_max-inl.h"
#include "kernels/cpu/marlin_tile-inl.h"
#include "kernels/cpu/parallel.h"
#include "kernels/format/int4_format.h"

// The groups' digests: XXH3-64 inlined (a call per 256-byte group costs as much as the hash).
#define XXH_INLINE_ALL
#include <xxhash.h>  // NOLINT(build/include_order)

HWY_BEFORE_NAMESPACE();
namespace wsync::kernels::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace fmt = ::wsync::kernels::format;

constexpr int64_t kRowBlock = 16;

#if HWY_TARGET != HWY_SCALAR
// q = clamp(rint(vf / vs), -7, 7); u = q + 8; pairs of lanes -> one byte (u_even | u_odd << 4),
// stored at `bytes`: Lanes/2 bytes, i.e. the little-endian bytes of the packed words (§2).
// u is read from the mantissa of q + (2^23 + 8), exact for |q| <= 7: no float->int conversion.
template <class DF, class V>
HWY_INLINE void EmitPacked(DF df, V vf, V vs, uint8_t* HWY_RESTRICT bytes) {
  const hn::Rebind<uint32_t, DF> du32;
  const hn::Repartition<uint64_t, DF> du64;
  const hn::Rebind<uint8_t, decltype(du64)> d8;
  auto r = hn::Round(hn::Div(vf, vs));
  r = hn::Max(r, hn::Set(df, -static_cast<float>(fmt::kQMax)));  // max(NaN, -7) = -7 as fmaxf
  r = hn::Min(r, hn::Set(df, static_cast<float>(fmt::kQMax)));
  const auto u =
      hn::And(hn::BitCast(du32, hn::Add(r, hn::Set(df, 8388608.0f + fmt::kNibbleBias))), hn::Set(du32, 0xFu));
  const auto v = hn::BitCast(du64, u);
  const auto pair = hn::And(hn::Or(v, hn::ShiftRight<28>(v)), hn::Set(du64, uint64_t{0xFF}));
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // vpmovqb: one instruction where Highway 1.0.3's TruncateTo emits a permute chain.
  _mm_storel_epi64(reinterpret_cast<__m128i*>(bytes), _mm512_cvtepi64_epi8(pair.raw));
  (void)d8;
#else
  hn::StoreU(hn::TruncateTo(d8, pair), d8, bytes);
#endif
}
#endif

// out[0 .. n/8) = the packed words of n values (n % 8 == 0) sharing one scale.
void QuantizeToWords(const uint16_t* HWY_RESTRICT x, int64_t n, float scale, bool bf16, uint32_t* HWY_RESTRICT out) {
  int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> df;
  const hn::Rebind<uint16_t, decltype(df)> d16;
  const hn::Rebind<uint32_t, decltype(df)> du32;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  const auto vs = hn::Set(df, scale);
  uint8_t* HWY_RESTRICT bytes = reinterpret_cast<uint8_t*>(out);
  if (bf16) {
    for (; i + lanes <= n; i += lanes) {
      const auto vf = hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(d16, x + i))));
      EmitPacked(df, vf, vs, bytes + i / 2);
    }
  } else {
    for (; i + lanes <= n; i += lanes) {
      const auto vf = hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(x + i)));
      EmitPacked(df, vf, vs, bytes + i / 2);
    }
  }
#endif
  for (; i < n; i += 8) {  // tail (and the scalar target): same math through the shared helpers
    uint32_t word = 0;
    for (int j = 0; j < 8; ++j) {
      const float v = bf16 ? BF16ToF32(x[i + j]) : F16ToF32(x[i + j]);
      word |= fmt::QuantizeNibble(v, scale) << (4 * j);
    }
    out[i / 8] = word;
  }
}

// out[j * ld + r] = staged[r * stride + j] for r < rows (<= 16), j < kw: words of 16 consecutive
// rows side by side, i.e. one 64-byte line of qweight[K/8, N] per j. Full, 64-byte-aligned lines
// are gathered and written with streaming stores: the kw lines lie N*4 bytes apart, too far for
// the hardware prefetcher, so ordinary stores would stall on their read-for-ownership.
void WriteTransposed(const uint32_t* HWY_RESTRICT staged, int64_t stride, int64_t kw, int64_t rows,
                     uint32_t* HWY_RESTRICT out, int64_t ld) {
#if HWY_TARGET != HWY_SCALAR
  const hn::CappedTag<uint32_t, 16> d;
  const hn::RebindToSigned<decltype(d)> di;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const bool aligned = reinterpret_cast<uintptr_t>(out) % 64 == 0 && (ld * 4) % 64 == 0;
  if (rows == kRowBlock && aligned && kRowBlock % lanes == 0) {
    const auto idx = hn::Mul(hn::Iota(di, 0), hn::Set(di, static_cast<int32_t>(stride)));
    for (int64_t j = 0; j < kw; ++j) {
      for (int64_t part = 0; part < kRowBlock; part += lanes) {
        const auto v = hn::GatherIndex(d, staged + part * stride + j, idx);
        hn::Stream(v, d, out + j * ld + part);
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < kw; ++j) {
    for (int64_t r = 0; r < rows; ++r) out[j * ld + r] = staged[r * stride + j];
  }
}

// Words per row of the GPTQ staging scratch: K/8 plus padding so that the 16 rows do not alias
// the same L1 sets (a row stride that is a multiple of 4 KiB would).
int64_t StagingStride(int64_t k) { return k / 8 + 16; }

// With reuse (a.next_digests): records group `gi`'s digest of its input `x`, and when the earlier
// one is the same, copies the group's earlier words to `words` and scale, returning true.
bool ReuseGroup(const internal::QuantizeArgs& a, int64_t gi, const uint16_t* x, int64_t words_at, uint32_t* words) {
  const uint64_t d = XXH3_64bits(x, static_cast<size_t>(a.group) * sizeof(uint16_t));
  a.next_digests[gi] = d;
  if (a.digests == nullptr || a.digests[gi] != d) return false;
  a.scales[gi] = a.prev_scales[gi];
  std::memcpy(words, a.prev_packed + words_at, static_cast<size_t>(a.group / 8) * sizeof(uint32_t));
  return true;
}

// Units are (expert, 16-row block); scratch holds kRowBlock * StagingStride(K) words. Adds the
// groups it reused to *reused.
// Returns the smallest (row * ng + g) of a group holding Inf/NaN, or -1.
int64_t QuantizeUnits(const internal::QuantizeArgs& a, int64_t begin, int64_t end, uint8_t* scratch, int64_t* reused) {
  const uint32_t nonfinite = fmt::NonFiniteAbsBits16(a.is_bf16);
  int64_t bad = -1;
  const int64_t blocks = (a.n + kRowBlock - 1) / kRowBlock;
  const int64_t kw = a.k / fmt::kNibblesPerWord;
  const int64_t ng = a.k / a.group;
  const int64_t stride = StagingStride(a.k);
  const bool gptq = a.layout == internal::Layout::kGptq;
  uint32_t* staged = reinterpret_cast<uint32_t*>(scratch);
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t e = unit / blocks;
    const int64_t n0 = (unit % blocks) * kRowBlock;
    const int64_t n1 = std::min(a.n, n0 + kRowBlock);
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t row = e * a.n + n;
      const uint16_t* x = a.w + row * a.k;
      uint32_t* words = gptq ? staged + (n - n0) * stride : staged;
      for (int64_t g = 0; g < ng; ++g) {
        // Software prefetch ~2 KiB ahead (the next row near the end of this one): the amax pass is
        // the first touch of W and otherwise stalls on it.
        for (int64_t off = 0; off < a.group; off += 32) hwy::Prefetch(x + g * a.group + 1024 + off);
        if (a.next_digests != nullptr &&
            ReuseGroup(a, row * ng + g, x + g * a.group, row * kw + g * (a.group / 8), words + g * (a.group / 8))) {
          ++*reused;  // compressed-tensors only (int4.cc): the group's index is its scale's
          continue;
        }
        const uint32_t bits = AbsMaxBits(x + g * a.group, a.group);
        if (bits >= nonfinite && bad < 0) bad = row * ng + g;
        const float amax = a.is_bf16 ? BF16ToF32(static_cast<uint16_t>(bits)) : F16ToF32(static_cast<uint16_t>(bits));
        const float scale = fmt::GroupScale(amax, a.variant);
        const uint16_t s16 = a.is_bf16 ? F32ToBF16(scale) : F32ToF16(scale);
        if (gptq) {
          a.scales[(e * ng + g) * a.n + n] = s16;
        } else {
          a.scales[row * ng + g] = s16;
        }
        QuantizeToWords(x + g * a.group, a.group, scale, a.is_bf16, words + g * (a.group / 8));
      }
      if (!gptq) StreamCopy(words, kw, a.packed + row * kw);
    }
    if (gptq) WriteTransposed(staged, stride, kw, n1 - n0, a.packed + e * kw * a.n + n0, a.n);
  }
  hwy::FlushStream();  // order the streaming stores before the caller reads the output
  return bad;
}

// dst[c] = OR_i nibble(rows[i] % 8) of src row rows[i] / 8, at nibble i, for c < n: the word of
// 8 logical K rows gathered from a GPTQ [K/8, n] matrix (act-order perm, §4.3). Lanewise over c.
void GatherRows(const uint32_t* HWY_RESTRICT src, int64_t n, const int32_t* rows, uint32_t* HWY_RESTRICT dst) {
  const uint32_t* HWY_RESTRICT s[8];
  int sh[8];
  for (int i = 0; i < 8; ++i) {
    s[i] = src + static_cast<int64_t>(rows[i] >> 3) * n;
    sh[i] = 4 * (rows[i] & 7);
  }
  for (int64_t c = 0; c < n; ++c) {
    uint32_t w = 0;
    for (int i = 0; i < 8; ++i) w |= ((s[i][c] >> sh[i]) & 0xFu) << (4 * i);
    dst[c] = w;
  }
}

// Inverse of EmitTile: GPTQ rows A = a[0..64), B = b[0..64) of a tile from its 128 words.
void SplitTile(const uint32_t* HWY_RESTRICT o, uint32_t* HWY_RESTRICT a, uint32_t* HWY_RESTRICT b) {
#if HWY_TARGET == HWY_SCALAR
  for (int cc = 0; cc < 8; ++cc) {
    for (int v = 0; v < 4; ++v) {
      const int c = 16 * v + cc;
      uint32_t x0 = o[16 * cc + v], x1 = o[16 * cc + 4 + v];
      uint32_t x2 = o[16 * cc + 8 + v], x3 = o[16 * cc + 12 + v];
      fmt::Transpose4x4Bytes(x0, x1, x2, x3);  // planes Lo(c), Lo(c+8), Hi(c), Hi(c+8)
      a[c] = fmt::PlanesToA(x0, x2);
      b[c] = fmt::PlanesToB(x0, x2);
      a[c + 8] = fmt::PlanesToA(x1, x3);
      b[c + 8] = fmt::PlanesToB(x1, x3);
    }
  }
#else
  const hn::CappedTag<uint32_t, 8> d;
  const hn::RebindToSigned<decltype(d)> di;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const auto idx = hn::Mul(hn::Iota(di, 0), hn::Set(di, 16));  // lane cc -> word 16 cc + q
  const auto m4 = hn::Set(d, 0x0F0F0F0Fu), m4h = hn::Set(d, 0xF0F0F0F0u);
  for (int v = 0; v < 4; ++v) {
    for (int cc = 0; cc < 8; cc += lanes) {
      const uint32_t* base = o + 16 * cc + v;
      auto x0 = hn::GatherIndex(d, base + 0, idx), x1 = hn::GatherIndex(d, base + 4, idx);
      auto x2 = hn::GatherIndex(d, base + 8, idx), x3 = hn::GatherIndex(d, base + 12, idx);
      Transpose4x4BytesV(d, x0, x1, x2, x3);
      // Vector forms of format::PlanesToA / PlanesToB.
      hn::StoreU(hn::Or(hn::And(x0, m4), hn::ShiftLeft<4>(hn::And(x2, m4))), d, a + 16 * v + cc);
      hn::StoreU(hn::Or(hn::And(x1, m4), hn::ShiftLeft<4>(hn::And(x3, m4))), d, a + 16 * v + 8 + cc);
      hn::StoreU(hn::Or(hn::And(hn::ShiftRight<4>(x0), m4), hn::And(x2, m4h)), d, b + 16 * v + cc);
      hn::StoreU(hn::Or(hn::And(hn::ShiftRight<4>(x1), m4), hn::And(x3, m4h)), d, b + 16 * v + 8 + cc);
    }
  }
#endif
}

// Units are (expert, k-tile); scratch holds 2N words (the perm-gathered rows).
void RepackUnits(const internal::RepackArgs& a, int64_t begin, int64_t end, uint32_t* scratch) {
  const int64_t n = a.n, kw = a.k / 8, ktiles = a.k / fmt::kTileK;
  uint32_t* HWY_RESTRICT ga = scratch;
  uint32_t* HWY_RESTRICT gb = scratch + n;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t e = unit / ktiles, kt = unit % ktiles;
    const uint32_t* q = a.in + e * kw * n;
    const uint32_t* HWY_RESTRICT ra;
    const uint32_t* HWY_RESTRICT rb;
    if (a.perm != nullptr) {
      // Marlin row k is GPTQ row perm[k] (§4.3): gather the 16 rows of this tile.
      const int32_t* p = a.perm + e * a.k + kt * fmt::kTileK;
      GatherRows(q, n, p, ga);
      GatherRows(q, n, p + 8, gb);
      ra = ga;
      rb = gb;
    } else {
      ra = q + 2 * kt * n;
      rb = ra + n;
    }
    uint32_t* out = a.out + e * (a.k / fmt::kTileK) * 2 * n + fmt::TileOffset(kt, 0, n);
    for (int64_t nt = 0; nt < n / fmt::kTileN; ++nt) {
      EmitTile(ra + nt * fmt::kTileN, rb + nt * fmt::kTileN, out + nt * fmt::kTileWords);
    }
  }
  hwy::FlushStream();
}

// Inverse of RepackUnits without perm. Units are (expert, k-tile); scratch holds 2N words.
void RestoreUnits(const internal::RepackArgs& a, int64_t begin, int64_t end, uint32_t* scratch) {
  const int64_t n = a.n, kw = a.k / 8, ktiles = a.k / fmt::kTileK;
  uint32_t* HWY_RESTRICT lo = scratch;
  uint32_t* HWY_RESTRICT hi = scratch + n;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t e = unit / ktiles, kt = unit % ktiles;
    const uint32_t* in = a.in + e * ktiles * 2 * n + fmt::TileOffset(kt, 0, n);
    for (int64_t nt = 0; nt < n / fmt::kTileN; ++nt) {
      SplitTile(in + nt * fmt::kTileWords, lo + nt * fmt::kTileN, hi + nt * fmt::kTileN);
    }
    // lo/hi now hold GPTQ rows 2kt and 2kt+1: stream them out.
    uint32_t* ra = a.out + e * kw * n + 2 * kt * n;
    StreamCopy(lo, n, ra);
    StreamCopy(hi, n, ra + n);
  }
  hwy::FlushStream();
}

// out row j of expert e = the 8 rows inv[8j..8j+7] of the permuted-order GPTQ matrix `tmp`.
void UnpermuteRows(const internal::RepackArgs& a, const uint32_t* tmp, const int32_t* inv, int64_t begin, int64_t end) {
  const int64_t kw = a.k / 8;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t e = unit / kw, j = unit % kw;
    GatherRows(tmp + e * kw * a.n, a.n, inv + e * a.k + 8 * j, a.out + (e * kw + j) * a.n);
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace wsync::kernels::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace wsync::kernels::cpu {

HWY_EXPORT(QuantizeUnits);
HWY_EXPORT(RepackUnits);
HWY_EXPORT(RestoreUnits);
HWY_EXPORT(UnpermuteRows);
HWY_EXPORT(TargetName);

namespace fmt = ::wsync::kernels::format;

const char* SimdTargetName() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

absl::Status Quantize(const internal::QuantizeArgs& args) {
  const int64_t blocks = (args.n + 15) / 16;
  std::atomic<int64_t> bad{INT64_MAX};
  std::atomic<int64_t> reused{0};
  ParallelForBytes(args.experts * blocks, args.threads, 16 * args.k * 2, args.min_bytes_per_thread,
                   [&](int64_t b, int64_t e) {
                     // 16 staged word rows of StagingStride(K) = K/8 + 16 words
                     std::vector<uint8_t> scratch(16 * static_cast<size_t>(args.k / 8 + 16) * sizeof(uint32_t));
                     int64_t mine_reused = 0;
                     const int64_t mine = HWY_DYNAMIC_DISPATCH(QuantizeUnits)(args, b, e, scratch.data(), &mine_reused);
                     reused.fetch_add(mine_reused, std::memory_order_relaxed);
                     if (mine < 0) return;
                     AtomicMin(bad, mine);
                   });
  if (args.reused_groups != nullptr) *args.reused_groups = reused.load();
  if (bad.load() != INT64_MAX) return internal::NonFiniteError(args, bad.load());
  return absl::OkStatus();
}

absl::Status GptqToMarlin(const internal::RepackArgs& args) {
  ParallelForBytes(args.experts * (args.k / fmt::kTileK), args.threads, 8 * args.n, args.min_bytes_per_thread,
                   [&](int64_t b, int64_t e) {
                     std::vector<uint32_t> scratch(static_cast<size_t>(2 * args.n));
                     HWY_DYNAMIC_DISPATCH(RepackUnits)(args, b, e, scratch.data());
                   });
  return absl::OkStatus();
}

absl::Status MarlinToGptq(const internal::RepackArgs& args) {
  const int64_t n = args.n, k = args.k, kw = k / 8;
  if (args.perm == nullptr) {
    ParallelForBytes(args.experts * (k / fmt::kTileK), args.threads, 8 * n, args.min_bytes_per_thread,
                     [&](int64_t b, int64_t e) {
                       std::vector<uint32_t> scratch(static_cast<size_t>(2 * n));
                       HWY_DYNAMIC_DISPATCH(RestoreUnits)(args, b, e, scratch.data());
                     });
    return absl::OkStatus();
  }
  // Marlin row k is GPTQ row perm[k]: restore in Marlin row order into a temporary (allocated per
  // call: this inverse is not on the sync path), then GPTQ row p = temporary row inv[p].
  std::vector<int32_t> inv(static_cast<size_t>(args.experts * k));
  for (int64_t e = 0; e < args.experts; ++e) {
    for (int64_t i = 0; i < k; ++i) inv[e * k + args.perm[e * k + i]] = static_cast<int32_t>(i);
  }
  std::vector<uint32_t> tmp(static_cast<size_t>(args.experts * kw * n));
  internal::RepackArgs plain = args;
  plain.perm = nullptr;
  plain.out = tmp.data();
  ParallelForBytes(args.experts * (k / fmt::kTileK), args.threads, 8 * n, args.min_bytes_per_thread,
                   [&](int64_t b, int64_t e) {
                     std::vector<uint32_t> scratch(static_cast<size_t>(2 * n));
                     HWY_DYNAMIC_DISPATCH(RestoreUnits)(plain, b, e, scratch.data());
                   });
  ParallelForBytes(args.experts * kw, args.threads, 4 * n, args.min_bytes_per_thread, [&](int64_t b, int64_t e) {
    HWY_DYNAMIC_DISPATCH(UnpermuteRows)(args, tmp.data(), inv.data(), b, e);
  });
  return absl::OkStatus();
}

absl::Status PermuteScales(const internal::ScalePermArgs& args) {
  const int width = args.channelwise ? fmt::kScalePermChannelWidth : fmt::kScalePermGroupedWidth;
  int src[fmt::kScalePermGroupedWidth];
  for (int p = 0; p < width; ++p) src[p] = args.channelwise ? fmt::ScalePermChannel(p) : fmt::ScalePermGrouped(p);
  const int64_t rows = args.experts * args.rows;
  ParallelForBytes(rows, args.threads, 2 * args.n, args.min_bytes_per_thread, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const uint16_t* in = args.in + r * args.n;
      uint16_t* out = args.out + r * args.n;
      for (int64_t c0 = 0; c0 < args.n; c0 += width) {
        for (int p = 0; p < width; ++p) {
          if (args.inverse) {
            out[c0 + src[p]] = in[c0 + p];
          } else {
            out[c0 + p] = in[c0 + src[p]];
          }
        }
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace wsync::kernels::cpu
#endif  // HWY_ONCE
