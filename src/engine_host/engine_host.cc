// libwsync_engine_host: the C API of wsync_engine_host.h over the reference engine's process shell
// (ref_engine: EngineCore's state machine, the RolloutEngine service, the agent registrar) and the
// rollout agent's ParamArena, with the engine's own model behind callbacks (CallbackModel).
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/config.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/rpc_security.h"
#include "common/status.h"
#include "engine_memory/engine_memory.h"
#include "engine_memory/param_arena.h"
#include "engine_model/engine_layout.h"
#include "engine_model/repack.h"
#include "engine_side/checkpoint.h"
#include "engine_side/core.h"
#include "engine_side/registration.h"
#include "engine_side/server.h"
#include "wsync_engine_host.h"

namespace {

using wsync::engine_side::EngineCore;

thread_local std::string g_last_error;

int Fail(const absl::Status& s) {
  g_last_error = std::string(s.message());
  return static_cast<int>(s.code());
}
int Ok() {
  g_last_error.clear();
  return 0;
}

constexpr size_t kErrLen = 2048;

// The engine's model: Prepare and Generate call the host's callbacks.
class CallbackModel final : public wsync::engine_side::ServedModel {
 public:
  explicit CallbackModel(const wsync_engine_options& o)
      : prepare_(o.prepare), generate_(o.generate), on_pause_(o.on_pause), on_continue_(o.on_continue), ctx_(o.ctx) {}

  absl::Status OnPause(wsync::engine_side::PauseMode mode) override {
    if (on_pause_ == nullptr) return absl::OkStatus();
    char err[kErrLen] = {0};
    const int m = mode == wsync::engine_side::PauseMode::kAbort ? 2 : 1;
    if (on_pause_(ctx_, m, err, sizeof(err)) == 0) return absl::OkStatus();
    err[kErrLen - 1] = 0;
    return absl::UnavailableError(absl::StrCat("the engine's pause failed: ", err));
  }

  absl::Status OnContinue(uint64_t version) override {
    if (on_continue_ == nullptr) return absl::OkStatus();
    char err[kErrLen] = {0};
    if (on_continue_(ctx_, version, err, sizeof(err)) == 0) return absl::OkStatus();
    err[kErrLen - 1] = 0;
    return absl::UnavailableError(absl::StrCat("the engine could not resume on version ", version, ": ", err));
  }

  absl::Status Prepare(uint64_t version) override {
    char err[kErrLen] = {0};
    const int rc = prepare_(ctx_, version, err, sizeof(err));
    if (rc == 0) return absl::OkStatus();
    err[kErrLen - 1] = 0;
    return absl::InternalError(absl::StrCat("the engine could not read version ", version, ": ",
                                            err[0] ? err : "its prepare callback failed (no message)"));
  }

  absl::StatusOr<std::vector<int32_t>> Generate(absl::Span<const int32_t> prompt, int max_new_tokens,
                                                const StepHook& before_step) override {
    if (generate_ == nullptr) return absl::UnimplementedError("this engine serves no Generate over gRPC");
    if (before_step) RETURN_IF_ERROR(before_step(0));
    std::vector<int32_t> out(static_cast<size_t>(max_new_tokens));
    size_t n = 0;
    char err[kErrLen] = {0};
    const int rc = generate_(ctx_, prompt.data(), prompt.size(), static_cast<uint32_t>(max_new_tokens), out.data(), &n,
                             err, sizeof(err));
    err[kErrLen - 1] = 0;
    if (rc != 0) return absl::InternalError(absl::StrCat("the engine's generate failed: ", err));
    if (n > out.size())
      return absl::InternalError(absl::StrCat("the engine's generate returned ", n, " tokens for ", out.size()));
    out.resize(n);
    return out;
  }

 private:
  wsync_engine_prepare_fn prepare_;
  wsync_engine_generate_fn generate_;
  wsync_engine_pause_fn on_pause_;
  wsync_engine_continue_fn on_continue_;
  void* ctx_;
};

std::string Str(const char* s) { return s ? std::string(s) : std::string(); }

constexpr char kViewServesNothing[] = "an attached view (wsync_engine_attach) serves nothing: use its host";

}  // namespace

struct wsync_engine {
  std::string engine_id, config_json, quant_json, listen, agent, agent_file;
  wsync::RpcSecurity security;
  wsync::ModelConfig config;
  std::unique_ptr<wsync::engine_model::EngineLayout> layout;
  std::unique_ptr<wsync::engine_memory::ParamArena> arena;       // a host: its own segment
  std::unique_ptr<wsync::engine_memory::EngineMemory> attached;  // a view: another host's, mapped
  wsync::engine_model::EngineWeights* weights = nullptr;         // the arena's or the mapping's
  std::unique_ptr<EngineCore> core;
  std::vector<std::string> dtype_names;
  std::vector<std::string> source_dtypes;
  std::string checkpoint;   // loaded at create, prepared as version 0 at start
  std::string attach_info;  // made once, by wsync_engine_attach_info

  absl::Mutex mu;
  std::unique_ptr<wsync::engine_side::EngineServer> server ABSL_GUARDED_BY(mu);
  std::unique_ptr<wsync::engine_side::AgentRegistrar> registrar ABSL_GUARDED_BY(mu);
  std::string address;  // set once by start
};

namespace {

// The config, quantization and EngineLayout of e->config_json / e->quant_json (TP 1).
absl::Status MakeLayout(wsync_engine* e) {
  using namespace wsync;
  ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(e->config_json, "the engine's config.json"));
  e->config = std::move(config);
  e->config.quantization.reset();
  if (!e->quant_json.empty()) {
    ASSIGN_OR_RETURN(QuantizationConfig q, ParseQuantizationConfig(e->quant_json, "the engine's quantization_config"));
    RETURN_IF_ERROR(q.CheckInt4Supported());
    e->config.quantization = std::move(q);
  }
  ASSIGN_OR_RETURN(
      engine_model::EngineLayout layout,
      engine_model::EngineLayout::Create(e->config, e->config.quantization ? &*e->config.quantization : nullptr,
                                         engine_model::EngineRank()));
  e->layout = std::make_unique<engine_model::EngineLayout>(std::move(layout));
  return absl::OkStatus();
}

// The safetensors names of the params' and sources' dtypes (what the info structs point at).
void NameDtypes(wsync_engine* e) {
  for (const wsync::engine_model::EngineBuffer& b : e->weights->buffers())
    e->dtype_names.emplace_back(wsync::SafetensorsName(b.dtype));
  for (const wsync::engine_model::HfSource& src : e->layout->sources())
    e->source_dtypes.emplace_back(wsync::SafetensorsName(src.dtype));
}

}  // namespace

extern "C" {

const char* wsync_engine_last_error(void) { return g_last_error.c_str(); }
int wsync_engine_abi_version(void) { return WSYNC_ENGINE_HOST_ABI_VERSION; }

int wsync_engine_create(const wsync_engine_options* o, wsync_engine** out) {
  using namespace wsync;
  if (o == nullptr || out == nullptr) return Fail(absl::InvalidArgumentError("wsync_engine_create: null argument"));
  *out = nullptr;
  const std::string id = Str(o->engine_id);
  if (id.empty() || id.size() > 64 ||
      id.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                           "0123456789._-") != std::string::npos)
    return Fail(absl::InvalidArgumentError(absl::StrCat("engine id '", id, "': want [A-Za-z0-9._-]{1,64}")));
  if (o->prepare == nullptr) return Fail(absl::InvalidArgumentError("wsync_engine_create: no prepare callback"));
  if (Str(o->agent).empty() && Str(o->agent_file).empty())
    return Fail(absl::InvalidArgumentError("wsync_engine_create: no rollout agent (agent or agent_file)"));
  auto e = std::make_unique<wsync_engine>();
  e->engine_id = id;
  e->config_json = Str(o->config_json);
  e->quant_json = Str(o->quant_json);
  e->listen = o->listen && *o->listen ? o->listen : "127.0.0.1:0";
  e->agent = Str(o->agent);
  e->agent_file = Str(o->agent_file);
  RpcSecurityOptions so;
  so.token_file = Str(o->token_file);
  absl::StatusOr<RpcSecurity> sec = LoadRpcSecurity(so);
  if (!sec.ok()) return Fail(sec.status());
  e->security = *sec;

  absl::StatusOr<int> device = engine_memory::ParseParamMemory(o->param_memory ? o->param_memory : "shm");
  if (!device.ok()) return Fail(device.status());
  if (absl::Status st = MakeLayout(e.get()); !st.ok()) return Fail(st);
  engine_model::EngineRank rank;  // TP 1: the host is one engine rank

  if (*device < 0) {
    absl::StatusOr<std::vector<std::string>> stale = engine_memory::ReclaimStaleShmSegments(id, 0);
    for (const std::string& name : stale.ok() ? *stale : std::vector<std::string>{})
      WSYNC_LOG(INFO) << "removed the shm segment /" << name << " of a killed earlier process of engine " << id;
  }
  absl::StatusOr<std::unique_ptr<engine_memory::ParamArena>> arena =
      *device >= 0 ? engine_memory::ParamArena::CreateOnDevice(*e->layout, *device)
                   : engine_memory::ParamArena::Create(*e->layout, engine_memory::UniqueShmName(id, 0));
  if (!arena.ok()) return Fail(arena.status());
  e->arena = *std::move(arena);
  e->weights = &e->arena->weights();
  NameDtypes(e.get());

  if (o->checkpoint && *o->checkpoint) {
    e->checkpoint = o->checkpoint;
    absl::StatusOr<engine_side::CheckpointStats> stats =
        engine_side::LoadCheckpoint(e->checkpoint, *e->layout, *e->weights);
    if (!stats.ok()) return Fail(stats.status());
    WSYNC_LOG(INFO) << "engine host " << id << ": loaded checkpoint " << e->checkpoint << " (" << stats->tensors
                    << " tensors, " << stats->quantized << " quantized at load)";
  }
  engine_side::EngineCoreOptions co;
  co.engine_id = id;
  if (o->hold_timeout_s > 0) co.hold_timeout = absl::Seconds(o->hold_timeout_s);
  absl::StatusOr<std::unique_ptr<EngineCore>> core =
      EngineCore::Create(e->config, rank, std::make_unique<CallbackModel>(*o), co);
  if (!core.ok()) return Fail(core.status());
  e->core = *std::move(core);
  WSYNC_LOG(INFO) << "engine host " << id << ": " << wsync::ArchitectureName(e->config.arch)
                  << (e->config.quantization ? " INT4" : " bf16") << ", " << e->layout->params().size() << " params, "
                  << e->arena->size() << " bytes in " << e->arena->where();
  *out = e.release();
  return Ok();
}

const char* wsync_engine_attach_info(wsync_engine* e) {
  if (e == nullptr) return "";
  if (e->attach_info.empty()) {
    wsync::v1::RegisterEngineRequest req;
    if (e->arena) e->arena->FillParams(req.mutable_params());
    nlohmann::json j = {{"engine_id", e->engine_id},
                        {"config_json", e->config_json},
                        {"quant_json", e->quant_json},
                        {"params", absl::Base64Escape(req.SerializeAsString())}};
    e->attach_info = j.dump();
  }
  return e->attach_info.c_str();
}

int wsync_engine_attach(const char* info, wsync_engine** out) {
  using namespace wsync;
  if (info == nullptr || out == nullptr) return Fail(absl::InvalidArgumentError("wsync_engine_attach: null argument"));
  *out = nullptr;
  nlohmann::json j = nlohmann::json::parse(info, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("params") || !j["params"].is_string() ||
      !j.value("config_json", nlohmann::json()).is_string())
    return Fail(absl::InvalidArgumentError("wsync_engine_attach: not a host's attach info (wsync_engine_attach_info)"));
  auto e = std::make_unique<wsync_engine>();
  e->engine_id = j.value("engine_id", std::string("attached"));
  e->config_json = j["config_json"].get<std::string>();
  e->quant_json = j.value("quant_json", std::string());
  if (absl::Status st = MakeLayout(e.get()); !st.ok()) return Fail(st);
  std::string bytes;
  v1::RegisterEngineRequest req;
  if (!absl::Base64Unescape(j["params"].get<std::string>(), &bytes) || !req.ParseFromString(bytes))
    return Fail(absl::InvalidArgumentError("wsync_engine_attach: the params of the attach info do not parse"));
  absl::StatusOr<std::unique_ptr<engine_memory::EngineMemory>> memory = engine_memory::MapEngineMemory(req.params());
  if (!memory.ok()) return Fail(Annotate(memory.status(), absl::StrCat("attaching to engine ", e->engine_id)));
  e->attached = *std::move(memory);
  e->weights = &e->attached->weights();
  if (absl::Status st = e->weights->CheckMatches(*e->layout); !st.ok())
    return Fail(Annotate(st, absl::StrCat("attaching to engine ", e->engine_id)));
  NameDtypes(e.get());
  *out = e.release();
  return Ok();
}

size_t wsync_engine_param_count(const wsync_engine* e) { return e ? e->weights->size() : 0; }

int wsync_engine_param(const wsync_engine* e, size_t index, wsync_engine_param_info* out) {
  if (e == nullptr || out == nullptr) return Fail(absl::InvalidArgumentError("wsync_engine_param: null argument"));
  const auto& buffers = e->weights->buffers();
  if (index >= buffers.size())
    return Fail(absl::OutOfRangeError(absl::StrCat("param ", index, " of ", buffers.size())));
  const wsync::engine_model::EngineBuffer& b = buffers[index];
  const int p = e->layout->FindParam(b.name);
  if (b.shape.size() > 4) return Fail(absl::InternalError(absl::StrCat(b.name, ": more than 4 dimensions")));
  std::memset(out, 0, sizeof(*out));
  out->name = b.name.c_str();
  out->dtype = e->dtype_names[index].c_str();
  out->ndim = static_cast<int>(b.shape.size());
  for (size_t i = 0; i < b.shape.size(); ++i) out->shape[i] = b.shape[i];
  out->nbytes = b.nbytes;
  out->data = b.data;
  out->kind = p < 0 ? 0 : static_cast<int>(e->layout->params()[static_cast<size_t>(p)].kind);
  out->device = b.on_device() ? b.cuda_device : -1;
  return Ok();
}

size_t wsync_engine_linear_count(const wsync_engine* e) { return e ? e->layout->linears().size() : 0; }

int wsync_engine_linear(const wsync_engine* e, size_t index, wsync_engine_linear_info* out) {
  if (e == nullptr || out == nullptr) return Fail(absl::InvalidArgumentError("wsync_engine_linear: null argument"));
  const auto& linears = e->layout->linears();
  if (index >= linears.size())
    return Fail(absl::OutOfRangeError(absl::StrCat("linear ", index, " of ", linears.size())));
  const wsync::engine_model::EngineLinear& l = linears[index];
  out->name = l.name.c_str();
  out->quantized = l.quantized ? 1 : 0;
  out->experts = l.experts;
  out->n = l.n;
  out->k = l.k;
  return Ok();
}

size_t wsync_engine_source_count(const wsync_engine* e) { return e ? e->layout->sources().size() : 0; }

int wsync_engine_source(const wsync_engine* e, size_t index, wsync_engine_source_info* out) {
  using wsync::engine_model::HfSource;
  if (e == nullptr || out == nullptr) return Fail(absl::InvalidArgumentError("wsync_engine_source: null argument"));
  const auto& sources = e->layout->sources();
  if (index >= sources.size())
    return Fail(absl::OutOfRangeError(absl::StrCat("source ", index, " of ", sources.size())));
  const HfSource& s = sources[index];
  if (s.shape.size() > 4) return Fail(absl::InternalError(absl::StrCat(s.hf_name, ": more than 4 dimensions")));
  std::memset(out, 0, sizeof(*out));
  out->hf_name = s.hf_name.c_str();
  out->dtype = e->source_dtypes[index].c_str();
  out->ndim = static_cast<int>(s.shape.size());
  for (size_t i = 0; i < s.shape.size(); ++i) out->shape[i] = s.shape[i];
  out->action = s.action == HfSource::Action::kCopy ? 0 : s.action == HfSource::Action::kCheckShape ? 1 : 2;
  out->param = s.param >= 0 ? e->layout->params()[static_cast<size_t>(s.param)].name.c_str() : "";
  out->expert = s.expert;
  out->transpose = s.transpose ? 1 : 0;
  out->dst_row0 = s.dst_row0;
  out->dst_col0 = s.dst_col0;
  out->rows = s.rows;
  out->cols = s.cols;
  out->shape_values[0] = s.shape_values[0];
  out->shape_values[1] = s.shape_values[1];
  return Ok();
}

int wsync_engine_loaded(const wsync_engine* e, const char* param_name, void* out, uint64_t out_bytes, int64_t* shape) {
  using namespace wsync;
  if (e == nullptr || param_name == nullptr || out == nullptr)
    return Fail(absl::InvalidArgumentError("wsync_engine_loaded: null argument"));
  const int pi = e->layout->FindParam(param_name);
  if (pi < 0) return Fail(absl::NotFoundError(absl::StrCat("no parameter '", param_name, "' in this engine")));
  const engine_model::EngineParam& p = e->layout->params()[static_cast<size_t>(pi)];
  absl::StatusOr<int64_t> elements = NumElements(p.loaded_shape);
  if (!elements.ok()) return Fail(elements.status());
  const uint64_t want = static_cast<uint64_t>(*elements) * ItemSize(p.dtype);
  if (out_bytes != want)
    return Fail(absl::InvalidArgumentError(
        absl::StrCat(param_name, ": the loaded form is ", want, " bytes, the buffer ", out_bytes)));
  const MutableTensorView view(p.dtype, p.loaded_shape, {static_cast<std::byte*>(out), want});
  if (absl::Status s = engine_model::RestoreParamToLoaded(*e->layout, param_name, *e->weights, view); !s.ok())
    return Fail(s);
  if (shape != nullptr) {
    for (size_t i = 0; i < 4; ++i) shape[i] = i < p.loaded_shape.size() ? p.loaded_shape[i] : 0;
  }
  return Ok();
}

int wsync_engine_dense_bf16(const wsync_engine* e, const char* linear_name, void* out, uint64_t out_bytes) {
  using namespace wsync;
  if (e == nullptr || linear_name == nullptr || out == nullptr)
    return Fail(absl::InvalidArgumentError("wsync_engine_dense_bf16: null argument"));
  const int li = e->layout->FindLinear(linear_name);
  if (li < 0) return Fail(absl::NotFoundError(absl::StrCat("no linear '", linear_name, "' in this engine")));
  const engine_model::EngineLinear& l = e->layout->linears()[static_cast<size_t>(li)];
  const uint64_t want = static_cast<uint64_t>((l.experts > 0 ? l.experts : 1) * l.n * l.k) * 2;
  if (out_bytes != want)
    return Fail(absl::InvalidArgumentError(
        absl::StrCat(linear_name, ": the bf16 weight is ", want, " bytes, the buffer ", out_bytes)));
  engine_model::DenseOptions d;
  d.out_dtype = DType::kBF16;
  absl::StatusOr<Tensor> dense = engine_model::DequantizeToDense(*e->layout, linear_name, *e->weights, d);
  if (!dense.ok()) return Fail(dense.status());
  if (dense->nbytes() != want)
    return Fail(absl::InternalError(absl::StrCat(linear_name, ": dequantized to ", dense->nbytes(), " bytes")));
  std::memcpy(out, dense->data_as<std::byte>(), want);
  return Ok();
}

int wsync_engine_start(wsync_engine* e) {
  using namespace wsync;
  if (e == nullptr) return Fail(absl::InvalidArgumentError("wsync_engine_start: null engine"));
  if (!e->core) return Fail(absl::FailedPreconditionError(kViewServesNothing));
  absl::MutexLock lock(&e->mu);
  if (e->server) return Fail(absl::FailedPreconditionError(absl::StrCat("engine ", e->engine_id, " already started")));
  if (!e->checkpoint.empty() && e->core->Health().state == engine_side::HealthInfo::State::kNoWeights) {
    if (absl::Status s = e->core->PrepareInitial(0, absl::StrCat("checkpoint ", e->checkpoint)); !s.ok())
      return Fail(s);
  }
  absl::StatusOr<std::unique_ptr<engine_side::EngineServer>> server =
      engine_side::EngineServer::Start(e->core.get(), e->listen, e->security);
  if (!server.ok()) return Fail(server.status());
  e->server = *std::move(server);
  e->address = e->server->address();
  engine_side::RegistrarOptions ro;
  ro.agent_address = e->agent;
  ro.agent_address_file = e->agent_file;
  ro.security = e->security;
  EngineCore* core = e->core.get();
  ro.on_registered = [core](const v1::RegisterEngineReply& r) { core->HoldForCatchUp(r.catch_up_version()); };
  e->registrar = engine_side::AgentRegistrar::Start(ro, [e, core] {
    v1::RegisterEngineRequest req;
    req.set_engine_id(e->engine_id);
    req.set_tp_size(1);
    req.set_tp_rank(0);
    req.set_ep_size(1);
    req.set_model_config_json(e->config_json);
    req.set_quantization_config_json(e->quant_json);
    req.set_engine_address(e->address);
    req.set_version(core->version());
    e->arena->FillParams(req.mutable_params());
    return req;
  });
  WSYNC_LOG(INFO) << "engine host " << e->engine_id << ": RolloutEngine on " << e->address;
  return Ok();
}

const char* wsync_engine_address(const wsync_engine* e) { return e ? e->address.c_str() : ""; }

int wsync_engine_begin_request(wsync_engine* e, int64_t timeout_ms, uint64_t* version) {
  if (e == nullptr || version == nullptr)
    return Fail(absl::InvalidArgumentError("wsync_engine_begin_request: null argument"));
  if (!e->core) return Fail(absl::FailedPreconditionError(kViewServesNothing));
  absl::StatusOr<uint64_t> v = e->core->BeginRequest(absl::Now() + absl::Milliseconds(timeout_ms), nullptr);
  if (!v.ok()) return Fail(v.status());
  *version = *v;
  return Ok();
}

void wsync_engine_end_request(wsync_engine* e) {
  if (e && e->core) e->core->EndRequest();
}

int wsync_engine_request_stopped(const wsync_engine* e) {
  if (e == nullptr) return Fail(absl::InvalidArgumentError("wsync_engine_request_stopped: null engine"));
  if (!e->core) return Fail(absl::FailedPreconditionError(kViewServesNothing));
  const absl::Status s = e->core->RequestStopped();
  return s.ok() ? Ok() : Fail(s);
}

int wsync_engine_update_weights(wsync_engine* e, uint64_t min_version, int64_t timeout_ms, uint64_t* version) {
  using namespace wsync;
  if (e == nullptr || version == nullptr)
    return Fail(absl::InvalidArgumentError("wsync_engine_update_weights: null argument"));
  if (!e->core) return Fail(absl::FailedPreconditionError(kViewServesNothing));
  std::string agent = e->agent;
  if (!e->agent_file.empty()) {
    absl::StatusOr<std::string> text = ReadTextFile(e->agent_file);
    if (!text.ok()) return Fail(text.status());
    agent = std::string(absl::StripAsciiWhitespace(*text));
  }
  if (agent.empty()) return Fail(absl::UnavailableError("no rollout agent address yet (agent_file is empty)"));
  auto stub = v1::RolloutAgent::NewStub(MakeChannel(agent, e->security));
  grpc::ClientContext ctx;
  PrepareContext(&ctx, e->security, absl::Milliseconds(timeout_ms));
  v1::UpdateWeightsRequest req;
  req.set_min_version(min_version);
  v1::UpdateWeightsReply reply;
  const absl::Status s = FromGrpcStatus(stub->UpdateWeights(&ctx, req, &reply));
  if (!s.ok()) return Fail(Annotate(s, absl::StrCat("UpdateWeights at the rollout agent ", agent)));
  *version = reply.version();
  return Ok();
}

int wsync_engine_health(const wsync_engine* e, int* state, uint64_t* version) {
  if (e == nullptr || state == nullptr || version == nullptr)
    return Fail(absl::InvalidArgumentError("wsync_engine_health: null argument"));
  if (!e->core) return Fail(absl::FailedPreconditionError(kViewServesNothing));
  const wsync::engine_side::HealthInfo h = e->core->Health();
  *state = static_cast<int>(h.state) + 1;  // kServing.. -> SERVING = 1 ..
  *version = h.version;
  return Ok();
}

void wsync_engine_destroy(wsync_engine* e) {
  if (e == nullptr) return;
  {
    absl::MutexLock lock(&e->mu);
    if (e->registrar) e->registrar->Stop();
    if (e->core) e->core->Shutdown();
    if (e->server) e->server->Shutdown(absl::Milliseconds(500));
  }
  delete e;
}

}  // extern "C"
