// A metrics registry (counters, gauges, histograms with labels) rendered in the Prometheus text
// exposition format (version 0.0.4), and a small HTTP endpoint (cpp-httplib) serving it.
//
// Every agent owns one MetricsRegistry (or uses Global()) and, when asked to, a MetricsServer on
// --metrics-port. Metric objects are created once and then updated lock-free on hot paths.
// Ownership: the registry owns every metric; pointers it returns stay valid for its lifetime.
// Thread-safety: all methods of all classes here may be called from any thread.
// Errors: invalid metric or label names, or re-registering a name with another type, help text
// or bucket layout, are kInvalidArgument naming the metric.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace httplib {
class Server;
}

namespace wsync {

using Labels = std::map<std::string, std::string>;

class Counter {
 public:
  void Increment(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }  // v >= 0
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v) { value_.fetch_add(v, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // `bounds`: strictly increasing finite upper bounds; +Inf is implicit.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  // Cumulative counts per bound (the last entry is +Inf), the sum and the count, consistent
  // with each other.
  struct Snapshot {
    std::vector<uint64_t> cumulative;
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // GUARDED_BY(mu_), one per bound plus +Inf
  double sum_ = 0;                // GUARDED_BY(mu_)
};

// Exponential bucket bounds: start, start*factor, ... (count values).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // The process-wide registry.
  static MetricsRegistry& Global();

  // Returns the metric of that name and label set, creating it on first use.
  absl::StatusOr<Counter*> GetCounter(absl::string_view name, absl::string_view help, const Labels& labels = {});
  absl::StatusOr<Gauge*> GetGauge(absl::string_view name, absl::string_view help, const Labels& labels = {});
  absl::StatusOr<Histogram*> GetHistogram(absl::string_view name, absl::string_view help,
                                          const std::vector<double>& bounds, const Labels& labels = {});

  // Prometheus text format: "# HELP", "# TYPE", then one sample line per series, families
  // sorted by name, series by labels.
  std::string RenderPrometheus() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    std::string help;
    std::vector<double> bounds;
    std::map<Labels, std::unique_ptr<Counter>> counters;
    std::map<Labels, std::unique_ptr<Gauge>> gauges;
    std::map<Labels, std::unique_ptr<Histogram>> histograms;
  };
  absl::StatusOr<Family*> FamilyFor(absl::string_view name, absl::string_view help, Type type,
                                    const std::vector<double>& bounds, const Labels& labels);

  mutable std::mutex mu_;
  std::map<std::string, Family> families_;  // GUARDED_BY(mu_)
};

// Serves GET /metrics (the registry, text/plain; version=0.0.4) and GET /healthz ("ok").
class MetricsServer {
 public:
  explicit MetricsServer(const MetricsRegistry* registry);
  ~MetricsServer();  // stops the server
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Binds host:port (port 0 picks a free port) and serves from a background thread. Defaults to
  // loopback: expose it further only on purpose. kUnavailable if the address cannot be bound;
  // kFailedPrecondition if already started.
  absl::Status Start(const std::string& host = "127.0.0.1", int port = 0);
  int port() const { return port_; }
  // Stops serving and joins the thread. Idempotent.
  void Stop();

 private:
  const MetricsRegistry* registry_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = -1;
};

}  // namespace wsync
