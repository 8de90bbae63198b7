// Scalar INT4 reference of the independent verifier: the quantizers a trainer runs and the inverses
// of the engine layouts, written from docs/spec/FORMATS.md (§1, §2, §4.2, §5) and
// docs/spec/AWQ.md (§1, §3) with plain loops. It shares no code with src/kernels (the optimized
// path it checks): only the exact bf16 / fp16 conversions of common/dtype.h.
//
//   Symmetric (compressed-tensors W4A16), FORMATS.md §1, per row and group of G along K:
//     amax  = max |w|                    (float32 of a bf16 / fp16 value: exact)
//     qat   : scale = max(fl32(amax / 7), 1e-5f)               (true division)
//     slime : scale = max(fl32(amax * fl32(1/7)), 1e-5f)       (0x3E124925, the rounded reciprocal)
//     q     = clamp(rint(fl32(w / scale)), -7, 7)              (IEEE division, ties to even)
//     code u = q + 8; stored scale = dtype(scale) (the model dtype); value = q * stored scale
//   AWQ (zero points), AWQ.md §1, per row and group:
//     fp16 (AutoAWQ on a GPU): every op rounds to fp16 (h(x) = fp16(x)): w = h(w); s = h(h(max - min)
//       clamped below at h(1e-5)) * fl32(1/15)); z = clamp(-rint(h(min / s)), 0, 15);
//       u = clamp(rint(h(w / s)) + z, 0, 15)
//     fp32: s = max(max - min, 1e-5f) / 15; z = clamp(-rint(min / s), 0, 15); u = clamp(rint(w / s) + z, 0, 15)
//     stored scale = dtype(s); value = (u - z) * stored scale
//   Marlin (FORMATS.md §4.2, AWQ.md §3.1): word 4t + v of tile (kt, nt) of a [K/16, 2N] int32
//     array holds in nibble j the code u[16kt + 2(t%4) + dk[j], 64nt + 16v + t/4 + dn[j]] (GPTQ
//     orientation, k-major), dk = (0,8,0,8,1,9,1,9), dn = (0,0,8,8,0,0,8,8).
//   Scale permutation (FORMATS.md §5): grouped, per 64 columns out[8i + j] = in[i + 8j];
//     single, per 32 columns out[8i + j] = in[2i + (0,1,8,9,16,17,24,25)[j]].
//   Marlin zero points (AWQ.md §3.3): nibble t of word w of a group row = z[64(w/8) + w%8 + 8·ORDER[t]],
//     ORDER = (0,2,4,6,1,3,5,7).
//   TensorRT-LLM W4A16 (TRTLLM_INT4.md §1.1), a [K, N/2] byte array per expert: position k' of column
//     n holds u[32(k'/32) + PERM[k'%32], n] in nibble REG_DST[k'%8] of word
//     sm80: (n/4)(K/2) + 32(k'/64) + 8(n%4) + (k'%64)/8;  sm90 dense: n(K/8) + k'/8,
//     PERM = (0 1 8 9 16 17 24 25 2 3 10 11 18 19 26 27 4 5 12 13 20 21 28 29 6 7 14 15 22 23 30 31),
//     REG_DST = (0 4 1 5 2 6 3 7); u = q + 8.
//
// Decisions where the specs are silent (the same as the kernels', docs/kernels.md, but re-derived):
//   * a non-finite weight is refused (kInvalidArgument naming the column): upstream would emit NaN
//     scales; so is, under the fp16 AWQ arithmetic, a weight or a group range fp16 cannot hold
//     (it rounds to Inf, AutoAWQ would produce NaN / Inf scales);
//   * the all-zero group gets the floor scale (1e-5f, or h(1e-5) / 15 for fp16 AWQ) and code 8
//     (symmetric) or u = z = 0 (AWQ); -0.0 is zero;
//   * channelwise (G = -1) is one group of the whole row.
// Errors: kInvalidArgument with the column (callers add the tensor and row).
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace wsync::tools::reference {

// Which symmetric quantizer the trainer ran (FORMATS.md §1.1 / §1.2). wsync-trainer-agent uses
// kQat (RankSyncOptions::quant_variant's default).
enum class SymmetricVariant { kQat, kSlime };
// Which AWQ arithmetic the trainer ran (AWQ.md §1). wsync-trainer-agent uses kFp16.
enum class AwqArith { kFp16, kFp32 };

// The float value of a stored scale (bf16 or fp16 bits).
float ScaleValue(uint16_t bits, DType dtype);

// Quantizes one row `w` (float32 values of the model's bf16 / fp16 elements) in groups of `group`
// (-1: one group of the whole row; else it must divide the row). codes[k] = q + 8 (0..15),
// scales[g] = the bits of dtype(scale), `scale_dtype` bf16 or fp16. Row length must be > 0.
absl::Status QuantizeRowSymmetric(std::span<const float> w, int group, SymmetricVariant variant, DType scale_dtype,
                                  uint8_t* codes, uint16_t* scales);

// AWQ with zero points: codes[k] = u (0..15), scales[g] (dtype bits), zeros[g] = z (0..15).
absl::Status QuantizeRowAwq(std::span<const float> w, int group, AwqArith arith, DType scale_dtype, uint8_t* codes,
                            uint16_t* scales, uint8_t* zeros);

// One Marlin GEMM weight (one expert): `words` holds [k/16, 2n] int32 words (little-endian bytes,
// 8 * k * n / 8 = k * n / 2 bytes); codes_nk receives u in HF orientation, codes_nk[row * k + col]
// for output row `row` < n and input column `col` < k. Requires k % 16 == 0 and n % 64 == 0.
void DecodeMarlinWeight(const unsigned char* words, int64_t k, int64_t n, uint8_t* codes_nk);

// The inverse of the Marlin scale permutation on `rows` rows of `n` scales (n % 64 == 0): `grouped`
// picks the 64-column perm, else the 32-column single perm. in/out are 16-bit patterns, row-major.
void UnpermuteMarlinScales(const uint16_t* permuted, int64_t rows, int64_t n, bool grouped, uint16_t* out);

// Marlin zero points: `words` [rows, n/8] int32 (little-endian bytes) -> z[rows * n] (0..15).
void DecodeMarlinZeros(const unsigned char* words, int64_t rows, int64_t n, uint8_t* z);

// One TensorRT-LLM W4A16 GEMM weight (one expert): `bytes` [k, n/2] -> codes_nk[row * k + col] = u.
// `sm90_dense`: the sm90 layout of a dense weight (no column interleave), else the sm80 layout.
// Requires k % 64 == 0 and n % 64 == 0.
void DecodeTrtllmWeight(const unsigned char* bytes, int64_t k, int64_t n, bool sm90_dense, uint8_t* codes_nk);

}  // namespace wsync::tools::reference
