// The dir: weight source: a sharded directory opens, validates and verifies bit-exactly against
// its HF checkpoint; malformed directories are refused with errors naming the file and tensor;
// a replaced rank file is seen by the next OpenRank while older views stay valid.
#include "trainer_agent/source/dir_source.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tools/synth/testing/world.h"

namespace wsync::trainer_agent {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

constexpr uint64_t kSeed = 20261121;

class DirSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/dir_source_" + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    auto m = tools::testing::SmallModel(tools::testing::SmallOptions(Architecture::kDeepseekV3), kSeed);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
    // TP 2, PP 2, EP 2, ETP 1, DP 2: 8 ranks, experts split over the TP group.
    auto stats = tools::WriteMegatronSource(model_.config_json, model_.config, model_.weights,
                                            tools::testing::Parallel(2, 2, 2, 1, 2), dir_);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->files_built, 4);
    EXPECT_EQ(stats->files_copied, 4);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void WriteText(const std::string& name, const std::string& text) {
    std::ofstream(dir_ + "/" + name, std::ios::trunc) << text;
  }
  std::string ReadText(const std::string& name) {
    std::ifstream in(dir_ + "/" + name);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  std::string dir_;
  tools::SyntheticModel model_;
};

TEST_F(DirSourceTest, OpensValidatesAndVerifiesBitExact) {
  auto src = DirSource::Open(dir_);
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_EQ(src->layout().world_size(), 8);
  EXPECT_EQ(src->parallel().padded_vocab_size, 1024);
  for (int r = 0; r < 8; ++r) {
    auto shard = src->OpenRank(r);
    ASSERT_TRUE(shard.ok()) << shard.status();
    ASSERT_EQ(shard->tensors.size(), shard->params.size());
    for (size_t i = 0; i < shard->params.size(); ++i) {
      EXPECT_EQ(shard->tensors[i].shape(), shard->params[i].local_shape);
      EXPECT_EQ(shard->tensors[i].dtype(), shard->params[i].dtype);
    }
  }
  auto report = tools::VerifyDirSource(*src, model_.weights);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->hf_bytes, model_.weights.TotalBytes());
  EXPECT_THAT(src->OpenRank(8).status().message(), HasSubstr("rank 8 is outside the world of 8 ranks"));
}

TEST_F(DirSourceTest, MissingRankFile) {
  fs::remove(dir_ + "/rank-00005.safetensors");
  auto src = DirSource::Open(dir_);
  ASSERT_TRUE(src.ok());
  auto shard = src->OpenRank(5);
  EXPECT_EQ(shard.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(shard.status().message(), HasSubstr("rank-00005.safetensors of rank 5 is missing"));
  EXPECT_TRUE(src->OpenRank(4).ok());
  EXPECT_EQ(tools::VerifyDirSource(*src, model_.weights).status().code(), absl::StatusCode::kNotFound);
}

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Rewrites rank 0's file with `edit` applied to its (name, tensor) list.
void RewriteRank0(const std::string& dir, const std::function<void(NamedTensors*)>& edit) {
  auto f = SafetensorsFile::Open(dir + "/rank-00000.safetensors");
  ASSERT_TRUE(f.ok());
  NamedTensors tensors;
  for (const auto& e : f->tensors()) tensors.emplace_back(e.name, *Tensor::CopyOf(e.view));
  edit(&tensors);
  SafetensorsWriter w;
  for (auto& [name, t] : tensors) ASSERT_TRUE(w.Add(name, t.view()).ok());
  ASSERT_TRUE(w.Write(dir + "/rank-00000.safetensors").ok());
}

TEST_F(DirSourceTest, WrongShapeUnknownAndMissingNames) {
  auto src = DirSource::Open(dir_);
  ASSERT_TRUE(src.ok());
  RewriteRank0(dir_, [](NamedTensors* t) {
    for (auto& [name, tensor] : *t)
      if (name == "decoder.layers.0.self_attention.linear_kv_down_proj.weight")
        tensor = *Tensor::Zeros(DType::kBF16, Shape{41, 64});
  });
  auto shard = src->OpenRank(0);
  ASSERT_FALSE(shard.ok());
  EXPECT_THAT(shard.status().message(), HasSubstr("rank-00000.safetensors: 1 parameter(s) with a wrong dtype or shape: "
                                                  "decoder.layers.0.self_attention.linear_kv_down_proj.weight: "
                                                  "expected BF16[40, 64], found BF16[41, 64]"));

  RewriteRank0(dir_, [](NamedTensors* t) {
    for (auto& [name, tensor] : *t)
      if (name == "decoder.layers.0.self_attention.linear_kv_down_proj.weight") {
        tensor = *Tensor::Zeros(DType::kBF16, Shape{40, 64});
        name = "decoder.layers.0.self_attention.linear_kv_down.weight";
      }
    t->emplace_back("decoder.layers.9.mlp.router.weight", *Tensor::Zeros(DType::kBF16, Shape{8, 64}));
  });
  shard = src->OpenRank(0);
  ASSERT_FALSE(shard.ok());
  EXPECT_THAT(
      shard.status().message(),
      HasSubstr("1 missing parameter(s): decoder.layers.0.self_attention.linear_kv_down_proj.weight (BF16[40, 64])"));
  EXPECT_THAT(shard.status().message(), HasSubstr("2 unknown parameter(s) (not held by this rank): "));
  EXPECT_THAT(shard.status().message(), HasSubstr("decoder.layers.9.mlp.router.weight"));

  RewriteRank0(dir_, [](NamedTensors* t) {
    for (auto& [name, tensor] : *t)
      if (name == "decoder.layers.1.mlp.router.expert_bias") tensor = *Tensor::Zeros(DType::kBF16, Shape{8});
  });
  shard = src->OpenRank(0);
  EXPECT_THAT(shard.status().message(),
              HasSubstr("decoder.layers.1.mlp.router.expert_bias: expected F32[8], found BF16[8]"));
}

TEST_F(DirSourceTest, TruncatedFile) {
  const std::string path = dir_ + "/rank-00002.safetensors";
  fs::resize_file(path, fs::file_size(path) - 100);
  auto src = DirSource::Open(dir_);
  ASSERT_TRUE(src.ok());
  auto shard = src->OpenRank(2);
  EXPECT_EQ(shard.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shard.status().message(), HasSubstr("rank-00002.safetensors"));
}

TEST_F(DirSourceTest, MismatchedParallelJsonAndConfig) {
  const std::string good = ReadText("parallel.json");
  WriteText("parallel.json", absl::StrReplaceAll(good, {{"\"world_size\": 8", "\"world_size\": 6"}}));
  EXPECT_THAT(DirSource::Open(dir_).status().message(), HasSubstr("world_size=6 != tp*cp*pp*dp = 2*1*2*2"));
  WriteText("parallel.json", absl::StrReplaceAll(good, {{"\"ep\": 2", "\"ep\": 3"}}));
  auto st = DirSource::Open(dir_).status();
  EXPECT_THAT(st.message(), HasSubstr("parallel.json: ep=3 does not divide number of routed experts=8"));
  WriteText(
      "parallel.json",
      absl::StrReplaceAll(good, {{"\"layers_per_stage\": [\n    2,\n    2\n  ]", "\"layers_per_stage\": [3, 2]"}}));
  EXPECT_THAT(DirSource::Open(dir_).status().message(), HasSubstr("sums to 5 but the model has num_hidden_layers=4"));
  WriteText("parallel.json",
            absl::StrReplaceAll(good, {{"\"padded_vocab_size\": 1024", "\"padded_vocab_size\": 1536"}}));
  // Valid on its own, but the files hold 512-row embedding shards: refused when the rank opens.
  auto src = DirSource::Open(dir_);
  ASSERT_TRUE(src.ok());
  EXPECT_THAT(src->OpenRank(0).status().message(),
              HasSubstr("embedding.word_embeddings.weight: expected BF16[768, 64], found BF16[512, 64]"));
  WriteText("parallel.json", good);
  WriteText("config.json",
            absl::StrReplaceAll(model_.config_json, {{"\"num_attention_heads\": 8", "\"num_attention_heads\": 7"}}));
  EXPECT_THAT(DirSource::Open(dir_).status().message(), HasSubstr("tp=2 does not divide"));
  fs::remove(dir_ + "/parallel.json");
  EXPECT_EQ(DirSource::Open(dir_).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(DirSource::Open(dir_ + "/nope").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(DirSourceTest, ReopenSeesAReplacedFileAndOldViewsStayValid) {
  auto src = DirSource::Open(dir_);
  ASSERT_TRUE(src.ok());
  auto before = src->OpenRank(0);
  ASSERT_TRUE(before.ok());
  const int i = before->Find("decoder.final_layernorm.weight");
  ASSERT_EQ(i, -1);  // stage 0 has no final norm
  const int j = before->Find("decoder.layers.0.input_layernorm.weight");
  ASSERT_GE(j, 0);
  const std::vector<std::byte> old(before->tensors[j].bytes().begin(), before->tensors[j].bytes().end());
  RewriteRank0(dir_, [](NamedTensors* t) {
    for (auto& [name, tensor] : *t)
      if (name == "decoder.layers.0.input_layernorm.weight")
        std::memset(tensor.data_as<std::byte>(), 0x3f, tensor.nbytes());
  });
  auto after = src->OpenRank(0);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(static_cast<const uint8_t*>(after->tensors[j].data())[0], 0x3f);
  EXPECT_EQ(std::memcmp(before->tensors[j].data(), old.data(), old.size()), 0);
}

}  // namespace
}  // namespace wsync::trainer_agent
