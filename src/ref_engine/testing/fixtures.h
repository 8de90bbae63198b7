// Test-only helpers for the reference-engine tests: random HF checkpoints for a ModelConfig,
// compressed-tensors INT4 quantization of them (src/kernels QuantizeInt4), engine-rank parameters
// produced by the real rollout loader (engine_model EngineLayout + Loader, repack Commit into
// Marlin), and an in-process TP group (threads + barrier) that provides TpCollectives.
//
// Thread-safety: TensorMap is not synchronized (build it, then share it read-only);
// InProcessGroup's collectives are meant to be called by its `size` rank threads concurrently.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/config.h"
#include "common/tensor.h"
#include "ref_engine/model.h"

namespace wsync::ref_engine::testing {

// An owning name -> tensor map.
class TensorMap {
 public:
  void Put(const std::string& name, Tensor t) { map_[name] = std::move(t); }
  bool Has(const std::string& name) const { return map_.count(name) != 0; }
  const Tensor& At(const std::string& name) const { return map_.at(name); }
  Tensor& Mutable(const std::string& name) { return map_.at(name); }
  void Erase(const std::string& name) { map_.erase(name); }
  const std::map<std::string, Tensor>& all() const { return map_; }
  // A ParamLookup over this map (kNotFound for absent names). The map must outlive it.
  ParamLookup Lookup() const;

 private:
  std::map<std::string, Tensor> map_;
};

// Names and shapes of the HF tensors of `config` (Llama/Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V3).
std::vector<std::pair<std::string, Shape>> HfTensorShapes(const ModelConfig& config);

// Random HF checkpoint, bf16 (e_score_correction_bias f32): linears and lm_head N(0, 1/K),
// embeddings N(0, 1) (N(0, 1/H) when tied), norm weights N(1, 0.1^2), biases N(0, 0.1^2), score bias N(0, 0.05^2).
TensorMap RandomHfModel(const ModelConfig& config, uint64_t seed);

// INT4 per config.quantization: every 2-D `*.weight` not ignored becomes compressed-tensors
// `P.weight_packed` [N, K/8] + `P.weight_scale` [N, K/G] + `P.weight_shape` I64 [N, K] in `sent`
// (what slime sends), or for an AWQ config `P.qweight` [K, N/8] + `P.qzeros` [K/G, N/8] +
// `P.scales` [K/G, N]; `dequantized` holds the HF checkpoint with those weights replaced by
// bf16((u - 8) * scale), AWQ bf16((u - z) * scale) (for the oracle).
struct QuantizedHf {
  TensorMap sent;
  TensorMap dequantized;
};
absl::StatusOr<QuantizedHf> QuantizeHf(const ModelConfig& config, const TensorMap& hf);

// Engine parameters of one rank (bf16 tensors and Marlin INT4) from sent HF tensors, through the
// rollout agent's own path: EngineLayout::Create(config, config.quantization, rank), Loader::Load of
// every sent tensor, CheckComplete, Commit (verify on) into OwnedEngineWeights, copied out by name.
// With rank.fused_shared_experts (EP = 1, bf16) the unfused shared experts are then moved into
// expert n_routed of w13/w2, the layout SGLang's shared-experts fusion gives (the loader never
// fuses). Errors from the loader / repack are passed through.
absl::StatusOr<TensorMap> EngineParamsForRank(const ModelConfig& config, const EngineRank& rank, const TensorMap& sent);

// T ranks' collectives in one process. Sums are taken in rank order, so every rank gets the same bits.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size)
      : size_(size), ptrs_(static_cast<size_t>(size)), sizes_(static_cast<size_t>(size)) {}
  TpCollectives ForRank(int rank);

 private:
  void Barrier();
  absl::Status AllReduce(int rank, absl::Span<float> data);
  absl::Status AllGather(int rank, absl::Span<const float> local, absl::Span<float> gathered);

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<const float*> ptrs_;
  std::vector<size_t> sizes_;
};

// Runs fn(rank) on `size` threads and returns the statuses in rank order.
std::vector<absl::Status> RunRanks(int size, const std::function<absl::Status(int rank)>& fn);

// A fresh empty directory "<temp_directory_path>/<name>-<pid>" ($TMPDIR or /tmp), removed with its
// contents when the test process exits normally.
std::string FreshTempDir(const std::string& name);

// Parses a config.json text; aborts the test binary on error (test inputs are fixed).
ModelConfig MustParseConfig(const std::string& json);

}  // namespace wsync::ref_engine::testing
