// The independent verifier of what one engine rank holds (issue #32, "proof, not claims"):
// engine memory decoded back to codes, scales and dense values, compared with the checkpoint
// quantized by a separate scalar reference, sharing no code with the sync path (the rollout
// agent's EngineLayout / Loader / Commit, src/kernels, src/model, the trainer agent). It uses
// src/common only (safetensors reader, config.json / quantization_config parsing, bf16 / fp16
// conversions) and re-derives every rule from the specs:
//   * which params a rank holds, their names, dtypes and shapes, and which block of which
//     checkpoint tensor fills each: docs/spec/ENGINE_LAYOUT.md §1-§5 (replicated, column / row
//     parallel, QKV by query groups with KV replication, gate_up, vocab padded to 64 and sliced,
//     fused MoE w13 / w2 with the EP rank r / (T/EP) and moe_tp rank r % (T/EP), tied embeddings,
//     DeepSeek-V3 MLA), with wsync's documented choices (src/engine_model/README.md
//     "Decisions": shared-experts fusion off, no placeholder params, o_proj.bias with
//     attention_bias, tied MoE models refused);
//   * plain params (bf16 / fp16 / fp32): the expected bytes, compared bit for bit;
//   * INT4 params (compressed-tensors -> Marlin, or with "engine_layout": "trtllm-sm80" / "-sm90"
//     -> TensorRT-LLM's preprocessed W4A16 bytes, MoE FC1 w3_w1 up_proj first; AWQ -> AWQ-Marlin
//     with zero points): the engine's words decoded (int4_scalar.h), compared code for code, scale for scale and zero
//     for zero with the checkpoint's bf16 weight quantized by int4_scalar.h, and reported with the dequantized float32
//     values of both sides (CT: (u - 8) * s, AWQ: (u - z) * s);
//   * FP8 params (quant_method fp8 block, compressed-tensors float per channel; docs/spec/FP8.md
//     §4, §6): the checkpoint's bf16 weight quantized by fp8_scalar.h (slime's scales, ue8m0 for
//     scale_fmt "ue8m0"), its codes and F32 scales cut as the rank holds them, compared bit for bit;
//   * the set: every expected param present, none unexpected, dtypes and shapes as specified.
//
// Usage:
//   ASSIGN_OR_RETURN(auto ref, Reference::Open("/ckpt/step-100", {.quantization_config_json = q}));
//   ASSIGN_OR_RETURN(RankReport report, ref.CheckRank({.tp_size = 2, .tp_rank = 1}, engine_params));
//   if (!report.ok()) std::puts(report.Summary().c_str());
//
// Errors: Open: kNotFound / kPermissionDenied for unreadable files, kInvalidArgument naming the file
// and tensor for a bad config.json, safetensors file, duplicate tensor or bad quantization config,
// kUnimplemented for quantization settings the reference does not cover. ExpectedParams /
// CheckRank: kInvalidArgument naming the values for a rank the spec refuses (§6: TP / EP
// divisibility, INT4 and Marlin constraints, mixed quantization of a fused layer), for a checkpoint
// tensor that is missing (kNotFound), mis-shaped, of the wrong dtype or unknown, and for malformed
// engine params (duplicate names, an unknown dtype, bytes that disagree with dtype and shape).
// Mismatches between engine and checkpoint are not errors: they are the report's content.
// Thread-safety: a Reference is immutable after Open; its const methods may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/tensor.h"
#include "tools/wsyncctl/reference/int4_scalar.h"

namespace wsync::tools::reference {

// One parameter as the engine reports it: SGLang name, safetensors dtype ("BF16", "F32", "I32"),
// shape, raw little-endian bytes.
struct EngineParam {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// One engine rank: TP size and rank, MoE expert parallelism inside the TP group (ENGINE_LAYOUT §1).
struct EngineRank {
  int tp_size = 1;
  int tp_rank = 0;
  int ep_size = 1;
  // It also holds the checkpoint's MTP layer as SGLang's NextN draft model (deepseek_nextn.py /
  // glm4_moe_nextn.py; engine_model README decision 20): model.layers.{L}.enorm / hnorm / eh_proj
  // (whole, bf16) / shared_head.norm and an MoE decoder layer L sharded as the others.
  bool mtp_draft = false;
};

struct ReferenceOptions {
  // The quantization_config the engines serve (the object, or a config.json holding one); empty: a
  // bf16 engine. compressed-tensors W4A16 -> Marlin, AWQ -> AWQ-Marlin.
  std::string quantization_config_json;
  SymmetricVariant variant = SymmetricVariant::kQat;  // compressed-tensors: the trainer's quantizer
  AwqArith awq_arith = AwqArith::kFp16;               // AWQ: the trainer's arithmetic
};

// A param the rank must hold: name, dtype, shape (the engine form).
struct ExpectedParam {
  std::string name;
  DType dtype = DType::kBF16;
  Shape shape;
  std::string what;  // "plain", "int4 weight", "int4 scales", "int4 zero points"
};

struct ParamResult {
  enum class Verdict { kOk, kMismatch, kMissing, kUnexpected };
  std::string name;
  Verdict verdict = Verdict::kOk;
  std::string detail;  // empty when OK; else what differs, with the first differing element
};
absl::string_view VerdictName(ParamResult::Verdict v);  // "ok", "MISMATCH", "MISSING", "UNEXPECTED"

struct RankReport {
  EngineRank rank;
  std::vector<ParamResult> params;  // the expected params in layout order, then unexpected ones
  size_t Count(ParamResult::Verdict v) const;
  bool ok() const;
  // One line per param that is not OK, and a total ("rank 1 of 2 (EP 1): 57 params, 2 not OK").
  std::string Summary() const;
  const ParamResult* Find(absl::string_view name) const;
};

class Reference {
 public:
  // Reads `hf_dir`/config.json and maps every *.safetensors file of `hf_dir`.
  static absl::StatusOr<Reference> Open(const std::string& hf_dir, const ReferenceOptions& options);

  // The params one rank must hold, in layout order (no checkpoint values are read).
  absl::StatusOr<std::vector<ExpectedParam>> ExpectedParams(const EngineRank& rank) const;

  // Checks every param of `params` (all of one rank's) against the checkpoint.
  absl::StatusOr<RankReport> CheckRank(const EngineRank& rank, const std::vector<EngineParam>& params) const;

  Reference(Reference&&) noexcept;
  Reference& operator=(Reference&&) noexcept;
  ~Reference();

 private:
  struct State;
  explicit Reference(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace wsync::tools::reference
