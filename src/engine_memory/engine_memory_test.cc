// MapEngineMemory: the agent maps exactly what the engine registered, writes land in the engine's
// segment, and every unsafe or inconsistent registration is refused naming the param / segment.
#include "engine_memory/engine_memory.h"

#include <sys/stat.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "engine_memory/param_arena.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/testing/test_models.h"

namespace wsync::engine_memory {
namespace {

using ::testing::HasSubstr;

class EngineMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto config = ParseModelConfig(model::testing::kQwen3Json, "qwen3");
    ASSERT_TRUE(config.ok()) << config.status();
    auto layout = engine_model::EngineLayout::Create(*config, nullptr, {2, 1, 1});
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = std::make_unique<engine_model::EngineLayout>(std::move(*layout));
  }
  // The engine's end: a ParamArena for the layout, its segment then set to `mode` (ParamArena
  // always creates 0600; a wider mode is what an engine that shares its weights wider registers).
  std::unique_ptr<ParamArena> Segment(mode_t mode = 0600) {
    auto m = ParamArena::Create(*layout_, UniqueShmName("mem", 1));
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return nullptr;
    if (mode != 0600) {
      EXPECT_EQ(chmod(absl::StrCat("/dev/shm", (*m)->segment().name()).c_str(), mode), 0);
    }
    return std::move(*m);
  }
  std::unique_ptr<engine_model::EngineLayout> layout_;
};

TEST_F(EngineMemoryTest, MapsEveryParamIntoTheEnginesSegment) {
  auto seg = Segment();
  ASSERT_NE(seg, nullptr);
  v1::RegisterEngineRequest req;
  seg->FillParams(req.mutable_params());
  auto mem = MapEngineMemory(req.params());
  ASSERT_TRUE(mem.ok()) << mem.status();
  EXPECT_TRUE((*mem)->weights().CheckMatches(*layout_).ok()) << (*mem)->weights().CheckMatches(*layout_);
  EXPECT_EQ((*mem)->segments(), std::vector<std::string>{seg->segment().name()});
  uint64_t total = 0;
  for (const auto& p : req.params()) total += p.nbytes();
  EXPECT_EQ((*mem)->param_bytes(), total);
  // A write through the agent's mapping is visible in the engine's (a different mapping).
  const engine_model::EngineBuffer& b = (*mem)->weights().buffers().back();
  std::memset(b.data, 0x5a, b.nbytes);
  const engine_model::EngineBuffer* theirs = seg->weights().Find(b.name);
  ASSERT_NE(theirs, nullptr);
  EXPECT_NE(theirs->data, b.data);
  EXPECT_EQ(static_cast<const unsigned char*>(theirs->data)[b.nbytes - 1], 0x5a);
}

TEST_F(EngineMemoryTest, RefusesASegmentOthersCanRead) {
  auto seg = Segment(0644);
  ASSERT_NE(seg, nullptr);
  v1::RegisterEngineRequest req;
  seg->FillParams(req.mutable_params());
  auto mem = MapEngineMemory(req.params());
  ASSERT_FALSE(mem.ok());
  EXPECT_TRUE(absl::IsPermissionDenied(mem.status())) << mem.status();
  EXPECT_THAT(mem.status().message(), HasSubstr("mode 0644"));
  EXPECT_THAT(mem.status().message(), HasSubstr(seg->segment().name()));
}

TEST_F(EngineMemoryTest, RefusesInconsistentParams) {
  auto seg = Segment();
  ASSERT_NE(seg, nullptr);
  v1::RegisterEngineRequest good;
  seg->FillParams(good.mutable_params());
  struct Case {
    const char* what;
    std::function<void(v1::RegisterEngineRequest&)> edit;
    absl::StatusCode code;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"outside", [&](auto& r) { r.mutable_params(0)->mutable_memory()->set_offset(seg->segment().size()); },
       absl::StatusCode::kInvalidArgument, "lie outside the"},
      {"nbytes", [](auto& r) { r.mutable_params(0)->set_nbytes(r.params(0).nbytes() + 2); },
       absl::StatusCode::kInvalidArgument, "needs"},
      {"name", [](auto& r) { r.mutable_params(1)->mutable_memory()->set_shm_name("no-slash"); },
       absl::StatusCode::kInvalidArgument, "is not of the form"},
      {"missing", [](auto& r) { r.mutable_params(1)->mutable_memory()->set_shm_name("/wsync-test-does-not-exist"); },
       absl::StatusCode::kNotFound, "wsync-test-does-not-exist"},
      // A device param: needs a CUDA build (else kUnimplemented) and a GPU (none here).
      {"cuda", [](auto& r) { r.mutable_params(0)->mutable_memory()->set_cuda_ipc_handle(std::string(64, '\1')); },
       CudaIpcCompiled() ? absl::StatusCode::kFailedPrecondition : absl::StatusCode::kUnimplemented, "CUDA"},
      {"dtype", [](auto& r) { r.mutable_params(0)->set_dtype(v1::DTYPE_UNSPECIFIED); },
       absl::StatusCode::kInvalidArgument, "unknown dtype"},
      {"duplicate", [](auto& r) { *r.add_params() = r.params(0); }, absl::StatusCode::kInvalidArgument,
       "registered twice"},
  };
  for (const Case& c : cases) {
    v1::RegisterEngineRequest req = good;
    c.edit(req);
    auto mem = MapEngineMemory(req.params());
    ASSERT_FALSE(mem.ok()) << c.what;
    EXPECT_EQ(mem.status().code(), c.code) << c.what << ": " << mem.status();
    EXPECT_THAT(mem.status().message(), HasSubstr(c.message)) << c.what;
  }
}

TEST_F(EngineMemoryTest, AWrongShapeMapsButDoesNotMatchTheLayout) {
  auto seg = Segment();
  ASSERT_NE(seg, nullptr);
  v1::RegisterEngineRequest req;
  seg->FillParams(req.mutable_params());
  // Same bytes, another shape: mapping accepts it, CheckMatches names it.
  auto* p = req.mutable_params(0);
  const int64_t rows = p->shape(0), cols = p->shape_size() > 1 ? p->shape(1) : 1;
  p->clear_shape();
  p->add_shape(cols);
  p->add_shape(rows);
  auto mem = MapEngineMemory(req.params());
  ASSERT_TRUE(mem.ok()) << mem.status();
  absl::Status m = (*mem)->weights().CheckMatches(*layout_);
  EXPECT_TRUE(absl::IsInvalidArgument(m)) << m;
  EXPECT_THAT(m.message(), HasSubstr(p->name()));
}

}  // namespace
}  // namespace wsync::engine_memory
