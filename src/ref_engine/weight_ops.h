// The reference engine's weights in the form it serves them, and the kernels the forward pass
// (model.h) runs over them. A weight is read IN PLACE from the engine's parameter memory whenever
// that memory can be read directly:
//   kBF16    bf16 rows, converted to f32 inside the dot products (bf16 -> f32 is exact);
//   kF32     f32 rows (f32 parameters, and f32 copies of f16 / misaligned / 1-D parameters);
//   kFp8     FP8 E4M3 codes with F32 block or row scales (Fp8Ref), decoded row by row;
//   kMarlin  INT4 in SGLang's Marlin layout (ENGINE_LAYOUT.md §4, FORMATS.md §4-§5): int32 words
//            [E, K/16, 2N] holding 16 (K) x 64 (N) tiles, and bf16/f16 scales [E, K/G, N] permuted
//            with scale_perm (64 columns) or scale_perm_single (32 columns); AWQ-Marlin adds zero
//            points [E, K/G, N/8] in Marlin's zero-point layout (AWQ.md §3.3).
//
// Math. The weight element (n, k) of a Marlin matrix is
//     w = bf16((u - z) * s),  u = the nibble of (k, n) (kernels/format/int4_format.h LocateInTile),
//                             z = 8 (GPTQ's bias), or AWQ's zero point of (k / G, n),
//                             s = f32(scale[k / G][n]) after undoing the scale permutation,
// rounded to bf16 as the Marlin GEMM does (FORMATS.md §8); the f32 product is exact. Every
// product below is x * w in f32 without FMA contraction (-ffp-contract=off), and every dot
// product follows ops.h Dot: 8 partial sums acc[k % 8], each in increasing k, combined as
// ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)). So MatMul over a kBF16 / kMarlin weight
// returns the same bits as ops.h Dot over the f32 matrix MaterializeWeight() returns, and a
// forward pass over in-place weights is bit-identical to one over an f32 copy of every weight.
//
// Marlin MatMul, per 64-column block: the scales (and AWQ zero points) of the block are
// un-permuted once into tile-word order; then every 16 x 64 tile is decoded into [slot 8][word 128] dequantized values
// (slot s of word w is element (WordRow(w) + SlotDk(s), WordCol(w) + SlotDn(s)) of the tile), and each token
// accumulates x * w into acc[row parity][column half][word], the x of a lane following the
// 16-word period of WordRow. The slots are visited with rows r, r+1 before r+8, r+9, so each
// accumulator sees its k in increasing order; the columns are put back in order only when the
// block's sums are combined. The hot loops are also compiled for AVX2 (same bits).
//
// Thread-safety: pure functions over caller-owned memory; concurrent calls are safe.
// Ownership: a WeightRef points into memory it does not own (the engine parameter memory or the
// model's copies), which must outlive its use. Errors: none here; callers validate shapes and
// alignment (kBF16 rows 2-byte, kF32 4-byte, Marlin words 4-byte and scales 2-byte aligned).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "common/dtype.h"
#include "common/tensor.h"

namespace wsync::ref_engine {

// Marlin INT4 weights [E, N, K] (E stacked experts, or E = 1 for a linear) read in place.
struct MarlinRef {
  const uint32_t* packed = nullptr;  // [E, K/16, 2N] words
  const uint16_t* scales = nullptr;  // [E, K/group, N] bf16 (or f16) bits, permuted
  const uint32_t* zeros = nullptr;   // AWQ-Marlin zero points [E, K/group, N/8]; null: z = 8 (GPTQ)
  bool scales_f16 = false;
  int64_t experts = 1, n = 0, k = 0;  // K % 16 == 0, N % 64 == 0
  int64_t group = 0;                  // rows of K per scale row (K for channelwise); K % group == 0
  // Which permutation SGLang applied to the scales: scale_perm (64 columns) or scale_perm_single
  // (32 columns). Usually `group < K`, except the MoE w13 quirk (ENGINE_LAYOUT.md §4).
  bool grouped_perm = true;

  int64_t groups() const { return k / group; }
  size_t packed_words() const { return static_cast<size_t>(experts * (k / 16) * 2 * n); }
  size_t scale_count() const { return static_cast<size_t>(experts * groups() * n); }
  size_t zero_words() const { return static_cast<size_t>(experts * groups() * (n / 8)); }
  float Scale(int64_t e, int64_t g, int64_t col) const;  // un-permuted scale, as f32
  int Zero(int64_t e, int64_t g, int64_t col) const;     // the zero point: 8, or AWQ's
};

// FP8 E4M3 weights [E, N, K] read in place (docs/spec/FP8.md §1, §4): codes [E, N, K] and F32
// scales per bn x bk block ([E, ceil(N/bn), ceil(K/bk)]) or per row (bn = 0: [E, N, 1]). Element
// (n, k) is float(code) * scale in f32 (exact for the code, one rounding for the product), the same
// bits as the f32 copy of kFloat32Copy.
struct Fp8Ref {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;  // 4-byte aligned
  int64_t experts = 1, n = 0, k = 0, bn = 0, bk = 0;
  int64_t scale_rows() const { return bn > 0 ? (n + bn - 1) / bn : n; }
  int64_t scale_cols() const { return bk > 0 ? (k + bk - 1) / bk : 1; }
};

enum class WeightForm : uint8_t { kNone, kF32, kBF16, kMarlin, kFp8 };

// One weight of the forward pass: a row-major [rows, cols] matrix (cols = the engine parameter's
// last dimension; stacked experts [E, N, K] have rows = E * N), or a 1-D vector (rows = 1).
struct WeightRef {
  Shape shape;  // the shape of the bf16 engine parameter of the same name
  WeightForm form = WeightForm::kNone;
  int64_t rows = 0, cols = 0;
  const void* data = nullptr;  // kF32: float[rows * cols]; kBF16: uint16_t[rows * cols]
  MarlinRef marlin;            // kMarlin (rows = experts * n, cols = k)
  Fp8Ref fp8;                  // kFp8 (rows = experts * n, cols = k)

  bool empty() const { return form == WeightForm::kNone; }
  const float* f32() const { return static_cast<const float*>(data); }  // kF32 only
  // Expert e of a stacked [E, N, K] weight, as an [N, K] matrix (any form).
  WeightRef Expert(int64_t e, int64_t num_experts) const;
};

// ---- dot products (ops.h Dot order) --------------------------------------------------------------

// sum_i a[i] * bf16(b[i]), the 8 partial sums of ops.h Dot.
inline float DotBf16(const float* a, const uint16_t* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * BF16ToF32(b[i + j]);
  for (int j = 0; i < n; ++i, ++j) acc[j] += a[i] * BF16ToF32(b[i]);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// y[t * w.rows + i] = Dot(x + t * w.cols, row i of w) for t < n, i < w.rows. Marlin: E == 1.
void MatMul(const float* x, int64_t n, const WeightRef& w, float* y);
// Dot(row i of w, x) (kF32 / kBF16 / kFp8).
float RowDot(const WeightRef& w, int64_t i, const float* x);
// y += alpha * row i of w, as ops.h Axpy (kF32 / kBF16 / kFp8).
void RowAxpy(const WeightRef& w, int64_t i, float alpha, float* y);
// out[0 .. cols) = row i of w as f32 (kF32 / kBF16 / kFp8).
void RowToFloats(const WeightRef& w, int64_t i, float* out);

// The whole weight as f32, row-major [rows, cols] (any form; Marlin is dequantized exactly).
void MaterializeWeight(const WeightRef& w, float* out);

// Decodes Marlin expert e's tile (kt, nt) into out[k_local * 64 + c_local] (16 x 64), using the
// same tile decoder as MatMul. For tests and MaterializeWeight.
void DecodeMarlinTile(const MarlinRef& m, int64_t e, int64_t kt, int64_t nt, float* out);

// ---- validation ------------------------------------------------------------------------------------

// The first index in [begin, end) of a bf16 / f16 / f32 array (any alignment) whose value is Inf
// or NaN, or nullopt. Other dtypes: nullopt.
std::optional<int64_t> FirstNonFinite(DType dtype, const std::byte* data, int64_t begin, int64_t end);
// The value at index i of such an array, as f32 (exact).
float FloatAt(DType dtype, const std::byte* data, int64_t i);

// True if every dequantized value of `m` is certainly finite, judged from the scales alone:
// every scale s is finite and bf16(c |s|) is finite, c = the largest |u - z| (8 for GPTQ's bias,
// 15 with AWQ zero points). False means "maybe not" (a non-finite scale is always used, so it is
// then certainly not); the caller then decides exactly with MaterializeWeight. `scales` may be
// misaligned (read with memcpy).
bool MarlinScalesCertainlyFinite(const std::byte* scales, bool f16, size_t count, bool zero_points = false);

}  // namespace wsync::ref_engine
