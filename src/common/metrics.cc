#include "common/metrics.h"

#include <httplib.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace wsync {
namespace {

bool ValidName(absl::string_view n, bool allow_colon) {
  if (n.empty()) return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':') ||
                    (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

// Prometheus escaping: backslash and newline always; the double quote inside label values only.
std::string Escape(absl::string_view v, bool quote) {
  std::string out;
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '\n')
      out += "\\n";
    else if (quote && c == '"')
      out += "\\\"";
    else
      out.push_back(c);
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return absl::StrFormat("%.17g", v);
}

// {a="x",b="y"} with an optional extra label (le for histogram buckets); "" when empty.
std::string RenderLabels(const Labels& labels, absl::string_view extra_key = "", absl::string_view extra_value = "") {
  std::string out;
  for (const auto& [k, v] : labels)
    absl::StrAppend(&out, out.empty() ? "{" : ",", k, "=\"", Escape(v, /*quote=*/true), "\"");
  if (!extra_key.empty()) absl::StrAppend(&out, out.empty() ? "{" : ",", extra_key, "=\"", extra_value, "\"");
  if (!out.empty()) out += "}";
  return out;
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[i];
  sum_ += v;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t acc = 0;
  for (uint64_t c : counts_) {
    acc += c;
    s.cumulative.push_back(acc);
  }
  s.count = acc;
  s.sum = sum_;
  return s;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> b;
  for (int i = 0; i < count; ++i, start *= factor) b.push_back(start);
  return b;
}

MetricsRegistry& MetricsRegistry::Global() {
  static MetricsRegistry* registry = new MetricsRegistry();
  return *registry;
}

absl::StatusOr<MetricsRegistry::Family*> MetricsRegistry::FamilyFor(absl::string_view name, absl::string_view help,
                                                                    Type type, const std::vector<double>& bounds,
                                                                    const Labels& labels) {
  if (!ValidName(name, /*allow_colon=*/true))
    return absl::InvalidArgumentError(absl::StrCat("invalid metric name \"", name, "\""));
  for (const auto& [k, v] : labels)
    if (!ValidName(k, false) || k.rfind("__", 0) == 0 || (type == Type::kHistogram && k == "le"))
      return absl::InvalidArgumentError(absl::StrCat("metric ", name, ": invalid label name \"", k, "\""));
  if (type == Type::kHistogram) {
    if (bounds.empty()) return absl::InvalidArgumentError(absl::StrCat("histogram ", name, ": no buckets"));
    for (size_t i = 0; i < bounds.size(); ++i)
      if (!std::isfinite(bounds[i]) || (i > 0 && bounds[i] <= bounds[i - 1]))
        return absl::InvalidArgumentError(
            absl::StrCat("histogram ", name, ": bucket bounds must be finite and strictly increasing"));
  }
  auto [it, inserted] = families_.try_emplace(std::string(name));
  Family& f = it->second;
  if (inserted) {
    f.type = type;
    f.help = std::string(help);
    f.bounds = bounds;
  } else if (f.type != type || f.help != help || f.bounds != bounds) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", name, " is already registered with another type, help text or buckets"));
  }
  return &f;
}

absl::StatusOr<Counter*> MetricsRegistry::GetCounter(absl::string_view name, absl::string_view help,
                                                     const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto f = FamilyFor(name, help, Type::kCounter, {}, labels);
  if (!f.ok()) return f.status();
  auto& slot = (*f)->counters[labels];
  if (!slot) slot = std::make_unique<Counter>();
  return slot.get();
}

absl::StatusOr<Gauge*> MetricsRegistry::GetGauge(absl::string_view name, absl::string_view help, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto f = FamilyFor(name, help, Type::kGauge, {}, labels);
  if (!f.ok()) return f.status();
  auto& slot = (*f)->gauges[labels];
  if (!slot) slot = std::make_unique<Gauge>();
  return slot.get();
}

absl::StatusOr<Histogram*> MetricsRegistry::GetHistogram(absl::string_view name, absl::string_view help,
                                                         const std::vector<double>& bounds, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto f = FamilyFor(name, help, Type::kHistogram, bounds, labels);
  if (!f.ok()) return f.status();
  auto& slot = (*f)->histograms[labels];
  if (!slot) slot = std::make_unique<Histogram>(bounds);
  return slot.get();
}

std::string MetricsRegistry::RenderPrometheus() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    static constexpr const char* kTypeNames[] = {"counter", "gauge", "histogram"};
    absl::StrAppend(&out, "# HELP ", name, " ", Escape(f.help, /*quote=*/false), "\n# TYPE ", name, " ",
                    kTypeNames[static_cast<int>(f.type)], "\n");
    for (const auto& [labels, c] : f.counters)
      absl::StrAppend(&out, name, RenderLabels(labels), " ", FormatValue(c->value()), "\n");
    for (const auto& [labels, g] : f.gauges)
      absl::StrAppend(&out, name, RenderLabels(labels), " ", FormatValue(g->value()), "\n");
    for (const auto& [labels, h] : f.histograms) {
      const Histogram::Snapshot s = h->snapshot();
      for (size_t i = 0; i < s.cumulative.size(); ++i) {
        const std::string le = i < f.bounds.size() ? FormatValue(f.bounds[i]) : "+Inf";
        absl::StrAppend(&out, name, "_bucket", RenderLabels(labels, "le", le), " ", s.cumulative[i], "\n");
      }
      absl::StrAppend(&out, name, "_sum", RenderLabels(labels), " ", FormatValue(s.sum), "\n");
      absl::StrAppend(&out, name, "_count", RenderLabels(labels), " ", s.count, "\n");
    }
  }
  return out;
}

MetricsServer::MetricsServer(const MetricsRegistry* registry) : registry_(registry) {}

MetricsServer::~MetricsServer() { Stop(); }

absl::Status MetricsServer::Start(const std::string& host, int port) {
  if (server_) return absl::FailedPreconditionError("metrics server already started");
  auto server = std::make_unique<httplib::Server>();
  // httplib's default adds SO_REUSEPORT, which would let a second agent silently share the
  // port; keep only SO_REUSEADDR so a clash is an error.
  server->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const MetricsRegistry* registry = registry_;
  server->Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry->RenderPrometheus(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server->Get("/healthz",
              [](const httplib::Request&, httplib::Response& res) { res.set_content("ok\n", "text/plain"); });
  int bound = port;
  if (port == 0) {
    bound = server->bind_to_any_port(host);
  } else if (!server->bind_to_port(host, port)) {
    bound = -1;
  }
  if (bound < 0) return absl::UnavailableError(absl::StrCat("metrics server: cannot bind ", host, ":", port));
  port_ = bound;
  server_ = std::move(server);
  thread_ = std::thread([s = server_.get()] { s->listen_after_bind(); });
  return absl::OkStatus();
}

void MetricsServer::Stop() {
  if (!server_) return;
  server_->stop();
  if (thread_.joinable()) thread_.join();
  server_.reset();
  port_ = -1;
}

}  // namespace wsync
