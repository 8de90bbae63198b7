#include "ref_engine/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/parallel_for.h"
#include "common/status.h"
#include "kernels/awq.h"
#include "kernels/format/awq_format.h"
#include "kernels/format/fp8_format.h"
#include "kernels/format/int4_format.h"
#include "kernels/int4.h"
#include "kernels/trtllm.h"
#include "ref_engine/ops.h"

namespace wsync::ref_engine {
namespace {

constexpr int64_t kScanChunk = int64_t{1} << 20;  // elements per finiteness-scan task

// A TensorRT-LLM W4A16 weight (TRTLLM_INT4.md): int8 bytes [(E,) K, N/2] + scales [(E,) K/G, N].
struct TrtllmRef {
  int64_t experts = 1, n = 0, k = 0, group = 0;  // group: rows of K per scale row (K: channelwise)
  bool sm90 = false;                             // the engine's GPU family (dense layout on sm90)
  bool up_first = false;                         // MoE w3_w1: up_proj columns first (§4)
};

// W[e][n][k] = bf16((u - 8) * scale[e][k / G][n']) as float32, gate rows first (n' swaps the
// halves of a w3_w1); through the kernels' exact inverse of the preprocessing.
absl::Status DecodeTrtllm(const TensorView& bytes, const TensorView& scales, const TrtllmRef& r, float* out) {
  const int64_t E = r.experts, N = r.n, K = r.k, G = r.group, groups = K / G;
  kernels::TrtllmOptions t;
  t.num_threads = 1;
  t.arch = r.sm90 ? kernels::TrtllmArch::kSm90 : kernels::TrtllmArch::kSm80;
  ASSIGN_OR_RETURN(Tensor codes, Tensor::Empty(DType::kI32, bytes.rank() == 3 ? Shape{E, K / 8, N} : Shape{K / 8, N}));
  RETURN_IF_ERROR(kernels::UnpreprocessTrtllm(bytes, codes.mutable_view(), t));
  const uint32_t* q = codes.data_as<uint32_t>();
  const int64_t half = r.up_first ? N / 2 : 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t src = (n + half) % N;
      for (int64_t k = 0; k < K; ++k) {
        const int u = static_cast<int>((q[(e * (K / 8) + k / 8) * N + src] >> (4 * (k % 8))) & 0xFu);
        const float s = FloatAt(scales.dtype(), scales.bytes().data(), (e * groups + k / G) * N + src);
        out[(e * N + n) * K + k] = BF16ToF32(F32ToBF16(static_cast<float>(u - 8) * s));
      }
    }
  return absl::OkStatus();
}

// An FP8 weight (docs/spec/FP8.md §1, §4): F8_E4M3 codes [(E,) N, K] and F32 scales, per block
// (bn x bk: [(E,) ceil(N/bn), ceil(K/bk)]) or per row (bn = 0: [(E,) N, 1]).
struct Fp8Decode {
  int64_t experts = 1, n = 0, k = 0, bn = 0, bk = 0;
};

// W[e][n][k] = float(code) * scale of its block or row, in float32 (what the engines' block-FP8
// GEMMs multiply with once the activations are dequantized).
absl::Status DecodeFp8(const TensorView& codes, const TensorView& scales, const Fp8Decode& r, float* out) {
  const int64_t E = r.experts, N = r.n, K = r.k;
  const int64_t srows = r.bn > 0 ? (N + r.bn - 1) / r.bn : N, scols = r.bk > 0 ? (K + r.bk - 1) / r.bk : 1;
  const auto* q = reinterpret_cast<const uint8_t*>(codes.bytes().data());
  const std::byte* s = scales.bytes().data();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t srow = e * srows + (r.bn > 0 ? n / r.bn : n);
      for (int64_t k = 0; k < K; ++k) {
        const float sc = FloatAt(DType::kF32, s, srow * scols + (r.bk > 0 ? k / r.bk : 0));
        out[(e * N + n) * K + k] = kernels::format::E4m3Value(q[(e * N + n) * K + k]) * sc;
      }
    }
  return absl::OkStatus();
}

// One Prepare in progress. kInPlace: the new version's references plus the checks to run and the
// copies to make once every check has passed; kFloat32Copy: fresh float32 copies.
struct Plan {
  std::unique_ptr<ServedWeights> w = std::make_unique<ServedWeights>();
  // A finiteness check of elements [begin, end) of a float view, or (marlin) of a whole Marlin
  // tensor, reported under `name`.
  struct Check {
    std::string name;
    TensorView v;
    int64_t begin = 0, end = 0;
    bool marlin = false;
    TensorView scales, zeros;  // zeros: AWQ-Marlin only
    MarlinRef ref;             // sizes only (the pointers may be misaligned views; see RunCheck)
    bool trtllm = false;       // a TensorRT-LLM weight `v` with `scales`, decoded as `trt` says
    TrtllmRef trt;
    bool fp8 = false;  // an FP8 weight `v` with `scales`, decoded as `f8` says
    Fp8Decode f8;
  };
  // A copy into the model's reused buffers: f32 conversion of a float view, or the raw bytes of
  // misaligned Marlin words / scales.
  struct Copy {
    enum class Kind { kToF32, kPacked, kScales, kZeros, kTrtllm, kFp8 };
    std::string key;
    TensorView src;
    WeightRef* dst = nullptr;
    Kind kind = Kind::kToF32;
    TensorView scales;  // kTrtllm / kFp8: decoded to float32 with these scales
    TrtllmRef trt;
    Fp8Decode f8;
  };
  std::vector<Check> checks;
  std::vector<Copy> copies;
  int64_t bytes_in_place = 0;

  void Scan(const std::string& name, const TensorView& v) {
    for (int64_t b = 0; b < v.numel(); b += kScanChunk)
      checks.push_back({name, v, b, std::min(v.numel(), b + kScanChunk)});
  }
};

}  // namespace

std::string RankGeometry::Where() const { return absl::StrCat("EngineModel (tp rank ", r, "/", T, ")"); }

struct RankWeights::Impl {
  ModelConfig config;
  RankGeometry g;
  ParamLookup lookup;
  WeightMode mode = WeightMode::kInPlace;
  int prepare_threads = 0;
  std::unique_ptr<const ServedWeights> weights;
  PrepareStats stats;
  // kInPlace: float32 copies (1-D params, f16 / misaligned matrices) and aligned copies of
  // misaligned Marlin buffers, by engine parameter name; reused when the size is unchanged.
  absl::flat_hash_map<std::string, Buffer> copies;

  std::string Where() const { return g.Where(); }
  bool float32_copy() const { return mode == WeightMode::kFloat32Copy; }
  int Threads() const {
    if (prepare_threads > 0) return prepare_threads;
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }

  // ---- loading ---------------------------------------------------------------------------------

  absl::StatusOr<std::optional<TensorView>> Find(const std::string& name) const {
    absl::StatusOr<TensorView> v = lookup(name);
    if (v.ok()) return std::optional<TensorView>(*std::move(v));
    if (absl::IsNotFound(v.status())) return std::optional<TensorView>();
    return Annotate(v.status(), absl::StrCat(Where(), ": looking up ", name));
  }

  absl::StatusOr<TensorView> Get(const std::string& name) const {
    ASSIGN_OR_RETURN(std::optional<TensorView> v, Find(name));
    if (!v) return absl::NotFoundError(absl::StrCat(Where(), ": parameter ", name, " not found"));
    return *v;
  }

  absl::Status CheckShape(const std::string& name, const TensorView& v, const Shape& want) const {
    if (v.shape() != want)
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": parameter ", name, " has shape ",
                                                     ShapeToString(v.shape()), ", want ", ShapeToString(want)));
    return absl::OkStatus();
  }

  absl::Status CheckDType(const std::string& name, const TensorView& v, std::initializer_list<DType> ok) const {
    for (DType d : ok)
      if (v.dtype() == d) return absl::OkStatus();
    std::string want;
    for (DType d : ok) absl::StrAppend(&want, want.empty() ? "" : " or ", SafetensorsName(d));
    return absl::InvalidArgumentError(
        absl::StrCat(Where(), ": parameter ", name, " has dtype ", SafetensorsName(v.dtype()), ", want ", want));
  }

  // A fresh float32 buffer of n elements owned by the new version (kFloat32Copy).
  static absl::StatusOr<float*> Fresh(Plan& plan, int64_t n) {
    ASSIGN_OR_RETURN(Buffer b, Buffer::Allocate(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float)));
    plan.w->fresh.push_back(std::move(b));
    return reinterpret_cast<float*>(plan.w->fresh.back().data());
  }

  // A float (bf16/f16/f32) parameter of exactly `shape`, never INT4. kInPlace: matrices in bf16 /
  // f32 are read where they are; 1-D params and f16 or misaligned matrices get a float32 copy.
  absl::Status Float(const std::string& name, const Shape& shape, WeightRef* out, Plan& plan) const {
    if (absl::EndsWith(name, ".weight")) {
      const std::string base = name.substr(0, name.size() - 7);
      for (const std::string& packed : {base + ".weight_packed", base + ".qweight"}) {
        ASSIGN_OR_RETURN(std::optional<TensorView> p, Find(packed));
        if (p)
          return absl::InvalidArgumentError(absl::StrCat(Where(), ": ", packed, " is INT4, but the engine keeps ", name,
                                                         " in bf16 (ENGINE_LAYOUT.md §3.1)"));
      }
    }
    ASSIGN_OR_RETURN(TensorView v, Get(name));
    RETURN_IF_ERROR(CheckDType(name, v, {DType::kBF16, DType::kF16, DType::kF32}));
    RETURN_IF_ERROR(CheckShape(name, v, shape));
    out->shape = shape;
    out->cols = shape.back();
    out->rows = out->cols == 0 ? 0 : v.numel() / out->cols;
    if (float32_copy()) {
      ASSIGN_OR_RETURN(float* dst, Fresh(plan, v.numel()));
      out->form = WeightForm::kF32;
      out->data = dst;
      return ReadFloats(v, dst, name);
    }
    plan.Scan(name, v);
    const bool in_place = shape.size() >= 2 && ((v.dtype() == DType::kBF16 && v.IsAligned(2)) ||
                                                (v.dtype() == DType::kF32 && v.IsAligned(4)));
    if (in_place) {
      out->form = v.dtype() == DType::kBF16 ? WeightForm::kBF16 : WeightForm::kF32;
      out->data = v.data();
      plan.bytes_in_place += static_cast<int64_t>(v.nbytes());
    } else {
      out->form = WeightForm::kF32;  // data: the copy, once every check has passed
      plan.copies.push_back({name, v, out, Plan::Copy::Kind::kToF32});
    }
    return absl::OkStatus();
  }

  // Group size of a quantized linear with `rows` scale rows over K; ENGINE_LAYOUT.md §3.2.
  absl::StatusOr<int> GroupFor(const std::string& name, int64_t K, int64_t rows) const {
    if (g.group_size == -1) {
      if (rows != 1)
        return absl::InvalidArgumentError(
            absl::StrCat(Where(), ": ", name, " has ", rows, " scale rows, want 1 (channelwise quantization)"));
      return -1;
    }
    if (g.group_size > 0) {
      if (K % g.group_size != 0 || rows != K / g.group_size)
        return absl::InvalidArgumentError(absl::StrCat(
            Where(), ": ", name, " has ", rows, " scale rows for K = ", K, " and group size ", g.group_size,
            " (want K / G = ", K % g.group_size == 0 ? absl::StrCat(K / g.group_size) : std::string("not an integer"),
            ")"));
      return g.group_size;
    }
    if (rows < 1 || K % rows != 0)
      return absl::InvalidArgumentError(
          absl::StrCat(Where(), ": ", name, " has ", rows, " scale rows, which does not divide K = ", K));
    return rows == 1 ? -1 : static_cast<int>(K / rows);
  }

  // ---- kFloat32Copy: the kernels' path (MarlinToGptq + UnpermuteMarlinScales, then dequantize) ----

  // Copies a view whose data is not `align`-aligned (safetensors offsets need not be).
  static absl::StatusOr<TensorView> Aligned(const TensorView& v, size_t align, std::optional<Tensor>* keep) {
    if (v.IsAligned(align)) return v;
    ASSIGN_OR_RETURN(*keep, Tensor::CopyOf(v));
    return (*keep)->view();
  }

  // Marlin [(E,) K/16, 2N] + permuted scales [(E,) K/G, N] -> GPTQ qweight [(E,) K/8, N] and
  // GPTQ-order scales. `sglang_grouped` forces the scale permutation choice (the MoE w13 quirk)
  // when it differs from what UnpermuteMarlinScales(size_k = K, G) would pick.
  absl::Status UnMarlin(const std::string& packed_name, const TensorView& packed, const std::string& scale_name,
                        const TensorView& scale, int64_t K, int G, std::optional<bool> sglang_grouped, Tensor* gptq,
                        Tensor* scales) const {
    kernels::KernelOptions opts;
    opts.num_threads = 1;
    std::optional<Tensor> keep_p, keep_s;
    ASSIGN_OR_RETURN(const TensorView p, Aligned(packed, 4, &keep_p));
    ASSIGN_OR_RETURN(const TensorView s, Aligned(scale, 2, &keep_s));
    ASSIGN_OR_RETURN(Shape gshape, kernels::GptqShapeFor(p.shape()));
    ASSIGN_OR_RETURN(*gptq, Tensor::Empty(DType::kI32, gshape));
    RETURN_IF_ERROR(Annotate(kernels::MarlinToGptq(p, nullptr, gptq->mutable_view(), opts),
                             absl::StrCat(Where(), ": ", packed_name)));
    ASSIGN_OR_RETURN(*scales, Tensor::Empty(s.dtype(), s.shape()));
    const bool kernel_grouped = G != -1 && G < K;
    if (!sglang_grouped || *sglang_grouped == kernel_grouped) {
      return Annotate(kernels::UnpermuteMarlinScales(s, K, G, scales->mutable_view(), opts),
                      absl::StrCat(Where(), ": ", scale_name));
    }
    // SGLang permuted these scales with a size_k the kernel API cannot express (rows != size_k/G):
    // undo the column permutation directly with the shared format tables (FORMATS.md §5).
    const bool grouped = *sglang_grouped;
    const int width = grouped ? kernels::format::kScalePermGroupedWidth : kernels::format::kScalePermChannelWidth;
    const int64_t n = s.shape().back();
    if (n % width != 0)
      return absl::InvalidArgumentError(
          absl::StrCat(Where(), ": ", scale_name, ": N = ", n, " is not a multiple of ", width));
    const uint16_t* in = s.data_as<uint16_t>();
    uint16_t* out = scales->data_as<uint16_t>();
    const int64_t rows = s.numel() / n;
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t b = 0; b < n; b += width)
        for (int q = 0; q < width; ++q) {
          const int src = grouped ? kernels::format::ScalePermGrouped(q) : kernels::format::ScalePermChannel(q);
          out[row * n + b + src] = in[row * n + b + q];
        }
    return absl::OkStatus();
  }

  // W[e][n][k] = bf16((u - z) * scale[e][k / G][n]) from GPTQ qweight [E, K/8, N] and scales [E, K/G, N],
  // z = 8, or from AWQ-packed zero points [E, K/G, N/8] (`awq_zeros`); written to out (row-major [E, N, K]).
  static void Dequantize(const Tensor& gptq, const Tensor& scales, const Tensor* awq_zeros, int64_t E, int64_t K,
                         int64_t N, int G, float* out) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(gptq.view().data());
    const TensorView sv = scales.view();
    const int64_t Gc = G == -1 ? K : G, groups = K / Gc;
    std::vector<float> srow(static_cast<size_t>(groups * N));
    for (int64_t e = 0; e < E; ++e) {
      (void)ReadFloats(
          TensorView(sv.dtype(), {groups * N},
                     sv.bytes().subspan(static_cast<size_t>(e * groups * N * 2), static_cast<size_t>(groups * N * 2))),
          srow.data(), "scales");
      const uint32_t* qe = q + e * (K / 8) * N;
      float* oe = out + e * N * K;
      for (int64_t kw = 0; kw < K / 8; ++kw)
        for (int64_t n = 0; n < N; ++n) {
          const uint32_t word = qe[kw * N + n];
          for (int i = 0; i < 8; ++i) {
            const int64_t k = kw * 8 + i;
            int z = 8;
            if (awq_zeros != nullptr) {
              const uint32_t* zr = reinterpret_cast<const uint32_t*>(awq_zeros->view().data());
              z = static_cast<int>(kernels::format::AwqNibble(zr[((e * groups) + k / Gc) * (N / 8) + n / 8], n));
            }
            const float v = static_cast<float>(static_cast<int>((word >> (4 * i)) & 0xFu) - z) *
                            srow[static_cast<size_t>((k / Gc) * N + n)];
            oe[n * K + k] = BF16ToF32(F32ToBF16(v));
          }
        }
    }
  }

  // ---- INT4 --------------------------------------------------------------------------------------

  // Marlin tensors [E, K/16, 2N] + [E, K/G, N] of one weight [E, N, K] (checked by the caller).
  // kInPlace: read where they are (aligned copies if they are not 4 / 2-byte aligned), checked
  // for finiteness by a Check; kFloat32Copy: dequantized into a fresh float32 copy.
  // AWQ-Marlin: `zeros` (named zname) holds the Marlin zero points [E, K/G, N/8]; null for GPTQ.
  absl::Status Marlin(const std::string& name, const std::string& pname, const TensorView& packed,
                      const std::string& sname, const TensorView& scale, int64_t E, int64_t N, int64_t K, int G,
                      bool sglang_grouped, WeightRef* out, Plan& plan, const std::string& zname = "",
                      const TensorView* zeros = nullptr) const {
    out->shape = E == 1 && packed.rank() == 2 ? Shape{N, K} : Shape{E, N, K};
    out->rows = E * N;
    out->cols = K;
    if (float32_copy()) {
      Tensor gptq, scales;
      const std::optional<bool> force =
          sglang_grouped == (G != -1 && G < K) ? std::nullopt : std::optional(sglang_grouped);
      RETURN_IF_ERROR(UnMarlin(pname, packed, sname, scale, K, G, force, &gptq, &scales));
      std::optional<Tensor> awq_zeros;
      if (zeros != nullptr) {
        kernels::KernelOptions opts;
        opts.num_threads = 1;
        std::optional<Tensor> keep;
        ASSIGN_OR_RETURN(const TensorView z, Aligned(*zeros, 4, &keep));
        ASSIGN_OR_RETURN(awq_zeros, Tensor::Empty(DType::kI32, z.shape()));
        RETURN_IF_ERROR(Annotate(kernels::MarlinZerosToAwq(z, awq_zeros->mutable_view(), opts),
                                 absl::StrCat(Where(), ": ", zname)));
      }
      ASSIGN_OR_RETURN(float* dst, Fresh(plan, E * N * K));
      Dequantize(gptq, scales, awq_zeros ? &*awq_zeros : nullptr, E, K, N, G, dst);
      out->form = WeightForm::kF32;
      out->data = dst;
      return absl::OkStatus();
    }
    MarlinRef& m = out->marlin;
    m.scales_f16 = scale.dtype() == DType::kF16;
    m.experts = E;
    m.n = N;
    m.k = K;
    m.group = G == -1 ? K : G;
    m.grouped_perm = sglang_grouped;
    out->form = WeightForm::kMarlin;
    if (packed.IsAligned(4)) {
      m.packed = packed.data_as<uint32_t>();
      plan.bytes_in_place += static_cast<int64_t>(packed.nbytes());
    } else {
      plan.copies.push_back({pname, packed, out, Plan::Copy::Kind::kPacked});
    }
    if (scale.IsAligned(2)) {
      m.scales = scale.data_as<uint16_t>();
      plan.bytes_in_place += static_cast<int64_t>(scale.nbytes());
    } else {
      plan.copies.push_back({sname, scale, out, Plan::Copy::Kind::kScales});
    }
    if (zeros != nullptr && zeros->IsAligned(4)) {
      m.zeros = zeros->data_as<uint32_t>();
      plan.bytes_in_place += static_cast<int64_t>(zeros->nbytes());
    } else if (zeros != nullptr) {
      plan.copies.push_back({zname, *zeros, out, Plan::Copy::Kind::kZeros});
    }
    Plan::Check c;
    c.name = name;
    c.v = packed;
    c.marlin = true;
    c.scales = scale;
    if (zeros != nullptr) c.zeros = *zeros;
    c.ref = m;
    plan.checks.push_back(std::move(c));
    return absl::OkStatus();
  }

  // A linear of this rank, [N, K]: `prefix.weight` (float), or `prefix.weight_packed` +
  // `prefix.weight_scale` (Marlin INT4) when `int4_ok`.
  absl::Status Linear(const std::string& prefix, int64_t N, int64_t K, bool int4_ok, WeightRef* out, Plan& plan) const {
    const std::string wname = prefix + ".weight", pname = prefix + ".weight_packed", sname = prefix + ".weight_scale";
    ASSIGN_OR_RETURN(std::optional<TensorView> qweight, Find(prefix + ".qweight"));
    if (qweight) return AwqLinear(prefix, *qweight, N, K, int4_ok, out, plan);
    ASSIGN_OR_RETURN(std::optional<TensorView> packed, Find(pname));
    if (!packed) {
      ASSIGN_OR_RETURN(std::optional<TensorView> w, Find(wname));
      if (w && w->dtype() == DType::kI8) return TrtllmLinear(prefix, *w, N, K, int4_ok, out, plan);
      // FP8 has no fused-layer limits of INT4's (kv_b_proj, fused_qkv_a_proj_with_mqa load FP8).
      if (w && w->dtype() == DType::kF8E4M3) return Fp8(wname, *w, 1, N, K, true, out, plan);
      return Float(wname, {N, K}, out, plan);
    }
    if (!int4_ok)
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": ", pname, " is INT4, but SGLang cannot load ", prefix,
                                                     " as INT4 (ENGINE_LAYOUT.md §3.1); the engine keeps it in bf16"));
    ASSIGN_OR_RETURN(std::optional<TensorView> dense, Find(wname));
    if (dense)
      return absl::InvalidArgumentError(
          absl::StrCat(Where(), ": both ", wname, " and ", pname, " exist; a linear is either bf16 or INT4"));
    RETURN_IF_ERROR(CheckDType(pname, *packed, {DType::kI32}));
    if (K % 16 != 0 || N % 64 != 0)
      return absl::InvalidArgumentError(absl::StrCat(
          Where(), ": ", pname, ": Marlin needs K % 16 == 0 and N % 64 == 0, got [N, K] = [", N, ", ", K, "]"));
    RETURN_IF_ERROR(CheckShape(pname, *packed, {K / 16, 2 * N}));
    ASSIGN_OR_RETURN(TensorView scale, Get(sname));
    ASSIGN_OR_RETURN(const int G, GroupScales(sname, scale, 1, false, N, K));
    return Marlin(wname, pname, *packed, sname, scale, 1, N, K, G, G != -1 && G < K, out, plan);
  }

  // An FP8 weight `name` (F8_E4M3 [(E,) N, K], checked here) and its scales `name`_scale_inv (block,
  // the config's weight_block_size) or `name`_scale (per channel [(E,) N, 1]), all F32; served
  // from a float32 copy decoded at Prepare (kInPlace: after every check passed).
  absl::Status Fp8(const std::string& name, const TensorView& w, int64_t E, int64_t N, int64_t K, bool quant_ok,
                   WeightRef* out, Plan& plan) const {
    const QuantizationConfig* q = config.quantization ? &*config.quantization : nullptr;
    if (!quant_ok || q == nullptr || !q->is_fp8())
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": ", name, " is FP8, but ",
                                                     q == nullptr || !q->is_fp8()
                                                         ? "the engine's quantization_config is not FP8"
                                                         : "the engine keeps this linear in bf16"));
    const bool stacked = E > 1 || w.rank() == 3;
    RETURN_IF_ERROR(CheckShape(name, w, stacked ? Shape{E, N, K} : Shape{N, K}));
    Fp8Decode r{E, N, K, q->is_fp8_block() ? q->block_n : 0, q->is_fp8_block() ? q->block_k : 0};
    const std::string sname = name + (q->is_fp8_block() ? "_scale_inv" : "_scale");
    ASSIGN_OR_RETURN(TensorView scale, Get(sname));
    RETURN_IF_ERROR(CheckDType(sname, scale, {DType::kF32}));
    const int64_t srows = r.bn > 0 ? (N + r.bn - 1) / r.bn : N, scols = r.bk > 0 ? (K + r.bk - 1) / r.bk : 1;
    RETURN_IF_ERROR(CheckShape(sname, scale, stacked ? Shape{E, srows, scols} : Shape{srows, scols}));
    out->shape = stacked ? Shape{E, N, K} : Shape{N, K};
    out->rows = E * N;
    out->cols = K;
    out->form = WeightForm::kF32;
    if (float32_copy()) {
      ASSIGN_OR_RETURN(float* dst, Fresh(plan, E * N * K));
      out->data = dst;
      return DecodeFp8(w, scale, r, dst);
    }
    Plan::Check check;
    check.name = name;
    check.v = w;
    check.scales = scale;
    check.fp8 = true;
    check.f8 = r;
    plan.checks.push_back(std::move(check));
    if (scale.IsAligned(4)) {  // served in place: codes and scales where the engine holds them
      out->form = WeightForm::kFp8;
      out->fp8 =
          Fp8Ref{reinterpret_cast<const uint8_t*>(w.bytes().data()), scale.data_as<float>(), E, N, K, r.bn, r.bk};
      plan.bytes_in_place += static_cast<int64_t>(w.nbytes() + scale.nbytes());
      return absl::OkStatus();
    }
    Plan::Copy c{name, w, out, Plan::Copy::Kind::kFp8};
    c.scales = scale;
    c.f8 = r;
    plan.copies.push_back(std::move(c));  // misaligned scales: a decoded f32 copy
    return absl::OkStatus();
  }

  bool TrtllmSm90() const { return config.quantization && config.quantization->engine_layout == "trtllm-sm90"; }

  // A TensorRT-LLM weight [E, N, K] (`bytes` int8 [(E,) K, N/2], `scale` [(E,) K/G, N], checked by the
  // caller), served from a float32 copy decoded at Prepare (kInPlace: after every check passed).
  absl::Status Trtllm(const std::string& name, const TensorView& bytes, const std::string& sname,
                      const TensorView& scale, const TrtllmRef& r, WeightRef* out, Plan& plan) const {
    out->shape = bytes.rank() == 2 ? Shape{r.n, r.k} : Shape{r.experts, r.n, r.k};
    out->rows = r.experts * r.n;
    out->cols = r.k;
    out->form = WeightForm::kF32;
    if (float32_copy()) {
      ASSIGN_OR_RETURN(float* dst, Fresh(plan, r.experts * r.n * r.k));
      out->data = dst;
      return Annotate(DecodeTrtllm(bytes, scale, r, dst), absl::StrCat(Where(), ": ", name));
    }
    Plan::Copy c{name, bytes, out, Plan::Copy::Kind::kTrtllm};
    c.scales = scale;
    c.trt = r;
    plan.copies.push_back(std::move(c));
    Plan::Check check;
    check.name = name;
    check.v = bytes;
    check.scales = scale;
    check.trtllm = true;
    check.trt = r;
    plan.checks.push_back(std::move(check));
    (void)sname;
    return absl::OkStatus();
  }

  // Checks group scales [(E,) K/G, N] (bf16 / fp16; Marlin's permuted, AWQ's, TensorRT-LLM's) and
  // returns their group size.
  absl::StatusOr<int> GroupScales(const std::string& sname, const TensorView& scale, int64_t E, bool stacked, int64_t N,
                                  int64_t K) const {
    RETURN_IF_ERROR(CheckDType(sname, scale, {DType::kBF16, DType::kF16}));
    if (scale.rank() != (stacked ? 3 : 2) || scale.dim(scale.rank() - 1) != N || (stacked && scale.dim(0) != E))
      return absl::InvalidArgumentError(
          absl::StrCat(Where(), ": parameter ", sname, " has shape ", ShapeToString(scale.shape()), ", want [",
                       stacked ? absl::StrCat(E, ", ") : "", "K/G, ", N, "] (K = ", K, ")"));
    return GroupFor(sname, K, scale.dim(scale.rank() - 2));
  }

  // A TensorRT-LLM linear (TRTLLM_INT4.md §1-§3, engine_layout trtllm-*): `prefix.weight` int8
  // [K, N/2] preprocessed, `prefix.weight_scale` [K/G, N].
  absl::Status TrtllmLinear(const std::string& prefix, const TensorView& w, int64_t N, int64_t K, bool int4_ok,
                            WeightRef* out, Plan& plan) const {
    const std::string wname = prefix + ".weight", sname = prefix + ".weight_scale";
    if (!int4_ok)
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": ", wname, " is INT4 (int8 TensorRT-LLM bytes), but ",
                                                     prefix, " is served in bf16 (ENGINE_LAYOUT.md §3.1)"));
    if (K % 64 != 0 || N % 64 != 0)
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": ", wname,
                                                     ": the TensorRT-LLM layout needs K % 64 == 0 and N % 64 == 0, "
                                                     "got [N, K] = [",
                                                     N, ", ", K, "]"));
    RETURN_IF_ERROR(CheckShape(wname, w, {K, N / 2}));
    ASSIGN_OR_RETURN(TensorView scale, Get(sname));
    ASSIGN_OR_RETURN(const int G, GroupScales(sname, scale, 1, false, N, K));
    TrtllmRef r{1, N, K, G == -1 ? K : G, TrtllmSm90(), false};
    return Trtllm(wname, w, sname, scale, r, out, plan);
  }

  // TensorRT-LLM MoE (TRTLLM_INT4.md §4): `w3_w1_weight` int8 [E, H, I'] (up_proj columns first),
  // `w2_weight` int8 [E, I', H/2], scales [E, H/G, 2I'] and [E, I'/G, H]; the sm80 layout on every arch.
  absl::Status TrtllmExperts(const std::string& prefix, WeightRef* w13, WeightRef* w2, Plan& plan) const {
    const int64_t E = g.E_loc, I = g.I_loc, H = g.H;
    if (H % 64 != 0 || I % 64 != 0)
      return absl::InvalidArgumentError(
          absl::StrCat(Where(), ": ", prefix,
                       ": the TensorRT-LLM MoE layout needs H % 64 == 0 and I' % 64 == 0, got H = ", H, ", I' = ", I));
    struct Part {
      std::string name;
      int64_t n, k;
      bool up_first;
      WeightRef* out;
    };
    const Part parts[2] = {{prefix + ".w3_w1_weight", 2 * I, H, true, w13}, {prefix + ".w2_weight", H, I, false, w2}};
    for (const Part& part : parts) {
      ASSIGN_OR_RETURN(TensorView w, Get(part.name));
      RETURN_IF_ERROR(CheckDType(part.name, w, {DType::kI8}));
      RETURN_IF_ERROR(CheckShape(part.name, w, {E, part.k, part.n / 2}));
      const std::string sname = part.name + "_scale";
      ASSIGN_OR_RETURN(TensorView scale, Get(sname));
      ASSIGN_OR_RETURN(const int G, GroupScales(sname, scale, E, true, part.n, part.k));
      TrtllmRef r{E, part.n, part.k, G == -1 ? part.k : G, TrtllmSm90(), part.up_first};
      RETURN_IF_ERROR(Trtllm(part.name, w, sname, scale, r, part.out, plan));
    }
    return absl::OkStatus();
  }

  // An AWQ-Marlin linear (vLLM / SGLang awq_marlin, AWQ.md §3): `prefix.qweight` int32
  // [K/16, 2N], `prefix.qzeros` int32 [K/G, N/8] (Marlin zero points), `prefix.scales` [K/G, N]
  // permuted with the 64-column perm iff G < K.
  absl::Status AwqLinear(const std::string& prefix, const TensorView& qweight, int64_t N, int64_t K, bool int4_ok,
                         WeightRef* out, Plan& plan) const {
    const std::string qname = prefix + ".qweight", zname = prefix + ".qzeros", sname = prefix + ".scales";
    if (!int4_ok)
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": ", qname, " is INT4, but SGLang cannot load ", prefix,
                                                     " as INT4 (ENGINE_LAYOUT.md §3.1); the engine keeps it in bf16"));
    for (const std::string& other : {prefix + ".weight", prefix + ".weight_packed"}) {
      ASSIGN_OR_RETURN(std::optional<TensorView> v, Find(other));
      if (v)
        return absl::InvalidArgumentError(
            absl::StrCat(Where(), ": both ", other, " and ", qname, " exist; a linear has one form"));
    }
    RETURN_IF_ERROR(CheckDType(qname, qweight, {DType::kI32}));
    if (K % 16 != 0 || N % 64 != 0)
      return absl::InvalidArgumentError(absl::StrCat(
          Where(), ": ", qname, ": AWQ-Marlin needs K % 16 == 0 and N % 64 == 0, got [N, K] = [", N, ", ", K, "]"));
    RETURN_IF_ERROR(CheckShape(qname, qweight, {K / 16, 2 * N}));
    ASSIGN_OR_RETURN(TensorView scale, Get(sname));
    ASSIGN_OR_RETURN(const int G, GroupScales(sname, scale, 1, false, N, K));
    ASSIGN_OR_RETURN(TensorView zeros, Get(zname));
    RETURN_IF_ERROR(CheckDType(zname, zeros, {DType::kI32}));
    RETURN_IF_ERROR(CheckShape(zname, zeros, {scale.dim(0), N / 8}));
    return Marlin(prefix + ".weight", qname, qweight, sname, scale, 1, N, K, G, G != -1 && G < K, out, plan, zname,
                  &zeros);
  }

  // AWQ-Marlin stacked experts (AWQ.md §4): w13_qweight [E, H/16, 4I'], w2_qweight [E, I'/16, 2H],
  // w13_qzeros [E, H/G, 2I'/8], w2_qzeros [E, I'/G, H/8], w13_scales [E, H/G, 2I'], w2_scales
  // [E, I'/G, H]; both scale permutations use size_k = I' (vLLM's quirk).
  absl::Status AwqExperts(const std::string& prefix, WeightRef* w13, WeightRef* w2, Plan& plan) const {
    const int64_t E = g.E_loc, I = g.I_loc, H = g.H;
    struct Part {
      std::string base;  // "...experts.w13"
      int64_t n, k;
      WeightRef* out;
    };
    const Part parts[2] = {{prefix + ".w13", 2 * I, H, w13}, {prefix + ".w2", H, I, w2}};
    if (H % 64 != 0 || I % 32 != 0)
      return absl::InvalidArgumentError(absl::StrCat(
          Where(), ": ", prefix,
          ": AWQ-Marlin MoE needs H % 64 == 0 and I' % 32 == 0 (ENGINE_LAYOUT.md §4), got H = ", H, ", I' = ", I));
    int G_first = 0;
    for (const Part& part : parts) {
      const std::string qn = part.base + "_qweight", zn = part.base + "_qzeros", sn = part.base + "_scales";
      for (const std::string& other : {part.base + "_weight", part.base + "_weight_packed"}) {
        ASSIGN_OR_RETURN(std::optional<TensorView> v, Find(other));
        if (v)
          return absl::InvalidArgumentError(
              absl::StrCat(Where(), ": both ", other, " and ", qn, " exist; one FusedMoE has one quantization method"));
      }
      ASSIGN_OR_RETURN(TensorView q, Get(qn));
      RETURN_IF_ERROR(CheckDType(qn, q, {DType::kI32}));
      RETURN_IF_ERROR(CheckShape(qn, q, {E, part.k / 16, 2 * part.n}));
      ASSIGN_OR_RETURN(TensorView sc, Get(sn));
      RETURN_IF_ERROR(CheckDType(sn, sc, {DType::kBF16, DType::kF16}));
      if (sc.rank() != 3 || sc.dim(0) != E || sc.dim(2) != part.n)
        return absl::InvalidArgumentError(absl::StrCat(Where(), ": parameter ", sn, " has shape ",
                                                       ShapeToString(sc.shape()), ", want [", E, ", K/G, ", part.n,
                                                       "]"));
      ASSIGN_OR_RETURN(const int G, GroupFor(sn, part.k, sc.dim(1)));
      if (G_first == 0) G_first = G;
      if (g.group_size == 0 && G != G_first && sc.dim(1) != 1)
        return absl::InvalidArgumentError(
            absl::StrCat(Where(), ": ", prefix, ": w13 scales imply group size ", G_first, " but w2 scales imply ", G));
      ASSIGN_OR_RETURN(TensorView z, Get(zn));
      RETURN_IF_ERROR(CheckDType(zn, z, {DType::kI32}));
      RETURN_IF_ERROR(CheckShape(zn, z, {E, sc.dim(1), part.n / 8}));
      RETURN_IF_ERROR(
          Marlin(part.base + "_weight", qn, q, sn, sc, E, part.n, part.k, G, G != -1 && G < I, part.out, plan, zn, &z));
    }
    return absl::OkStatus();
  }

  // Stacked experts of a FusedMoE (ENGINE_LAYOUT.md §2.7 bf16, §3.3 + §4 Marlin INT4).
  absl::Status Experts(const std::string& prefix, WeightRef* w13, WeightRef* w2, Plan& plan) const {
    const int64_t E = g.E_loc, I = g.I_loc, H = g.H;
    const std::string n13 = prefix + ".w13_weight", n2 = prefix + ".w2_weight";
    ASSIGN_OR_RETURN(std::optional<TensorView> a13, Find(prefix + ".w13_qweight"));
    ASSIGN_OR_RETURN(std::optional<TensorView> a2, Find(prefix + ".w2_qweight"));
    if (a13 || a2) return AwqExperts(prefix, w13, w2, plan);
    ASSIGN_OR_RETURN(std::optional<TensorView> t13, Find(prefix + ".w3_w1_weight"));
    if (t13) return TrtllmExperts(prefix, w13, w2, plan);
    ASSIGN_OR_RETURN(std::optional<TensorView> p13, Find(n13 + "_packed"));
    ASSIGN_OR_RETURN(std::optional<TensorView> p2, Find(n2 + "_packed"));
    if (!p13 && !p2) {
      ASSIGN_OR_RETURN(std::optional<TensorView> f13, Find(n13));
      if (f13 && f13->dtype() == DType::kF8E4M3) {
        ASSIGN_OR_RETURN(TensorView f2, Get(n2));
        RETURN_IF_ERROR(CheckDType(n2, f2, {DType::kF8E4M3}));
        RETURN_IF_ERROR(Fp8(n13, *f13, E, 2 * I, H, true, w13, plan));
        return Fp8(n2, f2, E, H, I, true, w2, plan);
      }
      RETURN_IF_ERROR(Float(n13, {E, 2 * I, H}, w13, plan));
      return Float(n2, {E, H, I}, w2, plan);
    }
    if (!p13 || !p2)
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": ", p13 ? n13 : n2, "_packed is INT4 but ",
                                                     p13 ? n2 : n13,
                                                     " is not; one FusedMoE has one quantization method"));
    for (const std::string& n : {n13, n2}) {
      ASSIGN_OR_RETURN(std::optional<TensorView> d, Find(n));
      if (d)
        return absl::InvalidArgumentError(
            absl::StrCat(Where(), ": both ", n, " and ", n, "_packed exist; experts are either bf16 or INT4"));
    }
    RETURN_IF_ERROR(CheckDType(n13 + "_packed", *p13, {DType::kI32}));
    RETURN_IF_ERROR(CheckDType(n2 + "_packed", *p2, {DType::kI32}));
    if (H % 64 != 0 || I % 32 != 0)
      return absl::InvalidArgumentError(absl::StrCat(
          Where(), ": ", prefix, ": Marlin MoE needs H % 64 == 0 and I' % 32 == 0 (ENGINE_LAYOUT.md §4), got H = ", H,
          ", I' = ", I));
    RETURN_IF_ERROR(CheckShape(n13 + "_packed", *p13, {E, H / 16, 4 * I}));
    RETURN_IF_ERROR(CheckShape(n2 + "_packed", *p2, {E, I / 16, 2 * H}));
    ASSIGN_OR_RETURN(TensorView s13, Get(n13 + "_scale"));
    ASSIGN_OR_RETURN(TensorView s2, Get(n2 + "_scale"));
    RETURN_IF_ERROR(CheckDType(n13 + "_scale", s13, {DType::kBF16, DType::kF16}));
    RETURN_IF_ERROR(CheckDType(n2 + "_scale", s2, {DType::kBF16, DType::kF16}));
    if (s13.rank() != 3 || s13.dim(0) != E || s13.dim(2) != 2 * I)
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": parameter ", n13, "_scale has shape ",
                                                     ShapeToString(s13.shape()), ", want [", E, ", H/G, ", 2 * I, "]"));
    if (s2.rank() != 3 || s2.dim(0) != E || s2.dim(2) != H)
      return absl::InvalidArgumentError(absl::StrCat(Where(), ": parameter ", n2, "_scale has shape ",
                                                     ShapeToString(s2.shape()), ", want [", E, ", I'/G, ", H, "]"));
    ASSIGN_OR_RETURN(int G13, GroupFor(n13 + "_scale", H, s13.dim(1)));
    ASSIGN_OR_RETURN(int G2, GroupFor(n2 + "_scale", I, s2.dim(1)));
    if (g.group_size == 0) {
      // Inferred: both tensors share the FusedMoE's group size; a single row on both is channelwise.
      if (G13 == -1 && G2 != -1 && H % G2 == 0 && H / G2 == 1) G13 = G2;
      if (G2 == -1 && G13 != -1 && I % G13 == 0 && I / G13 == 1) G2 = G13;
      if (G13 != G2)
        return absl::InvalidArgumentError(
            absl::StrCat(Where(), ": ", prefix, ": w13 scales imply group size ", G13, " but w2 scales imply ", G2));
    }
    if (G2 != -1 && I % G2 != 0)
      return absl::InvalidArgumentError(
          absl::StrCat(Where(), ": ", prefix, ": I' = ", I, " is not a multiple of the group size ", G2));
    // SGLang permutes w13 scales with size_k = 4I' (ENGINE_LAYOUT.md §4 quirk).
    const bool grouped13 = G13 != -1 && G13 < 4 * I;
    RETURN_IF_ERROR(Marlin(n13, n13 + "_packed", *p13, n13 + "_scale", s13, E, 2 * I, H, G13, grouped13, w13, plan));
    return Marlin(n2, n2 + "_packed", *p2, n2 + "_scale", s2, E, H, I, G2, G2 != -1 && G2 < I, w2, plan);
  }

  // Resolves every parameter of the rank into plan.w (names, dtypes, shapes; kFloat32Copy also
  // copies and dequantizes) and indexes it under the bf16 engine parameter names.
  absl::Status Resolve(Plan& plan) const {
    ServedWeights* w = plan.w.get();
    const ModelConfig& c = config;
    const int64_t H = g.H;
    RETURN_IF_ERROR(Float("model.embed_tokens.weight", {g.P, H}, &w->embed, plan));
    if (!c.tie_word_embeddings) RETURN_IF_ERROR(Float("lm_head.weight", {g.P, H}, &w->lm_head, plan));
    RETURN_IF_ERROR(Float("model.norm.weight", {H}, &w->final_norm, plan));
    w->layers.resize(static_cast<size_t>(c.num_hidden_layers));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      LayerWeights& L = w->layers[static_cast<size_t>(i)];
      const std::string p = absl::StrCat("model.layers.", i, ".");
      RETURN_IF_ERROR(Float(p + "input_layernorm.weight", {H}, &L.in_norm, plan));
      RETURN_IF_ERROR(Float(p + "post_attention_layernorm.weight", {H}, &L.post_norm, plan));
      const std::string a = p + "self_attn.";
      if (c.mla) {
        const int64_t nl = g.nh / g.T;
        if (g.q_lora > 0) {
          RETURN_IF_ERROR(
              Linear(a + "fused_qkv_a_proj_with_mqa", g.q_lora + g.kv_lora + g.rope, H, false, &L.qkv_a, plan));
          RETURN_IF_ERROR(Float(a + "q_a_layernorm.weight", {g.q_lora}, &L.q_a_norm, plan));
          RETURN_IF_ERROR(Linear(a + "q_b_proj", nl * g.qd, g.q_lora, true, &L.q, plan));
        } else {
          RETURN_IF_ERROR(Linear(a + "q_proj", nl * g.qd, H, true, &L.q, plan));
          RETURN_IF_ERROR(Linear(a + "kv_a_proj_with_mqa", g.kv_lora + g.rope, H, true, &L.qkv_a, plan));
        }
        RETURN_IF_ERROR(Float(a + "kv_a_layernorm.weight", {g.kv_lora}, &L.kv_a_norm, plan));
        RETURN_IF_ERROR(Linear(a + "kv_b_proj", nl * g.kvd, g.kv_lora, false, &L.kv_b, plan));
        RETURN_IF_ERROR(Linear(a + "o_proj", H, nl * g.vd, true, &L.o, plan));
      } else {
        const int64_t nqkv = (g.nh_loc + 2 * g.kv_loc) * g.hd;
        RETURN_IF_ERROR(Linear(a + "qkv_proj", nqkv, H, true, &L.qkv, plan));
        if (c.qkv_bias) RETURN_IF_ERROR(Float(a + "qkv_proj.bias", {nqkv}, &L.qkv_bias, plan));
        RETURN_IF_ERROR(Linear(a + "o_proj", H, g.nh_loc * g.hd, true, &L.o, plan));
        if (c.o_proj_bias) RETURN_IF_ERROR(Float(a + "o_proj.bias", {H}, &L.o_bias, plan));
        if (c.qk_norm) {
          RETURN_IF_ERROR(Float(a + "q_norm.weight", {g.hd}, &L.q_norm, plan));
          RETURN_IF_ERROR(Float(a + "k_norm.weight", {g.hd}, &L.k_norm, plan));
        }
      }
      const std::string m = p + "mlp.";
      L.moe = c.IsMoeLayer(i);
      if (!L.moe) {
        RETURN_IF_ERROR(Linear(m + "gate_up_proj", 2 * g.F_loc, H, true, &L.gate_up, plan));
        RETURN_IF_ERROR(Linear(m + "down_proj", H, g.F_loc, true, &L.down, plan));
        if (c.mlp_bias) {
          RETURN_IF_ERROR(Float(m + "gate_up_proj.bias", {2 * g.F_loc}, &L.gate_up_bias, plan));
          RETURN_IF_ERROR(Float(m + "down_proj.bias", {H}, &L.down_bias, plan));
        }
        continue;
      }
      RETURN_IF_ERROR(Float(m + "gate.weight", {g.E_routed, H}, &L.router, plan));
      if (c.moe->HasExpertBias())
        RETURN_IF_ERROR(Float(m + "gate.e_score_correction_bias", {g.E_routed}, &L.score_bias, plan));
      RETURN_IF_ERROR(Experts(m + "experts", &L.w13, &L.w2, plan));
      if (g.S_loc > 0) {
        RETURN_IF_ERROR(Linear(m + "shared_experts.gate_up_proj", 2 * g.S_loc, H, true, &L.shared_gate_up, plan));
        RETURN_IF_ERROR(Linear(m + "shared_experts.down_proj", H, g.S_loc, true, &L.shared_down, plan));
      }
    }
    // Index under the bf16 engine parameter names.
    auto add = [&](const std::string& name, const WeightRef& ref) {
      if (ref.empty()) return;
      w->order.emplace_back(name, &ref);
      w->index[name] = &ref;
    };
    add("model.embed_tokens.weight", w->embed);
    add("lm_head.weight", w->lm_head);
    add("model.norm.weight", w->final_norm);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const LayerWeights& L = w->layers[static_cast<size_t>(i)];
      const std::string p = absl::StrCat("model.layers.", i, "."), a = p + "self_attn.", m = p + "mlp.";
      add(p + "input_layernorm.weight", L.in_norm);
      add(p + "post_attention_layernorm.weight", L.post_norm);
      add(a + "qkv_proj.weight", L.qkv);
      add(a + "qkv_proj.bias", L.qkv_bias);
      add(a + "o_proj.weight", L.o);
      add(a + "o_proj.bias", L.o_bias);
      add(a + "q_norm.weight", L.q_norm);
      add(a + "k_norm.weight", L.k_norm);
      add(a + (g.q_lora > 0 ? "fused_qkv_a_proj_with_mqa.weight" : "kv_a_proj_with_mqa.weight"), L.qkv_a);
      add(a + "q_a_layernorm.weight", L.q_a_norm);
      add(a + (g.q_lora > 0 ? "q_b_proj.weight" : "q_proj.weight"), L.q);
      add(a + "kv_a_layernorm.weight", L.kv_a_norm);
      add(a + "kv_b_proj.weight", L.kv_b);
      add(m + "gate_up_proj.weight", L.gate_up);
      add(m + "down_proj.weight", L.down);
      add(m + "gate_up_proj.bias", L.gate_up_bias);
      add(m + "down_proj.bias", L.down_bias);
      add(m + "gate.weight", L.router);
      add(m + "gate.e_score_correction_bias", L.score_bias);
      add(m + "experts.w13_weight", L.w13);
      add(m + "experts.w2_weight", L.w2);
      add(m + "shared_experts.gate_up_proj.weight", L.shared_gate_up);
      add(m + "shared_experts.down_proj.weight", L.shared_down);
    }
    return absl::OkStatus();
  }

  absl::Status NonFinite(const std::string& name, float value, int64_t element) const {
    return absl::DataLossError(
        absl::StrCat(Where(), ": parameter ", name, " holds a non-finite value (", value, ") at element ", element));
  }

  // One check of a kInPlace plan. Memory a weight sync wrote must hold finite numbers: NaN / Inf
  // weights are refused, never served.
  absl::Status RunCheck(const Plan::Check& c) const {
    if (c.fp8) {
      // Certainly finite when no code is NaN and every scale s is finite with 448 |s| finite.
      // A code is NaN iff its low 7 bits are all set: x = word & 0x7F.., then x + 0x01.. sets the high
      // bit of exactly those bytes (no byte carries into the next).
      const std::byte* codes = c.v.bytes().data();
      const int64_t count = c.v.numel();
      uint64_t nan_bits = 0;
      int64_t i = 0;
      for (; i + 8 <= count; i += 8) {
        uint64_t word;
        std::memcpy(&word, codes + i, 8);
        nan_bits |= ((word & 0x7F7F7F7F7F7F7F7FULL) + 0x0101010101010101ULL) & 0x8080808080808080ULL;
      }
      for (; i < count; ++i) nan_bits |= (static_cast<uint8_t>(codes[i]) & 0x7F) == 0x7F ? 1 : 0;
      const bool nan_code = nan_bits != 0;
      bool scales_ok = true;
      for (int64_t i = 0; i < c.scales.numel() && scales_ok; ++i)
        scales_ok = std::isfinite(448.0f * std::fabs(FloatAt(DType::kF32, c.scales.bytes().data(), i)));
      if (!nan_code && scales_ok) return absl::OkStatus();
      std::vector<float> dense(static_cast<size_t>(c.f8.experts * c.f8.n * c.f8.k));
      RETURN_IF_ERROR(DecodeFp8(c.v, c.scales, c.f8, dense.data()));
      for (size_t k = 0; k < dense.size(); ++k)
        if (!std::isfinite(dense[k])) return NonFinite(c.name, dense[k], static_cast<int64_t>(k));
      return absl::OkStatus();
    }
    if (c.trtllm) {
      const size_t count = static_cast<size_t>(c.scales.numel());
      if (MarlinScalesCertainlyFinite(c.scales.bytes().data(), c.scales.dtype() == DType::kF16, count))
        return absl::OkStatus();
      std::vector<float> dense(static_cast<size_t>(c.trt.experts * c.trt.n * c.trt.k));
      RETURN_IF_ERROR(Annotate(DecodeTrtllm(c.v, c.scales, c.trt, dense.data()), absl::StrCat(Where(), ": ", c.name)));
      for (size_t k = 0; k < dense.size(); ++k)
        if (!std::isfinite(dense[k])) return NonFinite(c.name, dense[k], static_cast<int64_t>(k));
      return absl::OkStatus();
    }
    if (!c.marlin) {
      const std::optional<int64_t> bad = FirstNonFinite(c.v.dtype(), c.v.bytes().data(), c.begin, c.end);
      if (!bad) return absl::OkStatus();
      return NonFinite(c.name, FloatAt(c.v.dtype(), c.v.bytes().data(), *bad), *bad);
    }
    const bool awq = c.zeros.nbytes() > 0;
    if (MarlinScalesCertainlyFinite(c.scales.bytes().data(), c.ref.scales_f16, c.ref.scale_count(), awq))
      return absl::OkStatus();
    // A scale is non-finite or large enough that bf16((u - 8) s) may overflow: decide exactly.
    std::optional<Tensor> keep_p, keep_s;
    ASSIGN_OR_RETURN(const TensorView p, Aligned(c.v, 4, &keep_p));
    ASSIGN_OR_RETURN(const TensorView s, Aligned(c.scales, 2, &keep_s));
    std::optional<Tensor> keep_z;
    WeightRef ref;
    ref.form = WeightForm::kMarlin;
    ref.marlin = c.ref;
    ref.marlin.packed = p.data_as<uint32_t>();
    ref.marlin.scales = s.data_as<uint16_t>();
    ref.marlin.zeros = nullptr;
    if (awq) {
      ASSIGN_OR_RETURN(const TensorView z, Aligned(c.zeros, 4, &keep_z));
      ref.marlin.zeros = z.data_as<uint32_t>();
    }
    ref.rows = c.ref.experts * c.ref.n;
    ref.cols = c.ref.k;
    std::vector<float> dense(static_cast<size_t>(ref.rows * ref.cols));
    MaterializeWeight(ref, dense.data());
    for (size_t k = 0; k < dense.size(); ++k)
      if (!std::isfinite(dense[k])) return NonFinite(c.name, dense[k], static_cast<int64_t>(k));
    return absl::OkStatus();
  }

  // kInPlace: resolve, check everything, then (only then) write the copies and swap.
  absl::Status PrepareInPlace() {
    Plan plan;
    RETURN_IF_ERROR(Resolve(plan));
    const int threads = Threads();
    RETURN_IF_ERROR(RunTasks(threads, plan.checks.size(), [&](size_t i) { return RunCheck(plan.checks[i]); }));
    // Buffers the copies lack (or whose size changed) are allocated before anything is written, so
    // that a failed allocation still leaves the previous version's copies intact.
    PrepareStats st;
    st.threads = threads;
    st.params = static_cast<int64_t>(plan.w->order.size());
    for (const Plan::Check& c : plan.checks)
      st.bytes_checked += c.fp8                  ? static_cast<int64_t>(c.v.nbytes() + c.scales.nbytes())
                          : c.marlin || c.trtllm ? static_cast<int64_t>(c.scales.nbytes())
                                                 : (c.end - c.begin) * static_cast<int64_t>(ItemSize(c.v.dtype()));
    absl::flat_hash_map<std::string, Buffer> fresh;
    absl::flat_hash_set<std::string> used;
    for (const Plan::Copy& c : plan.copies) {
      const size_t bytes =
          c.kind == Plan::Copy::Kind::kToF32    ? static_cast<size_t>(c.src.numel()) * sizeof(float)
          : c.kind == Plan::Copy::Kind::kTrtllm ? static_cast<size_t>(c.trt.experts * c.trt.n * c.trt.k) * sizeof(float)
          : c.kind == Plan::Copy::Kind::kFp8    ? static_cast<size_t>(c.f8.experts * c.f8.n * c.f8.k) * sizeof(float)
                                                : c.src.nbytes();
      used.insert(c.key);
      st.bytes_copied += static_cast<int64_t>(bytes);
      auto it = copies.find(c.key);
      if (it != copies.end() && it->second.size() == bytes) continue;
      ASSIGN_OR_RETURN(fresh[c.key], Buffer::Allocate(std::max<size_t>(bytes, 1)));
      st.bytes_allocated += static_cast<int64_t>(bytes);
    }
    // Nothing below fails.
    for (auto& [key, buffer] : fresh) copies[key] = std::move(buffer);
    absl::erase_if(copies, [&](const auto& kv) { return !used.contains(kv.first); });
    for (Plan::Copy& c : plan.copies) {
      void* dst = copies[c.key].data();
      switch (c.kind) {
        case Plan::Copy::Kind::kToF32:
        case Plan::Copy::Kind::kTrtllm:
        case Plan::Copy::Kind::kFp8: c.dst->data = dst; break;
        case Plan::Copy::Kind::kPacked: c.dst->marlin.packed = static_cast<const uint32_t*>(dst); break;
        case Plan::Copy::Kind::kScales: c.dst->marlin.scales = static_cast<const uint16_t*>(dst); break;
        case Plan::Copy::Kind::kZeros: c.dst->marlin.zeros = static_cast<const uint32_t*>(dst); break;
      }
    }
    RETURN_IF_ERROR(RunTasks(threads, plan.copies.size(), [&](size_t i) {
      const Plan::Copy& c = plan.copies[i];
      void* dst = copies.find(c.key)->second.data();
      if (c.kind == Plan::Copy::Kind::kToF32) return ReadFloats(c.src, static_cast<float*>(dst), c.key);
      if (c.kind == Plan::Copy::Kind::kTrtllm) return DecodeTrtllm(c.src, c.scales, c.trt, static_cast<float*>(dst));
      if (c.kind == Plan::Copy::Kind::kFp8) return DecodeFp8(c.src, c.scales, c.f8, static_cast<float*>(dst));
      std::memcpy(dst, c.src.data(), c.src.nbytes());
      return absl::OkStatus();
    }));
    st.bytes_in_place = plan.bytes_in_place;
    weights = std::move(plan.w);
    stats = st;
    return absl::OkStatus();
  }

  // kFloat32Copy (the baseline for benchmarks): a fresh float32 copy of everything, one thread.
  absl::Status PrepareFloat32Copy() {
    Plan plan;
    RETURN_IF_ERROR(Resolve(plan));
    PrepareStats st;
    st.params = static_cast<int64_t>(plan.w->order.size());
    for (const auto& [name, ref] : plan.w->order) {
      const int64_t n = ref->rows * ref->cols;
      for (int64_t k = 0; k < n; ++k)
        if (!std::isfinite(ref->f32()[k])) return NonFinite(name, ref->f32()[k], k);
      st.bytes_checked += n * static_cast<int64_t>(sizeof(float));
    }
    st.bytes_copied = st.bytes_allocated = st.bytes_checked;
    weights = std::move(plan.w);
    stats = st;
    return absl::OkStatus();
  }
};

RankWeights::RankWeights(ModelConfig config, RankGeometry geometry, ParamLookup lookup, WeightMode mode,
                         int prepare_threads)
    : impl_(std::make_unique<Impl>()) {
  impl_->config = std::move(config);
  impl_->g = geometry;
  impl_->lookup = std::move(lookup);
  impl_->mode = mode;
  impl_->prepare_threads = prepare_threads;
}
RankWeights::RankWeights(RankWeights&&) noexcept = default;
RankWeights& RankWeights::operator=(RankWeights&&) noexcept = default;
RankWeights::~RankWeights() = default;

absl::Status RankWeights::Prepare() {
  return impl_->float32_copy() ? impl_->PrepareFloat32Copy() : impl_->PrepareInPlace();
}

const ServedWeights* RankWeights::served() const { return impl_->weights.get(); }
const PrepareStats& RankWeights::last_prepare() const { return impl_->stats; }

absl::StatusOr<PreparedWeight> RankWeights::Weight(absl::string_view name) const {
  if (impl_->weights == nullptr)
    return absl::FailedPreconditionError(absl::StrCat(impl_->Where(), ": no weights prepared"));
  auto it = impl_->weights->index.find(name);
  if (it == impl_->weights->index.end())
    return absl::NotFoundError(absl::StrCat(impl_->Where(), ": no prepared weight named ", name));
  const WeightRef& ref = *it->second;
  PreparedWeight out{ref.shape, std::vector<float>(static_cast<size_t>(ref.rows * ref.cols))};
  MaterializeWeight(ref, out.data.data());
  return out;
}

}  // namespace wsync::ref_engine
