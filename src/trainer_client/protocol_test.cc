// The client <-> agent wire protocol: every message round-trips; every truncation, trailing byte
// and bad header is refused; frames travel over a socket pair with deadlines and peer loss.
#include "trainer_client/protocol.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "gtest/gtest.h"

namespace wsync::trainer_client {
namespace {

std::string RandomString(std::mt19937& rng, size_t max_len) {
  std::string s(rng() % (max_len + 1), '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

RegisterRequest RandomRegister(std::mt19937& rng) {
  RegisterRequest r;
  r.source_name = "job-" + std::to_string(rng() % 100);
  r.rank = static_cast<int32_t>(rng() % 1000);
  r.client_pid = rng();
  r.config_json = RandomString(rng, 300);
  r.parallel_json = RandomString(rng, 100);
  r.segment = "/wsync.x";
  r.segment_bytes = (uint64_t{rng()} << 32) | rng();
  const int n = static_cast<int>(rng() % 5);
  for (int i = 0; i < n; ++i) {
    TensorDecl t;
    t.name = RandomString(rng, 40);
    t.dtype = i % 2 ? "BF16" : "F32";
    for (int d = 0; d < static_cast<int>(rng() % 4); ++d) t.shape.push_back(static_cast<int64_t>(rng() % 1000));
    t.location = i % 3 == 2 ? Location::kCudaIpc : Location::kHostShm;
    t.offset = rng();
    t.nbytes = rng();
    if (t.location == Location::kCudaIpc) t.cuda_ipc_handle = std::string(kCudaIpcHandleBytes, static_cast<char>(i));
    t.device = static_cast<int32_t>(rng() % 8) - 1;
    r.tensors.push_back(t);
  }
  return r;
}

bool Same(const RegisterRequest& a, const RegisterRequest& b) {
  if (a.source_name != b.source_name || a.rank != b.rank || a.client_pid != b.client_pid ||
      a.config_json != b.config_json || a.parallel_json != b.parallel_json || a.segment != b.segment ||
      a.segment_bytes != b.segment_bytes || a.tensors.size() != b.tensors.size())
    return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto &x = a.tensors[i], &y = b.tensors[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || x.location != y.location ||
        x.offset != y.offset || x.nbytes != y.nbytes || x.cuda_ipc_handle != y.cuda_ipc_handle || x.device != y.device)
      return false;
  }
  return true;
}

TEST(Protocol, MessagesRoundTripAndEveryTruncationIsRefused) {
  std::mt19937 rng(20261121);  // seed recorded
  for (int iter = 0; iter < 50; ++iter) {
    const RegisterRequest reg = RandomRegister(rng);
    const std::string wire = Encode(reg);
    RegisterRequest back;
    std::string error;
    ASSERT_TRUE(Decode(wire, &back, &error)) << error;
    EXPECT_TRUE(Same(reg, back));
    for (size_t cut = 0; cut < wire.size(); cut += 1 + wire.size() / 64) {
      RegisterRequest t;
      EXPECT_FALSE(Decode(wire.substr(0, cut), &t, &error)) << "prefix " << cut;
    }
    EXPECT_FALSE(Decode(wire + "x", &back, &error));
    EXPECT_EQ(error, "register request: trailing bytes");

    RequestSyncRequest sync{(uint64_t{rng()} << 32) | rng(), rng(), (rng() & 1) != 0, -static_cast<int64_t>(rng())};
    RequestSyncRequest sync_back;
    ASSERT_TRUE(Decode(Encode(sync), &sync_back, &error));
    EXPECT_EQ(sync_back.version, sync.version);
    EXPECT_EQ(sync_back.wait, sync.wait);
    EXPECT_EQ(sync_back.generation, sync.generation);
    EXPECT_EQ(sync_back.timeout_ms, sync.timeout_ms);
    EXPECT_FALSE(Decode(Encode(sync).substr(1), &sync_back, &error));

    Reply reply{static_cast<int32_t>(rng() % 17), RandomString(rng, 200), rng(), rng(), (rng() & 1) != 0};
    Reply reply_back;
    ASSERT_TRUE(Decode(Encode(reply), &reply_back, &error));
    EXPECT_EQ(reply_back.code, reply.code);
    EXPECT_EQ(reply_back.message, reply.message);
    EXPECT_EQ(reply_back.sync_id, reply.sync_id);
    EXPECT_EQ(reply_back.version, reply.version);
    EXPECT_EQ(reply_back.coalesced, reply.coalesced);
  }
  // A tensor count larger than the payload, bad enum values.
  RegisterRequest r;
  std::string wire = Encode(r);
  wire[wire.size() - 1] = '\x7f';
  std::string error;
  EXPECT_FALSE(Decode(wire, &r, &error));
  std::string sync = Encode(RequestSyncRequest{1, 2, true, 5});
  sync[16] = 2;  // wait is 0 or 1
  RequestSyncRequest s;
  EXPECT_FALSE(Decode(sync, &s, &error));
}

class SocketPair : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0); }
  void TearDown() override {
    for (int fd : fds_)
      if (fd >= 0) close(fd);
  }
  int fds_[2] = {-1, -1};
};

TEST_F(SocketPair, FramesTravelWholeAndLargeOnesStream) {
  std::mt19937 rng(7);  // seed recorded
  std::string big(5u << 20, '\0');
  for (char& c : big) c = static_cast<char>(rng());
  std::string error;
  std::thread writer([&] { EXPECT_EQ(SendFrame(fds_[0], MsgType::kRegister, big, NowMs() + 10000, &error), 0); });
  MsgType type;
  std::string payload, rerror;
  EXPECT_EQ(RecvFrame(fds_[1], &type, &payload, NowMs() + 10000, &rerror), 0) << rerror;
  writer.join();
  EXPECT_EQ(type, MsgType::kRegister);
  EXPECT_TRUE(payload == big);
}

TEST_F(SocketPair, DeadlinesBadHeadersAndPeerLoss) {
  MsgType type;
  std::string payload, error;
  const int64_t t0 = NowMs();
  EXPECT_EQ(RecvFrame(fds_[1], &type, &payload, NowMs() + 100, &error), ETIMEDOUT);
  EXPECT_GE(NowMs() - t0, 90);
  EXPECT_EQ(error, "receiving: timed out");

  const std::string junk(16, 'x');
  ASSERT_EQ(write(fds_[0], junk.data(), junk.size()), 16);
  EXPECT_EQ(RecvFrame(fds_[1], &type, &payload, NowMs() + 1000, &error), EPROTO);
  EXPECT_EQ(error, "not a wsync frame (bad magic)");

  std::string header(16, '\0');
  const uint32_t words[4] = {kMagic, kProtocolVersion + 1, 1, 0};
  std::memcpy(header.data(), words, 16);
  ASSERT_EQ(write(fds_[0], header.data(), 16), 16);
  EXPECT_EQ(RecvFrame(fds_[1], &type, &payload, NowMs() + 1000, &error), EPROTO);
  EXPECT_NE(error.find("protocol version 2"), std::string::npos) << error;

  const uint32_t huge[4] = {kMagic, kProtocolVersion, 1, kMaxPayload + 1};
  std::memcpy(header.data(), huge, 16);
  ASSERT_EQ(write(fds_[0], header.data(), 16), 16);
  EXPECT_EQ(RecvFrame(fds_[1], &type, &payload, NowMs() + 1000, &error), EPROTO);

  EXPECT_EQ(SendFrame(fds_[0], MsgType::kReply, std::string(kMaxPayload + 1, 'a'), -1, &error), EMSGSIZE);

  close(fds_[0]);
  fds_[0] = -1;
  EXPECT_EQ(RecvFrame(fds_[1], &type, &payload, NowMs() + 1000, &error), ECONNRESET);
  EXPECT_EQ(SendFrame(fds_[1], MsgType::kReply, "x", NowMs() + 1000, &error), EPIPE);
}

TEST(Protocol, NamesPathsAndSizes) {
  EXPECT_TRUE(ValidSourceName("job-42.run_1"));
  for (const char* bad : {"", ".hidden", "a/b", "sp ace", "x\n"}) EXPECT_FALSE(ValidSourceName(bad)) << bad;
  EXPECT_FALSE(ValidSourceName(std::string(65, 'a')));
  EXPECT_EQ(SocketPath("/run/w", "job", 7), "/run/w/job.r00007.sock");
  setenv("WSYNC_RUNTIME_DIR", "/x/y", 1);
  EXPECT_EQ(RuntimeDir(), "/x/y");
  unsetenv("WSYNC_RUNTIME_DIR");
  uint64_t n = 0;
  EXPECT_TRUE(TensorBytes("BF16", {3, 5}, &n));
  EXPECT_EQ(n, 30u);
  EXPECT_TRUE(TensorBytes("F32", {}, &n));
  EXPECT_EQ(n, 4u);
  EXPECT_TRUE(TensorBytes("I64", {0, 7}, &n));
  EXPECT_EQ(n, 0u);
  EXPECT_FALSE(TensorBytes("BFLOAT16", {1}, &n));
  EXPECT_FALSE(TensorBytes("F32", {-1}, &n));
  EXPECT_FALSE(TensorBytes("F64", {int64_t{1} << 40, int64_t{1} << 40}, &n));
}

}  // namespace
}  // namespace wsync::trainer_client
