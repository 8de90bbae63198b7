// The rollout agent against the real trainer side: wsync-model-gen writes an INT4 Qwen3-MoE HF
// checkpoint, wsync-shard cuts it for PP 2, wsync-trainer-agent runs under mpirun (rank 0 hosts the
// coordinator and its store), wsync-rollout-agent joins it, a fake engine control surface with real
// shm memory registers with the agent, and wsyncctl triggers syncs and verifies the engine's memory
// bit for bit against the checkpoint (through RolloutAgent.EngineChecksums). Two stage groups, two
// syncs, recordings, engine call order.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/testing/test_models.h"
#include "rollout_fakes.h"

extern char** environ;

namespace wsync::rollout_agent {
using engine_model::EngineBuffer;

namespace {

namespace fs = std::filesystem;
using testing::AgentProcess;
using ::testing::ElementsAre;
using testing::FakeEngine;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

pid_t Spawn(const std::vector<std::string>& args, const std::string& log) {
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& s : copy) argv.push_back(s.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

// Waits for `pid` up to `limit`; kills it after that. Returns the exit code (-1: killed / signal).
int WaitFor(pid_t pid, absl::Duration limit) {
  const absl::Time deadline = absl::Now() + limit;
  int st = 0;
  for (;;) {
    if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      return -1;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

class RolloutAgentE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/rollout-e2e-", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_ + "/logs");
    sec_.token = absl::StrCat("e2e-token-", getpid());
    token_file_ = dir_ + "/token";
    std::ofstream(token_file_) << sec_.token << "\n";
    quant_json_ = model::testing::QuantJson(128, {"lm_head", "re:.*embed_tokens.*", "re:.*mlp\\.gate$"});
    quant_file_ = dir_ + "/quant.json";
    std::ofstream(quant_file_) << quant_json_;
  }
  void TearDown() override {
    if (agent_) agent_->Terminate();
    if (trainer_ > 0) {
      kill(trainer_, SIGTERM);
      if (WaitFor(trainer_, absl::Seconds(20)) == -1) ADD_FAILURE() << "the trainer did not stop on SIGTERM";
    }
    if (HasFailure()) {
      for (const auto& f : fs::directory_iterator(dir_ + "/logs"))
        std::cerr << "---- " << f.path().filename() << " ----\n" << ReadFile(f.path().string()) << "\n";
      if (agent_) std::cerr << "---- agent ----\n" << agent_->Log() << "\n";
    } else {
      if (agent_) agent_->RemoveFiles();
      fs::remove_all(dir_);
    }
  }

  // Runs a tool to completion; returns its exit code, its output in *out.
  int Run(const std::string& name, std::vector<std::string> args, std::string* out = nullptr,
          absl::Duration limit = absl::Seconds(120)) {
    const std::string log = absl::StrCat(dir_, "/logs/", name, "-", runs_++, ".log");
    args.insert(args.begin(), absl::StrCat(WSYNC_BIN_DIR, "/", name));
    const pid_t pid = Spawn(args, log);
    EXPECT_GT(pid, 0) << args[0];
    const int rc = pid > 0 ? WaitFor(pid, limit) : -1;
    if (out) *out = ReadFile(log);
    if (rc != 0) ADD_FAILURE() << absl::StrJoin(args, " ") << " exited " << rc << ":\n" << ReadFile(log);
    return rc;
  }
  std::vector<std::string> Ctl(std::vector<std::string> args) {
    std::vector<std::string> a = {"--coordinator", coordinator_, "--token-file", token_file_};
    a.insert(a.end(), args.begin(), args.end());
    return a;
  }

  std::string dir_, token_file_, quant_json_, quant_file_, coordinator_;
  RpcSecurity sec_;
  pid_t trainer_ = -1;
  std::unique_ptr<AgentProcess> agent_;
  int runs_ = 0;
};

TEST_F(RolloutAgentE2eTest, TheRealTrainerAndCoordinatorSyncAnEngineThroughTheAgent) {
  const std::string hf = dir_ + "/hf", src = dir_ + "/src";
  ASSERT_EQ(Run("wsync-model-gen", {"--arch", "qwen3-moe", "--preset", "tiny", "--seed", "20261121", "--out", hf,
                                    "--quant-config", quant_file_}),
            0);
  ASSERT_EQ(Run("wsync-shard", {"--hf", hf, "--out", src, "--tp", "1", "--pp", "2"}), 0);

  // Port 0: the coordinator binds a port of its own and writes it to --address-file. A port picked
  // here and bound later can be taken in between by another test running in parallel.
  const std::string coord_file = dir_ + "/coordinator";
  trainer_ = Spawn({WSYNC_MPIEXEC,
                    "--allow-run-as-root",
                    "--oversubscribe",
                    "-np",
                    "2",
                    absl::StrCat(WSYNC_BIN_DIR, "/wsync-trainer-agent"),
                    "--source",
                    "dir:" + src,
                    "--coordinator",
                    "127.0.0.1:0",
                    "--backend",
                    "gloo",
                    "--bucket-mib",
                    "1",
                    "--token-file",
                    token_file_,
                    "--address-file",
                    coord_file,
                    "--state-dir",
                    dir_ + "/state",
                    "--quant-config",
                    quant_file_},
                   dir_ + "/logs/trainer.log");
  ASSERT_GT(trainer_, 0);
  for (int i = 0; i < 600 && !absl::EndsWith(ReadFile(coord_file), "\n"); ++i) absl::SleepFor(absl::Milliseconds(100));
  coordinator_ = std::string(absl::StripAsciiWhitespace(ReadFile(coord_file)));
  ASSERT_TRUE(absl::StartsWith(coordinator_, "127.0.0.1:") && coordinator_ != "127.0.0.1:0")
      << "the coordinator did not start: address file holds '" << coordinator_ << "'";

  const std::string record = dir_ + "/record";
  auto agent = AgentProcess::Start(
      absl::StrCat(WSYNC_BIN_DIR, "/wsync-rollout-agent"), "e2e",
      {"--coordinator", coordinator_, "--token-file", token_file_, "--record-dir", record, "--heartbeat-ms", "200"},
      sec_);
  ASSERT_TRUE(agent.ok()) << agent.status();
  agent_ = std::move(*agent);
  FakeEngine::Options o;
  o.engine_id = "e2e-engine";
  o.config_json = ReadFile(hf + "/config.json");
  o.quant_json = quant_json_;
  o.security = sec_;
  auto engine = FakeEngine::Start(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_TRUE((*engine)->Register(agent_->address()).ok());

  // The agent joins the coordinator.
  std::string members;
  for (int i = 0; i < 100; ++i) {
    Run("wsyncctl", Ctl({"--json", "members"}), &members);
    if (members.find(agent_->address()) != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_NE(members.find(agent_->address()), std::string::npos) << members;

  std::string out;
  ASSERT_EQ(Run("wsyncctl", Ctl({"sync", "--wait"}), &out, absl::Seconds(180)), 0);
  EXPECT_THAT((*engine)->calls(), ElementsAre("pause:HOLD", "flush", "continue:1"));
  EXPECT_EQ((*engine)->version(), 1u);
  EXPECT_EQ(Run("wsyncctl", Ctl({"verify", "--against", hf}), &out, absl::Seconds(180)), 0);

  // A second sync on top: the engine follows, the recording holds both versions, both stages.
  ASSERT_EQ(Run("wsyncctl", Ctl({"sync", "--wait"}), &out, absl::Seconds(180)), 0);
  EXPECT_EQ((*engine)->calls().back(), "continue:2");
  EXPECT_EQ(Run("wsyncctl", Ctl({"verify", "--against", hf}), &out, absl::Seconds(180)), 0);
  EXPECT_TRUE(fs::exists(record + "/v1/pp0-00000.safetensors"));
  EXPECT_TRUE(fs::exists(record + "/v2/pp1-00000.safetensors"));

  // A corrupted engine is caught by verify (the checksums come from the engine's memory).
  const EngineBuffer& b = (*engine)->memory().weights().buffers().front();
  static_cast<unsigned char*>(b.data)[0] ^= 1;
  std::string bad;
  const std::string log = absl::StrCat(dir_, "/logs/verify-corrupt.log");
  const pid_t pid = Spawn({absl::StrCat(WSYNC_BIN_DIR, "/wsyncctl"), "--coordinator", coordinator_, "--token-file",
                           token_file_, "verify", "--against", hf},
                          log);
  EXPECT_NE(WaitFor(pid, absl::Seconds(180)), 0) << ReadFile(log);
  EXPECT_NE(ReadFile(log).find(b.name), std::string::npos) << ReadFile(log);
  static_cast<unsigned char*>(b.data)[0] ^= 1;
  agent_->Terminate();
}

}  // namespace
}  // namespace wsync::rollout_agent
