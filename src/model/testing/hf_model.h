// Test helper: a random HF checkpoint for a ModelConfig, as a weight sync sends it (HF names;
// INT4 linears as weight_packed int32 [N, K/8] + weight_scale [N, K/G] + weight_shape [2], or for
// an AWQ config qweight [K, N/8] + qzeros [K/G, N/8] + scales [K/G, N], AutoAWQ's fp16 arithmetic), plus
// the dense float32 value of every checkpoint tensor (dequantized for INT4) to check engine slices
// against. The names follow docs/spec/MEGATRON_TO_HF.md §5 and are written here independently of
// the engine layout, so that tests cross-check the layout's HF names.
// Which weights are INT4 follows slime (FORMATS.md §1.2): every `*.weight` of rank 2 that
// quantization_config.ignore does not match.
// Thread-safety: plain functions and values.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/config.h"
#include "common/tensor.h"
#include "kernels/int4.h"
#include "model/hf_tensor.h"

namespace wsync::model::testing {

// The unquantized HF checkpoint tensors of `config` in checkpoint order. `tied_lm_head`: also list
// lm_head.weight when embeddings are tied (what a PP>1 trainer sends). `mtp`: the MTP layers
// (model.layers.{num_hidden_layers + k}: enorm, hnorm, eh_proj, a decoder layer, shared_head.norm), quantized as the
// others but eh_proj.
std::vector<HfTensorSpec> HfCheckpointSpecs(const ModelConfig& config, bool tied_lm_head, bool mtp);

struct HfModelOptions {
  bool send_tied_lm_head = false;
  bool send_mtp = true;
  DType weight_shape_dtype = DType::kI64;  // compressed-tensors writes int64, slime int32
  kernels::QuantVariant variant = kernels::QuantVariant::kQat;
};

struct HfModel {
  std::vector<std::string> order;       // sent tensor names, in send order
  std::map<std::string, Tensor> sent;   // exactly what a sync delivers
  std::map<std::string, Tensor> dense;  // F32, by checkpoint name ("X.weight", norms, biases, ...)
  std::set<std::string> int4;           // checkpoint weight names sent as INT4
};

// Random values from std::mt19937(seed + tensor index): linear weights ~ N(0, 0.02) in bf16, norms
// 1 + N(0, 0.1), biases N(0, 0.02), e_score_correction_bias F32 N(0, 1).
absl::StatusOr<HfModel> MakeHfModel(const ModelConfig& config, const QuantizationConfig* quantization, uint32_t seed,
                                    const HfModelOptions& options = {});

// The next version of a sent model, as a delta sync sees it: each element of every sent tensor
// (bf16 value, packed INT4 word, scale) changed with probability p (one random byte of it flipped,
// std::mt19937_64(seed)); weight_shape tensors as they were. Only `order` and `sent` are filled.
HfModel ChangeElements(const HfModel& m, double p, uint32_t seed);

}  // namespace wsync::model::testing
