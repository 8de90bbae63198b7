#include "engine_memory/param_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/match.h"
#include "common/checksum.h"
#include "common/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace wsync::engine_memory {
namespace {

using ::testing::HasSubstr;

ModelConfig ParseConfig(const std::string& json) { return ParseModelConfig(json, "test config").value(); }

bool Exists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

TEST(ShmSegmentTest, ModeIs0600EvenWithAPermissiveUmaskAndUnlinkedOnDestroy) {
  const mode_t old = umask(0);
  const std::string name = UniqueShmName("unit", 0);
  {
    auto seg = ShmSegment::Create(name, 4096 + 3);
    umask(old);
    ASSERT_TRUE(seg.ok()) << seg.status();
    struct stat st;
    const int fd = shm_open(name.c_str(), O_RDONLY, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(fstat(fd, &st), 0);
    close(fd);
    EXPECT_EQ(st.st_mode & 07777, 0600u);
    EXPECT_EQ(st.st_uid, geteuid());
    EXPECT_EQ(static_cast<size_t>(st.st_size), 4096u + 3);
    EXPECT_EQ((*seg)->size(), 4096u + 3);
    // Zero-filled and writable, and visible through a second mapping (what the agent does).
    const auto* bytes = static_cast<const unsigned char*>((*seg)->data());
    for (size_t i = 0; i < (*seg)->size(); ++i) ASSERT_EQ(bytes[i], 0) << i;
    std::memset((*seg)->data(), 0x5a, (*seg)->size());
    const int fd2 = shm_open(name.c_str(), O_RDWR, 0);
    ASSERT_GE(fd2, 0);
    void* other = mmap(nullptr, (*seg)->size(), PROT_READ, MAP_SHARED, fd2, 0);
    close(fd2);
    ASSERT_NE(other, MAP_FAILED);
    EXPECT_EQ(static_cast<const unsigned char*>(other)[4098], 0x5a);
    munmap(other, (*seg)->size());
    EXPECT_TRUE(Exists(name));
  }
  EXPECT_FALSE(Exists(name)) << name << " must be unlinked when the segment is destroyed";
}

TEST(ShmSegmentTest, ExclusiveCreateAndBadArguments) {
  const std::string name = UniqueShmName("unit", 1);
  auto a = ShmSegment::Create(name, 64);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = ShmSegment::Create(name, 64);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(b.status().message(), HasSubstr(name));
  EXPECT_TRUE(Exists(name)) << "a refused duplicate must not unlink the first segment";
  EXPECT_EQ(ShmSegment::Create("no-slash", 64).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmSegment::Create("/a/b", 64).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmSegment::Create(UniqueShmName("unit", 2), 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmSegmentTest, UnlinkAllRemovesLiveSegmentsAndDestructionStaysHarmless) {
  const std::string n1 = UniqueShmName("unit", 3), n2 = UniqueShmName("unit", 4);
  auto a = ShmSegment::Create(n1, 128);
  auto b = ShmSegment::Create(n2, 128);
  ASSERT_TRUE(a.ok() && b.ok());
  UnlinkAllShmSegments();
  EXPECT_FALSE(Exists(n1));
  EXPECT_FALSE(Exists(n2));
  static_cast<char*>((*a)->data())[0] = 1;  // the mapping stays valid
}

TEST(ShmSegmentTest, NamesAreUniqueAndSanitized) {
  std::set<std::string> names;
  for (int i = 0; i < 100; ++i) names.insert(UniqueShmName("e/x y", 7));
  EXPECT_EQ(names.size(), 100u);
  const std::string n = *names.begin();
  EXPECT_TRUE(absl::StartsWith(n, "/wsync-engine-e_x_y-r7-")) << n;
  EXPECT_EQ(n.find('/', 1), std::string::npos);
  EXPECT_LE(UniqueShmName(std::string(500, 'a'), 0).size(), 120u);
}

// Segments of killed processes of the same engine rank are removed, nothing else: not a live
// process's (this one, pid 1), not another rank's or engine's, not a name that only starts alike.
TEST(ShmSegmentTest, ReclaimRemovesOnlyThisRanksSegmentsOfDeadProcesses) {
  char tmpl[] = "/tmp/wsync-shm-reclaim-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string hex = "0123456789abcdef";
  const std::string dead = "2147483000";  // above any pid_max: kill() says ESRCH
  const std::string me = std::to_string(getpid());
  const std::vector<std::string> kept = {
      "wsync-engine-unit-r2-" + me + "-" + hex,     "wsync-engine-unit-r2-1-" + hex,
      "wsync-engine-unit-r3-" + dead + "-" + hex,   "wsync-engine-other-r2-" + dead + "-" + hex,
      "wsync-engine-unit-r2-" + dead + "-xyz",      "wsync-engine-unit-r2-" + dead + "-" + hex + "0",
      "wsync-engine-unit-r2-x-" + dead + "-" + hex,
  };
  const std::string stale = "wsync-engine-unit-r2-" + dead + "-" + hex;
  for (const std::string& n : kept) std::ofstream(dir + "/" + n) << "x";
  std::ofstream(dir + "/" + stale) << "x";
  auto removed = ReclaimStaleShmSegments("unit", 2, dir);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, std::vector<std::string>{stale});
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + stale));
  for (const std::string& n : kept) EXPECT_TRUE(std::filesystem::exists(dir + "/" + n)) << n;
  EXPECT_TRUE(ReclaimStaleShmSegments("unit", 2, dir)->empty());
  EXPECT_FALSE(ReclaimStaleShmSegments("unit", 2, dir + "/missing").ok());
  std::filesystem::remove_all(dir);
}

TEST(ParamArenaTest, EveryParamIs64ByteAlignedDisjointAndRegistered) {
  const ModelConfig c = ParseConfig(R"({
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 256, "vocab_size": 250, "max_position_embeddings": 64, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
        "strategy": "group", "group_size": 32, "symmetric": true, "dynamic": false}}},
      "ignore": ["lm_head", "re:.*embed_tokens.*"]}})");
  for (int tp : {1, 2}) {
    auto layout = engine_model::EngineLayout::Create(c, &*c.quantization, {tp, tp - 1, 1});
    ASSERT_TRUE(layout.ok()) << layout.status();
    auto arena = ParamArena::Create(*layout, UniqueShmName("arena", tp));
    ASSERT_TRUE(arena.ok()) << arena.status();
    const auto& bufs = (*arena)->weights().buffers();
    ASSERT_EQ(bufs.size(), layout->params().size());
    EXPECT_TRUE((*arena)->weights().CheckMatches(*layout).ok());
    google::protobuf::RepeatedPtrField<v1::EngineParam> params;
    (*arena)->FillParams(&params);
    ASSERT_EQ(params.size(), static_cast<int>(bufs.size()));
    bool any_marlin = false;
    uint64_t prev_end = 0;
    for (size_t i = 0; i < bufs.size(); ++i) {
      const v1::EngineParam& p = params[static_cast<int>(i)];
      EXPECT_EQ(p.name(), bufs[i].name);
      EXPECT_EQ(p.memory().shm_name(), (*arena)->segment().name());
      EXPECT_EQ(p.memory().offset() % kParamAlignment, 0u) << p.name();
      EXPECT_GE(p.memory().offset(), prev_end) << p.name() << " overlaps the previous param";
      prev_end = p.memory().offset() + p.nbytes();
      EXPECT_LE(prev_end, (*arena)->segment().size());
      EXPECT_EQ(static_cast<const std::byte*>(bufs[i].data) - static_cast<const std::byte*>((*arena)->segment().data()),
                static_cast<ptrdiff_t>(p.memory().offset()));
      EXPECT_EQ(p.nbytes(), bufs[i].nbytes);
      ASSERT_EQ(p.shape_size(), static_cast<int>(bufs[i].shape.size()));
      for (int d = 0; d < p.shape_size(); ++d) EXPECT_EQ(p.shape(d), bufs[i].shape[static_cast<size_t>(d)]);
      if (absl::EndsWith(p.name(), "weight_packed")) {
        any_marlin = true;
        EXPECT_EQ(p.dtype(), v1::DTYPE_I32);
      }
      if (absl::EndsWith(p.name(), "norm.weight")) {
        EXPECT_EQ(p.dtype(), v1::DTYPE_BF16);
      }
    }
    EXPECT_TRUE(any_marlin);
    // The Marlin form: qkv_proj packed [K/16, 2N] on this rank.
    const engine_model::EngineBuffer* qkv = (*arena)->weights().Find("model.layers.0.self_attn.qkv_proj.weight_packed");
    ASSERT_NE(qkv, nullptr);
    const int64_t n = (4 / tp + 2 * (2 / tp)) * 32;
    EXPECT_EQ(qkv->shape, Shape({128 / 16, 2 * n}));
  }
}

TEST(ParamArenaTest, ChecksumCoversTheWholeSegment) {
  const ModelConfig c = ParseConfig(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 40,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 64, "torch_dtype": "bfloat16"})");
  auto layout = engine_model::EngineLayout::Create(c, nullptr, {1, 0, 1});
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto arena = ParamArena::Create(*layout, UniqueShmName("checksum", 0));
  ASSERT_TRUE(arena.ok()) << arena.status();
  const ShmSegment& seg = (*arena)->segment();
  auto* bytes = static_cast<std::byte*>(seg.data());
  const uint64_t zero = (*arena)->Checksum().value();
  EXPECT_EQ(zero, Xxh3_64({bytes, seg.size()}));
  // A byte of a param changes it; writing the byte back restores it.
  const engine_model::EngineBuffer& last = (*arena)->weights().buffers().back();
  static_cast<unsigned char*>(last.data)[last.nbytes - 1] = 0x01;
  const uint64_t written = (*arena)->Checksum().value();
  EXPECT_NE(written, zero);
  EXPECT_EQ(written, Xxh3_64({bytes, seg.size()}));
  static_cast<unsigned char*>(last.data)[last.nbytes - 1] = 0;
  EXPECT_EQ((*arena)->Checksum().value(), zero);
  // So does a byte between params (the zeroed alignment gaps are part of the segment).
  const auto& bufs = (*arena)->weights().buffers();
  bool gap = false;
  for (size_t i = 0; i + 1 < bufs.size() && !gap; ++i) {
    const uint64_t end = (*arena)->offset(i) + bufs[i].nbytes;
    if (end < (*arena)->offset(i + 1)) {
      bytes[end] = std::byte{1};
      EXPECT_NE((*arena)->Checksum().value(), zero) << "gap after " << bufs[i].name;
      bytes[end] = std::byte{0};
      gap = true;
    }
  }
  EXPECT_TRUE(gap) << "the layout has no gap between params; pick sizes that leave one";
  EXPECT_EQ((*arena)->Checksum().value(), zero);
}

}  // namespace
}  // namespace wsync::engine_memory
