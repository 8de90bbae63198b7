// The reference engine's weights: ONE SGLang engine rank's parameters resolved by their engine
// names, checked, and held as the WeightRefs (weight_ops.h) the forward pass (model.h) reads.
//
// Resolution: every parameter is fetched by its engine name through a ParamLookup, in load order,
// and its dtype and shape are checked against the rank's geometry (docs/spec/ENGINE_LAYOUT.md
// §1-§5). A linear is INT4 iff `P.weight_packed` exists (Marlin, ENGINE_LAYOUT.md §4: int32
// [K_p/16, 2N_p] + bf16 `P.weight_scale` [K_p/G, N_p] permuted; MoE `w13_weight_packed`
// [E_loc, H/16, 4I'] etc.) or `P.qweight` exists (AWQ-Marlin, AWQ.md §3-4: the same Marlin words
// plus `P.qzeros` int32 [K_p/G, N_p/8] Marlin zero points and `P.scales`; MoE `w13_qweight`,
// `w13_qzeros`, `w13_scales`, both MoE scale permutations with size_k = I'), otherwise `P.weight`
// (bf16 or f32) is read; an int8 `P.weight` (MoE: `w3_w1_weight`, `w2_weight`) is TensorRT-LLM's
// W4A16 layout (TRTLLM_INT4.md), served from a float32 copy decoded at Prepare. INT4 values are
// value = bf16((u - 8) * scale) (FORMATS.md §2), AWQ bf16((u - z) * scale) (rounded to bf16 as
// the Marlin GEMM does). The group
// size G comes from config.quantization when present, else from the scales' shape (a single scale
// row is read as channelwise). README.md records the decisions.
//
// Serving (WeightMode, README.md "Weights in place"). By default (kInPlace) the forward pass reads
// the parameter memory where it is: bf16 / f32 matrices row by row, Marlin INT4 tile by tile
// through the Marlin layout (weight_ops.h), so Prepare() is a validation pass: names, dtypes,
// shapes, and every value finite once dequantized. It copies only 1-D params (norms, biases; to
// f32) and f16 or misaligned matrices, into buffers it reuses across Prepares. Every check runs
// before the first copy is written, on `prepare_threads` threads. kFloat32Copy, the unoptimised
// baseline, makes a fresh float32 copy of every weight per Prepare on one thread (dequantized
// through src/kernels MarlinToGptq + UnpermuteMarlinScales); it is kept for benchmarks and as the
// tests' reference, and its results are bit-identical to kInPlace.
//
// Ownership: RankWeights copies the config and geometry and stores the lookup, which must stay
// callable for its life. kInPlace: the memory behind the views the lookup returned at the last
// successful Prepare() is read through served(), so it must stay valid, and hold the prepared
// version, until the next successful Prepare() or the destruction (the engine's pause protocol:
// core.h). kFloat32Copy: views need only live during Prepare(). ServedWeights owns its float32
// copies; the kInPlace copies belong to the RankWeights and live until the next successful Prepare.
// Thread-safety: Prepare() must not run concurrently with anything else on the same RankWeights
// (the caller serializes); the const members and the ServedWeights they return may be read
// concurrently.
// Errors (Prepare): kNotFound naming a missing parameter; kInvalidArgument naming a parameter
// whose dtype / shape differs (with want and got), both forms of one linear, or an INT4 tensor
// where the engine keeps bf16; kDataLoss naming a parameter that holds NaN / Inf once dequantized
// (the first one in load order, whatever the thread count); kResourceExhausted if a copy cannot be
// allocated; lookup errors other than kNotFound, annotated. On error nothing changes: the previous
// version's references and copies stay (no copy is written before every check passed). kInPlace
// reads matrices in place, so the previous version then holds only as far as that memory still
// holds it: a caller that wrote over it must not serve until a Prepare succeeds (EngineCore turns
// UNHEALTHY). Every message starts with RankGeometry::Where().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "common/tensor.h"
#include "ref_engine/weight_ops.h"

namespace wsync::ref_engine {

// Fetches an engine parameter by name. kNotFound if the rank holds no such parameter.
using ParamLookup = std::function<absl::StatusOr<TensorView>(absl::string_view name)>;

// The sizes of one engine rank's share of the model (ENGINE_LAYOUT.md §1-§5), which the
// parameters' shapes are checked against and the forward pass computes with. EngineModel::Create
// derives and validates it; the fields are plain values.
struct RankGeometry {
  int64_t T = 1, r = 0, ep = 1, moe_tp = 1, ep_rank = 0, moe_tp_rank = 0;  // tp size / rank, EP, moe-TP
  int64_t H = 0, V = 0, Vp = 0, P = 0;                      // hidden, vocab, pad(V, 64), vocab rows per rank
  int64_t nh = 0, nkv = 0, hd = 0, nh_loc = 0, kv_loc = 0;  // heads, kv heads, head_dim, per rank
  int64_t F_loc = 0;                                        // dense intermediate size per rank
  int64_t E_routed = 0, E_total = 0, E_loc = 0, I_loc = 0, first_expert = 0, S_loc = 0;  // MoE
  int64_t q_lora = 0, kv_lora = 0, nope = 0, rope = 0, vd = 0, qd = 0, kvd = 0;          // MLA
  int group_size = 0;  // from config.quantization: G or -1; 0 = infer from the scales' shapes

  // "EngineModel (tp rank r/T)": the start of every error message about this rank.
  std::string Where() const;
};

// A prepared (dequantized) weight, in the shape of the bf16 engine parameter of the same name: a
// float32 copy of exactly the values the forward pass multiplies with.
struct PreparedWeight {
  Shape shape;
  std::vector<float> data;
};

enum class WeightMode {
  kInPlace,      // read the parameter memory in place; Prepare validates (the default)
  kFloat32Copy,  // a fresh float32 copy of every weight per Prepare, one thread (the baseline for benchmarks)
};

// What the last successful Prepare() did (kInPlace; kFloat32Copy counts its copies as copied and
// allocated).
struct PrepareStats {
  int64_t params = 0;           // weights served (under their bf16 engine names)
  int64_t bytes_in_place = 0;   // parameter bytes the forward pass reads where they are
  int64_t bytes_checked = 0;    // bytes scanned for NaN / Inf (Marlin: the scales)
  int64_t bytes_copied = 0;     // bytes written into the model's own buffers
  int64_t bytes_allocated = 0;  // of which newly allocated (0 when every buffer was reused)
  int threads = 1;
};

// One decoder layer's weights; a WeightRef that the model does not have is empty().
struct LayerWeights {
  WeightRef in_norm, post_norm;
  // GQA attention.
  WeightRef qkv, qkv_bias, o, o_bias, q_norm, k_norm;
  // MLA attention: qkv_a is fused_qkv_a_proj_with_mqa (q_lora set) or kv_a_proj_with_mqa;
  // q is q_b_proj (q_lora set) or q_proj.
  WeightRef qkv_a, q_a_norm, q, kv_a_norm, kv_b;
  // MLP.
  bool moe = false;
  WeightRef gate_up, down;                // dense
  WeightRef gate_up_bias, down_bias;      // dense, Llama mlp_bias: [2 F_loc], [H]
  WeightRef router, score_bias;           // MoE router [E, H], e_score_correction_bias [E]
  WeightRef w13, w2;                      // [E_loc * 2I', H], [E_loc * H, I']
  WeightRef shared_gate_up, shared_down;  // unfused shared experts
};

// One prepared version: references into the parameter memory (kInPlace) or into copies.
struct ServedWeights {
  WeightRef embed, lm_head, final_norm;
  std::vector<LayerWeights> layers;
  // Under the bf16 engine parameter names, in load order.
  std::vector<std::pair<std::string, const WeightRef*>> order;
  absl::flat_hash_map<std::string, const WeightRef*> index;
  std::vector<Buffer> fresh;  // kFloat32Copy: this version's float32 copies
};

class RankWeights {
 public:
  // Stores its arguments (`geometry` as EngineModel::Create validated it); reads no parameter.
  // prepare_threads: kInPlace Prepare's checks and copies; 0 = hardware_concurrency.
  RankWeights(ModelConfig config, RankGeometry geometry, ParamLookup lookup, WeightMode mode, int prepare_threads);
  RankWeights(RankWeights&&) noexcept;
  RankWeights& operator=(RankWeights&&) noexcept;
  ~RankWeights();

  // Resolves every parameter of the rank through the lookup and checks names, dtypes, shapes and
  // finiteness; then serves the new version (see the file comment, also for the errors).
  absl::Status Prepare();
  // The version the last successful Prepare() made; nullptr before the first.
  const ServedWeights* served() const;
  const PrepareStats& last_prepare() const;

  // The served weight behind engine parameter `name`, as a float32 copy shaped as its bf16 engine
  // parameter (INT4 dequantized). kFailedPrecondition before Prepare(); kNotFound for a name this
  // rank does not hold.
  absl::StatusOr<PreparedWeight> Weight(absl::string_view name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace wsync::ref_engine
