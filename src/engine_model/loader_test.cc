// Loader + Staging: name / dtype / shape / weight_shape checks, duplicates, coverage errors,
// accepted-and-skipped tensors, and concurrent loading. Seeds are fixed and printed on failure.
#include "engine_model/loader.h"

#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/config.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/checksum.h"
#include "kernels/delta.h"
#include "model/testing/hf_model.h"
#include "model/testing/test_models.h"

namespace wsync::engine_model {
namespace {

using model::testing::HfModel;
using model::testing::MakeHfModel;
using model::testing::QuantJson;
using ::testing::HasSubstr;

ModelConfig Config(const std::string& json) {
  auto c = ParseModelConfig(json, "test");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

QuantizationConfig Quant(int g, const std::vector<std::string>& ignore) {
  auto q = ParseQuantizationConfig(model::testing::QuantJson(g, ignore), "quant");
  EXPECT_TRUE(q.ok()) << q.status();
  return *q;
}

// The Qwen3-MoE tests' INT4 config: G 32, routers, embeddings and lm_head in bf16.
QuantizationConfig MoeQuant() { return Quant(32, {"lm_head", "re:.*mlp\\.gate$", "re:.*embed_tokens.*"}); }

uint64_t StagingChecksum(const Staging& s) {
  Xxh3Stream h;
  for (size_t i = 0; i < s.layout().params().size(); ++i) h.Update(s.param(static_cast<int>(i)).bytes());
  return h.Digest();
}

absl::Status LoadAll(Loader& loader, const model::testing::HfModel& m) {
  for (const std::string& name : m.order) RETURN_IF_ERROR(loader.Load(name, m.sent.at(name).view()));
  return absl::OkStatus();
}

TEST(LoaderTest, BadInputsAreRefusedAndWriteNothing) {
  constexpr uint32_t kSeed = 101;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  const ModelConfig c = Config(model::testing::kLlamaJson);
  const QuantizationConfig q = Quant(128, {"lm_head", "re:.*embed_tokens.*"});
  auto layout = EngineLayout::Create(c, &q, {2, 0, 1});
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto staging = Staging::Create(*layout);
  ASSERT_TRUE(staging.ok()) << staging.status();
  Loader loader(staging->get());
  auto m = model::testing::MakeHfModel(c, &q, kSeed);
  ASSERT_TRUE(m.ok()) << m.status();
  const uint64_t before = StagingChecksum(**staging);

  // An engine name is not a sent HF name.
  const TensorView qkv = m->sent.at("model.layers.0.self_attn.q_proj.weight_packed").view();
  absl::Status st = loader.Load("model.layers.0.self_attn.qkv_proj.weight_packed", qkv);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("unknown tensor model.layers.0.self_attn.qkv_proj.weight_packed"));
  // bf16 checkpoint name of an INT4 linear is unknown too.
  st = loader.Load("model.layers.0.self_attn.q_proj.weight", qkv);
  EXPECT_THAT(st.message(), HasSubstr("unknown tensor model.layers.0.self_attn.q_proj.weight"));
  // Wrong dtype.
  Tensor f32 = *Tensor::Zeros(DType::kF32, {256});
  st = loader.Load("model.layers.0.input_layernorm.weight", f32.view());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("model.layers.0.input_layernorm.weight: got F32[256], want BF16[256]"));
  // Wrong shape.
  Tensor bad = *Tensor::Zeros(DType::kI32, {512, 31});
  st = loader.Load("model.layers.0.self_attn.q_proj.weight_packed", bad.view());
  EXPECT_THAT(st.message(), HasSubstr("got I32[512, 31], want I32[512, 32]"));
  // A view whose byte size disagrees with its shape.
  const TensorView norm = m->sent.at("model.layers.0.input_layernorm.weight").view();
  st = loader.Load("model.layers.0.input_layernorm.weight",
                   TensorView(DType::kBF16, {256}, norm.bytes().first(norm.nbytes() - 2)));
  EXPECT_THAT(st.message(), HasSubstr("the view holds 510 bytes"));
  // weight_shape values must be the HF [N, K]; int64 and int32 are accepted.
  Tensor ws = *Tensor::Empty(DType::kI64, {2});
  ws.data_as<int64_t>()[0] = 512;
  ws.data_as<int64_t>()[1] = 255;
  st = loader.Load("model.layers.0.self_attn.q_proj.weight_shape", ws.view());
  EXPECT_THAT(st.message(),
              HasSubstr("model.layers.0.self_attn.q_proj.weight_shape holds [512, 255], want [512, 256]"));
  Tensor ws16 = *Tensor::Zeros(DType::kBF16, {2});
  st = loader.Load("model.layers.0.self_attn.q_proj.weight_shape", ws16.view());
  EXPECT_THAT(st.message(), HasSubstr("want I64[2] (or I32)"));
  EXPECT_EQ(StagingChecksum(**staging), before) << "a refused Load wrote to staging";
  EXPECT_EQ((*staging)->num_missing(), (*staging)->num_required());

  Tensor ws32 = *Tensor::Empty(DType::kI32, {2});
  ws32.data_as<int32_t>()[0] = 512;
  ws32.data_as<int32_t>()[1] = 256;
  EXPECT_TRUE(loader.Load("model.layers.0.self_attn.q_proj.weight_shape", ws32.view()).ok());
  // A duplicate piece in one sync is an error, and does not rewrite staging.
  ASSERT_TRUE(loader.Load("model.layers.0.self_attn.q_proj.weight_packed", qkv).ok());
  const uint64_t once = StagingChecksum(**staging);
  st = loader.Load("model.layers.0.self_attn.q_proj.weight_packed", qkv);
  EXPECT_EQ(st.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(st.message(), HasSubstr("model.layers.0.self_attn.q_proj.weight_packed was already loaded in this sync"));
  st = loader.Load("model.layers.0.self_attn.q_proj.weight_shape", ws32.view());
  EXPECT_EQ(st.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(StagingChecksum(**staging), once);
  // After ResetCoverage (a new sync) the piece loads again.
  (*staging)->ResetCoverage();
  EXPECT_TRUE(loader.Load("model.layers.0.self_attn.q_proj.weight_packed", qkv).ok());
}

TEST(LoaderTest, CheckCompleteNamesEveryMissingPiece) {
  constexpr uint32_t kSeed = 202;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  const ModelConfig c = Config(model::testing::kQwen3MoeJson);
  const QuantizationConfig q = Quant(128, {"lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*embed_tokens.*"});
  auto m = model::testing::MakeHfModel(c, &q, kSeed);
  ASSERT_TRUE(m.ok()) << m.status();
  // T = 4, EP = 2, rank 3: experts 4..7, moe_tp rank 1.
  auto layout = EngineLayout::Create(c, &q, {4, 3, 2});
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto staging = Staging::Create(*layout);
  ASSERT_TRUE(staging.ok());
  Loader loader(staging->get());
  const std::set<std::string> dropped = {
      "model.layers.0.mlp.experts.5.up_proj.weight_packed", "model.layers.2.mlp.experts.7.down_proj.weight_shape",
      "model.layers.1.mlp.down_proj.weight_scale", "model.layers.2.self_attn.k_norm.weight",
      // other EP rank's experts are not required
      "model.layers.0.mlp.experts.1.gate_proj.weight_packed"};
  for (const std::string& name : m->order) {
    if (dropped.contains(name)) continue;
    ASSERT_TRUE(loader.Load(name, m->sent.at(name).view()).ok()) << name;
  }
  const absl::Status st = loader.CheckComplete();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("engine rank 3: 4 of "));
  EXPECT_THAT(st.message(), HasSubstr("model.layers.0.mlp.experts.w13_weight_packed: expert 5 up_proj missing "
                                      "(model.layers.0.mlp.experts.5.up_proj.weight_packed)"));
  EXPECT_THAT(st.message(), HasSubstr("model.layers.2.mlp.experts.7.down_proj.weight_shape missing "
                                      "(weight_shape of expert 7 down_proj)"));
  EXPECT_THAT(st.message(), HasSubstr("model.layers.1.mlp.down_proj.weight_scale: down_proj missing "
                                      "(model.layers.1.mlp.down_proj.weight_scale)"));
  EXPECT_THAT(st.message(), HasSubstr("model.layers.2.self_attn.k_norm.weight: whole tensor missing "
                                      "(model.layers.2.self_attn.k_norm.weight)"));
  EXPECT_EQ((*staging)->MissingPieces().size(), 4u);
  EXPECT_EQ((*staging)->num_missing(), 4);
  for (const std::string& name : dropped) {
    if (name.find("experts.1.") != std::string::npos) continue;
    ASSERT_TRUE(loader.Load(name, m->sent.at(name).view()).ok()) << name;
  }
  {
    const absl::Status st_ = loader.CheckComplete();
    EXPECT_TRUE(st_.ok()) << st_;
  }
}

TEST(LoaderTest, CheckCompleteCapsTheMessage) {
  const ModelConfig c = Config(model::testing::kQwen3MoeJson);
  auto layout = EngineLayout::Create(c, nullptr, {1, 0, 1});
  ASSERT_TRUE(layout.ok());
  auto staging = Staging::Create(*layout);
  ASSERT_TRUE(staging.ok());
  const absl::Status st = (*staging)->CheckComplete();
  EXPECT_THAT(st.message(), HasSubstr(absl::StrCat("... and ", (*staging)->num_required() - 32, " more")));
  EXPECT_EQ(static_cast<int64_t>((*staging)->MissingPieces().size()), (*staging)->num_required());
}

TEST(LoaderTest, SkippedTensorsAreCheckedAndAccepted) {
  constexpr uint32_t kSeed = 303;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  // Qwen2 tied: a sent lm_head.weight is dropped (but its shape is checked).
  const ModelConfig c = Config(model::testing::kQwen2Json);
  model::testing::HfModelOptions o;
  o.send_tied_lm_head = true;
  auto m = model::testing::MakeHfModel(c, nullptr, kSeed, o);
  ASSERT_TRUE(m.ok());
  auto layout = EngineLayout::Create(c, nullptr, {2, 1, 1});
  ASSERT_TRUE(layout.ok());
  auto staging = Staging::Create(*layout);
  ASSERT_TRUE(staging.ok());
  Loader loader(staging->get());
  ASSERT_TRUE(LoadAll(loader, *m).ok());
  EXPECT_TRUE(loader.CheckComplete().ok());
  Tensor wrong = *Tensor::Zeros(DType::kBF16, {999, 256});
  EXPECT_THAT(loader.Load("lm_head.weight", wrong.view()).message(), HasSubstr("want BF16[1000, 256]"));
  // Loading a skipped tensor twice is harmless (nothing is stored).
  EXPECT_TRUE(loader.Load("lm_head.weight", m->sent.at("lm_head.weight").view()).ok());

  // DeepSeek MTP layers: accepted unchecked and not stored.
  const ModelConfig d = Config(model::testing::kDeepseekJson);
  auto dm = model::testing::MakeHfModel(d, nullptr, kSeed + 1);
  ASSERT_TRUE(dm.ok());
  auto dl = EngineLayout::Create(d, nullptr, {2, 0, 2});
  ASSERT_TRUE(dl.ok()) << dl.status();
  auto ds = Staging::Create(*dl);
  ASSERT_TRUE(ds.ok());
  Loader dloader(ds->get());
  ASSERT_TRUE(dm->sent.contains("model.layers.3.eh_proj.weight"));
  {
    const absl::Status st_ = LoadAll(dloader, *dm);
    EXPECT_TRUE(st_.ok()) << st_;
  }
  {
    const absl::Status st_ = dloader.CheckComplete();
    EXPECT_TRUE(st_.ok()) << st_;
  }
  EXPECT_THAT(
      dloader.Load("model.layers.4.eh_proj.weight", dm->sent.at("model.layers.3.eh_proj.weight").view()).message(),
      HasSubstr("unknown tensor model.layers.4.eh_proj.weight"));
  // Other EP rank's experts: shape still checked.
  Tensor e = *Tensor::Zeros(DType::kBF16, {256, 255});
  EXPECT_THAT(dloader.Load("model.layers.1.mlp.experts.7.gate_proj.weight", e.view()).message(),
              HasSubstr("want BF16[256, 256]"));
}

TEST(LoaderTest, VocabRankWithoutRowsAndZeroPadding) {
  constexpr uint32_t kSeed = 404;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  std::string json = model::testing::kLlamaJson;
  json.replace(json.find(R"("vocab_size": 1000)"), 18, R"("vocab_size": 65)");
  const ModelConfig c = Config(json);
  auto m = model::testing::MakeHfModel(c, nullptr, kSeed);
  ASSERT_TRUE(m.ok());
  // pad(65, 64) = 128, P = 32: rank 2 holds row 64 and 31 zero rows, rank 3 only zeros.
  for (int r = 0; r < 4; ++r) {
    auto layout = EngineLayout::Create(c, nullptr, {4, r, 1});
    ASSERT_TRUE(layout.ok());
    auto staging = Staging::Create(*layout);
    ASSERT_TRUE(staging.ok());
    Loader loader(staging->get());
    ASSERT_TRUE(LoadAll(loader, *m).ok());
    {
      const absl::Status st_ = loader.CheckComplete();
      ASSERT_TRUE(st_.ok()) << st_;
    }
    const auto& src = layout->sources()[static_cast<size_t>(layout->FindSource("model.embed_tokens.weight"))];
    EXPECT_EQ(src.action, r == 3 ? HfSource::Action::kSkip : HfSource::Action::kCopy);
    for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"}) {
      const MutableTensorView v = *(*staging)->Find(name);
      ASSERT_EQ(v.shape(), (Shape{32, 256}));
      const auto* got = v.data_as<uint16_t>();
      const auto* full = m->sent.at(name).view().data_as<uint16_t>();
      for (int64_t row = 0; row < 32; ++row) {
        const int64_t hf_row = 32 * r + row;
        for (int64_t col = 0; col < 256; ++col) {
          const uint16_t want = hf_row < 65 ? full[hf_row * 256 + col] : 0;
          ASSERT_EQ(got[row * 256 + col], want) << name << " rank " << r << " row " << row;
        }
      }
    }
  }
}

TEST(LoaderTest, ConcurrentLoadsEqualSequentialLoads) {
  constexpr uint32_t kSeed = 505;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  const ModelConfig c = Config(model::testing::kQwen3MoeJson);
  const QuantizationConfig q = MoeQuant();
  auto m = model::testing::MakeHfModel(c, &q, kSeed);
  ASSERT_TRUE(m.ok());
  auto layout = EngineLayout::Create(c, &q, {2, 1, 1});
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto seq = Staging::Create(*layout);
  auto par = Staging::Create(*layout);
  ASSERT_TRUE(seq.ok() && par.ok());
  Loader ls(seq->get()), lp(par->get());
  ASSERT_TRUE(LoadAll(ls, *m).ok());
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  constexpr int kThreads = 4;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = static_cast<size_t>(t); i < m->order.size(); i += kThreads)
        if (!lp.Load(m->order[i], m->sent.at(m->order[i]).view()).ok()) failures++;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(lp.CheckComplete().ok());
  EXPECT_EQ(StagingChecksum(**seq), StagingChecksum(**par));
  // All threads racing on the same piece: exactly one wins.
  (*par)->ResetCoverage();
  std::atomic<int> ok{0}, dup{0};
  threads.clear();
  const std::string name = "model.layers.0.mlp.experts.3.up_proj.weight_packed";
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      const absl::Status st = lp.Load(name, m->sent.at(name).view());
      (st.ok() ? ok : dup)++;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), 1);
  EXPECT_EQ(dup.load(), kThreads - 1);
}

// The dense bytes of the block [row0, +rows) x [col0, +cols) of a sent tensor's matrix view, cut
// from the sent bytes (not read back from any staging).
std::vector<uint8_t> KeptBytes(const TensorView& t, const KeptBlock& k) {
  const MatrixDims d = MatrixOf(t.shape());
  const size_t item = ItemSize(t.dtype());
  std::vector<uint8_t> out;
  const auto* p = reinterpret_cast<const uint8_t*>(t.bytes().data());
  for (int64_t r = k.row0; r < k.row0 + k.rows; ++r)
    out.insert(out.end(), p + (r * d.cols + k.col0) * static_cast<int64_t>(item),
               p + (r * d.cols + k.col0 + k.cols) * static_cast<int64_t>(item));
  return out;
}

uint64_t Sum(const std::vector<uint8_t>& b) { return kernels::Sum64Host(std::as_bytes(std::span(b))); }

// One sent tensor's delta from `base` to `next` as the sender makes it for this rank: of the whole
// tensor (broadcast), or with `block` of the block this rank keeps (sharded delivery).
struct SentDelta {
  Loader::DeltaRef ref;
  std::vector<uint8_t> payload;
};
SentDelta MakeDelta(const EngineLayout& layout, const std::string& name, const Tensor& base, const Tensor& next,
                    bool block = false) {
  const int idx = layout.FindSource(name);
  const KeptBlock k = idx >= 0 ? KeptBlockOf(layout.sources()[static_cast<size_t>(idx)]) : KeptBlock{};
  const std::vector<uint8_t> b = KeptBytes(base.view(), k), x = KeptBytes(next.view(), k);
  const auto whole = [](const Tensor& t) {
    return std::span(reinterpret_cast<const uint8_t*>(t.view().bytes().data()), t.nbytes());
  };
  const std::span<const uint8_t> from = block ? std::span<const uint8_t>(b) : whole(base);
  const std::span<const uint8_t> to = block ? std::span<const uint8_t>(x) : whole(next);
  SentDelta d;
  auto plan = kernels::PlanDelta(from, to, static_cast<uint32_t>(ItemSize(next.dtype())));
  EXPECT_TRUE(plan.ok()) << name << ": " << plan.status();
  d.payload.resize(plan->payload_bytes);
  EXPECT_TRUE(kernels::WriteDelta(*plan, from, to, d.payload).ok()) << name;
  d.ref.encoding = plan->encoding;
  d.ref.base_sum = Sum(b);
  d.ref.sum = Sum(x);
  if (block) d.ref.block = Loader::BlockRef{k.row0, k.rows, k.col0, k.cols};
  return d;
}

// Two stagings of `layout`: one loaded with `next` in full, and one that holds `base` as a staging
// does when the next sync begins (every piece restored, none claimed yet).
struct Stagings {
  std::unique_ptr<Staging> full, delta;
};
Stagings FullAndBase(const EngineLayout& layout, const HfModel& base, const HfModel& next) {
  auto full = Staging::Create(layout);
  auto delta = Staging::Create(layout);
  EXPECT_TRUE(full.ok() && delta.ok());
  if (!full.ok() || !delta.ok()) return {};
  Loader lf(full->get()), ld(delta->get());
  EXPECT_TRUE(LoadAll(lf, next).ok());
  EXPECT_TRUE(LoadAll(ld, base).ok());
  (*delta)->ResetCoverage();
  (*delta)->MarkAllRestored();
  return {std::move(*full), std::move(*delta)};
}

// A delta sync into a staging that holds the base (every tensor sent as its delta, an unchanged one
// as an empty delta) leaves it as a full load of the new version does, every piece loaded; a piece
// whose delta did not come counts as missing in a delta sync: an INT4 MoE engine (its
// experts transposed into the GPTQ orientation) and a bf16 one with replicated KV heads, at
// several engine ranks, sparse and dense changes.
TEST(LoaderTest, ADeltaOntoItsBaseEqualsAFullLoadOfTheNewVersion) {
  constexpr uint32_t kSeed = 606;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  const ModelConfig moe = Config(model::testing::kQwen3MoeJson);
  const ModelConfig llama = Config(model::testing::kLlamaJson);
  const QuantizationConfig q = MoeQuant();
  struct Case {
    const ModelConfig* config;
    const QuantizationConfig* quant;
    EngineParallel parallel;
  };
  for (const Case& c : {Case{&moe, &q, {2, 1, 1}}, Case{&moe, &q, {2, 0, 2}}, Case{&llama, nullptr, {4, 3, 1}}}) {
    auto m = model::testing::MakeHfModel(*c.config, c.quant, kSeed);
    ASSERT_TRUE(m.ok()) << m.status();
    auto layout = EngineLayout::Create(*c.config, c.quant, c.parallel);
    ASSERT_TRUE(layout.ok()) << layout.status();
    for (double p : {0.01, 0.5}) {
      SCOPED_TRACE(absl::StrCat("tp rank ", c.parallel.tp_rank, " of ", c.parallel.tp_size, ", ep ", c.parallel.ep_size,
                                ", p ", p));
      const HfModel next = model::testing::ChangeElements(*m, p, kSeed + 1);
      const Stagings st = FullAndBase(*layout, *m, next);
      ASSERT_TRUE(st.full && st.delta);
      Loader ld(st.delta.get());
      int changed = 0;
      for (const std::string& name : m->order) {
        const Tensor& b = m->sent.at(name);
        const Tensor& n = next.sent.at(name);
        if (absl::EndsWith(name, ".weight_shape")) {  // sent whole
          ASSERT_TRUE(ld.Load(name, n.view()).ok()) << name;
          continue;
        }
        changed += std::memcmp(b.view().bytes().data(), n.view().bytes().data(), b.nbytes()) != 0;
        const SentDelta d = MakeDelta(*layout, name, b, n);
        const absl::Status st = ld.LoadDelta(name, n.dtype(), n.shape(), d.ref, d.payload);
        ASSERT_TRUE(st.ok()) << name << ": " << st;
        if (name == m->order.front()) {
          EXPECT_TRUE(ld.CheckComplete().ok());
          EXPECT_FALSE(ld.CheckComplete(/*loaded_only=*/true).ok()) << "only one delta came yet";
        }
      }
      EXPECT_GT(changed, 10);
      EXPECT_TRUE(ld.CheckComplete(/*loaded_only=*/true).ok()) << ld.CheckComplete(true);
      EXPECT_EQ(StagingChecksum(*st.delta), StagingChecksum(*st.full));
    }
  }
}

// Sharded delivery: a rank's group is sent the block it keeps, and a delta of that block (its
// elements only). Onto the base it gives what a full load of the new version gives; a block that
// does not hold what this rank keeps is refused, nothing claimed.
TEST(LoaderTest, ADeltaOfTheKeptBlockEqualsAFullLoadOfTheNewVersion) {
  constexpr uint32_t kSeed = 616;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  const ModelConfig moe = Config(model::testing::kQwen3MoeJson);
  const QuantizationConfig q = MoeQuant();
  auto m = model::testing::MakeHfModel(moe, &q, kSeed);
  ASSERT_TRUE(m.ok()) << m.status();
  auto layout = EngineLayout::Create(moe, &q, {2, 1, 1});
  ASSERT_TRUE(layout.ok()) << layout.status();
  const HfModel next = model::testing::ChangeElements(*m, 0.02, kSeed + 1);
  const Stagings sg = FullAndBase(*layout, *m, next);
  ASSERT_TRUE(sg.full && sg.delta);
  Loader ld(sg.delta.get());
  int blocks = 0;
  for (const std::string& name : m->order) {
    const Tensor& n = next.sent.at(name);
    const int idx = layout->FindSource(name);
    if (absl::EndsWith(name, ".weight_shape") || idx < 0 ||
        KeptBlockOf(layout->sources()[static_cast<size_t>(idx)]).empty()) {  // whole, or nothing kept
      ASSERT_TRUE(ld.Load(name, n.view()).ok()) << name;
      continue;
    }
    const SentDelta d = MakeDelta(*layout, name, m->sent.at(name), n, /*block=*/true);
    if (blocks++ == 0) {  // a block one row short of what the rank keeps: refused, the piece unclaimed
      Loader::DeltaRef short_ref = d.ref;
      short_ref.block->rows -= 1;
      const absl::Status st = ld.LoadDelta(name, n.dtype(), n.shape(), short_ref, d.payload);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_THAT(st.message(), HasSubstr("and this rank keeps rows"));
    }
    const absl::Status st = ld.LoadDelta(name, n.dtype(), n.shape(), d.ref, d.payload);
    ASSERT_TRUE(st.ok()) << name << ": " << st;
  }
  EXPECT_GT(blocks, 10);
  EXPECT_TRUE(ld.CheckComplete(/*loaded_only=*/true).ok()) << ld.CheckComplete(true);
  EXPECT_EQ(StagingChecksum(*sg.delta), StagingChecksum(*sg.full));
}

// Delta after delta, as consecutive delta syncs load them: the first checks each piece's base by
// reading its block back, later ones by the sum the staging recorded (Staging::known_sum), and each
// version equals a full load of it. A piece loaded whole in between (its bytes no longer those of
// the recorded sum) is read back again: without that, its next delta would be refused as not on
// its base. After ForgetSums, a staging byte changed behind the loader's back is caught.
TEST(LoaderTest, DeltasInARowCheckTheirBaseByTheRecordedSumAndEqualFullLoads) {
  constexpr uint32_t kSeed = 626;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  const ModelConfig moe = Config(model::testing::kQwen3MoeJson);
  const ModelConfig llama = Config(model::testing::kLlamaJson);
  const QuantizationConfig q = MoeQuant();
  for (auto [config, quant, parallel] :
       {std::tuple{&moe, &q, EngineParallel{2, 1, 1}},
        std::tuple{&llama, static_cast<const QuantizationConfig*>(nullptr), EngineParallel{4, 3, 1}}}) {
    auto v0 = model::testing::MakeHfModel(*config, quant, kSeed);
    ASSERT_TRUE(v0.ok()) << v0.status();
    auto layout = EngineLayout::Create(*config, quant, parallel);
    ASSERT_TRUE(layout.ok()) << layout.status();
    std::vector<HfModel> versions;
    versions.push_back(std::move(*v0));
    for (uint32_t k = 1; k <= 3; ++k)
      versions.push_back(model::testing::ChangeElements(versions.back(), 0.01, kSeed + k));
    auto staging = Staging::Create(*layout);
    ASSERT_TRUE(staging.ok());
    Loader ld(staging->get());
    ASSERT_TRUE(LoadAll(ld, versions[0]).ok());
    // The piece loaded whole in version 2's sync: an expert's packed weight (kept transposed) or a projection.
    const std::string whole = config == &moe ? "model.layers.0.mlp.experts.1.down_proj.weight_packed"
                                             : "model.layers.0.self_attn.o_proj.weight";
    const int whole_idx = layout->FindSource(whole);
    ASSERT_GE(whole_idx, 0);
    for (size_t v = 1; v < versions.size(); ++v) {
      SCOPED_TRACE(absl::StrCat(ArchitectureName(config->arch), " version ", v));
      (*staging)->MarkAllRestored();  // a delta sync begins (sums kept)
      for (const std::string& name : versions[v].order) {
        const Tensor& b = versions[v - 1].sent.at(name);
        const Tensor& n = versions[v].sent.at(name);
        const int idx = layout->FindSource(name);
        if (absl::EndsWith(name, ".weight_shape") || (v == 2 && name == whole)) {
          ASSERT_TRUE(ld.Load(name, n.view()).ok()) << name;
          if (idx >= 0) {
            EXPECT_FALSE((*staging)->known_sum(idx).has_value()) << name << ": loaded whole";
          }
          continue;
        }
        const SentDelta d = MakeDelta(*layout, name, b, n);
        const absl::Status st = ld.LoadDelta(name, n.dtype(), n.shape(), d.ref, d.payload);
        ASSERT_TRUE(st.ok()) << name << ": " << st;
        if (idx < 0 || KeptBlockOf(layout->sources()[static_cast<size_t>(idx)]).empty()) continue;
        ASSERT_EQ((*staging)->known_sum(idx), std::optional<uint64_t>(d.ref.sum)) << name;
      }
      EXPECT_TRUE(ld.CheckComplete(/*loaded_only=*/true).ok()) << ld.CheckComplete(true);
      auto full = Staging::Create(*layout);
      ASSERT_TRUE(full.ok());
      Loader lf(full->get());
      ASSERT_TRUE(LoadAll(lf, versions[v]).ok());
      ASSERT_EQ(StagingChecksum(**staging), StagingChecksum(**full));
    }
    // A byte of a piece changed behind the loader's back, then the sums forgotten: the next delta
    // of that piece reads its block back and is refused.
    (*staging)->MarkAllRestored();
    const HfModel v4 = model::testing::ChangeElements(versions.back(), 0.01, kSeed + 9);
    const HfSource& src = layout->sources()[static_cast<size_t>(whole_idx)];
    const EngineParam& param = layout->params()[static_cast<size_t>(src.param)];
    const MatrixDims pd = MatrixOf(param.loaded_shape);
    const int64_t item = static_cast<int64_t>(ItemSize(param.dtype));
    (*staging)
        ->param(src.param)
        .bytes()[(src.expert * pd.rows * pd.cols + src.dst_row0 * pd.cols + src.dst_col0) * item] ^= std::byte{1};
    (*staging)->ForgetSums();
    const SentDelta d = MakeDelta(*layout, whole, versions.back().sent.at(whole), v4.sent.at(whole));
    const Tensor& n = v4.sent.at(whole);
    const absl::Status st = ld.LoadDelta(whole, n.dtype(), n.shape(), d.ref, d.payload);
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
    EXPECT_THAT(st.message(), HasSubstr("does not hold the delta's base"));
    (*staging)->ResetCoverage();
    for (size_t i = 0; i < layout->sources().size(); ++i)
      EXPECT_FALSE((*staging)->known_sum(static_cast<int>(i)).has_value()) << "ResetCoverage keeps a sum";
  }
}

// A byte of the staging damaged where no delta writes (here: deltas of no change at all) is trusted
// by the recorded sum for at most recheck_every() deltas of its piece: the block is read back at
// exactly the delta the staggered count says (every - source % every after the first, which
// recorded the sum), and that delta is refused, and so is the next (its recorded sum is now the
// damaged block's).
TEST(LoaderTest, ABaseDamagedWhereNoDeltaWritesIsFoundWithinTheRecheckPeriod) {
  constexpr uint32_t kSeed = 636;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  const ModelConfig c = Config(model::testing::kQwen3MoeJson);
  const QuantizationConfig q = MoeQuant();
  auto m = model::testing::MakeHfModel(c, &q, kSeed);
  ASSERT_TRUE(m.ok());
  auto layout = EngineLayout::Create(c, &q, {2, 1, 1});
  ASSERT_TRUE(layout.ok());
  const std::string name = "model.layers.0.mlp.experts.3.up_proj.weight_packed";
  const int idx = layout->FindSource(name);
  ASSERT_GE(idx, 0);
  const Tensor& t = m->sent.at(name);
  const SentDelta same = MakeDelta(*layout, name, t, t);  // no item changed: an empty delta
  for (int every : {1, 3, 16}) {
    SCOPED_TRACE(absl::StrCat("recheck every ", every));
    auto staging = Staging::Create(*layout);
    ASSERT_TRUE(staging.ok());
    (*staging)->set_recheck_every(every);
    Loader ld(staging->get());
    ASSERT_TRUE(LoadAll(ld, *m).ok());
    (*staging)->MarkAllRestored();
    ASSERT_TRUE(ld.LoadDelta(name, t.dtype(), t.shape(), same.ref, same.payload).ok());  // records the sum
    ASSERT_TRUE((*staging)->known_sum(idx).has_value());
    const HfSource& src = layout->sources()[static_cast<size_t>(idx)];
    const EngineParam& param = layout->params()[static_cast<size_t>(src.param)];
    const MatrixDims pd = MatrixOf(param.loaded_shape);
    (*staging)->param(src.param).bytes()[(src.expert * pd.rows * pd.cols + src.dst_row0 * pd.cols + src.dst_col0) *
                                         static_cast<int64_t>(ItemSize(param.dtype))] ^= std::byte{0x40};
    int refused_at = 0;
    for (int sync = 1; sync <= every && refused_at == 0; ++sync) {
      (*staging)->MarkAllRestored();
      const absl::Status st = ld.LoadDelta(name, t.dtype(), t.shape(), same.ref, same.payload);
      if (st.ok()) continue;
      EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
      EXPECT_THAT(st.message(), HasSubstr("does not hold the delta's base"));
      refused_at = sync;
    }
    EXPECT_EQ(refused_at, every - idx % every) << "source " << idx;
    (*staging)->MarkAllRestored();
    EXPECT_EQ(ld.LoadDelta(name, t.dtype(), t.shape(), same.ref, same.payload).code(), absl::StatusCode::kDataLoss);
  }
}

// A delta that is not for what the staging holds, or that does not give the new version, is refused
// and the staging keeps its base: a wrong base, a damaged value, no base at all, a weight_shape, a
// second delta of one tensor.
TEST(LoaderTest, ADeltaNotOnItsBaseOrNotGivingTheNewVersionChangesNothing) {
  constexpr uint32_t kSeed = 707;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  const ModelConfig c = Config(model::testing::kQwen3MoeJson);
  const QuantizationConfig q = MoeQuant();
  auto m = model::testing::MakeHfModel(c, &q, kSeed);
  ASSERT_TRUE(m.ok());
  auto layout = EngineLayout::Create(c, &q, {2, 1, 1});
  ASSERT_TRUE(layout.ok());
  auto staging = Staging::Create(*layout);
  ASSERT_TRUE(staging.ok());
  Loader loader(staging->get());
  ASSERT_TRUE(LoadAll(loader, *m).ok());
  (*staging)->ResetCoverage();
  (*staging)->MarkAllRestored();
  const uint64_t before = StagingChecksum(**staging);
  const HfModel next = model::testing::ChangeElements(*m, 0.05, kSeed + 1);
  const HfModel other = model::testing::ChangeElements(*m, 0.05, kSeed + 2);
  const std::string name = "model.layers.0.mlp.experts.3.up_proj.weight_packed";
  const Tensor& n = next.sent.at(name);
  const SentDelta good = MakeDelta(*layout, name, m->sent.at(name), n);
  // Built on another base: the staging's block is not it.
  const SentDelta wrong_base = MakeDelta(*layout, name, other.sent.at(name), n);
  absl::Status st = loader.LoadDelta(name, n.dtype(), n.shape(), wrong_base.ref, wrong_base.payload);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(st.message(), HasSubstr("does not hold the delta's base"));
  // A damaged value: well-formed, and the result is not the new version.
  SentDelta damaged = good;
  damaged.payload.back() ^= 0x10;
  st = loader.LoadDelta(name, n.dtype(), n.shape(), damaged.ref, damaged.payload);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(st.message(), HasSubstr("is not the new version"));
  // A malformed payload.
  st = loader.LoadDelta(name, n.dtype(), n.shape(), good.ref, std::span(good.payload).first(good.payload.size() - 1));
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  // A weight_shape, and a tensor of another shape.
  const std::string shape_name = "model.layers.0.mlp.experts.3.up_proj.weight_shape";
  const Tensor& ws = m->sent.at(shape_name);
  EXPECT_EQ(loader.LoadDelta(shape_name, ws.dtype(), ws.shape(), good.ref, good.payload).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(loader.LoadDelta(name, n.dtype(), ws.shape(), good.ref, good.payload).code(),
            absl::StatusCode::kInvalidArgument);
  // An empty delta (no item changed) whose new version's sum is not the base's.
  SentDelta empty = MakeDelta(*layout, name, m->sent.at(name), m->sent.at(name));
  ASSERT_EQ(empty.payload.size(), 8u);
  empty.ref.sum ^= 1;
  st = loader.LoadDelta(name, n.dtype(), n.shape(), empty.ref, empty.payload);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(st.message(), HasSubstr("an empty delta"));
  EXPECT_EQ(StagingChecksum(**staging), before) << "a refused delta changed the staging";
  // The piece still holds its base: the right delta applies, once.
  ASSERT_TRUE(loader.LoadDelta(name, n.dtype(), n.shape(), good.ref, good.payload).ok());
  EXPECT_NE(StagingChecksum(**staging), before);
  EXPECT_EQ(loader.LoadDelta(name, n.dtype(), n.shape(), good.ref, good.payload).code(),
            absl::StatusCode::kAlreadyExists);
  // A new sync whose pieces are not restored: no base.
  (*staging)->ResetCoverage();
  st = loader.LoadDelta(name, n.dtype(), n.shape(), good.ref, good.payload);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(st.message(), HasSubstr("holds no base"));
}

}  // namespace
}  // namespace wsync::engine_model
