// Delta delivery across both sides, in one process: a stage source's BucketBuilder through a
// DeltaSink (trainer_agent/sync/delta_sink.h) into captured buckets, loaded by LoadBucket
// (rollout_agent/receive/stage_receiver.h) into the stagings of both engine ranks of a TP 2 INT4
// MoE engine. The expected staging is a fresh full load of the new version into a staging of its
// own (Loader::Load), never the delta path's output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/testing/capture_sink.h"
#include "common/checksum.h"
#include "common/config.h"
#include "common/status.h"
#include "engine_model/engine_layout.h"
#include "engine_model/loader.h"
#include "engine_model/staging.h"
#include "gmock/gmock.h"
#include "model/quant_target.h"
#include "model/testing/hf_model.h"
#include "model/testing/test_models.h"
#include "plan/delivery_plan.h"
#include "plan/sharded_sink.h"
#include "rollout_agent/receive/stage_receiver.h"
#include "trainer_agent/quantize/int4_quantizer.h"
#include "trainer_agent/sync/delta_sink.h"

namespace wsync {
namespace {

using engine_model::EngineLayout;
using engine_model::Loader;
using engine_model::Staging;
using model::testing::HfModel;
using ::testing::HasSubstr;

uint64_t Digest(const Staging& s) {
  Xxh3Stream h;
  for (size_t i = 0; i < s.layout().params().size(); ++i) h.Update(s.param(static_cast<int>(i)).bytes());
  return h.Digest();
}

// One engine rank: its layout, the staging the agent keeps across syncs, its loader.
struct Rank {
  std::unique_ptr<Staging> staging;
  std::unique_ptr<Loader> loader;
};

class DeltaSyncTest : public ::testing::Test {
 protected:
  using Buckets = std::vector<comm::testing::CaptureSink::Bucket>;

  void SetUp() override {
    auto c = ParseModelConfig(model::testing::kQwen3MoeJson, "test");
    ASSERT_TRUE(c.ok()) << c.status();
    config_ = *c;
    Serve(model::testing::QuantJson(32, {"lm_head", "re:.*mlp\\.gate$", "re:.*embed_tokens.*"}));
  }

  // The fixture's two engine ranks (TP 2) serving quantization_config `json`, with empty stagings.
  void Serve(const std::string& json) {
    auto q = ParseQuantizationConfig(json, "quant");
    ASSERT_TRUE(q.ok()) << q.status();
    quant_ = *q;
    layouts_.clear();
    ranks_.clear();
    for (int r = 0; r < 2; ++r) {
      auto l = EngineLayout::Create(config_, &quant_, {2, r, 1});
      ASSERT_TRUE(l.ok()) << l.status();
      layouts_.push_back(std::make_unique<EngineLayout>(std::move(*l)));
      auto s = Staging::Create(*layouts_.back());
      ASSERT_TRUE(s.ok()) << s.status();
      ranks_.push_back({std::move(*s), nullptr});
      ranks_.back().loader = std::make_unique<Loader>(ranks_.back().staging.get());
    }
  }

  std::vector<const EngineLayout*> Receivers() const { return {layouts_[0].get(), layouts_[1].get()}; }

  // The stage's buckets of `m` at `version`, through a DeltaSink on `base_version`.
  Buckets Send(const HfModel& m, uint64_t version, uint64_t base_version, trainer_agent::DeltaStats* stats = nullptr) {
    comm::testing::CaptureSink capture;
    trainer_agent::DeltaSink sink(capture, base_, Receivers(), base_version, version);
    comm::BucketBuilder builder(sink, {.bucket_bytes = 64 << 10, .version = version, .pp_stage = 0});
    for (const std::string& name : m.order) EXPECT_TRUE(builder.Add(name, m.sent.at(name).view()).ok()) << name;
    EXPECT_TRUE(builder.Finish().ok());
    EXPECT_EQ(capture.finishes, 1);
    if (stats != nullptr) *stats = sink.stats();
    return capture.buckets;
  }

  // Loads the captured buckets into every rank; the first error.
  absl::Status Receive(const Buckets& buckets, bool delta) {
    for (Rank& r : ranks_) {
      r.staging->ResetCoverage();
      if (delta) r.staging->MarkAllRestored();
      for (const auto& b : buckets) {
        EXPECT_TRUE(comm::ValidateManifest(b.manifest, b.data.size()).ok());
        auto buf = Buffer::Allocate(std::max<size_t>(b.data.size(), 1));
        if (!buf.ok()) return buf.status();
        std::memcpy(buf->data(), b.data.data(), b.data.size());
        if (absl::Status s = rollout_agent::LoadBucket(b.manifest, *buf, *r.loader, 2); !s.ok()) return s;
      }
      if (absl::Status s = r.loader->CheckComplete(); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Each rank's staging equals a fresh full load of `m`.
  void ExpectHolds(const HfModel& m, const std::string& what) {
    for (size_t r = 0; r < ranks_.size(); ++r) {
      auto fresh = Staging::Create(*layouts_[r]);
      ASSERT_TRUE(fresh.ok());
      Loader l(fresh->get());
      for (const std::string& name : m.order) ASSERT_TRUE(l.Load(name, m.sent.at(name).view()).ok()) << name;
      EXPECT_EQ(Digest(*ranks_[r].staging), Digest(**fresh)) << what << ": engine rank " << r;
    }
  }

  ModelConfig config_;
  QuantizationConfig quant_;
  std::vector<std::unique_ptr<EngineLayout>> layouts_;
  std::vector<Rank> ranks_;
  trainer_agent::DeltaBase base_;
};

TEST_F(DeltaSyncTest, DeltasOfConsecutiveVersionsLeaveEveryRankAsAFullLoadDoes) {
  constexpr uint32_t kSeed = 808;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  auto v1 = model::testing::MakeHfModel(config_, &quant_, kSeed);
  ASSERT_TRUE(v1.ok()) << v1.status();
  // Version 1, full (no base yet): every entry whole; the base is recorded.
  const Buckets full = Send(*v1, 1, 0);
  for (const auto& b : full) {
    EXPECT_EQ(b.manifest.base_version(), 0u);
    for (const auto& e : b.manifest.entries()) EXPECT_FALSE(e.has_delta()) << e.tensor().name();
  }
  ASSERT_TRUE(Receive(full, false).ok());
  ExpectHolds(*v1, "version 1");
  EXPECT_EQ(base_.version(), 1u);
  uint64_t full_bytes = 0;
  for (const auto& b : full) full_bytes += b.data.size();
  // Versions 2 and 3: 1 % and 30 % of the elements changed, each a delta on the one before.
  HfModel prev = model::testing::ChangeElements(*v1, 0, kSeed);
  for (auto [version, p] : {std::pair<uint64_t, double>{2, 0.01}, {3, 0.3}}) {
    const HfModel next = model::testing::ChangeElements(prev, p, kSeed + static_cast<uint32_t>(version));
    trainer_agent::DeltaStats stats;
    const Buckets delta = Send(next, version, version - 1, &stats);
    uint64_t sent = 0;
    for (const auto& b : delta) {
      sent += b.data.size();
      for (const auto& e : b.manifest.entries()) {
        const bool shape = e.tensor().name().ends_with("weight_shape");
        EXPECT_EQ(e.has_delta(), !shape) << e.tensor().name();
        if (e.has_delta()) {
          EXPECT_EQ(e.delta().sums_size(), 2);
        }
      }
    }
    EXPECT_GT(stats.delta_entries, 0u);
    EXPECT_LT(stats.sent_bytes, stats.tensor_bytes);
    const double fraction = static_cast<double>(stats.changed_items) / static_cast<double>(stats.items);
    EXPECT_NEAR(fraction, p, p / 4) << "version " << version;
    if (p < 0.1) {
      EXPECT_LT(sent * 10, full_bytes) << "version " << version << ": " << sent << " of " << full_bytes;
    }
    ASSERT_TRUE(Receive(delta, true).ok()) << "version " << version;
    ExpectHolds(next, absl::StrCat("version ", version));
    EXPECT_EQ(base_.version(), version);
    prev = model::testing::ChangeElements(next, 0, kSeed);
  }
}

// Sharded delivery: each receiver group's stream (the blocks its rank keeps) through a DeltaSink of
// its own, with a base per group; each rank loads only its group's buckets. The INT4 engines of the
// fixture (compressed-tensors, Marlin), then the same ranks serving AWQ (qweight / qzeros / scales,
// packed along N: the blocks cut for a TP rank are column blocks of them) and TensorRT-LLM's layout
// (int8 [K, N/2], preprocessed on the rollout side: sm80 interleaves columns, sm90's dense weights
// do not).
class ShardedDeltaSyncTest : public DeltaSyncTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(ShardedDeltaSyncTest, ShardedDeltasLeaveEveryRankAsAFullLoadDoes) {
  constexpr uint32_t kSeed = 909;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed, ", ", GetParam()));
  if (GetParam() == "awq") Serve(model::testing::AwqQuantJson(32, {}));
  if (GetParam().starts_with("trtllm")) {
    std::string json = model::testing::QuantJson(32, {"lm_head", "re:.*mlp\\.gate$", "re:.*embed_tokens.*"});
    json.insert(1, absl::StrCat(R"("engine_layout": ")", GetParam() == "trtllm_sm80" ? "trtllm-sm80" : "trtllm-sm90",
                                R"(", )"));
    Serve(json);
    ASSERT_EQ(layouts_[0]->int4_format(), engine_model::Int4Format::kTrtllm);
  }
  auto v1 = model::testing::MakeHfModel(config_, &quant_, kSeed);
  ASSERT_TRUE(v1.ok()) << v1.status();
  const engine_model::EngineParallel groups[2] = {layouts_[0]->parallel(), layouts_[1]->parallel()};
  auto plan = plan::ShardPlan::Create(config_, &quant_, groups);
  ASSERT_TRUE(plan.ok()) << plan.status();
  trainer_agent::DeltaBase bases[2];
  // One sync: every group's buckets, and what all the groups' DeltaSinks sent.
  auto send = [&](const HfModel& m, uint64_t version, uint64_t base_version, trainer_agent::DeltaStats* total) {
    std::vector<comm::testing::CaptureSink*> captures;
    std::vector<trainer_agent::DeltaSink*> deltas;
    std::vector<std::unique_ptr<comm::BucketSink>> sinks;
    for (int g = 0; g < 2; ++g) {
      auto capture = std::make_unique<comm::testing::CaptureSink>();
      captures.push_back(capture.get());
      auto d = std::make_unique<trainer_agent::DeltaSink>(std::move(capture), bases[g], std::vector{&plan->layout(g)},
                                                          base_version, version);
      deltas.push_back(d.get());
      sinks.push_back(std::move(d));
    }
    plan::ShardedSink sink(&*plan, std::move(sinks));
    comm::BucketBuilder builder(sink, {.bucket_bytes = 64 << 10, .version = version, .pp_stage = 0});
    for (const std::string& name : m.order) EXPECT_TRUE(builder.Add(name, m.sent.at(name).view()).ok()) << name;
    EXPECT_TRUE(builder.Finish().ok());
    std::vector<Buckets> out;
    *total = {};
    for (int g = 0; g < 2; ++g) {
      out.push_back(captures[static_cast<size_t>(g)]->buckets);
      const trainer_agent::DeltaStats& s = deltas[static_cast<size_t>(g)]->stats();
      total->delta_entries += s.delta_entries;
      total->sent_bytes += s.sent_bytes;
      total->tensor_bytes += s.tensor_bytes;
    }
    return out;
  };
  // Rank r loads group r's buckets.
  auto receive = [&](const std::vector<Buckets>& by_group, bool delta) {
    for (size_t r = 0; r < ranks_.size(); ++r) {
      ranks_[r].staging->ResetCoverage();
      if (delta) ranks_[r].staging->MarkAllRestored();
      for (const auto& b : by_group[r]) {
        EXPECT_TRUE(comm::ValidateManifest(b.manifest, b.data.size()).ok());
        auto buf = Buffer::Allocate(std::max<size_t>(b.data.size(), 1));
        if (!buf.ok()) return buf.status();
        std::memcpy(buf->data(), b.data.data(), b.data.size());
        RETURN_IF_ERROR(rollout_agent::LoadBucket(b.manifest, *buf, *ranks_[r].loader, 2));
      }
      RETURN_IF_ERROR(ranks_[r].loader->CheckComplete(/*loaded_only=*/delta));
    }
    return absl::OkStatus();
  };
  trainer_agent::DeltaStats st;
  ASSERT_TRUE(receive(send(*v1, 1, 0, &st), false).ok());
  ExpectHolds(*v1, "version 1 (sharded, full)");
  EXPECT_EQ(st.delta_entries, 0u);
  const uint64_t full_bytes = st.tensor_bytes;
  const HfModel v2 = model::testing::ChangeElements(*v1, 0.01, kSeed + 2);
  const std::vector<Buckets> delta = send(v2, 2, 1, &st);
  int block_deltas = 0;
  for (const Buckets& group : delta)
    for (const auto& b : group)
      for (const auto& e : b.manifest.entries()) block_deltas += e.has_block() && e.has_delta();
  EXPECT_GT(block_deltas, 0) << "the cut blocks go as deltas";
  EXPECT_LT(st.sent_bytes * 10, full_bytes) << st.sent_bytes << " of " << full_bytes;
  const absl::Status loaded = receive(delta, true);
  ASSERT_TRUE(loaded.ok()) << loaded;
  ExpectHolds(v2, "version 2 (sharded deltas)");
  EXPECT_EQ(bases[0].version(), 2u);
  EXPECT_EQ(bases[1].version(), 2u);
  // Broadcast deltas of version 3 to the same stagings (the fixture's DeltaSink and base).
  const Buckets whole = Send(v2, 2, 0);
  ASSERT_TRUE(Receive(whole, false).ok());
  const HfModel v3 = model::testing::ChangeElements(v2, 0.01, kSeed + 3);
  trainer_agent::DeltaStats bst;
  const Buckets bdelta = Send(v3, 3, 2, &bst);
  EXPECT_GT(bst.delta_entries, 0u);
  EXPECT_LT(bst.sent_bytes * 10, bst.tensor_bytes);
  const absl::Status bloaded = Receive(bdelta, true);
  ASSERT_TRUE(bloaded.ok()) << bloaded;
  ExpectHolds(v3, "version 3 (broadcast deltas)");
}

INSTANTIATE_TEST_SUITE_P(Formats, ShardedDeltaSyncTest,
                         ::testing::Values("compressed_tensors", "awq", "trtllm_sm80", "trtllm_sm90"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// A delta for a base the receivers do not hold (a sender that restarted, a damaged payload, a
// receiver whose staging is not the base) never becomes the new version.
TEST_F(DeltaSyncTest, WithoutTheRightBaseNothingIsTakenForTheNewVersion) {
  constexpr uint32_t kSeed = 909;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  auto v1 = model::testing::MakeHfModel(config_, &quant_, kSeed);
  ASSERT_TRUE(v1.ok());
  ASSERT_TRUE(Receive(Send(*v1, 1, 0), false).ok());
  const HfModel v2 = model::testing::ChangeElements(*v1, 0.02, kSeed + 2);
  // A sender whose base is not the one asked for sends every entry whole, and it loads.
  trainer_agent::DeltaBase held = std::move(base_);
  base_ = trainer_agent::DeltaBase();
  const Buckets whole = Send(v2, 2, 1);
  for (const auto& b : whole)
    for (const auto& e : b.manifest.entries()) EXPECT_FALSE(e.has_delta());
  // A damaged value inside a payload: the checksum of the result refuses it.
  base_ = std::move(held);
  const Buckets delta = Send(v2, 2, 1);
  Buckets damaged = delta;
  bool hit = false;
  for (auto& b : damaged) {
    for (const auto& e : b.manifest.entries()) {
      if (!hit && e.has_delta() && e.delta().changed_items() > 0 && e.delta().encoding() == 1) {
        b.data[e.offset() + e.nbytes() - 1] ^= std::byte{0x40};  // the last new value
        hit = true;
      }
    }
  }
  ASSERT_TRUE(hit);
  absl::Status s = Receive(damaged, true);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("is not the new version"));
  // A receiver whose staging is not the base (here: it holds version 2 already).
  ASSERT_TRUE(Receive(whole, true).ok());
  ExpectHolds(v2, "the whole entries of version 2");
  s = Receive(delta, true);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("does not hold the delta's base"));
  // A receiver layout the sender did not know (engine TP 1) is told so.
  auto solo = EngineLayout::Create(config_, &quant_, {1, 0, 1});
  ASSERT_TRUE(solo.ok());
  auto staging = Staging::Create(*solo);
  ASSERT_TRUE(staging.ok());
  Loader loader(staging->get());
  (*staging)->MarkAllRestored();
  const auto& b = delta.front();
  auto buf = Buffer::Allocate(std::max<size_t>(b.data.size(), 1));
  ASSERT_TRUE(buf.ok());
  std::memcpy(buf->data(), b.data.data(), b.data.size());
  s = rollout_agent::LoadBucket(b.manifest, *buf, loader, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("no checksums for engine rank 0 of TP 1"));
}

// What the sender cannot make a delta of goes whole: no receiver layout, a tensor a receiver's
// layout gives another shape; and a sync whose bucket failed to go names no base.
TEST_F(DeltaSyncTest, TheSenderSendsWholeWhatItCannotDeltaAndNamesNoBaseAfterAFailure) {
  constexpr uint32_t kSeed = 1010;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed));
  auto v1 = model::testing::MakeHfModel(config_, &quant_, kSeed);
  ASSERT_TRUE(v1.ok());
  const HfModel v2 = model::testing::ChangeElements(*v1, 0.02, kSeed + 2);
  // The data plane under the DeltaSink; it fails the first bucket when `fail_first` is set, and
  // takes the others (a caller that goes on to Finish after a failed bucket is then not stopped by it).
  struct FailFirstSink final : comm::testing::CaptureSink {
    bool fail_first = false;
    absl::Status Send(v1::BucketManifest m, Buffer data, uint64_t nbytes) override {
      if (std::exchange(fail_first, false)) return absl::UnavailableError("link down");
      return CaptureSink::Send(std::move(m), std::move(data), nbytes);
    }
  };
  auto send = [&](const HfModel& m, uint64_t version, uint64_t base_version, std::vector<const EngineLayout*> to,
                  bool fail_first = false) {
    FailFirstSink capture;
    capture.fail_first = fail_first;
    trainer_agent::DeltaSink sink(capture, base_, std::move(to), base_version, version);
    comm::BucketBuilder builder(sink, {.bucket_bytes = 64 << 10, .version = version, .pp_stage = 0});
    absl::Status s;
    for (const std::string& name : m.order) s.Update(builder.Add(name, m.sent.at(name).view()));
    s.Update(builder.Finish());  // even after a failure
    return std::pair{s, capture.buckets};
  };
  ASSERT_TRUE(send(*v1, 1, 0, Receivers()).first.ok());
  // No receiver layout: nothing to check a delta by, so everything whole (and the base kept).
  auto [ok, none] = send(v2, 2, 1, {});
  ASSERT_TRUE(ok.ok()) << ok;
  for (const auto& b : none)
    for (const auto& e : b.manifest.entries()) EXPECT_FALSE(e.has_delta()) << e.tensor().name();
  EXPECT_EQ(base_.version(), 2u);
  // A receiver whose layout is of another config (a vocabulary of 1024, not 1000: embed_tokens and
  // lm_head of another shape): what it describes otherwise goes whole, the rest as deltas.
  std::string other_json = model::testing::kQwen3MoeJson;
  const size_t at = other_json.find("\"vocab_size\": 1000");
  ASSERT_NE(at, std::string::npos);
  other_json.replace(at, 18, "\"vocab_size\": 1024");
  auto other_config = ParseModelConfig(other_json, "other");
  ASSERT_TRUE(other_config.ok()) << other_config.status();
  auto other = EngineLayout::Create(*other_config, &quant_, {2, 0, 1});
  ASSERT_TRUE(other.ok()) << other.status();
  const HfModel v3 = model::testing::ChangeElements(v2, 0.02, kSeed + 3);
  auto [ok3, mixed] = send(v3, 3, 2, {&*other});
  ASSERT_TRUE(ok3.ok()) << ok3;
  int whole = 0, deltas = 0;
  for (const auto& b : mixed) {
    for (const auto& e : b.manifest.entries()) {
      const int idx = other->FindSource(e.tensor().name());
      const Shape shape(e.tensor().shape().begin(), e.tensor().shape().end());
      if (idx >= 0 && other->sources()[static_cast<size_t>(idx)].shape != shape) {
        EXPECT_FALSE(e.has_delta()) << e.tensor().name();
        ++whole;
      }
      deltas += e.has_delta();
    }
  }
  EXPECT_GT(whole, 0);
  EXPECT_GT(deltas, 0);
  // The data plane fails the first bucket: the sync fails, and the base is named no version even
  // though the later buckets and Finish went through (the next sync, asked for a delta on 3, sends whole).
  auto [failed, lost] = send(v3, 4, 3, Receivers(), true);
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_EQ(base_.version(), 0u);
  auto [ok5, after] = send(v3, 5, 3, Receivers());
  ASSERT_TRUE(ok5.ok()) << ok5;
  for (const auto& b : after)
    for (const auto& e : b.manifest.entries()) EXPECT_FALSE(e.has_delta()) << e.tensor().name();
  EXPECT_EQ(base_.version(), 5u);
}

// `m` (bf16) with the lowest mantissa bit of about a fraction `p` of its elements flipped (a
// training step's change: an ulp, never Inf or NaN), std::mt19937(seed).
HfModel Nudged(const HfModel& m, double p, uint32_t seed) {
  HfModel n = model::testing::ChangeElements(m, 0, seed);
  std::mt19937 rng(seed);
  std::bernoulli_distribution flip(p);
  for (auto& [name, t] : n.sent) {
    if (t.dtype() != DType::kBF16) continue;
    auto* x = t.data_as<uint16_t>();
    for (size_t i = 0; i < t.nbytes() / 2; ++i)
      if (flip(rng)) x[i] ^= 1u;
  }
  return n;
}

// The stage source's quantizer with the delta base: a sync quantizes only the groups whose bf16
// inputs changed since the base's sync and copies the others from the base: INT4 groups of 32
// (compressed-tensors), AWQ's 8 rows' groups of 32 (one qzeros word), FP8 blocks of 32 x 32
// (DeepSeek-V3's form) and FP8 rows (compressed-tensors per channel). Expected: the groups counted unchanged by
// comparing the inputs' bits, and stagings equal to a full load of a plain quantization (no base) of the same version.
class QuantReuseTest : public DeltaSyncTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(QuantReuseTest, TheSenderQuantizesOnlyTheGroupsWhoseInputsChanged) {
  constexpr uint32_t kSeed = 1212;
  SCOPED_TRACE(absl::StrCat("seed ", kSeed, ", ", GetParam()));
  int64_t unit_rows = 1, unit_cols = 32;  // one group: rows x columns of an HF tensor (0: all columns)
  if (GetParam() == "fp8_block") {
    Serve(R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]})");
    unit_rows = 32;
  } else if (GetParam() == "awq") {  // a unit is one qzeros word: 8 rows' group
    Serve(model::testing::AwqQuantJson(32, {}));
    unit_rows = 8;
  } else if (GetParam() == "fp8_channel") {
    Serve(R"({"quant_method": "compressed-tensors", "format": "float-quantized",
              "ignore": ["lm_head", "re:.*mlp\\.gate$"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
              "strategy": "channel", "symmetric": true, "dynamic": false}}}})");
    unit_cols = 0;
  }
  auto bf16 = model::testing::MakeHfModel(config_, nullptr, kSeed);
  ASSERT_TRUE(bf16.ok());
  std::set<std::string> targets;  // the HF tensors the quantizer takes
  for (const auto& [name, t] : bf16->sent)
    if (model::IsQuantTarget(name, t.shape(), quant_)) targets.insert(name);
  ASSERT_FALSE(targets.empty());
  if (GetParam() == "int4") {
    auto q = model::testing::MakeHfModel(config_, &quant_, kSeed);
    ASSERT_TRUE(q.ok());
    ASSERT_EQ(targets, q->int4);
  }
  // One sync of the bf16 model `m`: the targets through the quantizer (with the base when
  // `reuse`, with `memo` when given), the rest as they are; into `sink` (a DeltaSink or a capture).
  auto send = [&](comm::BucketSink& sink, const HfModel& m, uint64_t version, bool reuse, bool finish = true,
                  trainer_agent::QuantMemo* memo = nullptr) {
    trainer_agent::Int4Quantizer quantizer(trainer_agent::Int4Options{.quant = &quant_, .num_threads = 2});
    if (reuse) quantizer.set_quantized_base(&base_);
    quantizer.set_quant_memo(memo);
    comm::BucketBuilder builder(sink, {.bucket_bytes = 64 << 10, .version = version, .pp_stage = 0});
    for (const std::string& name : m.order) {
      const TensorView w = m.sent.at(name).view();
      EXPECT_TRUE((targets.contains(name) ? quantizer.QuantizeInto(builder, name, w) : builder.Add(name, w)).ok())
          << name;
    }
    if (finish) {
      EXPECT_TRUE(builder.Finish().ok());
    }
    return quantizer.stats();
  };
  // The groups of the targets of `a` whose bf16 bits equal `b`'s, and all of them.
  auto same_groups = [&](const HfModel& a, const HfModel& b) {
    std::pair<uint64_t, uint64_t> n{0, 0};
    for (const std::string& name : targets) {
      const TensorView x = a.sent.at(name).view(), y = b.sent.at(name).view();
      const int64_t rows = x.dim(0), cols = x.dim(1), uc = unit_cols == 0 ? cols : unit_cols;
      const auto* xa = x.data_as<uint16_t>();
      const auto* ya = y.data_as<uint16_t>();
      for (int64_t r0 = 0; r0 < rows; r0 += unit_rows)
        for (int64_t c0 = 0; c0 < cols; c0 += uc, ++n.second) {
          bool same = true;
          for (int64_t r = r0; r < std::min(rows, r0 + unit_rows); ++r)
            same = same && std::memcmp(xa + r * cols + c0, ya + r * cols + c0,
                                       static_cast<size_t>(std::min(uc, cols - c0)) * 2) == 0;
          n.first += same;
        }
    }
    return n;
  };
  // Each rank's staging after `delta` equals a full load of `m` quantized without a base.
  auto expect_plain = [&](const HfModel& m, uint64_t version, const std::string& what) {
    comm::testing::CaptureSink plain;
    send(plain, m, version, false);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      auto fresh = Staging::Create(*layouts_[r]);
      ASSERT_TRUE(fresh.ok());
      Loader l(fresh->get());
      for (const auto& b : plain.buckets) {
        auto buf = Buffer::Allocate(std::max<size_t>(b.data.size(), 1));
        ASSERT_TRUE(buf.ok());
        std::memcpy(buf->data(), b.data.data(), b.data.size());
        ASSERT_TRUE(rollout_agent::LoadBucket(b.manifest, *buf, l, 2).ok());
      }
      EXPECT_EQ(Digest(*ranks_[r].staging), Digest(**fresh)) << what << ": engine rank " << r;
    }
  };
  comm::testing::CaptureSink c1;
  {
    trainer_agent::DeltaSink sink(c1, base_, Receivers(), 0, 1);
    const trainer_agent::Int4Stats st = send(sink, *bf16, 1, true);
    EXPECT_EQ(st.reused_groups, 0u);
    EXPECT_EQ(st.groups, same_groups(*bf16, *bf16).second);
  }
  ASSERT_TRUE(Receive(c1.buckets, false).ok());
  expect_plain(*bf16, 1, "version 1");
  // Version 2: a few of the bf16 elements changed (0.2 %; per row or block, rarer).
  const HfModel v2 = Nudged(*bf16, GetParam() == "int4" || GetParam() == "awq" ? 0.002 : 0.0002, kSeed + 2);
  const auto [same, groups] = same_groups(*bf16, v2);
  ASSERT_GT(same, groups / 4);
  ASSERT_LT(same, groups);
  comm::testing::CaptureSink c2;
  {
    trainer_agent::DeltaSink sink(c2, base_, Receivers(), 1, 2);
    const trainer_agent::Int4Stats st = send(sink, v2, 2, true);
    EXPECT_EQ(st.reused_groups, same);
    EXPECT_EQ(st.groups, groups);
  }
  ASSERT_TRUE(Receive(c2.buckets, true).ok());
  expect_plain(v2, 2, "version 2");
  // A sync that does not finish (its DeltaSink never sees Finish) keeps no digests: the next one
  // quantizes every group again, and still gives version 4's bytes.
  const HfModel v3 = Nudged(v2, 0.0002, kSeed + 3);
  {
    comm::testing::CaptureSink lost;
    trainer_agent::DeltaSink sink(lost, base_, Receivers(), 2, 3);
    send(sink, v3, 3, true, /*finish=*/false);
  }
  const HfModel v4 = Nudged(v3, 0.0002, kSeed + 4);
  comm::testing::CaptureSink c4;
  {
    trainer_agent::DeltaSink sink(c4, base_, Receivers(), 0, 4);
    EXPECT_EQ(send(sink, v4, 4, true).reused_groups, 0u);
  }
  ASSERT_TRUE(Receive(c4.buckets, false).ok());
  expect_plain(v4, 4, "version 4 after a lost sync");

  // Without a base (a sharded sync's stage source), a memo: the same groups reused, the bytes of a
  // plain quantization. With a base again, the memo's copies of the base's tensors go.
  trainer_agent::QuantMemo memo;
  comm::testing::CaptureSink m1, m2, p2;
  EXPECT_EQ(send(m1, *bf16, 1, false, true, &memo).reused_groups, 0u);
  const trainer_agent::Int4Stats st = send(m2, v2, 2, false, true, &memo);
  EXPECT_EQ(st.reused_groups, same);
  EXPECT_EQ(st.groups, groups);
  send(p2, v2, 2, false);
  ASSERT_EQ(m2.buckets.size(), p2.buckets.size());
  for (size_t b = 0; b < m2.buckets.size(); ++b) EXPECT_EQ(m2.buckets[b].data, p2.buckets[b].data) << "bucket " << b;
  EXPECT_GT(memo.bytes(), groups * 8);
  comm::testing::CaptureSink c5;
  {
    trainer_agent::DeltaSink sink(c5, base_, Receivers(), 4, 5);
    send(sink, v2, 5, true, true, &memo);
  }
  EXPECT_EQ(memo.bytes(), 0u);
  ASSERT_TRUE(Receive(c5.buckets, true).ok());
  expect_plain(v2, 5, "version 5");

  // With the base and the memo (a broadcast delta sync in the trainer agent), a tensor whose
  // comparison reused under a tenth of its units pauses its digests for 2 syncs (QuantMemo); the
  // base then keeps none of its digests, so a probe records before the next compares. Every
  // rank then holds what a plain quantization gives (the last sync copies every group).
  const auto other = model::testing::MakeHfModel(config_, nullptr, kSeed + 9);
  ASSERT_TRUE(other.ok());
  ASSERT_EQ(same_groups(v2, *other).first, 0u);
  uint64_t version = 5;
  const uint64_t all_groups = groups;  // a lambda cannot capture a structured binding (clang 14)
  auto next_sync = [&](const HfModel& m) {
    comm::testing::CaptureSink c;
    trainer_agent::DeltaSink sink(c, base_, Receivers(), version, version + 1);
    ++version;
    const trainer_agent::Int4Stats s = send(sink, m, version, true, true, &memo);
    EXPECT_EQ(s.groups, all_groups) << "version " << version;
    EXPECT_TRUE(Receive(c.buckets, true).ok()) << "version " << version;
    expect_plain(m, version, absl::StrCat("version ", version));
    return std::pair{s.reused_groups, s.undigested_groups};
  };
  using R = std::pair<uint64_t, uint64_t>;
  EXPECT_EQ(next_sync(*other), (R{0, 0}));  // nothing reused: a pause
  EXPECT_EQ(next_sync(*other), (R{0, groups}));
  EXPECT_EQ(next_sync(*other), (R{0, groups}));
  EXPECT_EQ(next_sync(*other), (R{0, 0}));       // the probe records
  EXPECT_EQ(next_sync(*other), (R{groups, 0}));  // and compares
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantReuseTest, ::testing::Values("int4", "awq", "fp8_block", "fp8_channel"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace wsync
