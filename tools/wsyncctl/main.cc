// wsyncctl: the operators' command line for a running wsync deployment.
//
//   wsyncctl [--coordinator HOST:PORT] [--token-file F] [--tls-ca F] [--json] [--timeout S] COMMAND
//     sync [--wait] [--wait-if-busy] [--min-agents N] [--version V]   trigger a sync (and watch it)
//     status                                           the fleet's version and what each engine serves
//     members                                          the rollout agents and their versions
//     engines                                          the fleet: each engine's missing TP ranks, removed or not
//     remove-engine ENGINE                             take an engine out of the fleet (no longer counted behind)
//     versions                                         every sync attempt: version, outcome, engines behind
//     timings [VERSION]                                per-phase seconds and GB/s of one sync (default: latest)
//     verify --against HF_DIR [--quant-config F]       recompute every engine rank's weights from a checkpoint
//                                                      and compare them, bit for bit, with what it holds
//            [--independent]                           instead: decode every rank's memory with the independent
//                                                      reference and compare with the checkpoint it quantizes
//     generate --engine ADDR --prompt 1,2,3 [--max-new-tokens K]   one request to an engine (smoke test)
//     update-weights --agent ADDR [--min-version V]    bring the engine behind an agent to a published version
//
// Exit codes: 0 success; 1 the operation failed (a sync failed, verify found differences);
// 2 bad usage or input; 3 the coordinator or an agent is unreachable or timed out;
// 4 refused (wrong or missing token); 5 busy (a sync is already running) or refused by the fleet's
// state; 6 the sync was committed on part of the fleet only (partial: the engines left behind named).
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <map>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/functional/function_ref.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/rpc_security.h"
#include "common/status.h"
#include "common/units.h"
#include "engine_model/engine_layout.h"
#include "nlohmann/json.hpp"
#include "tools/wsyncctl/reference/reference.h"
#include "tools/wsyncctl/verify.h"
#include "trainer_agent/quantize/quant_select.h"
#include "wsync/v1/coordinator.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"
#include "wsync/v1/rollout.grpc.pb.h"

namespace wsync {
namespace {

using json = nlohmann::json;

struct Globals {
  std::string coordinator = "127.0.0.1:7070";
  RpcSecurityOptions sec_options;
  RpcSecurity sec;
  bool json = false;
  double timeout_s = 30;
};

int ExitCodeFor(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk: return 0;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound: return 2;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded: return 3;
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied: return 4;
    case absl::StatusCode::kFailedPrecondition: return 5;
    default: return 1;
  }
}

// `server`: what was called ("the coordinator at ADDR" by default), for the hint.
int Fail(const absl::Status& s, const Globals& g, const std::string& server = "") {
  if (g.json) {
    std::printf(
        "%s\n",
        json({{"ok", false}, {"code", absl::StatusCodeToString(s.code())}, {"error", s.message()}}).dump(2).c_str());
  } else {
    std::fprintf(stderr, "wsyncctl: %s\n", s.ToString().c_str());
    if (absl::IsUnavailable(s)) {
      if (server.empty()) {
        std::fprintf(stderr, "  (is the coordinator running at %s? see --coordinator", g.coordinator.c_str());
      } else {
        std::fprintf(stderr, "  (is %s running?", server.c_str());
      }
      std::fprintf(stderr, "%s)\n",
                   g.sec.tls() ? "; with TLS, --tls-ca must be the CA that signed its certificate, and "
                                 "--tls-cert / --tls-key a client certificate it accepts"
                               : "; a deployment that runs TLS needs --tls-ca (and --tls-cert / --tls-key)");
    }
    if (absl::IsUnauthenticated(s))
      std::fprintf(stderr, "  (pass the deployment's token with --token-file or WSYNC_TOKEN)\n");
  }
  return ExitCodeFor(s);
}

class Ctl {
 public:
  explicit Ctl(const Globals& g) : g_(g), stub_(v1::Coordinator::NewStub(MakeChannel(g.coordinator, g.sec))) {}

  template <typename Req, typename Reply>
  absl::Status Call(grpc::Status (v1::Coordinator::Stub::*rpc)(grpc::ClientContext*, const Req&, Reply*),
                    const Req& req, Reply* reply) {
    grpc::ClientContext ctx;
    PrepareContext(&ctx, g_.sec, absl::Seconds(g_.timeout_s));
    return FromGrpcStatus(((*stub_).*rpc)(&ctx, req, reply));
  }

  int Status() {
    v1::StatusReply r;
    if (auto s = Call(&v1::Coordinator::Stub::Status, v1::StatusRequest(), &r); !s.ok()) return Fail(s, g_);
    if (g_.json) {
      json engines = json::array();
      for (const auto& e : r.engines()) {
        json ranks = json::array();
        for (const auto& rv : e.rank_versions())
          ranks.push_back({{"tp_rank", rv.tp_rank()}, {"version", rv.version()}, {"has_agent", rv.has_agent()}});
        engines.push_back({{"engine_id", e.engine_id()},
                           {"tp_size", e.tp_size()},
                           {"version", e.version()},
                           {"behind", e.behind()},
                           {"removed", e.removed()},
                           {"ranks", ranks}});
      }
      std::printf("%s\n", json({{"version", r.version()},
                                {"state", r.state()},
                                {"running_sync_id", r.running_sync_id()},
                                {"members", r.members()},
                                {"trainer_ranks", r.trainer_ranks()},
                                {"last_error", r.last_error()},
                                {"engines_behind", r.engines_behind()},
                                {"engines", engines}})
                              .dump(2)
                              .c_str());
      return 0;
    }
    std::printf(
        "coordinator %s: %s, version %llu%s, %u rollout agents, %u trainer ranks\n", g_.coordinator.c_str(),
        r.state().c_str(), static_cast<unsigned long long>(r.version()),
        r.engines_behind()
            ? absl::StrCat(" (", r.engines_behind(), " engine", r.engines_behind() > 1 ? "s" : "", " BEHIND)").c_str()
            : "",
        r.members(), r.trainer_ranks());
    if (r.running_sync_id()) std::printf("running sync %llu\n", static_cast<unsigned long long>(r.running_sync_id()));
    for (const auto& e : r.engines()) {
      std::string state;
      if (e.removed()) {
        state = "out of the fleet (remove-engine)";
      } else if (e.version() != 0 && !e.behind()) {
        state = absl::StrCat("serves version ", e.version());
      } else {
        std::vector<std::string> ranks;
        for (const auto& rv : e.rank_versions())
          ranks.push_back(absl::StrCat(e.tp_size() > 1 ? absl::StrCat("tp ", rv.tp_rank(), " ") : "",
                                       rv.has_agent() ? absl::StrCat("on version ", rv.version()) : "no agent"));
        state = absl::StrCat(e.behind() ? "BEHIND: " : "", absl::StrJoin(ranks, ", "));
      }
      std::printf("  engine %-14s tp %-3u %s\n", e.engine_id().c_str(), e.tp_size(), state.c_str());
    }
    if (!r.last_error().empty()) std::printf("last error: %s\n", r.last_error().c_str());
    return 0;
  }

  int Members() {
    v1::MembersReply r;
    if (auto s = Call(&v1::Coordinator::Stub::Members, v1::MembersRequest(), &r); !s.ok()) return Fail(s, g_);
    if (g_.json) {
      json out = json::array();
      for (const auto& m : r.members()) {
        out.push_back({{"agent_id", m.agent_id()},
                       {"address", m.agent_address()},
                       {"engine_id", m.engine_id()},
                       {"tp_rank", m.tp_rank()},
                       {"tp_size", m.tp_size()},
                       {"version", m.version()},
                       {"heartbeat_age_s", m.last_heartbeat_age_seconds()}});
      }
      std::printf("%s\n", out.dump(2).c_str());
      return 0;
    }
    std::printf("%-10s %-22s %-12s %-7s %-8s %s\n", "AGENT", "ADDRESS", "ENGINE", "TP", "VERSION", "HEARTBEAT");
    for (const auto& m : r.members()) {
      std::printf("%-10s %-22s %-12s %u/%-5u %-8llu %.1f s ago\n", m.agent_id().c_str(), m.agent_address().c_str(),
                  m.engine_id().c_str(), m.tp_rank(), m.tp_size(), static_cast<unsigned long long>(m.version()),
                  m.last_heartbeat_age_seconds());
    }
    return 0;
  }

  // The fleet: every engine an agent has joined for, its missing TP ranks, and whether it was
  // taken out (remove-engine). A sync publishes only when no engine of the fleet misses a rank.
  int Engines() {
    v1::MembersReply r;
    if (auto s = Call(&v1::Coordinator::Stub::Members, v1::MembersRequest(), &r); !s.ok()) return Fail(s, g_);
    if (g_.json) {
      json out = json::array();
      for (const auto& e : r.engines())
        out.push_back({{"engine_id", e.engine_id()},
                       {"tp_size", e.tp_size()},
                       {"missing_ranks", std::vector<uint32_t>(e.missing_ranks().begin(), e.missing_ranks().end())},
                       {"removed", e.removed()}});
      std::printf("%s\n", out.dump(2).c_str());
      return 0;
    }
    std::printf("%-16s %-4s %s\n", "ENGINE", "TP", "STATE");
    for (const auto& e : r.engines()) {
      std::string state = e.removed() ? "out of the fleet (remove-engine): not synced" : "complete";
      if (!e.removed() && e.missing_ranks_size() > 0) {
        state = "MISSING TP rank";
        for (int i = 0; i < e.missing_ranks_size(); ++i) absl::StrAppend(&state, i ? ", " : " ", e.missing_ranks(i));
        absl::StrAppend(&state, ": it sits syncs out (and is behind) until it is back or removed");
      }
      std::printf("%-16s %-4u %s\n", e.engine_id().c_str(), e.tp_size(), state.c_str());
    }
    return 0;
  }

  int RemoveEngine(const std::string& engine_id) {
    v1::RemoveEngineRequest req;
    req.set_engine_id(engine_id);
    v1::RemoveEngineReply r;
    if (auto s = Call(&v1::Coordinator::Stub::RemoveEngine, req, &r); !s.ok()) return Fail(s, g_);
    if (!g_.json) std::printf("engine %s is out of the fleet: syncs no longer include it\n", engine_id.c_str());
    return 0;
  }

  int Versions() {
    v1::VersionsReply r;
    if (auto s = Call(&v1::Coordinator::Stub::Versions, v1::VersionsRequest(), &r); !s.ok()) return Fail(s, g_);
    if (g_.json) {
      json out = json::array();
      for (const auto& v : r.versions()) {
        out.push_back({{"version", v.version()},
                       {"sync_id", v.sync_id()},
                       {"ok", v.ok()},
                       {"outcome", v.outcome()},
                       {"behind", std::vector<std::string>(v.behind().begin(), v.behind().end())},
                       {"caught_up_unix_ms", v.caught_up_unix_ms()},
                       {"error", v.error()},
                       {"seconds", v.seconds()},
                       {"bytes", v.bytes()},
                       {"finished_unix_ms", v.finished_unix_ms()}});
      }
      std::printf("%s\n", out.dump(2).c_str());
      return 0;
    }
    std::printf("%-8s %-6s %-8s %10s %12s  %s\n", "VERSION", "SYNC", "OUTCOME", "SECONDS", "BYTES", "DETAIL");
    for (const auto& v : r.versions()) {
      std::string outcome = v.outcome().empty() ? (v.ok() ? "done" : "failed") : v.outcome();
      std::string detail = v.error();
      if (outcome == "partial") {
        detail = v.behind_size() > 0
                     ? absl::StrCat("BEHIND: ", absl::StrJoin(v.behind(), ", "))
                     : absl::StrCat("every engine caught up", v.caught_up_unix_ms() ? " since " : "",
                                    v.caught_up_unix_ms()
                                        ? absl::FormatTime("%H:%M:%S", absl::FromUnixMillis(v.caught_up_unix_ms()),
                                                           absl::LocalTimeZone())
                                        : "");
        if (!v.error().empty()) absl::StrAppend(&detail, " [", v.error(), "]");
      }
      for (char& c : outcome) c = outcome == "done" ? c : static_cast<char>(std::toupper(c));
      std::printf("%-8llu %-6llu %-8s %10.3f %12s  %s\n", static_cast<unsigned long long>(v.version()),
                  static_cast<unsigned long long>(v.sync_id()), outcome.c_str(), v.seconds(),
                  FormatBytes(v.bytes()).c_str(), detail.c_str());
    }
    return 0;
  }

  int Timings(uint64_t version) {
    v1::TimingsRequest req;
    req.set_version(version);
    v1::TimingsReply r;
    if (auto s = Call(&v1::Coordinator::Stub::Timings, req, &r); !s.ok()) return Fail(s, g_);
    if (g_.json) {
      json phases = json::array();
      for (const auto& p : r.phases())
        phases.push_back({{"phase", p.phase()}, {"seconds", p.seconds()}, {"bytes", p.bytes()}});
      json out{{"version", r.version()}, {"sync_id", r.sync_id()}, {"delivery", r.delivery()}, {"phases", phases}};
      if (r.tensor_bytes() > 0)
        out["delta"] = {{"base", r.delta_base()},
                        {"tensor_bytes", r.tensor_bytes()},
                        {"sent_bytes", r.sent_bytes()},
                        {"items", r.delta_items()},
                        {"changed_items", r.changed_items()},
                        {"quant_groups", r.quant_groups()},
                        {"reused_groups", r.reused_groups()},
                        {"undigested_groups", r.undigested_groups()}};
      std::printf("%s\n", out.dump(2).c_str());
      return 0;
    }
    std::printf("version %llu (sync %llu, %s delivery)\n%-18s %10s %12s %10s\n",
                static_cast<unsigned long long>(r.version()), static_cast<unsigned long long>(r.sync_id()),
                r.delivery().c_str(), "PHASE", "SECONDS", "BYTES", "GB/s");
    for (const auto& p : r.phases()) {
      std::printf("%-18s %10.4f %12s %10s\n", p.phase().c_str(), p.seconds(),
                  p.bytes() ? FormatBytes(p.bytes()).c_str() : "-",
                  p.bytes() && p.seconds() > 0 ? absl::StrFormat("%.2f", p.bytes() / p.seconds() / 1e9).c_str() : "-");
    }
    if (r.tensor_bytes() > 0) {  // the trainer kept a delta base: what it sent against a full sync
      const double sent = 100.0 * static_cast<double>(r.sent_bytes()) / static_cast<double>(r.tensor_bytes());
      std::string line = absl::StrFormat(
          "%s: %s sent of %s (%.2f %%)",
          r.delta_base() ? absl::StrCat("deltas from version ", r.delta_base()) : "in full (delta base kept)",
          FormatBytes(r.sent_bytes()), FormatBytes(r.tensor_bytes()), sent);
      if (r.delta_items() > 0)
        absl::StrAppendFormat(&line, "; %d of %d elements changed (%.3f %%)", r.changed_items(), r.delta_items(),
                              100.0 * static_cast<double>(r.changed_items()) / static_cast<double>(r.delta_items()));
      if (r.quant_groups() > 0)
        absl::StrAppendFormat(&line, "; %d of %d quantization groups not quantized again (inputs unchanged)",
                              r.reused_groups(), r.quant_groups());
      if (r.undigested_groups() > 0)
        absl::StrAppendFormat(&line, ", %d quantized without digests (where they did not pay)", r.undigested_groups());
      std::printf("%s\n", line.c_str());
    }
    return 0;
  }

  int Sync(bool wait, bool wait_if_busy, uint32_t min_agents, uint64_t version, const std::string& delivery,
           const std::string& delta) {
    v1::TriggerSyncRequest req;
    req.set_delivery(delivery);
    req.set_delta(delta);
    req.set_wait_if_busy(wait_if_busy);
    req.set_min_agents(min_agents);
    req.set_version(version);
    v1::TriggerSyncReply r;
    if (auto s = Call(&v1::Coordinator::Stub::TriggerSync, req, &r); !s.ok()) return Fail(s, g_);
    if (!wait) {
      if (g_.json) {
        std::printf(
            "%s\n",
            json({{"sync_id", r.sync_id()}, {"version", r.version()}, {"coalesced", r.coalesced()}}).dump(2).c_str());
      } else {
        std::printf("sync %llu %s -> version %llu\n", static_cast<unsigned long long>(r.sync_id()),
                    r.coalesced() ? "(already requested)" : "started", static_cast<unsigned long long>(r.version()));
      }
      return 0;
    }
    return Watch(r.sync_id());
  }

  int Watch(uint64_t id) {
    grpc::ClientContext ctx;
    PrepareContext(&ctx, g_.sec, absl::Hours(24));
    v1::WatchSyncRequest req;
    req.set_sync_id(id);
    auto reader = stub_->WatchSync(&ctx, req);
    v1::SyncEvent e, last;
    const bool tty = isatty(STDERR_FILENO) && !g_.json;
    std::string last_phase;
    while (reader->Read(&e)) {
      last = e;
      if (g_.json) continue;
      if (tty) {
        const double rate = e.elapsed_seconds() > 0 ? e.bytes_done() / e.elapsed_seconds() : 0;
        std::string eta = "-";
        if (rate > 0 && e.bytes_total() > e.bytes_done())
          eta = absl::StrFormat("%.1fs", (e.bytes_total() - e.bytes_done()) / rate);
        const int width = 30;
        const int filled =
            e.bytes_total() ? static_cast<int>(width * std::min(1.0, double(e.bytes_done()) / e.bytes_total())) : 0;
        std::fprintf(stderr, "\r\033[K%-9s [%s%s] %llu buckets  %s / %s  %.2f GB/s  ETA %s", e.phase().c_str(),
                     std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                     static_cast<unsigned long long>(e.buckets_done()), FormatBytes(e.bytes_done()).c_str(),
                     e.bytes_total() ? FormatBytes(e.bytes_total()).c_str() : "?", rate / 1e9, eta.c_str());
      } else if (e.phase() != last_phase) {
        std::fprintf(stderr, "sync %llu: %s (%.2f s)\n", static_cast<unsigned long long>(e.sync_id()),
                     e.phase().c_str(), e.elapsed_seconds());
      }
      last_phase = e.phase();
    }
    if (tty) std::fprintf(stderr, "\n");
    absl::Status s = FromGrpcStatus(reader->Finish());
    if (absl::IsUnavailable(s) && last.sync_id() != 0) {
      // The coordinator went away mid-sync: say what that means rather than "Socket closed".
      s = absl::UnavailableError(absl::StrCat(
          "lost the coordinator at ", g_.coordinator, " during sync ", id, " (version ", last.version(), ", phase ",
          last.phase(), ", ", absl::StrFormat("%.1f", last.elapsed_seconds()),
          " s in): the trainer job (its rank 0) is gone, e.g. a trainer rank died and mpirun ended the job. No "
          "engine committed this version unless `wsyncctl versions` lists it after the restart; restart the trainer "
          "job (with the same --state-dir), then sync again [",
          s.message(), "]"));
    }
    if (!s.ok()) return Fail(s, g_);
    const bool ok = last.phase() == "done";
    const bool partial = last.phase() == "partial";
    if (g_.json) {
      std::printf("%s\n", json({{"sync_id", last.sync_id()},
                                {"version", last.version()},
                                {"ok", ok},
                                {"outcome", last.phase()},
                                {"phase", last.phase()},
                                {"seconds", last.elapsed_seconds()},
                                {"bytes", last.bytes_done()},
                                {"error", last.error()}})
                              .dump(2)
                              .c_str());
    } else if (ok) {
      std::printf("sync %llu: version %llu published in %.3f s (%s)\n", static_cast<unsigned long long>(last.sync_id()),
                  static_cast<unsigned long long>(last.version()), last.elapsed_seconds(),
                  FormatBytes(last.bytes_done()).c_str());
    } else if (partial) {
      std::printf("sync %llu: version %llu PARTIAL (published to part of the fleet) in %.3f s: %s\n",
                  static_cast<unsigned long long>(last.sync_id()), static_cast<unsigned long long>(last.version()),
                  last.elapsed_seconds(), last.error().c_str());
      for (const auto& m : last.members()) {
        if (!m.error().empty())
          std::printf("  %s (engine %s tp %u): %s\n", m.agent_id().c_str(), m.engine_id().c_str(), m.tp_rank(),
                      m.error().c_str());
      }
    } else {
      std::printf("sync %llu FAILED: %s\n", static_cast<unsigned long long>(last.sync_id()), last.error().c_str());
      for (const auto& m : last.members()) {
        if (!m.error().empty())
          std::printf("  %s (engine %s tp %u): %s\n", m.agent_id().c_str(), m.engine_id().c_str(), m.tp_rank(),
                      m.error().c_str());
      }
    }
    return ok ? 0 : partial ? 6 : 1;
  }

  // What both verifies share: for every member, its agent's stub and EngineChecksums (the engine's
  // config, TP layout, version and checksums; its error otherwise), handed to `check`, which prints
  // its lines, fills its JSON entry and says whether the rank passed. With --json the entries are
  // printed at the end. Exit status 0 when there is a member and every one passed.
  using RankCheck = absl::FunctionRef<bool(const v1::Member&, v1::RolloutAgent::Stub&, absl::Status,
                                           const v1::EngineChecksumsReply&, json*)>;
  int ForEveryEngineRank(const v1::MembersReply& members, RankCheck check) {
    json out = json::array();
    bool all_ok = members.members_size() > 0;
    if (members.members_size() == 0 && !g_.json) std::printf("no rollout agents to verify\n");
    for (const auto& m : members.members()) {
      auto stub = v1::RolloutAgent::NewStub(MakeChannel(m.agent_address(), g_.sec));
      grpc::ClientContext ctx;
      PrepareContext(&ctx, g_.sec, absl::Seconds(g_.timeout_s) + absl::Minutes(5));
      v1::EngineChecksumsReply r;
      absl::Status s = FromGrpcStatus(stub->EngineChecksums(&ctx, v1::EngineChecksumsRequest(), &r));
      json entry;
      all_ok = check(m, *stub, s, r, &entry) && all_ok;
      out.push_back(std::move(entry));
    }
    if (g_.json) std::printf("%s\n", json({{"ok", all_ok}, {"engines", out}}).dump(2).c_str());
    return all_ok ? 0 : 1;
  }

  int Verify(const std::string& hf_dir, const std::string& quant_file) {
    v1::MembersReply members;
    if (auto s = Call(&v1::Coordinator::Stub::Members, v1::MembersRequest(), &members); !s.ok()) return Fail(s, g_);
    std::optional<QuantizationConfig> quant;
    if (!quant_file.empty()) {
      auto q = LoadQuantizationConfig(quant_file);
      if (!q.ok()) return Fail(q.status(), g_);
      quant = *q;
    }
    // What a sync must have delivered, per quantization: --quant-config for every engine, else each
    // engine's own (engines may declare different layouts of one quantization), else the
    // checkpoint's. Computed once per distinct config.
    std::map<std::string, std::unique_ptr<trainer_agent::ExpectedSync>> expected_by_quant;
    // mtp: the MTP layers a sync delivers too (an engine holding the NextN draft needs them).
    auto expected_for = [&](const std::optional<QuantizationConfig>& engine_quant, const std::string& key,
                            int64_t mtp = 0) -> absl::StatusOr<const trainer_agent::ExpectedSync*> {
      const bool own = quant_file.empty() && engine_quant.has_value();
      const std::string k = absl::StrCat(own ? key : std::string(), mtp > 0 ? absl::StrCat("\n--mtp ", mtp) : "");
      auto it = expected_by_quant.find(k);
      if (it != expected_by_quant.end()) return it->second.get();
      ASSIGN_OR_RETURN(trainer_agent::ExpectedSync e,
                       trainer_agent::ExpectedSentTensorsFromDir(hf_dir, own ? engine_quant : quant, {}, mtp));
      auto owned = std::make_unique<trainer_agent::ExpectedSync>(std::move(e));
      const trainer_agent::ExpectedSync* p = owned.get();
      expected_by_quant.emplace(k, std::move(owned));
      return p;
    };
    if (quant_file.empty()) {  // the checkpoint must be readable whatever the engines say
      if (auto e = expected_for(std::nullopt, ""); !e.ok()) return Fail(e.status(), g_);
    } else if (auto e = expected_for(quant, ""); !e.ok()) {
      return Fail(e.status(), g_);
    }
    return ForEveryEngineRank(members, [&](const v1::Member& m, v1::RolloutAgent::Stub&, absl::Status s,
                                           const v1::EngineChecksumsReply& r, json* entry) {
      tools::VerifyResult vr;
      if (s.ok()) {
        auto model = ParseModelConfig(r.model_config_json(), "engine config");
        std::optional<QuantizationConfig> engine_quant;
        if (model.ok() && !r.quantization_config_json().empty()) {
          auto q = ParseQuantizationConfig(r.quantization_config_json(), "engine quantization config");
          if (q.ok())
            engine_quant = *q;
          else
            s = q.status();
        }
        if (!model.ok()) s = model.status();
        absl::StatusOr<engine_model::EngineLayout> layout = absl::InternalError("unset");
        // an engine holding an MTP layer's eh_proj serves the NextN draft (engine_model README
        // decision 20): its layout has the draft, and the sync must have delivered the MTP layer
        engine_model::EngineParallel parallel{static_cast<int>(r.tp_size()), static_cast<int>(r.tp_rank()),
                                              static_cast<int>(r.ep_size())};
        for (const auto& p : r.params())
          parallel.mtp_draft = parallel.mtp_draft || engine_model::IsMtpDraftParam(p.name());
        if (s.ok()) {
          layout = engine_model::EngineLayout::Create(*model, engine_quant ? &*engine_quant : nullptr, parallel);
          s = layout.status();
        }
        absl::StatusOr<const trainer_agent::ExpectedSync*> expected = absl::InternalError("unset");
        if (s.ok()) {
          expected = expected_for(engine_quant, r.quantization_config_json(),
                                  parallel.mtp_draft ? model->num_nextn_predict_layers : 0);
          s = expected.status();
        }
        if (s.ok()) {
          auto weights = tools::ExpectedEngineWeights(*layout, (*expected)->tensors);
          if (!weights.ok()) {
            s = Annotate(weights.status(), "recomputing the engine weights from the checkpoint");
          } else {
            std::map<std::string, uint64_t> actual;
            for (const auto& p : r.params()) actual[p.name()] = p.xxh3_64();
            auto want = tools::ChecksumWeights((*weights)->weights());
            if (want.ok())
              vr = tools::CompareChecksums(*want, actual);
            else
              s = want.status();
          }
        }
      }
      const bool ok = s.ok() && vr.ok();
      if (g_.json) {
        *entry = json({{"agent_id", m.agent_id()},
                       {"engine_id", m.engine_id()},
                       {"tp_rank", m.tp_rank()},
                       {"version", r.version()},
                       {"ok", ok},
                       {"params", vr.params},
                       {"mismatched", vr.mismatched},
                       {"missing", vr.missing},
                       {"unexpected", vr.unexpected},
                       {"error", std::string(s.message())}});
      } else if (!s.ok()) {
        std::printf("%s engine %s tp %u: ERROR %s\n", m.agent_id().c_str(), m.engine_id().c_str(), m.tp_rank(),
                    s.ToString().c_str());
      } else {
        std::printf("%s engine %s tp %u version %llu: %s (%zu params", m.agent_id().c_str(), m.engine_id().c_str(),
                    m.tp_rank(), static_cast<unsigned long long>(r.version()), ok ? "bit-exact" : "DIFFERS", vr.params);
        if (!ok)
          std::printf(", %zu differ, %zu missing, %zu unexpected", vr.mismatched.size(), vr.missing.size(),
                      vr.unexpected.size());
        std::printf(")\n");
        for (size_t i = 0; i < vr.mismatched.size() && i < 10; ++i)
          std::printf("  differs: %s\n", vr.mismatched[i].c_str());
      }
      return ok;
    });
  }

  // verify --independent: every engine rank's memory (ReadEngine) decoded by the independent
  // reference (tools/wsyncctl/reference/: specs re-implemented in scalar code, sharing nothing with
  // the loader, repack or kernels) and compared with the checkpoint quantized by it: codes, scales
  // and zero points exactly, bf16 params bit for bit. One Reference per quantization config.
  int VerifyIndependent(const std::string& hf_dir, const std::string& quant_file) {
    v1::MembersReply members;
    if (auto s = Call(&v1::Coordinator::Stub::Members, v1::MembersRequest(), &members); !s.ok()) return Fail(s, g_);
    std::string forced_quant;
    if (!quant_file.empty()) {
      auto text = ReadTextFile(quant_file);
      if (!text.ok()) return Fail(text.status(), g_);
      forced_quant = *text;
    }
    std::map<std::string, std::unique_ptr<tools::reference::Reference>> refs;  // by quantization config text
    return ForEveryEngineRank(members, [&](const v1::Member& m, v1::RolloutAgent::Stub& stub, absl::Status s,
                                           const v1::EngineChecksumsReply& info, json* entry) {
      // The engine's memory, param by param (one version: the agent reads it under the commit's lock).
      std::vector<tools::reference::EngineParam> params;
      uint64_t version = 0;
      if (s.ok()) {
        grpc::ClientContext ctx;
        PrepareContext(&ctx, g_.sec, absl::Seconds(g_.timeout_s) + absl::Minutes(10));
        auto reader = stub.ReadEngine(&ctx, v1::ReadEngineRequest());
        v1::EngineChunk c;
        bool last = false;
        while (reader->Read(&c)) {
          version = c.version();
          if (c.last()) {
            last = true;
            break;
          }
          if (c.param() == params.size()) {
            tools::reference::EngineParam p;
            p.name = c.name();
            p.dtype = c.dtype();
            p.shape.assign(c.shape().begin(), c.shape().end());
            p.bytes.reserve(c.nbytes());
            params.push_back(std::move(p));
          }
          if (c.param() + 1 != params.size() || c.offset() != params.back().bytes.size()) {
            s = absl::DataLossError(
                absl::StrCat("ReadEngine: chunk of param ", c.param(), " at offset ", c.offset(), " out of order"));
            ctx.TryCancel();
            break;
          }
          params.back().bytes.append(c.data());
        }
        absl::Status fin = FromGrpcStatus(reader->Finish());
        if (s.ok() && !fin.ok()) s = Annotate(fin, "reading the engine's memory (ReadEngine)");
        if (s.ok() && !last) s = absl::DataLossError("ReadEngine: the stream ended before its last chunk");
      }
      absl::StatusOr<tools::reference::RankReport> report = absl::InternalError("unset");
      if (s.ok()) {
        const std::string quant = quant_file.empty() ? info.quantization_config_json() : forced_quant;
        auto it = refs.find(quant);
        if (it == refs.end()) {
          auto ref = tools::reference::Reference::Open(hf_dir, {.quantization_config_json = quant});
          if (ref.ok()) {
            it = refs.emplace(quant, std::make_unique<tools::reference::Reference>(std::move(*ref))).first;
          } else {
            s = Annotate(ref.status(), "the independent reference");
          }
        }
        if (s.ok()) {
          tools::reference::EngineRank rank{static_cast<int>(info.tp_size()), static_cast<int>(info.tp_rank()),
                                            static_cast<int>(info.ep_size())};
          // an engine holding an MTP layer's eh_proj serves a NextN draft: the reference then
          // expects the whole draft (and a draft the engine lacks in part shows as missing params)
          for (const auto& p : params)
            rank.mtp_draft = rank.mtp_draft ||
                             (absl::StartsWith(p.name, "model.layers.") && absl::EndsWith(p.name, ".eh_proj.weight"));
          report = it->second->CheckRank(rank, params);
          s = report.status();
        }
      }
      const bool ok = s.ok() && report->ok();
      if (g_.json) {
        json bad = json::array();
        if (s.ok())
          for (const auto& p : report->params)
            if (p.verdict != tools::reference::ParamResult::Verdict::kOk)
              bad.push_back({{"name", p.name},
                             {"verdict", std::string(tools::reference::VerdictName(p.verdict))},
                             {"detail", p.detail}});
        *entry = json({{"agent_id", m.agent_id()},
                       {"engine_id", m.engine_id()},
                       {"tp_rank", m.tp_rank()},
                       {"version", version},
                       {"ok", ok},
                       {"params", s.ok() ? report->params.size() : 0},
                       {"not_ok", bad},
                       {"error", std::string(s.message())}});
      } else if (!s.ok()) {
        std::printf("%s engine %s tp %u: independent verify: ERROR %s\n", m.agent_id().c_str(), m.engine_id().c_str(),
                    m.tp_rank(), s.ToString().c_str());
      } else {
        std::printf("%s engine %s tp %u version %llu: independent: %s (%zu params decoded and compared)\n",
                    m.agent_id().c_str(), m.engine_id().c_str(), m.tp_rank(), static_cast<unsigned long long>(version),
                    ok ? "equal to the reference" : "DIFFERS", report->params.size());
        if (!ok) {
          int shown = 0;
          for (const auto& p : report->params) {
            if (p.verdict == tools::reference::ParamResult::Verdict::kOk || shown++ >= 10) continue;
            std::printf("  %s %s: %s\n", std::string(tools::reference::VerdictName(p.verdict)).c_str(), p.name.c_str(),
                        p.detail.c_str());
          }
        }
      }
      return ok;
    });
  }

  int Generate(const std::string& engine, const std::string& prompt, uint32_t max_new) {
    v1::GenerateRequest req;
    for (absl::string_view t : absl::StrSplit(prompt, ',', absl::SkipWhitespace())) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(t, &id))
        return Fail(absl::InvalidArgumentError(absl::StrCat("bad token id \"", t, "\" in --prompt")), g_);
      req.add_prompt(id);
    }
    req.set_max_new_tokens(max_new);
    auto stub = v1::RolloutEngine::NewStub(MakeChannel(engine, g_.sec));
    grpc::ClientContext ctx;
    PrepareContext(&ctx, g_.sec, absl::Seconds(g_.timeout_s));
    v1::GenerateReply r;
    absl::Status s = FromGrpcStatus(stub->Generate(&ctx, req, &r));
    if (!s.ok()) return Fail(s, g_, absl::StrCat("the engine at ", engine));
    std::vector<int32_t> tokens(r.tokens().begin(), r.tokens().end());
    if (g_.json)
      std::printf("%s\n", json({{"version", r.version()}, {"tokens", tokens}}).dump().c_str());
    else
      std::printf("version %llu: %s\n", static_cast<unsigned long long>(r.version()),
                  absl::StrJoin(tokens, ",").c_str());
    return 0;
  }

  // RolloutAgent.UpdateWeights: the engine behind `agent` on a version >= min_version (0: the
  // newest published), copied from a peer when one holds it; waits up to --timeout.
  int UpdateWeights(const std::string& agent, uint64_t min_version) {
    auto stub = v1::RolloutAgent::NewStub(MakeChannel(agent, g_.sec));
    grpc::ClientContext ctx;
    PrepareContext(&ctx, g_.sec, absl::Seconds(g_.timeout_s));
    v1::UpdateWeightsRequest req;
    req.set_min_version(min_version);
    v1::UpdateWeightsReply r;
    const absl::Time start = absl::Now();
    absl::Status s = FromGrpcStatus(stub->UpdateWeights(&ctx, req, &r));
    if (!s.ok()) return Fail(s, g_, absl::StrCat("the rollout agent at ", agent));
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (g_.json)
      std::printf("%s\n", json({{"version", r.version()}, {"seconds", seconds}}).dump().c_str());
    else
      std::printf("version %llu (%.3f s)\n", static_cast<unsigned long long>(r.version()), seconds);
    return 0;
  }

 private:
  const Globals& g_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

int Main(int argc, char** argv) {
  CLI::App app(
      "wsyncctl: operate a wsync deployment (trigger and watch syncs, inspect members, versions and\n"
      "timings, verify engine weights against a checkpoint).\n\n"
      "Examples:\n"
      "  wsyncctl sync --wait                      trigger a sync and follow it\n"
      "  wsyncctl timings                          where the last sync spent its time\n"
      "  wsyncctl verify --against /ckpt/step-100  bit-exact check of every engine rank\n"
      "  wsyncctl update-weights --agent HOST:PORT  an engine on the newest published version\n");
  app.require_subcommand(1);
  Globals g;
  app.add_option("--coordinator", g.coordinator, "Coordinator address (trainer rank 0)")->envname("WSYNC_COORDINATOR");
  app.add_option("--token-file", g.sec_options.token_file, "Bearer token file (else $WSYNC_TOKEN)");
  app.add_option("--tls-ca", g.sec_options.tls_ca_file, "CA certificate of the servers (enables TLS)");
  app.add_option("--tls-cert", g.sec_options.tls_cert_file, "Client certificate (mutual TLS)");
  app.add_option("--tls-key", g.sec_options.tls_key_file, "Client key (mutual TLS)");
  app.add_flag("--json", g.json, "Machine-readable output");
  app.add_option("--timeout", g.timeout_s, "Deadline of each RPC, seconds")->check(CLI::PositiveNumber);

  bool wait = false, wait_if_busy = false;
  uint32_t min_agents = 1;
  uint64_t sync_version = 0;
  std::string delivery, delta;
  auto* sync = app.add_subcommand("sync", "Trigger a sync");
  sync->add_flag("--wait", wait, "Follow it to the end with a progress bar; exit 1 if it fails");
  sync->add_flag("--wait-if-busy", wait_if_busy, "Queue behind a running sync instead of failing (exit 5)");
  sync->add_option("--min-agents", min_agents, "Refuse with fewer rollout agents");
  sync->add_option("--delivery", delivery,
                   "broadcast (every agent receives every byte) or sharded (every agent only its engine rank's "
                   "blocks); default: the trainer agents' --delivery")
      ->check(CLI::IsMember({"broadcast", "sharded"}));
  sync->add_option("--delta", delta,
                   "off (every byte), auto (only what changed since the version the engines hold, when the trainer "
                   "and every engine hold it) or on (the same; engines not on it copy the new version from a peer "
                   "after); default: the trainer agents' --delta")
      ->check(CLI::IsMember({"off", "auto", "on"}));
  sync->add_option("--version", sync_version,
                   "Publish this version (e.g. the training step; must be newer than every published or pending "
                   "one; a request for a pending or published version joins that sync). Default: the next number");
  app.add_subcommand("status", "The fleet's version, the coordinator's state and what every engine serves");
  app.add_subcommand("members", "Rollout agents");
  app.add_subcommand("engines", "The fleet: every engine, its missing TP ranks, removed or not");
  std::string remove_id;
  app.add_subcommand("remove-engine", "Take an engine out of the fleet (no longer counted as behind)")
      ->add_option("ENGINE", remove_id, "engine id (wsyncctl engines)")
      ->required();
  app.add_subcommand("versions", "Every sync attempt: done, partial (engines behind named) or failed");
  uint64_t version = 0;
  auto* timings = app.add_subcommand("timings", "Per-phase timings of one sync");
  timings->add_option("version", version, "Version (default: the latest finished)");
  std::string against, quant_file;
  auto* verify = app.add_subcommand("verify", "Compare every engine rank's weights with a checkpoint, bit for bit");
  verify->add_option("--against", against, "HF checkpoint directory (config.json + *.safetensors)")->required();
  verify->add_option("--quant-config", quant_file, "Quantization config (default: the engines' own)");
  bool independent = false;
  verify->add_flag("--independent", independent,
                   "Decode every engine rank's memory with the independent reference (tools/wsyncctl/reference: the "
                   "specs in scalar code, sharing nothing with the loader, repack or kernels) and compare it with the "
                   "checkpoint quantized by that reference, instead of recomputing checksums with the sync's own code");
  std::string engine, prompt;
  uint32_t max_new = 8;
  auto* generate = app.add_subcommand("generate", "Send one greedy generation request to an engine (a smoke test)");
  generate->add_option("--engine", engine, "The engine's RolloutEngine address (its rank 0)")->required();
  generate->add_option("--prompt", prompt, "Comma-separated token ids")->required();
  generate->add_option("--max-new-tokens", max_new, "Tokens to generate");
  std::string agent;
  uint64_t min_version = 0;
  auto* update = app.add_subcommand(
      "update-weights", "Bring an engine to a version >= --min-version (0: the newest published) through its agent");
  update->add_option("--agent", agent, "The engine rank's rollout agent address")->required();
  update->add_option("--min-version", min_version, "The version wanted; 0: the newest the coordinator published");
  CLI11_PARSE(app, argc, argv);

  auto sec = LoadRpcSecurity(g.sec_options);
  if (!sec.ok()) return Fail(sec.status(), g);
  g.sec = *sec;
  Ctl ctl(g);
  if (app.got_subcommand("status")) return ctl.Status();
  if (app.got_subcommand("members")) return ctl.Members();
  if (app.got_subcommand("engines")) return ctl.Engines();
  if (app.got_subcommand("remove-engine")) return ctl.RemoveEngine(remove_id);
  if (app.got_subcommand("versions")) return ctl.Versions();
  if (app.got_subcommand("timings")) return ctl.Timings(version);
  if (app.got_subcommand("sync")) return ctl.Sync(wait, wait_if_busy, min_agents, sync_version, delivery, delta);
  if (app.got_subcommand("verify"))
    return independent ? ctl.VerifyIndependent(against, quant_file) : ctl.Verify(against, quant_file);
  if (app.got_subcommand("generate")) return ctl.Generate(engine, prompt, max_new);
  if (app.got_subcommand("update-weights")) return ctl.UpdateWeights(agent, min_version);
  return 2;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) { return wsync::Main(argc, argv); }
