#include "tools/wsyncctl/reference/reference.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "tools/wsyncctl/reference/fp8_scalar.h"
#include "tools/wsyncctl/reference/rank_spec.h"

namespace wsync::tools::reference {

using internal::Block;
using internal::Int4Spec;
using internal::PlainSpec;
using internal::RankSpec;

absl::string_view VerdictName(ParamResult::Verdict v) {
  switch (v) {
    case ParamResult::Verdict::kOk: return "ok";
    case ParamResult::Verdict::kMismatch: return "MISMATCH";
    case ParamResult::Verdict::kMissing: return "MISSING";
    case ParamResult::Verdict::kUnexpected: return "UNEXPECTED";
  }
  return "?";
}

size_t RankReport::Count(ParamResult::Verdict v) const {
  return static_cast<size_t>(
      std::count_if(params.begin(), params.end(), [v](const auto& p) { return p.verdict == v; }));
}

bool RankReport::ok() const { return Count(ParamResult::Verdict::kOk) == params.size(); }

const ParamResult* RankReport::Find(absl::string_view name) const {
  for (const ParamResult& p : params)
    if (p.name == name) return &p;
  return nullptr;
}

std::string RankReport::Summary() const {
  std::string out;
  for (const ParamResult& p : params)
    if (p.verdict != ParamResult::Verdict::kOk)
      absl::StrAppend(&out, VerdictName(p.verdict), " ", p.name, ": ", p.detail, "\n");
  absl::StrAppend(&out, "rank ", rank.tp_rank, " of ", rank.tp_size, " (EP ", rank.ep_size, "): ", params.size(),
                  " params, ", params.size() - Count(ParamResult::Verdict::kOk), " not OK (",
                  Count(ParamResult::Verdict::kMismatch), " mismatched, ", Count(ParamResult::Verdict::kMissing),
                  " missing, ", Count(ParamResult::Verdict::kUnexpected), " unexpected)");
  return out;
}

struct Reference::State {
  std::string dir;
  ModelConfig config;
  std::optional<QuantizationConfig> quant;
  ReferenceOptions options;
  std::vector<SafetensorsFile> files;
  std::map<std::string, std::pair<TensorView, std::string>> tensors;  // name -> (view, file)
};

Reference::Reference(std::unique_ptr<State> state) : state_(std::move(state)) {}
Reference::Reference(Reference&&) noexcept = default;
Reference& Reference::operator=(Reference&&) noexcept = default;
Reference::~Reference() = default;

absl::StatusOr<Reference> Reference::Open(const std::string& hf_dir, const ReferenceOptions& options) {
  auto st = std::make_unique<State>();
  st->dir = hf_dir;
  st->options = options;
  ASSIGN_OR_RETURN(st->config, LoadModelConfig(hf_dir));
  if (!options.quantization_config_json.empty()) {
    ASSIGN_OR_RETURN(st->quant,
                     ParseQuantizationConfig(options.quantization_config_json, "engine quantization config"));
    RETURN_IF_ERROR(st->quant->CheckSupported());
  }
  std::error_code ec;
  std::vector<std::string> paths;
  for (std::filesystem::directory_iterator it(hf_dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().extension() == ".safetensors") paths.push_back(it->path().string());
  if (ec) return absl::NotFoundError(absl::StrCat("listing ", hf_dir, ": ", ec.message()));
  if (paths.empty()) return absl::NotFoundError(absl::StrCat("no *.safetensors file in ", hf_dir));
  std::sort(paths.begin(), paths.end());
  for (const std::string& p : paths) {
    ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(p));
    for (const SafetensorsEntry& e : f.tensors()) {
      auto [it, inserted] = st->tensors.emplace(e.name, std::make_pair(e.view, p));
      if (!inserted)
        return absl::InvalidArgumentError(
            absl::StrCat("checkpoint tensor \"", e.name, "\" is in both ", it->second.second, " and ", p));
    }
    st->files.push_back(std::move(f));
  }
  return Reference(std::move(st));
}

absl::StatusOr<std::vector<ExpectedParam>> Reference::ExpectedParams(const EngineRank& rank) const {
  ASSIGN_OR_RETURN(RankSpec spec,
                   internal::BuildRankSpec(state_->config, state_->quant ? &*state_->quant : nullptr, rank));
  return std::move(spec.params);
}

namespace {

// model.layers.{i}.* with i in [first, end): a DeepSeek MTP layer, which SGLang's main model skips.
bool IsMtpTensor(absl::string_view name, int64_t first, int64_t end) {
  if (!absl::ConsumePrefix(&name, "model.layers.")) return false;
  const size_t dot = name.find('.');
  int64_t layer = 0;
  return dot != absl::string_view::npos && absl::SimpleAtoi(name.substr(0, dot), &layer) && layer >= first &&
         layer < end;
}

float ToFloat(const std::byte* p, DType dtype) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return BF16ToF32(b);
    }
    case DType::kF16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return F16ToF32(b);
    }
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    default: return 0.0f;
  }
}

std::string Bits(const std::byte* p, DType dtype) {
  uint64_t v = 0;
  std::memcpy(&v, p, ItemSize(dtype));  // little-endian host
  return absl::StrFormat("0x%0*x", static_cast<int>(2 * ItemSize(dtype)), v);
}

std::string ElementString(const std::byte* p, DType dtype) {
  if (dtype == DType::kF8E4M3) return absl::StrCat(Bits(p, dtype), " (", E4m3ValueOf(static_cast<uint8_t>(*p)), ")");
  if (IsFloating(dtype)) return absl::StrCat(Bits(p, dtype), " (", ToFloat(p, dtype), ")");
  return Bits(p, dtype);
}

std::string IndexString(const Shape& shape, int64_t flat) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] == 0 ? 0 : flat % shape[d];
    flat = shape[d] == 0 ? 0 : flat / shape[d];
  }
  return absl::StrCat("[", absl::StrJoin(idx, ", "), "]");
}

// The block holding element (expert, row, col) of a param's matrix, or null (padding).
const Block* BlockAt(const std::vector<Block>& blocks, int64_t expert, int64_t row, int64_t col) {
  for (const Block& b : blocks)
    if (b.expert == expert && row >= b.dst_row0 && row < b.dst_row0 + b.rows && col >= b.dst_col0 &&
        col < b.dst_col0 + b.cols)
      return &b;
  return nullptr;
}

// Where element (expert, row, col) comes from: "X.weight[r, c]" ("X.bias[r]" for a 1-D tensor).
std::string SourceString(const std::vector<Block>& blocks, int64_t expert, int64_t row, int64_t col,
                         bool one_d = false) {
  const Block* b = BlockAt(blocks, expert, row, col);
  if (b == nullptr) return "zero padding";
  if (one_d) return absl::StrCat(b->hf, "[", b->src_row0 + row - b->dst_row0, "]");
  return absl::StrCat(b->hf, "[", b->src_row0 + row - b->dst_row0, ", ", b->src_col0 + col - b->dst_col0, "]");
}

std::string ExpertPrefix(int64_t experts, int64_t e) { return experts > 0 ? absl::StrCat("expert ", e, ", ") : ""; }

// The engine's param after the set-level checks: dtype and shape parsed, bytes matching them.
struct Reported {
  const EngineParam* param = nullptr;
  DType dtype = DType::kU8;
  Shape shape;
};

class Checker {
 public:
  Checker(const ModelConfig& config, const std::map<std::string, std::pair<TensorView, std::string>>& tensors,
          const ReferenceOptions& options)
      : config_(config), tensors_(tensors), options_(options) {}

  // The checkpoint weights spec.fp8 names quantized to FP8 by fp8_scalar.h: "<hf>#fp8" (codes)
  // and "<hf>#scale" (F32 scales), read by the FP8 params' blocks. After CheckCheckpoint.
  absl::Status QuantizeFp8(const RankSpec& spec) {
    for (const auto& [hf, how] : spec.fp8) {
      const TensorView& w = tensors_.at(hf).first;
      Derived& codes = derived_[hf + "#fp8"];
      Derived& scales = derived_[hf + "#scale"];
      std::vector<uint8_t> c;
      std::vector<float> sc;
      RETURN_IF_ERROR(Annotate(QuantizeFp8Scalar(w, how.bn, how.bk, how.ue8m0, &c, &sc),
                               absl::StrCat("quantizing checkpoint tensor \"", hf, "\" to FP8")));
      codes.bytes.assign(reinterpret_cast<const char*>(c.data()), c.size());
      scales.bytes.assign(reinterpret_cast<const char*>(sc.data()), sc.size() * 4);
      const int64_t N = w.dim(0), K = w.dim(1);
      const Shape sshape = how.bn > 0 ? Shape{(N + how.bn - 1) / how.bn, (K + how.bk - 1) / how.bk} : Shape{N, 1};
      codes.view = TensorView(DType::kF8E4M3, w.shape(), std::as_bytes(std::span(codes.bytes)));
      scales.view = TensorView(DType::kF32, sshape, std::as_bytes(std::span(scales.bytes)));
    }
    return absl::OkStatus();
  }

  absl::Status CheckCheckpoint(const RankSpec& spec) {
    for (const auto& [name, info] : spec.hf) {
      auto it = tensors_.find(name);
      if (it == tensors_.end()) {
        if (!info.required) continue;
        return absl::NotFoundError(absl::StrCat("checkpoint tensor \"", name, "\" is missing (", config_.architecture,
                                                " as configured needs it)"));
      }
      const TensorView& v = it->second.first;
      if (v.shape() != info.shape)
        return absl::InvalidArgumentError(absl::StrCat("checkpoint tensor \"", name, "\" (", it->second.second, ") is ",
                                                       v.DebugString(), ", the config implies shape ",
                                                       ShapeToString(info.shape)));
      const bool dtype_ok = v.dtype() == info.dtype || (info.widen_ok && v.dtype() == config_.dtype);
      if (!dtype_ok)
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint tensor \"", name, "\" (", it->second.second, ") is ", v.DebugString(), ", want ",
            SafetensorsName(info.dtype), info.widen_ok ? absl::StrCat(" or ", SafetensorsName(config_.dtype)) : "",
            " (the reference reads a ", SafetensorsName(config_.dtype), " checkpoint)"));
    }
    for (const auto& [name, entry] : tensors_) {
      if (spec.hf.count(name) != 0 || IsMtpTensor(name, spec.mtp_first, spec.mtp_end)) continue;
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint tensor \"", name, "\" (", entry.second, ") is not a tensor of ",
                       config_.architecture, " as configured",
                       absl::EndsWith(name, "weight_packed") || absl::EndsWith(name, "qweight")
                           ? " (a quantized tensor: the reference reads an unquantized checkpoint)"
                           : ""));
    }
    return absl::OkStatus();
  }

  // The plain param's expected bytes.
  std::string ExpectedPlain(const PlainSpec& p) const {
    const size_t item = ItemSize(p.dtype);
    std::string want(static_cast<size_t>(std::max<int64_t>(p.experts, 1) * p.n * p.k) * item, '\0');
    for (const Block& b : p.blocks) {
      const TensorView& src = Source(b.hf);
      const int64_t src_cols = src.rank() == 1 ? 1 : src.dim(1);
      const size_t src_item = ItemSize(src.dtype());
      for (int64_t i = 0; i < b.rows; ++i) {
        const std::byte* s = src.bytes().data() + ((b.src_row0 + i) * src_cols + b.src_col0) * src_item;
        char* d = want.data() + ((b.expert * p.n + b.dst_row0 + i) * p.k + b.dst_col0) * item;
        if (src.dtype() == p.dtype) {
          std::memcpy(d, s, static_cast<size_t>(b.cols) * item);
        } else {  // a 16-bit checkpoint value widened to an F32 param: exact
          for (int64_t j = 0; j < b.cols; ++j) {
            const float f = ToFloat(s + j * src_item, src.dtype());
            std::memcpy(d + j * item, &f, 4);
          }
        }
      }
    }
    return want;
  }

  ParamResult CheckPlain(const PlainSpec& p, const Reported& got) const {
    ParamResult r{p.name, ParamResult::Verdict::kOk, ""};
    if (!ShapeAndDtype(p.dtype, p.shape, got, &r)) return r;
    const std::string want = ExpectedPlain(p);
    const std::string& have = got.param->bytes;
    if (want == have) return r;
    const size_t item = ItemSize(p.dtype);
    const int64_t numel = static_cast<int64_t>(want.size() / item);
    int64_t first = -1, count = 0;
    for (int64_t i = 0; i < numel; ++i) {
      if (std::memcmp(want.data() + i * item, have.data() + i * item, item) != 0) {
        if (first < 0) first = i;
        ++count;
      }
    }
    const auto* w = reinterpret_cast<const std::byte*>(want.data()) + first * item;
    const auto* h = reinterpret_cast<const std::byte*>(have.data()) + first * item;
    const int64_t e = first / (p.n * p.k), row = first / p.k % p.n, col = first % p.k;
    r.verdict = ParamResult::Verdict::kMismatch;
    r.detail =
        absl::StrCat("element ", IndexString(p.shape, first), ": engine ", ElementString(h, p.dtype), " vs expected ",
                     ElementString(w, p.dtype), " (from ", SourceString(p.blocks, e, row, col, p.shape.size() == 1),
                     "); ", count, " of ", numel, " elements differ");
    return r;
  }

  // The three params of an INT4 GEMM weight. `got` holds null params for those not reported.
  absl::StatusOr<std::vector<ParamResult>> CheckInt4(const Int4Spec& s, const Reported& packed, const Reported& scales,
                                                     const Reported& zeros) const {
    const int64_t E = std::max<int64_t>(s.experts, 1), n = s.n, k = s.k, ng = s.groups;
    // Expected codes [E][n][k], scales [E][n][ng] and zeros [E][n][ng], from the checkpoint rows.
    std::vector<uint8_t> want_codes(E * n * k), want_zeros(E * n * ng);
    std::vector<uint16_t> want_scales(E * n * ng);
    std::vector<float> row;
    std::vector<uint8_t> row_codes, row_zeros;
    std::vector<uint16_t> row_scales;
    for (const Block& b : s.blocks) {
      const TensorView& src = tensors_.at(b.hf).first;
      const int64_t K = src.dim(1), row_groups = s.group == -1 ? 1 : K / s.group;
      row.resize(K);
      row_codes.resize(K);
      row_scales.resize(row_groups);
      row_zeros.resize(row_groups);
      for (int64_t i = 0; i < b.rows; ++i) {
        const int64_t src_row = b.src_row0 + i;
        const size_t item = ItemSize(src.dtype());
        for (int64_t c = 0; c < K; ++c) row[c] = ToFloat(src.bytes().data() + (src_row * K + c) * item, src.dtype());
        absl::Status st = s.awq ? QuantizeRowAwq(row, s.group, options_.awq_arith, s.scale_dtype, row_codes.data(),
                                                 row_scales.data(), row_zeros.data())
                                : QuantizeRowSymmetric(row, s.group, options_.variant, s.scale_dtype, row_codes.data(),
                                                       row_scales.data());
        if (!st.ok()) return Annotate(st, absl::StrCat("quantizing checkpoint tensor \"", b.hf, "\" row ", src_row));
        const int64_t dst_row = b.dst_row0 + i;
        std::memcpy(&want_codes[(b.expert * n + dst_row) * k + b.dst_col0], &row_codes[b.src_col0], b.cols);
        // Groups never straddle a rank's slice (K_p % G == 0); a channelwise row has one group, the
        // whole HF row's, on every rank (§3.2, `marlin_repeat_scales_on_all_ranks`).
        const int64_t block_groups = s.group == -1 ? 1 : b.cols / s.group;
        const int64_t src_g0 = s.group == -1 ? 0 : b.src_col0 / s.group,
                      dst_g0 = s.group == -1 ? 0 : b.dst_col0 / s.group;
        for (int64_t g = 0; g < block_groups; ++g) {
          want_scales[(b.expert * n + dst_row) * ng + dst_g0 + g] = row_scales[src_g0 + g];
          want_zeros[(b.expert * n + dst_row) * ng + dst_g0 + g] = row_zeros[src_g0 + g];
        }
      }
    }
    // The engine's side, decoded where the param was reported with the right dtype and shape.
    std::vector<ParamResult> out;
    ParamResult rp{s.packed_name, ParamResult::Verdict::kOk, ""}, rs{s.scale_name, ParamResult::Verdict::kOk, ""},
        rz{s.zeros_name, ParamResult::Verdict::kOk, ""};
    std::optional<std::vector<uint8_t>> got_codes, got_zeros;  // [E][n][k], [E][ng][n]
    std::optional<std::vector<uint16_t>> got_scales;           // [E][ng][n]
    if (ShapeAndDtype(s.packed_dtype(), s.packed_shape(), packed, &rp)) {
      got_codes.emplace(E * n * k);
      const auto* words = reinterpret_cast<const unsigned char*>(packed.param->bytes.data());
      for (int64_t e = 0; e < E; ++e) {  // k * n / 2 bytes per expert in every layout
        if (s.trtllm != 0)
          DecodeTrtllmWeight(words + e * (k * n / 2), k, n, s.trtllm == 90, got_codes->data() + e * n * k);
        else
          DecodeMarlinWeight(words + e * (k * n / 2), k, n, got_codes->data() + e * n * k);
      }
    }
    if (ShapeAndDtype(s.scale_dtype, s.scale_shape(), scales, &rs)) {
      std::vector<uint16_t> permuted(E * ng * n);
      std::memcpy(permuted.data(), scales.param->bytes.data(), permuted.size() * 2);
      got_scales.emplace(E * ng * n);
      if (s.trtllm != 0) {  // W4A16 scales are not permuted (TRTLLM_INT4.md §3.1)
        *got_scales = std::move(permuted);
      } else {
        for (int64_t e = 0; e < E; ++e)
          UnpermuteMarlinScales(permuted.data() + e * ng * n, ng, n, s.grouped_perm, got_scales->data() + e * ng * n);
      }
    }
    if (s.awq && ShapeAndDtype(DType::kI32, s.zeros_shape(), zeros, &rz)) {
      got_zeros.emplace(E * ng * n);
      const auto* words = reinterpret_cast<const unsigned char*>(zeros.param->bytes.data());
      for (int64_t e = 0; e < E; ++e)
        DecodeMarlinZeros(words + e * (ng * n / 2), ng, n, got_zeros->data() + e * ng * n);
    }
    // Dequantized values: the engine's from its own codes, scales and zeros where decoded (else
    // the expected ones, so that one bad param does not hide behind another).
    const auto group_of = [&](int64_t col) { return s.group == -1 ? int64_t{0} : col / s.group; };
    const auto value = [&](bool engine, int64_t e, int64_t r, int64_t c) -> float {
      const int64_t g = group_of(c);
      const int u = engine && got_codes ? (*got_codes)[(e * n + r) * k + c] : want_codes[(e * n + r) * k + c];
      const uint16_t sb =
          engine && got_scales ? (*got_scales)[(e * ng + g) * n + r] : want_scales[(e * n + r) * ng + g];
      const int z = !s.awq                ? 8
                    : engine && got_zeros ? (*got_zeros)[(e * ng + g) * n + r]
                                          : want_zeros[(e * n + r) * ng + g];
      return static_cast<float>(u - z) * ScaleValue(sb, s.scale_dtype);  // exact: |u - z| <= 15, 8-bit mantissa
    };
    const auto element = [&](int64_t e, int64_t r, int64_t c) {
      return absl::StrCat(ExpertPrefix(s.experts, e), "row ", r, ", column ", c, " (group ", group_of(c), ")");
    };
    int64_t value_diffs = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < k; ++c) {
          const float a = value(true, e, r, c), b = value(false, e, r, c);
          value_diffs += std::memcmp(&a, &b, 4) != 0;
        }
    const std::string values_note =
        absl::StrCat(value_diffs, " of ", E * n * k, " dequantized float32 values of ", s.linear, " differ");
    if (got_codes) {
      int64_t count = 0;
      std::string first;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = 0; c < k; ++c) {
            const int64_t i = (e * n + r) * k + c;
            if ((*got_codes)[i] == want_codes[i]) continue;
            if (count++ == 0)
              first = absl::StrCat(element(e, r, c), ": engine code ", (*got_codes)[i], " (value ",
                                   value(true, e, r, c), ") vs expected code ", want_codes[i], " (value ",
                                   value(false, e, r, c), ", from ", SourceString(s.blocks, e, r, c), ")");
          }
      if (count > 0) {
        rp.verdict = ParamResult::Verdict::kMismatch;
        rp.detail =
            absl::StrCat("codes differ at ", first, "; ", count, " of ", E * n * k, " codes differ; ", values_note);
      }
    }
    if (got_scales) {
      int64_t count = 0;
      std::string first;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t g = 0; g < ng; ++g) {
            const uint16_t have = (*got_scales)[(e * ng + g) * n + r], want = want_scales[(e * n + r) * ng + g];
            if (have == want) continue;
            if (count++ == 0) {
              const int64_t c = s.group == -1 ? 0 : g * s.group;
              first =
                  absl::StrCat(ExpertPrefix(s.experts, e), "row ", r, ", group ", g, ": engine scale ",
                               absl::StrFormat("0x%04x", have), " (", ScaleValue(have, s.scale_dtype), ") vs expected ",
                               absl::StrFormat("0x%04x", want), " (", ScaleValue(want, s.scale_dtype), ", from ",
                               SourceString(s.blocks, e, r, c), "); its element at column ", c, ": engine value ",
                               value(true, e, r, c), " vs expected ", value(false, e, r, c));
            }
          }
      if (count > 0) {
        rs.verdict = ParamResult::Verdict::kMismatch;
        rs.detail =
            absl::StrCat("scales differ at ", first, "; ", count, " of ", E * n * ng, " scales differ; ", values_note);
      }
    }
    if (got_zeros) {
      int64_t count = 0;
      std::string first;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t g = 0; g < ng; ++g) {
            const int have = (*got_zeros)[(e * ng + g) * n + r], want = want_zeros[(e * n + r) * ng + g];
            if (have == want) continue;
            if (count++ == 0) {
              const int64_t c = s.group == -1 ? 0 : g * s.group;
              first = absl::StrCat(ExpertPrefix(s.experts, e), "row ", r, ", group ", g, ": engine zero point ", have,
                                   " vs expected ", want, " (from ", SourceString(s.blocks, e, r, c),
                                   "); its element at column ", c, ": engine value ", value(true, e, r, c),
                                   " vs expected ", value(false, e, r, c));
            }
          }
      if (count > 0) {
        rz.verdict = ParamResult::Verdict::kMismatch;
        rz.detail = absl::StrCat("zero points differ at ", first, "; ", count, " of ", E * n * ng,
                                 " zero points differ; ", values_note);
      }
    }
    out.push_back(std::move(rp));
    out.push_back(std::move(rs));
    if (s.awq) out.push_back(std::move(rz));
    return out;
  }

 private:
  // False (and `r` filled) when the param is missing or its dtype / shape differ from the spec's.
  static bool ShapeAndDtype(DType dtype, const Shape& shape, const Reported& got, ParamResult* r) {
    if (got.param == nullptr) {
      r->verdict = ParamResult::Verdict::kMissing;
      r->detail = absl::StrCat("the rank must hold it (", SafetensorsName(dtype), ShapeToString(shape),
                               ") but the engine did not report it");
      return false;
    }
    if (got.dtype != dtype || got.shape != shape) {
      r->verdict = ParamResult::Verdict::kMismatch;
      r->detail = absl::StrCat("engine holds ", SafetensorsName(got.dtype), ShapeToString(got.shape), ", expected ",
                               SafetensorsName(dtype), ShapeToString(shape));
      return false;
    }
    return true;
  }

  const ModelConfig& config_;
  const std::map<std::string, std::pair<TensorView, std::string>>& tensors_;
  struct Derived {
    std::string bytes;
    TensorView view;
  };
  std::map<std::string, Derived> derived_;  // QuantizeFp8's tensors (std::map: stable addresses)

  const TensorView& Source(const std::string& name) const {
    auto it = derived_.find(name);
    return it != derived_.end() ? it->second.view : tensors_.at(name).first;
  }
  const ReferenceOptions& options_;
};

}  // namespace

absl::StatusOr<RankReport> Reference::CheckRank(const EngineRank& rank, const std::vector<EngineParam>& params) const {
  const State& st = *state_;
  ASSIGN_OR_RETURN(RankSpec spec, internal::BuildRankSpec(st.config, st.quant ? &*st.quant : nullptr, rank));
  Checker checker(st.config, st.tensors, st.options);
  RETURN_IF_ERROR(checker.CheckCheckpoint(spec));
  RETURN_IF_ERROR(checker.QuantizeFp8(spec));

  // The engine's params, validated as input.
  std::map<std::string, Reported> reported;
  for (const EngineParam& p : params) {
    Reported r;
    r.param = &p;
    auto dt = ParseSafetensorsDType(p.dtype);
    if (!dt.ok()) return Annotate(dt.status(), absl::StrCat("engine param \"", p.name, "\""));
    r.dtype = *dt;
    r.shape.assign(p.shape.begin(), p.shape.end());
    auto bytes = NumBytes(r.dtype, r.shape);
    if (!bytes.ok()) return Annotate(bytes.status(), absl::StrCat("engine param \"", p.name, "\""));
    if (static_cast<size_t>(*bytes) != p.bytes.size())
      return absl::InvalidArgumentError(absl::StrCat("engine param \"", p.name, "\" is ", p.dtype,
                                                     ShapeToString(r.shape), " = ", *bytes, " bytes, but ",
                                                     p.bytes.size(), " bytes came"));
    if (!reported.emplace(p.name, r).second)
      return absl::InvalidArgumentError(absl::StrCat("engine param \"", p.name, "\" is reported twice"));
  }
  const auto find = [&](const std::string& name) {
    auto it = reported.find(name);
    return it == reported.end() ? Reported{} : it->second;
  };

  std::map<std::string, ParamResult> results;
  for (const PlainSpec& p : spec.plain) results[p.name] = checker.CheckPlain(p, find(p.name));
  for (const Int4Spec& s : spec.int4) {
    ASSIGN_OR_RETURN(std::vector<ParamResult> rs, checker.CheckInt4(s, find(s.packed_name), find(s.scale_name),
                                                                    s.awq ? find(s.zeros_name) : Reported{}));
    for (ParamResult& r : rs) results[r.name] = std::move(r);
  }
  RankReport report;
  report.rank = rank;
  std::set<std::string> expected;
  for (const ExpectedParam& e : spec.params) {
    expected.insert(e.name);
    report.params.push_back(std::move(results.at(e.name)));
  }
  for (const EngineParam& p : params) {
    if (expected.count(p.name) != 0) continue;
    report.params.push_back({p.name, ParamResult::Verdict::kUnexpected,
                             absl::StrCat("the engine holds ", p.dtype, ShapeToString(find(p.name).shape),
                                          ", which this rank does not hold by the spec")});
  }
  return report;
}

}  // namespace wsync::tools::reference
