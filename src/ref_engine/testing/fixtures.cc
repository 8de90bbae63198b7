#include "ref_engine/testing/fixtures.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine_model/engine_layout.h"
#include "engine_model/engine_weights.h"
#include "engine_model/loader.h"
#include "engine_model/repack.h"
#include "kernels/awq.h"
#include "kernels/fp8.h"
#include "kernels/int4.h"

namespace wsync::ref_engine::testing {
namespace {

template <typename T>
T Must(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "ref_engine fixtures: %s: %s\n", what, v.status().ToString().c_str());
    std::abort();
  }
  return *std::move(v);
}

Tensor New(DType dt, Shape shape) { return Must(Tensor::Zeros(dt, std::move(shape)), "Tensor::Zeros"); }

Tensor Copy(const Tensor& t) { return Must(Tensor::CopyOf(t.view()), "Tensor::CopyOf"); }

int GroupOf(const ModelConfig& c) {
  if (!c.quantization) return -1;
  if (c.quantization->strategy == "channel" || c.quantization->group_size <= 0) return -1;
  return c.quantization->group_size;
}

// Stacks `extra` [n, k] as one more expert after the experts of `stacked` [E, n, k].
Tensor AppendExpert(const Tensor& stacked, const Tensor& extra) {
  Shape s = stacked.shape();
  s[0] += 1;
  Tensor out = New(stacked.dtype(), s);
  std::memcpy(out.mutable_view().bytes().data(), stacked.view().bytes().data(), stacked.nbytes());
  std::memcpy(out.mutable_view().bytes().data() + stacked.nbytes(), extra.view().bytes().data(), extra.nbytes());
  return out;
}

}  // namespace

ParamLookup TensorMap::Lookup() const {
  return [this](absl::string_view name) -> absl::StatusOr<TensorView> {
    auto it = map_.find(std::string(name));
    if (it == map_.end()) return absl::NotFoundError(absl::StrCat("no tensor ", name));
    return it->second.view();
  };
}

std::vector<std::pair<std::string, Shape>> HfTensorShapes(const ModelConfig& c) {
  std::vector<std::pair<std::string, Shape>> out;
  const int64_t H = c.hidden_size, V = c.vocab_size, nh = c.num_attention_heads;
  out.push_back({"model.embed_tokens.weight", {V, H}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {V, H}});
  out.push_back({"model.norm.weight", {H}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, "."), a = p + "self_attn.", m = p + "mlp.";
    out.push_back({p + "input_layernorm.weight", {H}});
    out.push_back({p + "post_attention_layernorm.weight", {H}});
    if (c.mla) {
      const MlaConfig& l = *c.mla;
      const int64_t qd = l.qk_nope_head_dim + l.qk_rope_head_dim;
      if (l.q_lora_rank > 0) {
        out.push_back({a + "q_a_proj.weight", {l.q_lora_rank, H}});
        out.push_back({a + "q_a_layernorm.weight", {l.q_lora_rank}});
        out.push_back({a + "q_b_proj.weight", {nh * qd, l.q_lora_rank}});
      } else {
        out.push_back({a + "q_proj.weight", {nh * qd, H}});
      }
      out.push_back({a + "kv_a_proj_with_mqa.weight", {l.kv_lora_rank + l.qk_rope_head_dim, H}});
      out.push_back({a + "kv_a_layernorm.weight", {l.kv_lora_rank}});
      out.push_back({a + "kv_b_proj.weight", {nh * (l.qk_nope_head_dim + l.v_head_dim), l.kv_lora_rank}});
      out.push_back({a + "o_proj.weight", {H, nh * l.v_head_dim}});
    } else {
      const int64_t nkv = c.num_key_value_heads, hd = c.head_dim;
      out.push_back({a + "q_proj.weight", {nh * hd, H}});
      out.push_back({a + "k_proj.weight", {nkv * hd, H}});
      out.push_back({a + "v_proj.weight", {nkv * hd, H}});
      out.push_back({a + "o_proj.weight", {H, nh * hd}});
      if (c.qkv_bias) {
        out.push_back({a + "q_proj.bias", {nh * hd}});
        out.push_back({a + "k_proj.bias", {nkv * hd}});
        out.push_back({a + "v_proj.bias", {nkv * hd}});
        if (c.o_proj_bias) out.push_back({a + "o_proj.bias", {H}});
      }
      if (c.qk_norm) {
        out.push_back({a + "q_norm.weight", {hd}});
        out.push_back({a + "k_norm.weight", {hd}});
      }
    }
    auto mlp = [&](const std::string& q, int64_t F) {
      out.push_back({q + "gate_proj.weight", {F, H}});
      out.push_back({q + "up_proj.weight", {F, H}});
      out.push_back({q + "down_proj.weight", {H, F}});
    };
    if (!c.IsMoeLayer(i)) {
      mlp(m, c.intermediate_size);
      if (c.mlp_bias) {
        out.push_back({m + "gate_proj.bias", {c.intermediate_size}});
        out.push_back({m + "up_proj.bias", {c.intermediate_size}});
        out.push_back({m + "down_proj.bias", {H}});
      }
      continue;
    }
    const MoeConfig& e = *c.moe;
    out.push_back({m + "gate.weight", {e.num_experts, H}});
    if (e.HasExpertBias()) out.push_back({m + "gate.e_score_correction_bias", {e.num_experts}});
    for (int64_t x = 0; x < e.num_experts; ++x) mlp(absl::StrCat(m, "experts.", x, "."), e.moe_intermediate_size);
    if (e.num_shared_experts > 0) mlp(m + "shared_experts.", e.num_shared_experts * e.moe_intermediate_size);
  }
  return out;
}

TensorMap RandomHfModel(const ModelConfig& c, uint64_t seed) {
  TensorMap out;
  std::mt19937_64 rng(seed);
  for (const auto& [name, shape] : HfTensorShapes(c)) {
    double mean = 0, stddev;
    DType dt = DType::kBF16;
    if (absl::EndsWith(name, "e_score_correction_bias")) {
      stddev = 0.05;
      dt = DType::kF32;
    } else if (absl::EndsWith(name, "norm.weight")) {
      mean = 1.0;
      stddev = 0.1;
    } else if (absl::EndsWith(name, ".bias")) {
      stddev = 0.1;
    } else if (absl::StrContains(name, "embed_tokens")) {
      // Tied: keep the embedding small so that the logits are not dominated by the last token's
      // own embedding (greedy decoding would just repeat it).
      stddev = c.tie_word_embeddings ? 1.0 / std::sqrt(static_cast<double>(shape[1])) : 1.0;
    } else {
      stddev = 1.0 / std::sqrt(static_cast<double>(shape[1]));
    }
    std::normal_distribution<double> dist(mean, stddev);
    Tensor t = New(dt, shape);
    const int64_t n = t.view().numel();
    for (int64_t i = 0; i < n; ++i) {
      const float v = static_cast<float>(dist(rng));
      if (dt == DType::kF32) {
        t.data_as<float>()[i] = v;
      } else {
        t.data_as<uint16_t>()[i] = F32ToBF16(v);
      }
    }
    out.Put(name, std::move(t));
  }
  return out;
}

absl::StatusOr<QuantizedHf> QuantizeHf(const ModelConfig& c, const TensorMap& hf) {
  if (!c.quantization) return absl::InvalidArgumentError("QuantizeHf: config has no quantization_config");
  const int G = GroupOf(c);
  QuantizedHf q;
  for (const auto& [name, t] : hf.all()) {
    const bool quantize = absl::EndsWith(name, ".weight") && t.shape().size() == 2 && !c.quantization->IsIgnored(name);
    if (!quantize) {
      q.sent.Put(name, Copy(t));
      q.dequantized.Put(name, Copy(t));
      continue;
    }
    const std::string prefix = name.substr(0, name.size() - 7);
    if (c.quantization->is_fp8()) {
      // FP8 (FP8.md §2.1 / §3.1, slime's variants): codes + F32 scales; the oracle gets
      // float(code) * scale (kernels::DequantizeFp8*, checked against torch in kernels/fp8_test.cc).
      const QuantizationConfig& fq = *c.quantization;
      kernels::KernelOptions ko;
      ko.num_threads = 1;
      Tensor codes = New(DType::kF8E4M3, t.shape()), deq = New(DType::kF32, t.shape());
      Tensor scales;
      if (fq.is_fp8_block()) {
        ASSIGN_OR_RETURN(const Shape sshape, kernels::Fp8BlockScaleShape(t.shape(), fq.block_n, fq.block_k));
        scales = New(DType::kF32, sshape);
        kernels::Fp8BlockOptions bo;
        bo.block_n = fq.block_n;
        bo.block_k = fq.block_k;
        bo.num_threads = 1;
        RETURN_IF_ERROR(kernels::QuantizeFp8Block(t.view(), codes.mutable_view(), scales.mutable_view(), bo));
        RETURN_IF_ERROR(
            kernels::DequantizeFp8Block(codes.view(), scales.view(), fq.block_n, fq.block_k, deq.mutable_view(), ko));
      } else {
        scales = New(DType::kF32, {t.shape()[0], 1});
        kernels::Fp8ChannelOptions co;
        co.num_threads = 1;
        RETURN_IF_ERROR(kernels::QuantizeFp8Channel(t.view(), codes.mutable_view(), scales.mutable_view(), co));
        RETURN_IF_ERROR(kernels::DequantizeFp8Channel(codes.view(), scales.view(), deq.mutable_view(), ko));
      }
      q.sent.Put(name, std::move(codes));
      q.sent.Put(prefix + (fq.is_fp8_block() ? ".weight_scale_inv" : ".weight_scale"), std::move(scales));
      q.dequantized.Put(name, std::move(deq));
      continue;
    }
    if (c.quantization->is_awq()) {
      kernels::AwqQuantizeOptions ao;
      ao.group_size = G;
      ao.num_threads = 1;
      ASSIGN_OR_RETURN(kernels::AwqShapes shapes, kernels::AwqShapesFor(t.view(), G));
      Tensor qweight = New(DType::kI32, shapes.qweight), qzeros = New(DType::kI32, shapes.qzeros),
             scales = New(t.dtype(), shapes.scales);
      RETURN_IF_ERROR(
          kernels::QuantizeAwq(t.view(), qweight.mutable_view(), qzeros.mutable_view(), scales.mutable_view(), ao));
      // Dequantize (AWQ.md §1-2): W[n, k] = (u - z) * scales[k / G, n], column n of a packed row in
      // word n / 8 at nibble (0, 4, 1, 5, 2, 6, 3, 7)[n % 8]; rounded to bf16.
      static constexpr int kNibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};
      const int64_t N = t.shape()[0], K = t.shape()[1], Gc = G == -1 ? K : G;
      auto code = [&](const Tensor& packed, int64_t row, int64_t n) {
        return static_cast<int>((packed.view().data_as<uint32_t>()[row * (N / 8) + n / 8] >> (4 * kNibble[n % 8])) &
                                0xFu);
      };
      Tensor deq = New(DType::kBF16, t.shape());
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          const float sc = BF16ToF32(scales.data_as<uint16_t>()[(k / Gc) * N + n]);
          deq.data_as<uint16_t>()[n * K + k] =
              F32ToBF16(static_cast<float>(code(qweight, k, n) - code(qzeros, k / Gc, n)) * sc);
        }
      q.sent.Put(prefix + ".qweight", std::move(qweight));
      q.sent.Put(prefix + ".qzeros", std::move(qzeros));
      q.sent.Put(prefix + ".scales", std::move(scales));
      q.dequantized.Put(name, std::move(deq));
      continue;
    }
    kernels::QuantizeOptions opts;
    opts.group_size = G;
    opts.format = kernels::PackFormat::kCompressedTensors;
    opts.num_threads = 1;
    ASSIGN_OR_RETURN(kernels::QuantizedShapes shapes, kernels::QuantizedShapesFor(t.view(), G, opts.format));
    Tensor packed = New(DType::kI32, shapes.packed), scales = New(t.dtype(), shapes.scales);
    RETURN_IF_ERROR(kernels::QuantizeInt4(t.view(), packed.mutable_view(), scales.mutable_view(), opts));
    // Dequantize (FORMATS.md §2): W[n, k] = (u - 8) * scale[n, k / G], rounded to bf16.
    const int64_t N = t.shape()[0], K = t.shape()[1], Gc = G == -1 ? K : G;
    Tensor deq = New(DType::kBF16, t.shape());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t word = packed.data_as<uint32_t>()[n * (K / 8) + k / 8];
        const int u = static_cast<int>((word >> (4 * (k % 8))) & 0xFu);
        const float s = BF16ToF32(scales.data_as<uint16_t>()[n * (K / Gc) + k / Gc]);
        deq.data_as<uint16_t>()[n * K + k] = F32ToBF16(static_cast<float>(u - 8) * s);
      }
    q.sent.Put(prefix + ".weight_packed", std::move(packed));
    q.sent.Put(prefix + ".weight_scale", std::move(scales));
    Tensor shape = New(DType::kI64, {2});
    shape.data_as<int64_t>()[0] = N;
    shape.data_as<int64_t>()[1] = K;
    q.sent.Put(prefix + ".weight_shape", std::move(shape));
    q.dequantized.Put(name, std::move(deq));
  }
  return q;
}

absl::StatusOr<TensorMap> EngineParamsForRank(const ModelConfig& c, const EngineRank& rank, const TensorMap& sent) {
  if (rank.fused_shared_experts && rank.ep_size != 1)
    return absl::InvalidArgumentError("EngineParamsForRank: the test's shared-experts fusion needs EP = 1");
  const QuantizationConfig* quant = c.quantization ? &*c.quantization : nullptr;
  ASSIGN_OR_RETURN(engine_model::EngineLayout layout,
                   engine_model::EngineLayout::Create(c, quant, {rank.tp_size, rank.tp_rank, rank.ep_size}));
  ASSIGN_OR_RETURN(std::unique_ptr<engine_model::Staging> staging, engine_model::Staging::Create(layout));
  engine_model::Loader loader(staging.get());
  for (const auto& [name, t] : sent.all()) RETURN_IF_ERROR(loader.Load(name, t.view()));
  RETURN_IF_ERROR(loader.CheckComplete());
  ASSIGN_OR_RETURN(std::unique_ptr<engine_model::OwnedEngineWeights> engine,
                   engine_model::OwnedEngineWeights::Allocate(layout));
  engine_model::RepackOptions ro;
  ro.num_threads = 1;
  ro.verify = true;
  RETURN_IF_ERROR(engine_model::Commit(*staging, engine->weights(), ro));
  TensorMap out;
  for (const engine_model::EngineBuffer& b : engine->weights().buffers()) {
    ASSIGN_OR_RETURN(MutableTensorView v, engine->weights().View(b.name));
    ASSIGN_OR_RETURN(Tensor t, Tensor::CopyOf(v));
    out.Put(b.name, std::move(t));
  }
  if (!rank.fused_shared_experts) return out;
  // SGLang's shared-experts fusion (ENGINE_LAYOUT.md §2.7), which the loader never produces: with
  // n_shared = 1 and EP = 1 the shared expert's TP slice (S/T = I/T rows) is exactly expert
  // n_routed's moe-TP slice, so the unfused gate_up [2I', H] / down [H, I'] become the last expert.
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (!c.IsMoeLayer(i)) continue;
    const std::string m = absl::StrCat("model.layers.", i, ".mlp.");
    if (!out.Has(m + "experts.w13_weight") || !out.Has(m + "shared_experts.gate_up_proj.weight"))
      return absl::InvalidArgumentError(
          absl::StrCat("EngineParamsForRank: fusion needs bf16 experts and shared experts in ", m));
    out.Put(m + "experts.w13_weight",
            AppendExpert(out.At(m + "experts.w13_weight"), out.At(m + "shared_experts.gate_up_proj.weight")));
    out.Put(m + "experts.w2_weight",
            AppendExpert(out.At(m + "experts.w2_weight"), out.At(m + "shared_experts.down_proj.weight")));
    out.Erase(m + "shared_experts.gate_up_proj.weight");
    out.Erase(m + "shared_experts.down_proj.weight");
  }
  return out;
}

void InProcessGroup::Barrier() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != gen; });
}

absl::Status InProcessGroup::AllReduce(int rank, absl::Span<float> data) {
  ptrs_[static_cast<size_t>(rank)] = data.data();
  sizes_[static_cast<size_t>(rank)] = data.size();
  Barrier();
  bool same = true;
  for (size_t s : sizes_) same = same && s == data.size();
  std::vector<float> sum;
  if (same) {
    sum.assign(ptrs_[0], ptrs_[0] + data.size());
    for (int r = 1; r < size_; ++r)
      for (size_t i = 0; i < data.size(); ++i) sum[i] += ptrs_[static_cast<size_t>(r)][i];
  }
  Barrier();
  if (!same) return absl::InvalidArgumentError("InProcessGroup: all_reduce sizes differ between ranks");
  std::copy(sum.begin(), sum.end(), data.begin());
  return absl::OkStatus();
}

absl::Status InProcessGroup::AllGather(int rank, absl::Span<const float> local, absl::Span<float> gathered) {
  ptrs_[static_cast<size_t>(rank)] = local.data();
  sizes_[static_cast<size_t>(rank)] = local.size();
  Barrier();
  bool same = gathered.size() == local.size() * static_cast<size_t>(size_);
  for (size_t s : sizes_) same = same && s == local.size();
  if (same)
    for (int r = 0; r < size_; ++r)
      std::copy_n(ptrs_[static_cast<size_t>(r)], local.size(),
                  gathered.begin() + static_cast<int64_t>(r * local.size()));
  Barrier();
  if (!same) return absl::InvalidArgumentError("InProcessGroup: all_gather sizes differ between ranks");
  return absl::OkStatus();
}

TpCollectives InProcessGroup::ForRank(int rank) {
  TpCollectives c;
  c.all_reduce_sum = [this, rank](absl::Span<float> d) { return AllReduce(rank, d); };
  c.all_gather = [this, rank](absl::Span<const float> l, absl::Span<float> g) { return AllGather(rank, l, g); };
  return c;
}

std::vector<absl::Status> RunRanks(int size, const std::function<absl::Status(int rank)>& fn) {
  std::vector<absl::Status> st(static_cast<size_t>(size));
  std::vector<std::thread> th;
  for (int r = 0; r < size; ++r) th.emplace_back([&, r] { st[static_cast<size_t>(r)] = fn(r); });
  for (std::thread& t : th) t.join();
  return st;
}

ModelConfig MustParseConfig(const std::string& json) { return Must(ParseModelConfig(json, "test config"), "config"); }

std::string FreshTempDir(const std::string& name) {
  struct Registry {
    std::mutex mu;
    std::vector<std::string> dirs;
    ~Registry() {
      std::error_code ec;
      for (const std::string& d : dirs) std::filesystem::remove_all(d, ec);
    }
  };
  static Registry registry;
  const std::string dir = (std::filesystem::temp_directory_path() / absl::StrCat(name, "-", getpid())).string();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directories(dir, ec);
  std::lock_guard<std::mutex> lock(registry.mu);
  registry.dirs.push_back(dir);
  return dir;
}

}  // namespace wsync::ref_engine::testing
