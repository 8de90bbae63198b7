#include "common/metrics.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <thread>
#include <vector>

#include "common/logging.h"

namespace wsync {
namespace {

TEST(MetricsTest, RendersPrometheusText) {
  MetricsRegistry r;
  auto syncs = r.GetCounter("wsync_syncs_total", "Completed syncs.", {{"result", "ok"}});
  ASSERT_TRUE(syncs.ok());
  (*syncs)->Increment();
  (*syncs)->Increment(2);
  auto version = r.GetGauge("wsync_weight_version", "Committed weight version.");
  ASSERT_TRUE(version.ok());
  (*version)->Set(7);
  auto h = r.GetHistogram("wsync_phase_seconds", "Phase duration.", {0.1, 1, 10}, {{"phase", "transfer"}});
  ASSERT_TRUE(h.ok());
  for (double v : {0.05, 0.1, 0.5, 20.0}) (*h)->Observe(v);
  auto weird = r.GetGauge("wsync_label_escape", "Escapes \\ and\nnewlines.", {{"path", "a\"b\\c\nd"}});
  ASSERT_TRUE(weird.ok());

  const std::string text = r.RenderPrometheus();
  EXPECT_NE(text.find("# HELP wsync_syncs_total Completed syncs.\n# TYPE wsync_syncs_total counter\n"
                      "wsync_syncs_total{result=\"ok\"} 3\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("wsync_weight_version 7\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE wsync_phase_seconds histogram\n"
                      "wsync_phase_seconds_bucket{phase=\"transfer\",le=\"0.10000000000000001\"} 2\n"
                      "wsync_phase_seconds_bucket{phase=\"transfer\",le=\"1\"} 3\n"
                      "wsync_phase_seconds_bucket{phase=\"transfer\",le=\"10\"} 3\n"
                      "wsync_phase_seconds_bucket{phase=\"transfer\",le=\"+Inf\"} 4\n"
                      "wsync_phase_seconds_sum{phase=\"transfer\"} 20.649999999999999\n"
                      "wsync_phase_seconds_count{phase=\"transfer\"} 4\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("# HELP wsync_label_escape Escapes \\\\ and\\nnewlines.\n"), std::string::npos) << text;
  EXPECT_NE(text.find("{path=\"a\\\"b\\\\c\\nd\"}"), std::string::npos) << text;
}

TEST(MetricsTest, SameSeriesIsReturnedAndConflictsAreRefused) {
  MetricsRegistry r;
  auto a = r.GetCounter("c_total", "h", {{"k", "v"}});
  auto b = r.GetCounter("c_total", "h", {{"k", "v"}});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(r.GetGauge("c_total", "h").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.GetCounter("c_total", "other help").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.GetCounter("9bad", "h").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.GetCounter("bad-name", "h").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.GetCounter("ok", "h", {{"bad-label", "v"}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.GetHistogram("hist", "h", {1, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.GetHistogram("hist", "h", {1}, {{"le", "x"}}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MetricsTest, ConcurrentUpdatesAreNotLost) {
  MetricsRegistry r;
  Counter* c = *r.GetCounter("n_total", "n");
  Histogram* h = *r.GetHistogram("lat", "l", ExponentialBuckets(1, 2, 4));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        c->Increment();
        h->Observe(3);
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(c->value(), 40000);
  EXPECT_EQ(h->snapshot().count, 40000u);
  EXPECT_EQ(h->snapshot().cumulative[1], 0u);      // <= 2
  EXPECT_EQ(h->snapshot().cumulative[2], 40000u);  // <= 4
}

TEST(MetricsTest, ServesOverHttpOnLoopback) {
  MetricsRegistry r;
  (*r.GetGauge("wsync_members", "Members."))->Set(4);
  MetricsServer server(&r);
  ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());
  ASSERT_GT(server.port(), 0);
  EXPECT_EQ(server.Start().code(), absl::StatusCode::kFailedPrecondition);
  httplib::Client client("127.0.0.1", server.port());
  client.set_connection_timeout(5);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_NE(res->body.find("wsync_members 4\n"), std::string::npos);
  EXPECT_NE(res->get_header_value("Content-Type").find("version=0.0.4"), std::string::npos);
  auto health = client.Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->body, "ok\n");
  EXPECT_EQ(client.Get("/nope")->status, 404);
  // A second server on the same port is refused with kUnavailable.
  MetricsServer clash(&r);
  EXPECT_EQ(clash.Start("127.0.0.1", server.port()).code(), absl::StatusCode::kUnavailable);
  server.Stop();
  server.Stop();  // idempotent
}

std::vector<std::string>* g_lines = nullptr;
void Capture(const std::string& line) { g_lines->push_back(line); }

TEST(LoggingTest, LevelsPrefixAndSink) {
  std::vector<std::string> lines;
  g_lines = &lines;
  SetLogSinkForTesting(&Capture);
  SetLogIdentity("trainer", 3);
  SetLogLevel(LogLevel::kInfo);
  int evaluated = 0;
  WSYNC_LOG(DEBUG) << "hidden " << ++evaluated;
  WSYNC_LOG(INFO) << "bucket " << 4;
  WSYNC_LOG(ERROR) << "boom";
  SetLogSinkForTesting(nullptr);
  EXPECT_EQ(evaluated, 0);  // disabled messages format nothing
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0][0], 'I');
  EXPECT_NE(lines[0].find(" trainer[3] metrics_test.cc:"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("] bucket 4\n"), std::string::npos) << lines[0];
  EXPECT_EQ(lines[1][0], 'E');
  LogLevel l;
  EXPECT_TRUE(ParseLogLevel("WARN", &l));
  EXPECT_EQ(l, LogLevel::kWarning);
  EXPECT_FALSE(ParseLogLevel("loud", &l));
  // The --log-level flag of the binaries: empty keeps the level, an unknown one changes nothing.
  SetLogLevel(LogLevel::kInfo);
  EXPECT_TRUE(ApplyLogLevelFlag(""));
  EXPECT_EQ(GetLogLevel(), LogLevel::kInfo);
  EXPECT_FALSE(ApplyLogLevelFlag("loud"));
  EXPECT_EQ(GetLogLevel(), LogLevel::kInfo);
  EXPECT_TRUE(ApplyLogLevelFlag("error"));
  EXPECT_EQ(GetLogLevel(), LogLevel::kError);
  SetLogLevel(LogLevel::kInfo);
}

}  // namespace
}  // namespace wsync
