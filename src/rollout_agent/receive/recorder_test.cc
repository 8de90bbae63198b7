// Recorder: files appear only under the partial directory until Finish() publishes DIR/v{N}
// atomically; the recorded tensors are the received bytes; failed syncs leave nothing behind.
#include "rollout_agent/receive/recorder.h"

#include <filesystem>
#include <fstream>
#include <random>

#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rollout_agent/receive/testing/sync_testing.h"

namespace wsync::rollout_agent {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::vector<std::string> Files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

class RecorderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/recorder-" + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    std::mt19937 rng(7);  // seed recorded
    for (int i = 0; i < 5; ++i) {
      auto t = Tensor::Empty(i == 3 ? DType::kI32 : DType::kBF16, {3 + i, 64});
      ASSERT_TRUE(t.ok());
      auto* p = reinterpret_cast<unsigned char*>(t->mutable_view().data());
      for (size_t k = 0; k < t->nbytes(); ++k) p[k] = static_cast<unsigned char>(rng());
      tensors_.push_back(std::move(*t));
    }
    std::vector<std::pair<std::string, TensorView>> named;
    for (size_t i = 0; i < tensors_.size(); ++i) named.emplace_back("t." + std::to_string(i), tensors_[i].view());
    auto b = testing::PackBuckets(named, {.version = 9, .pp_stage = 1, .bucket_bytes = 1000});
    ASSERT_TRUE(b.ok()) << b.status();
    buckets_ = std::move(*b);
    ASSERT_GE(buckets_.size(), 3u);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  void WriteAll(const Recorder& r) {
    for (auto& b : buckets_) {
      b.manifest.set_nbytes(b.nbytes);
      ASSERT_TRUE(r.WriteBucket(b.manifest, b.data.data()).ok());
    }
  }
  std::string dir_;
  std::vector<Tensor> tensors_;
  std::vector<testing::PackedBucket> buckets_;
};

TEST_F(RecorderTest, PublishesTheReceivedTensorsOnFinish) {
  auto r = Recorder::Start(dir_, 9, "sync1");
  ASSERT_TRUE(r.ok()) << r.status();
  WriteAll(**r);
  EXPECT_FALSE(fs::exists(dir_ + "/v9"));  // nothing visible before Finish
  const std::vector<std::string> partial = Files(dir_);
  ASSERT_EQ(partial.size(), 1u);
  EXPECT_THAT(partial[0], ::testing::StartsWith(".v9.partial-sync1-"));
  ASSERT_TRUE((*r)->Finish().ok());
  EXPECT_EQ(Files(dir_), std::vector<std::string>{"v9"});
  std::vector<std::string> want;
  for (size_t i = 0; i < buckets_.size(); ++i) want.push_back("pp1-0000" + std::to_string(i) + ".safetensors");
  EXPECT_EQ(Files(dir_ + "/v9"), want);
  size_t seen = 0;
  for (const auto& f : want) {
    auto file = SafetensorsFile::Open(dir_ + "/v9/" + f);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(file->metadata().at("wsync_version"), "9");
    EXPECT_EQ(file->metadata().at("wsync_pp_stage"), "1");
    EXPECT_EQ(file->metadata().at("wsync_sync"), "sync1");
    for (const auto& e : file->tensors()) {
      const size_t i = std::stoul(e.name.substr(2));
      const TensorView want_view = tensors_[i].view();
      EXPECT_EQ(e.view.dtype(), want_view.dtype());
      EXPECT_EQ(e.view.shape(), want_view.shape());
      ASSERT_EQ(e.view.nbytes(), want_view.nbytes());
      EXPECT_EQ(std::memcmp(e.view.data(), want_view.data(), want_view.nbytes()), 0) << e.name;
      ++seen;
    }
  }
  EXPECT_EQ(seen, tensors_.size());
}

TEST_F(RecorderTest, FinishReplacesAnOlderRecordingOfTheSameVersion) {
  // An earlier sync's recording of the same version number, written even after this sync started
  // (timestamps do not decide; the files' sync key does): another sync's key, no key, no file
  // wsync can read.
  for (int old = 0; old < 3; ++old) {
    auto r = Recorder::Start(dir_, 9, "run1-2");
    ASSERT_TRUE(r.ok()) << r.status();
    fs::create_directories(dir_ + "/v9");
    if (old == 2) {
      std::ofstream(dir_ + "/v9/stale.safetensors") << "x";
    } else {
      SafetensorsWriter w;
      ASSERT_TRUE(w.Add("old", tensors_[0].view()).ok());
      if (old == 0) w.SetMetadata("wsync_sync", "run0-1");
      ASSERT_TRUE(w.Write(dir_ + "/v9/stale.safetensors").ok());
    }
    WriteAll(**r);
    ASSERT_TRUE((*r)->Finish().ok());
    EXPECT_EQ(Files(dir_), std::vector<std::string>{"v9"});
    EXPECT_FALSE(fs::exists(dir_ + "/v9/stale.safetensors")) << old;
    EXPECT_EQ(Files(dir_ + "/v9").size(), buckets_.size());
    fs::remove_all(dir_ + "/v9");
  }
}

TEST_F(RecorderTest, AgentsSharingTheDirectoryPublishOnce) {
  // Two agents of one sync (same key), interleaved as in the agent: each writes, then finishes.
  for (bool b_checks_after_a : {true, false}) {
    auto a = Recorder::Start(dir_, 9, "run1-5");
    auto b = Recorder::Start(dir_, 9, "run1-5");
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_NE((*a)->partial_dir(), (*b)->partial_dir());
    WriteAll(**a);
    WriteAll(**b);
    std::ofstream((*a)->partial_dir() + "/only-in-a") << "a";  // tells a's recording from b's
    if (b_checks_after_a) {
      ASSERT_TRUE((*a)->Finish().ok());
      ASSERT_TRUE((*b)->Finish().ok());
    } else {
      ASSERT_TRUE((*b)->Finish().ok());
      ASSERT_TRUE((*a)->Finish().ok());
    }
    EXPECT_EQ(Files(dir_), std::vector<std::string>{"v9"}) << "the second copy must be dropped, nothing left behind";
    EXPECT_EQ(fs::exists(dir_ + "/v9/only-in-a"), b_checks_after_a) << "the first recording published was replaced";
    fs::remove_all(dir_ + "/v9");
  }
}

TEST_F(RecorderTest, RefusesBadSyncKeys) {
  for (const char* key : {"", "a/b", "a\nb"}) {
    auto r = Recorder::Start(dir_, 9, key);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << key;
  }
  EXPECT_FALSE(fs::exists(dir_));
}

TEST_F(RecorderTest, DiscardAndDestructionLeaveNothing) {
  {
    auto r = Recorder::Start(dir_, 3, "a");
    ASSERT_TRUE(r.ok());
    WriteAll(**r);
    (*r)->Discard();
    EXPECT_TRUE(Files(dir_).empty());
  }
  {
    auto r = Recorder::Start(dir_, 4, "b");
    ASSERT_TRUE(r.ok());
    WriteAll(**r);
  }
  EXPECT_TRUE(Files(dir_).empty());
}

TEST_F(RecorderTest, RefusesSplitEntries) {
  auto r = Recorder::Start(dir_, 9, "split");
  ASSERT_TRUE(r.ok());
  v1::BucketManifest m = buckets_[0].manifest;
  m.mutable_entries(0)->set_total_nbytes(m.entries(0).nbytes() * 2);
  absl::Status s = (*r)->WriteBucket(m, buckets_[0].data.data());
  EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("t.0"));
}

// A block of a sharded sync and a delta are not tensors: refused, nothing written.
TEST_F(RecorderTest, RefusesBlockAndDeltaEntries) {
  auto r = Recorder::Start(dir_, 10, "block");
  ASSERT_TRUE(r.ok());
  v1::BucketManifest m = buckets_[0].manifest;
  auto* b = m.mutable_entries(0)->mutable_block();
  b->set_rows(1);
  b->set_cols(1);
  absl::Status s = (*r)->WriteBucket(m, buckets_[0].data.data());
  EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("blocks of a sharded sync are not recorded"));
  // A delta entry, even one whose payload is the tensor's size (dense), is not the tensor's bytes.
  m = buckets_[0].manifest;
  m.set_base_version(1);
  m.mutable_entries(0)->mutable_delta()->set_encoding(0);
  s = (*r)->WriteBucket(m, buckets_[0].data.data());
  EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("deltas of a delta sync are not recorded"));
  (*r)->Discard();
  EXPECT_TRUE(Files(dir_).empty());
}

}  // namespace
}  // namespace wsync::rollout_agent
