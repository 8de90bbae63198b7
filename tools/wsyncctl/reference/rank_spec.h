// Internal to the independent verifier (reference.h): what one SGLang engine rank holds, derived
// from docs/spec/ENGINE_LAYOUT.md alone. Every engine param is either plain (bf16 / fp16 / fp32,
// filled by blocks of checkpoint tensors, zero elsewhere; FP8 codes and scales, filled by blocks
// of checkpoint weights quantized by fp8_scalar.h, FP8.md §4) or one of the two / three params of an
// INT4 GEMM weight (Marlin words, permuted scales, AWQ-Marlin zero points) filled from blocks of
// checkpoint weights. Blocks are given in the HF orientation of the rank's GEMM matrix ([n, k] per
// expert: n output features, k input features).
//
// BuildRankSpec refuses what §6 refuses (kInvalidArgument naming the values) and settings it does
// not cover (kUnimplemented). Thread-safety: pure function; the result is a plain value.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/config.h"
#include "common/tensor.h"
#include "tools/wsyncctl/reference/reference.h"

namespace wsync::tools::reference::internal {

// rows x cols of a checkpoint tensor (viewed as 2-D; a 1-D [n] as [n, 1]) copied to local expert
// `expert` (0 when the param has no expert dim) at (dst_row0, dst_col0) of the param's matrix.
struct Block {
  std::string hf;
  int64_t expert = 0;
  int64_t src_row0 = 0, src_col0 = 0, rows = 0, cols = 0;
  int64_t dst_row0 = 0, dst_col0 = 0;
};

struct PlainSpec {
  std::string name;
  DType dtype = DType::kBF16;
  Shape shape;          // [n], [n, k] or [experts, n, k]
  int64_t experts = 0;  // 0: no expert dim
  int64_t n = 0, k = 1;
  std::vector<Block> blocks;  // elements no block covers are zero (vocab padding)
};

// One INT4 GEMM weight of the rank (a dense linear, or the stacked w13 / w2 of the local experts).
struct Int4Spec {
  std::string linear;                               // for messages: "model.layers.0.self_attn.qkv_proj"
  std::string packed_name, scale_name, zeros_name;  // zeros_name only for AWQ
  bool awq = false;
  int trtllm = 0;  // TensorRT-LLM W4A16 instead of Marlin: 80 (sm80 layout), 90 (sm90 dense layout)
  DType scale_dtype = DType::kBF16;
  int64_t experts = 0;  // 0: dense [n, k]; else E_loc stacked
  int64_t n = 0, k = 0;
  int group = -1;             // G, -1 channelwise
  int64_t groups = 1;         // k / G, 1 channelwise
  bool grouped_perm = false;  // Marlin: the 64-column scale permutation (else the 32-column single one)
  std::vector<Block> blocks;
  DType packed_dtype() const { return trtllm ? DType::kI8 : DType::kI32; }
  Shape packed_shape() const;  // (E,) [k/16, 2n] int32 (Marlin); (E,) [k, n/2] int8 (TensorRT-LLM)
  Shape scale_shape() const;   // (E,) [groups, n], Marlin-permuted or (TensorRT-LLM) not
  Shape zeros_shape() const;   // (E,) [groups, n/8]
};

// How a checkpoint weight is quantized to FP8 (docs/spec/FP8.md §2-§3, §6): its codes are the
// tensor "<hf>#fp8" (F8_E4M3, the weight's shape) and its F32 scales "<hf>#scale" ([ceil(N/bn),
// ceil(K/bk)], or [N, 1] per channel when bn == 0), which the FP8 params' blocks read.
struct Fp8Source {
  int64_t bn = 0, bk = 0;
  bool ue8m0 = false;
};

// A tensor of the checkpoint the model consists of (every rank's, every expert's).
struct HfInfo {
  Shape shape;
  DType dtype = DType::kBF16;
  bool widen_ok = false;  // an F32 param: the checkpoint may hold it in the model's 16-bit dtype too
  bool required = true;   // false: accepted if present (a tied lm_head.weight), never read
};

struct RankSpec {
  std::vector<PlainSpec> plain;
  std::vector<Int4Spec> int4;
  std::map<std::string, Fp8Source> fp8;  // checkpoint weights quantized to FP8 (FP8 params are plain)
  std::vector<ExpectedParam> params;     // every param, in layout order
  std::map<std::string, HfInfo> hf;      // the checkpoint tensors of the model
  int64_t mtp_first = 0, mtp_end = 0;    // layers [mtp_first, mtp_end): DeepSeek MTP, not loaded
};

absl::StatusOr<RankSpec> BuildRankSpec(const ModelConfig& config, const QuantizationConfig* quant,
                                       const EngineRank& rank);

}  // namespace wsync::tools::reference::internal
