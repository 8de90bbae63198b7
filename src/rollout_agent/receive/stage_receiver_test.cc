// ReceiveStage over a real Gloo group inside this process (the stage source on a thread as group
// rank 0, the receiving agent as rank 1, an in-memory store): a generated INT4 checkpoint arrives
// complete in staging; manifests of another version or a split tensor are refused; Cancel stops
// a stage waiting for its group or for buckets within a bounded time. With two GPUs, the same
// checkpoint over NCCL (source on GPU 0, receiver on GPU 1: device buffers, copied down once, or
// loaded in place into a device staging); with one GPU, Gloo into a device staging (uploaded once).
#include "rollout_agent/receive/stage_receiver.h"

#include <thread>

#include "comm/store/store.h"
#include "comm/testing/faulty_communicator.h"
#include "comm/testing/local_group.h"
#include "common/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dispatch.h"
#include "model/testing/hf_model.h"
#include "model/testing/test_models.h"
#include "rollout_agent/receive/testing/sync_testing.h"

namespace wsync::rollout_agent {

namespace {

using ::testing::HasSubstr;

class StageReceiverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto config = ParseModelConfig(model::testing::kQwen3MoeJson, "qwen3_moe");
    ASSERT_TRUE(config.ok()) << config.status();
    auto quant = ParseQuantizationConfig(
        model::testing::QuantJson(128, {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"}), "quant");
    ASSERT_TRUE(quant.ok()) << quant.status();
    auto layout = engine_model::EngineLayout::Create(*config, &*quant, {2, 1, 1});
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = std::make_unique<engine_model::EngineLayout>(std::move(*layout));
    auto staging = engine_model::Staging::Create(*layout_);
    ASSERT_TRUE(staging.ok());
    staging_ = std::move(*staging);
    auto model = model::testing::MakeHfModel(*config, &*quant, /*seed=*/20261122);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    for (const auto& name : model_.order) tensors_.emplace_back(name, model_.sent.at(name).view());
  }

  StageOptions Options(const std::string& group, SyncCancel* cancel, engine_model::Loader* loader) {
    StageOptions o;
    o.store = &store_;
    o.group = group;
    o.rank = 1;
    o.size = 2;
    o.version = 5;
    o.join_timeout = absl::Seconds(20);
    o.op_timeout = absl::Seconds(20);
    o.loader = loader;
    o.cancel = cancel;
    return o;
  }

  // Forms the group as rank 0 on a thread and runs `send` with it (over NCCL on GPU 0).
  std::thread Source(const std::string& group, std::function<void(comm::Communicator&)> send,
                     comm::Backend backend = comm::Backend::kGloo) {
    return std::thread([this, group, send, backend] {
      auto comm = comm::CreateGroup(backend, comm::testing::LocalMemberOptions(store_, group, 0, 2, absl::Seconds(20)));
      ASSERT_TRUE(comm.ok()) << comm.status();
      send(**comm);
    });
  }

  // Sends the checkpoint (256 KiB buckets) from a stage source on a thread and receives it into
  // staging_ as rank 1; `sent`: the number of buckets.
  absl::StatusOr<StageStats> SendAndReceive(const std::string& group, comm::Backend backend, int cuda_device,
                                            int load_threads, size_t* sent) {
    auto buckets = testing::PackBuckets(tensors_, {.version = 5, .bucket_bytes = 256 << 10});
    if (!buckets.ok()) return buckets.status();
    *sent = buckets->size();
    std::thread source = Source(
        group, [&](comm::Communicator& c) { EXPECT_TRUE(testing::SendBuckets(c, std::move(*buckets)).ok()); }, backend);
    SyncCancel cancel;
    engine_model::Loader loader(staging_.get());
    StageOptions o = Options(group, &cancel, &loader);
    o.backend = backend;
    o.cuda_device = cuda_device;
    o.load_threads = load_threads;
    auto stats = ReceiveStage(o);
    source.join();
    return stats;
  }

  // Every sent tensor is in staging, which equals a direct load of the same tensors.
  void ExpectStagingIsADirectLoad() {
    EXPECT_TRUE(staging_->CheckComplete().ok()) << staging_->CheckComplete();
    auto direct = engine_model::Staging::Create(*layout_);
    ASSERT_TRUE(direct.ok());
    engine_model::Loader direct_loader(direct->get());
    for (const auto& [name, view] : tensors_) ASSERT_TRUE(direct_loader.Load(name, view).ok()) << name;
    for (size_t i = 0; i < layout_->params().size(); ++i) {
      const auto a = staging_->param(static_cast<int>(i)), b = (*direct)->param(static_cast<int>(i));
      std::vector<std::byte> got(a.nbytes());  // a device staging's bytes, copied down
      ASSERT_TRUE(staging_->space().CopyToHost(got.data(), a.data(), a.nbytes()).ok());
      ASSERT_EQ(std::memcmp(got.data(), b.data(), a.nbytes()), 0) << layout_->params()[i].name;
    }
  }

  comm::MemoryStore store_;
  std::unique_ptr<engine_model::EngineLayout> layout_;
  std::unique_ptr<engine_model::Staging> staging_;
  model::testing::HfModel model_;
  std::vector<std::pair<std::string, TensorView>> tensors_;
};

TEST_F(StageReceiverTest, ACheckpointArrivesCompleteInStaging) {
  size_t n = 0;
  auto stats = SendAndReceive("ok", comm::Backend::kGloo, 0, 3, &n);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->buckets, n);
  EXPECT_EQ(stats->tensors, tensors_.size());
  ExpectStagingIsADirectLoad();
}

// The NCCL data plane: the stage source on GPU 0, this agent receiving on GPU 1 into device
// buffers, each bucket Sum64-checked there and copied down once for the loader.
TEST_F(StageReceiverTest, OverNcclACheckpointArrivesCompleteInStagingFromAnotherGpu) {
  absl::StatusOr<int> gpus = kernels::CudaDeviceCount();
  if (!comm::BackendCompiledIn(comm::Backend::kNccl) || !gpus.ok() || *gpus < 2)
    GTEST_SKIP() << "needs NCCL and two GPUs";
  size_t n = 0;
  auto stats = SendAndReceive("nccl", comm::Backend::kNccl, 1, 2, &n);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->buckets, n);
  EXPECT_GT(stats->to_host, absl::ZeroDuration());
  ExpectStagingIsADirectLoad();
}

// A device staging on the receiving GPU: over NCCL the buckets are loaded where they arrive (no
// copy down); over Gloo each host bucket is uploaded once and loaded on the GPU.
TEST_F(StageReceiverTest, OverNcclADeviceStagingLoadsTheBucketsWhereTheyArrive) {
  absl::StatusOr<int> gpus = kernels::CudaDeviceCount();
  if (!comm::BackendCompiledIn(comm::Backend::kNccl) || !gpus.ok() || *gpus < 2)
    GTEST_SKIP() << "needs NCCL and two GPUs";
  auto device_staging = engine_model::Staging::Create(*layout_, MemorySpace::Cuda(1));
  ASSERT_TRUE(device_staging.ok()) << device_staging.status();
  staging_ = std::move(*device_staging);
  size_t n = 0;
  auto stats = SendAndReceive("nccl-dev", comm::Backend::kNccl, 1, 2, &n);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->buckets, n);
  EXPECT_EQ(stats->to_host, absl::ZeroDuration());
  ExpectStagingIsADirectLoad();
}

TEST_F(StageReceiverTest, OverGlooADeviceStagingGetsEveryBucketUploadedOnce) {
  if (!kernels::GpuAvailable()) GTEST_SKIP() << "no CUDA device";
  auto device_staging = engine_model::Staging::Create(*layout_, MemorySpace::Cuda(0));
  ASSERT_TRUE(device_staging.ok()) << device_staging.status();
  staging_ = std::move(*device_staging);
  size_t n = 0;
  auto stats = SendAndReceive("gloo-dev", comm::Backend::kGloo, 0, 3, &n);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->buckets, n);
  EXPECT_GT(stats->to_device, absl::ZeroDuration());
  ExpectStagingIsADirectLoad();
}

TEST_F(StageReceiverTest, ABucketOfAnotherVersionIsRefused) {
  auto buckets = testing::PackBuckets(tensors_, {.version = 4, .bucket_bytes = 256 << 10});
  ASSERT_TRUE(buckets.ok());
  std::thread source =
      Source("version", [&](comm::Communicator& c) { (void)testing::SendBuckets(c, std::move(*buckets)); });
  SyncCancel cancel;
  engine_model::Loader loader(staging_.get());
  auto stats = ReceiveStage(Options("version", &cancel, &loader));
  source.join();
  ASSERT_FALSE(stats.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(stats.status())) << stats.status();
  EXPECT_THAT(stats.status().message(), HasSubstr("carries version 4 but the sync is version 5"));
}

TEST_F(StageReceiverTest, ASplitTensorIsRefusedAndTheSenderLearnsIt) {
  auto buckets = testing::PackBuckets(tensors_, {.version = 5, .bucket_bytes = 256 << 10});
  ASSERT_TRUE(buckets.ok());
  (*buckets)[1].manifest.mutable_entries(0)->set_total_nbytes((*buckets)[1].manifest.entries(0).nbytes() * 2);
  // Keep the manifest valid for the data plane: the whole tensor would be twice the entry.
  auto* t = (*buckets)[1].manifest.mutable_entries(0)->mutable_tensor();
  t->set_shape(0, t->shape(0) * 2);
  absl::Status sent;
  std::thread source =
      Source("split", [&](comm::Communicator& c) { sent = testing::SendBuckets(c, std::move(*buckets)); });
  SyncCancel cancel;
  engine_model::Loader loader(staging_.get());
  auto stats = ReceiveStage(Options("split", &cancel, &loader));
  source.join();
  ASSERT_FALSE(stats.ok());
  EXPECT_TRUE(absl::IsUnimplemented(stats.status())) << stats.status();
  EXPECT_THAT(stats.status().message(), HasSubstr("stage 0 bucket 1"));
  EXPECT_FALSE(sent.ok()) << "the stage source must see the receiver abort";
}

TEST_F(StageReceiverTest, CancelStopsAStageWaitingForItsGroup) {
  SyncCancel cancel;
  engine_model::Loader loader(staging_.get());
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(300));
    cancel.Cancel("operator abort");
  });
  const absl::Time t0 = absl::Now();
  auto stats = ReceiveStage(Options("nobody", &cancel, &loader));
  canceller.join();
  ASSERT_FALSE(stats.ok());
  EXPECT_TRUE(absl::IsAborted(stats.status())) << stats.status();
  EXPECT_THAT(stats.status().message(), HasSubstr("operator abort"));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
}

TEST_F(StageReceiverTest, CancelStopsAStageWaitingForBuckets) {
  auto buckets = testing::PackBuckets(tensors_, {.version = 5, .bucket_bytes = 256 << 10});
  ASSERT_TRUE(buckets.ok());
  SyncCancel cancel;
  absl::Status sent;
  std::thread source = Source("stall", [&](comm::Communicator& c) {
    // Two buckets, then the trainer stalls; the agent is aborted.
    auto& b = *buckets;
    EXPECT_TRUE(testing::SendRawBucket(c, b[0].manifest, b[0].data, b[0].nbytes, false).ok());
    EXPECT_TRUE(testing::SendRawBucket(c, b[1].manifest, b[1].data, b[1].nbytes, false).ok());
    absl::SleepFor(absl::Milliseconds(300));
    cancel.Cancel("AbortSync");
    sent = testing::SendRawBucket(c, b[2].manifest, b[2].data, b[2].nbytes, false);
  });
  engine_model::Loader loader(staging_.get());
  const absl::Time t0 = absl::Now();
  auto stats = ReceiveStage(Options("stall", &cancel, &loader));
  source.join();
  ASSERT_FALSE(stats.ok());
  EXPECT_TRUE(absl::IsAborted(stats.status())) << stats.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  EXPECT_FALSE(sent.ok()) << "the source's next broadcast must fail";
}

// A stage source whose communicator fails mid-stream the way a real one does (an error, or the
// member gone; comm/testing/faulty_communicator.h), at its 2nd, 5th and 8th operation: the stage
// fails within the timeout with the data plane's error, and the staging is left incomplete (the
// sync cannot commit it).
TEST_F(StageReceiverTest, ASourceWhoseCommunicatorFailsMidStreamFailsTheStage) {
  using comm::testing::Fault;
  auto packed = testing::PackBuckets(tensors_, {.version = 5, .bucket_bytes = 64 << 10});
  ASSERT_TRUE(packed.ok()) << packed.status();
  ASSERT_GE(packed->size(), 5u);
  for (Fault::Kind kind : {Fault::Kind::kError, Fault::Kind::kPeerGone}) {
    for (int at : {1, 4, 7}) {
      SCOPED_TRACE(::testing::Message() << "kind " << static_cast<int>(kind) << " at " << at);
      auto buckets = testing::PackBuckets(tensors_, {.version = 5, .bucket_bytes = 64 << 10});
      ASSERT_TRUE(buckets.ok());
      const std::string group = absl::StrCat("faulty-", static_cast<int>(kind), "-", at);
      absl::Status sent;
      std::thread source([&] {
        auto comm = comm::CreateGroup(comm::Backend::kGloo,
                                      comm::testing::LocalMemberOptions(store_, group, 0, 2, absl::Seconds(20)));
        ASSERT_TRUE(comm.ok()) << comm.status();
        comm::testing::FaultyCommunicator faulty(std::move(*comm), {{.kind = kind, .at = at}});
        sent = testing::SendBuckets(faulty, std::move(*buckets));
      });
      staging_->ResetCoverage();
      SyncCancel cancel;
      engine_model::Loader loader(staging_.get());
      const absl::Time t0 = absl::Now();
      auto stats = ReceiveStage(Options(group, &cancel, &loader));
      source.join();
      EXPECT_LT(absl::Now() - t0, absl::Seconds(10)) << "the stage waited out its source";
      ASSERT_FALSE(stats.ok()) << "the stage finished as if nothing had failed";
      EXPECT_TRUE(absl::IsAborted(stats.status()) || absl::IsUnavailable(stats.status())) << stats.status();
      EXPECT_FALSE(sent.ok());
      EXPECT_FALSE(staging_->CheckComplete().ok()) << "a stage that failed left a complete staging";
    }
  }
}

TEST(FormationLatchTest, OpensWhenEveryStageArrivedAndEndsOnCancelOrTimeout) {
  SyncCancel cancel;
  FormationLatch latch(3);
  std::vector<std::thread> stages;
  for (int i = 0; i < 2; ++i) stages.emplace_back([&] { latch.Arrive(); });
  for (auto& t : stages) t.join();
  // Two of three: the third is still forming.
  absl::Status late = latch.Wait(cancel, absl::Milliseconds(100));
  EXPECT_TRUE(absl::IsDeadlineExceeded(late)) << late;
  EXPECT_THAT(late.message(), HasSubstr("1 stage(s) still forming"));
  std::thread third([&] {
    absl::SleepFor(absl::Milliseconds(50));
    latch.Arrive();
  });
  EXPECT_TRUE(latch.Wait(cancel, absl::Seconds(10)).ok());
  third.join();
  // A stage that never forms: the sync is cancelled (its stage failed), and the wait ends at once.
  FormationLatch stuck(2);
  stuck.Arrive();
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(100));
    cancel.Cancel("stage 1 failed");
  });
  const absl::Time t0 = absl::Now();
  EXPECT_TRUE(absl::IsAborted(stuck.Wait(cancel, absl::Seconds(30))));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  canceller.join();
}

// A stage whose group formed waits for the sync's other stages before it receives a bucket; when
// the sync is cancelled meanwhile it ends with kAborted, nothing loaded.
TEST_F(StageReceiverTest, AFormedStageWaitsForTheOthersBeforeReceiving) {
  auto buckets = testing::PackBuckets(tensors_, {.version = 5, .bucket_bytes = 256 << 10});
  ASSERT_TRUE(buckets.ok());
  SyncCancel cancel;
  FormationLatch formed(2);  // this stage and one that never forms
  std::thread source = Source("latched", [&](comm::Communicator& c) {
    auto& b = *buckets;  // fails once the stage aborts the group (or is buffered by the socket)
    testing::SendRawBucket(c, b[0].manifest, b[0].data, b[0].nbytes, false).IgnoreError();
  });
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(500));
    cancel.Cancel("the other stage's group never formed");
  });
  engine_model::Loader loader(staging_.get());
  StageOptions o = Options("latched", &cancel, &loader);
  o.formed = &formed;
  auto stats = ReceiveStage(o);
  canceller.join();
  source.join();
  ASSERT_FALSE(stats.ok());
  EXPECT_TRUE(absl::IsAborted(stats.status())) << stats.status();
  EXPECT_THAT(stats.status().message(), HasSubstr("never formed"));
  EXPECT_EQ(staging_->num_missing(), staging_->num_required()) << "nothing loaded";
}

}  // namespace
}  // namespace wsync::rollout_agent
