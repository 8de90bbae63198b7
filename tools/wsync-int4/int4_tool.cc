#include "int4_tool.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <regex>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "kernels/format/int4_format.h"

namespace wsync::tools {
namespace {

constexpr absl::string_view kLayoutKey = "wsync.layout";

// Keeps every produced tensor alive until the writer has written the file.
class Arena {
 public:
  absl::StatusOr<Tensor*> Empty(DType dt, Shape shape) {
    ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(dt, std::move(shape)));
    tensors_.push_back(std::make_unique<Tensor>(std::move(t)));
    return tensors_.back().get();
  }
  // `v` itself when aligned to `alignment`, else an aligned copy (safetensors offsets need not be).
  absl::StatusOr<TensorView> Aligned(const TensorView& v, size_t alignment) {
    if (v.IsAligned(alignment)) return v;
    ASSIGN_OR_RETURN(Tensor t, Tensor::CopyOf(v));
    tensors_.push_back(std::make_unique<Tensor>(std::move(t)));
    return tensors_.back()->view();
  }

 private:
  std::vector<std::unique_ptr<Tensor>> tensors_;
};

absl::Status TensorError(absl::string_view name, absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": ", msg));
}
absl::Status InTensor(const absl::Status& st, absl::string_view name) {
  return Annotate(st, absl::StrCat("tensor \"", name, "\""));
}

bool StripSuffix(absl::string_view name, absl::string_view suffix, std::string* prefix) {
  if (!absl::EndsWith(name, suffix) || name.size() == suffix.size()) return false;
  *prefix = std::string(name.substr(0, name.size() - suffix.size()));
  return true;
}

// [.., R, C] -> [.., C, R] for 2- or 4-byte elements.
absl::Status TransposeLast2(const TensorView& in, Tensor* out) {
  const Shape& s = in.shape();
  const int64_t e = s.size() == 3 ? s[0] : 1, r = s[s.size() - 2], c = s.back();
  const size_t item = ItemSize(in.dtype());
  const std::byte* src = in.bytes().data();
  std::byte* dst = reinterpret_cast<std::byte*>(out->data_as<uint8_t>());
  for (int64_t x = 0; x < e; ++x) {
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < c; ++j) {
        std::memcpy(dst + ((x * c + j) * r + i) * item, src + ((x * r + i) * c + j) * item, item);
      }
    }
  }
  return absl::OkStatus();
}

Shape SwapLast2(const Shape& s) {
  Shape t = s;
  std::swap(t[t.size() - 1], t[t.size() - 2]);
  return t;
}

kernels::KernelOptions Kopts(int threads) {
  kernels::KernelOptions o;
  o.num_threads = threads;
  return o;
}

// perm = stable argsort of g_idx per expert, from tensor "<prefix>.<perm_from>".
absl::StatusOr<const TensorView*> PermFor(const SafetensorsFile& file, const std::string& prefix,
                                          const std::string& perm_from, const Shape& gptq_shape, Arena& arena,
                                          TensorView* storage) {
  if (perm_from.empty()) return nullptr;
  const std::string name = absl::StrCat(prefix, ".", perm_from);
  const SafetensorsEntry* g = file.Find(name);
  const int64_t experts = gptq_shape.size() == 3 ? gptq_shape[0] : 1, k = 8 * gptq_shape[gptq_shape.size() - 2];
  if (g == nullptr) return TensorError(name, "missing (needed by --perm-from)");
  const Shape want = gptq_shape.size() == 3 ? Shape{experts, k} : Shape{k};
  if (g->view.dtype() != DType::kI32 || g->view.shape() != want) {
    return TensorError(name, absl::StrCat("is ", SafetensorsName(g->view.dtype()), ShapeToString(g->view.shape()),
                                          ", want I32", ShapeToString(want)));
  }
  ASSIGN_OR_RETURN(const TensorView gv, arena.Aligned(g->view, 4));
  ASSIGN_OR_RETURN(Tensor * perm, arena.Empty(DType::kI32, want));
  const auto* gi = gv.data_as<int32_t>();
  auto* p = perm->data_as<int32_t>();
  for (int64_t e = 0; e < experts; ++e) {
    std::iota(p + e * k, p + (e + 1) * k, 0);
    std::stable_sort(p + e * k, p + (e + 1) * k, [&](int32_t a, int32_t b) { return gi[e * k + a] < gi[e * k + b]; });
  }
  *storage = perm->view();
  return storage;
}

struct Layer {
  std::string weight, scales, prefix;
  bool compressed_tensors;
};

// The layers of a file: every *.qweight (with *.scales) and *.weight_packed (with *.weight_scale).
absl::StatusOr<std::vector<Layer>> FindLayers(const SafetensorsFile& file) {
  std::vector<Layer> layers;
  for (const auto& e : file.tensors()) {
    Layer l;
    if (StripSuffix(e.name, ".qweight", &l.prefix)) {
      l.scales = l.prefix + ".scales";
      l.compressed_tensors = false;
    } else if (StripSuffix(e.name, ".weight_packed", &l.prefix)) {
      l.scales = l.prefix + ".weight_scale";
      l.compressed_tensors = true;
    } else {
      continue;
    }
    l.weight = e.name;
    if (file.Find(l.scales) == nullptr) return TensorError(e.name, absl::StrCat("missing scales \"", l.scales, "\""));
    if (e.view.dtype() != DType::kI32) {
      return TensorError(e.name, absl::StrCat("dtype ", SafetensorsName(e.view.dtype()), " unsupported (want I32)"));
    }
    layers.push_back(std::move(l));
  }
  return layers;
}

absl::Status CheckScaleDtype(const SafetensorsEntry& s) {
  if (s.view.dtype() != DType::kBF16 && s.view.dtype() != DType::kF16) {
    return TensorError(s.name,
                       absl::StrCat("dtype ", SafetensorsName(s.view.dtype()), " unsupported (want BF16 or F16)"));
  }
  if (s.view.rank() != 2 && s.view.rank() != 3) {
    return TensorError(s.name, absl::StrCat("rank ", s.view.rank(), " unsupported: ", ShapeToString(s.view.shape())));
  }
  return absl::OkStatus();
}

absl::Status CheckGroupSize(int g) {
  if (g == -1 || g == 32 || g == 64 || g == 128) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--group-size ", g, " unsupported (want 32, 64, 128 or -1)"));
}

// An AWQ layer: <prefix>.qweight [.., K, N/8], .qzeros [.., K/G, N/8], .scales [.., K/G, N].
struct AwqLayer {
  std::string prefix;
  const SafetensorsEntry *qweight, *qzeros, *scales;
  int64_t k, n, groups;  // groups = K/G
  int group_size;        // G, or kChannelwise for one group row
};

absl::StatusOr<std::vector<AwqLayer>> FindAwqLayers(const SafetensorsFile& file) {
  std::vector<AwqLayer> layers;
  for (const auto& e : file.tensors()) {
    AwqLayer l;
    if (!StripSuffix(e.name, ".qweight", &l.prefix)) continue;
    l.qweight = &e;
    l.qzeros = file.Find(l.prefix + ".qzeros");
    l.scales = file.Find(l.prefix + ".scales");
    if (l.qzeros == nullptr || l.scales == nullptr) {
      return TensorError(e.name, absl::StrCat("missing \"", l.prefix, l.qzeros == nullptr ? ".qzeros" : ".scales",
                                              "\" (an AWQ layer has qweight, qzeros and scales)"));
    }
    const TensorView &q = e.view, &z = l.qzeros->view, &s = l.scales->view;
    RETURN_IF_ERROR(CheckScaleDtype(*l.scales));
    if (q.dtype() != DType::kI32 || z.dtype() != DType::kI32) {
      return TensorError(e.name, "qweight and qzeros must be I32");
    }
    if (q.rank() != s.rank() || z.rank() != s.rank()) {
      return TensorError(e.name, absl::StrCat("ranks differ: qweight ", ShapeToString(q.shape()), ", qzeros ",
                                              ShapeToString(z.shape()), ", scales ", ShapeToString(s.shape())));
    }
    l.k = q.dim(q.rank() - 2);
    l.n = s.shape().back();
    l.groups = s.dim(s.rank() - 2);
    if (q.shape().back() * 8 != l.n) {
      return TensorError(e.name,
                         absl::StrCat("is ", ShapeToString(q.shape()), " but scales ", ShapeToString(s.shape()),
                                      " say N = ", l.n, ": not an AWQ [K, N/8] qweight (GPTQ? use marlin-repack)"));
    }
    Shape zwant = s.shape();
    zwant.back() = l.n / 8;
    if (z.shape() != zwant) {
      return TensorError(l.qzeros->name,
                         absl::StrCat("is ", ShapeToString(z.shape()), ", want ", ShapeToString(zwant)));
    }
    if (l.groups <= 0 || l.k % l.groups != 0) {
      return TensorError(l.scales->name, absl::StrCat(l.groups, " group rows do not divide K = ", l.k));
    }
    if (s.rank() == 3 && (q.dim(0) != s.dim(0) || z.dim(0) != s.dim(0))) {
      return TensorError(e.name, "expert counts of qweight, qzeros and scales differ");
    }
    l.group_size = l.groups == 1 ? kernels::kChannelwise : static_cast<int>(l.k / l.groups);
    layers.push_back(l);
  }
  return layers;
}

absl::Status RefuseLayout(const SafetensorsFile& file, std::initializer_list<absl::string_view> refused,
                          absl::string_view command) {
  const auto layout = file.metadata().find(std::string(kLayoutKey));
  if (layout == file.metadata().end()) return absl::OkStatus();
  for (absl::string_view r : refused) {
    if (layout->second == r) {
      return absl::InvalidArgumentError(absl::StrCat(file.path(), ": metadata ", kLayoutKey, " = \"", layout->second,
                                                     "\": ", command, " does not take that layout"));
    }
  }
  return absl::OkStatus();
}

void CopyMetadata(const SafetensorsFile& file, SafetensorsWriter& writer) {
  for (const auto& [k, v] : file.metadata()) writer.SetMetadata(k, v);
}

// Shared body of repack (to_marlin) and restore.
absl::Status Convert(const RepackFileOptions& o, bool to_marlin) {
  RETURN_IF_ERROR(CheckGroupSize(o.group_size));
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(o.in));
  const auto layout = file.metadata().find(std::string(kLayoutKey));
  if (to_marlin && layout != file.metadata().end() && layout->second == "marlin") {
    return absl::InvalidArgumentError(absl::StrCat(o.in, ": already in Marlin layout (metadata ", kLayoutKey, ")"));
  }
  if (!to_marlin && layout != file.metadata().end() && layout->second != "marlin") {
    return absl::InvalidArgumentError(
        absl::StrCat(o.in, ": metadata ", kLayoutKey, " = \"", layout->second, "\", not a Marlin file"));
  }
  ASSIGN_OR_RETURN(const std::vector<Layer> layers, FindLayers(file));
  Arena arena;
  std::map<std::string, TensorView> replaced;
  const kernels::KernelOptions kopt = Kopts(o.threads);
  for (const Layer& l : layers) {
    const SafetensorsEntry& w = *file.Find(l.weight);
    const SafetensorsEntry& s = *file.Find(l.scales);
    RETURN_IF_ERROR(CheckScaleDtype(s));
    if (!l.compressed_tensors && w.view.rank() == s.view.rank() && s.view.shape().back() == 8 * w.view.shape().back()) {
      return TensorError(l.weight, absl::StrCat("is AWQ-packed (", ShapeToString(w.view.shape()), " with scales ",
                                                ShapeToString(s.view.shape()), "): use awq-marlin-repack"));
    }
    ASSIGN_OR_RETURN(TensorView wv, arena.Aligned(w.view, 4));
    ASSIGN_OR_RETURN(TensorView sv, arena.Aligned(s.view, 2));
    if (to_marlin) {
      if (l.compressed_tensors) {  // §7: weight_packed.T, weight_scale.T (per expert)
        if (wv.rank() != 2 && wv.rank() != 3) return TensorError(l.weight, "rank must be 2 or 3");
        ASSIGN_OR_RETURN(Tensor * wt, arena.Empty(DType::kI32, SwapLast2(wv.shape())));
        RETURN_IF_ERROR(TransposeLast2(wv, wt));
        ASSIGN_OR_RETURN(Tensor * st, arena.Empty(sv.dtype(), SwapLast2(sv.shape())));
        RETURN_IF_ERROR(TransposeLast2(sv, st));
        wv = wt->view();
        sv = st->view();
      }
      absl::StatusOr<Shape> mshape_or = kernels::MarlinShapeFor(wv.shape());
      if (!mshape_or.ok()) return InTensor(mshape_or.status(), l.weight);
      const Shape mshape = *mshape_or;
      const int64_t k = 8 * wv.dim(wv.rank() - 2);
      TensorView perm_storage;
      ASSIGN_OR_RETURN(const TensorView* perm, PermFor(file, l.prefix, o.perm_from, wv.shape(), arena, &perm_storage));
      ASSIGN_OR_RETURN(Tensor * m, arena.Empty(DType::kI32, mshape));
      RETURN_IF_ERROR(InTensor(kernels::GptqToMarlin(wv, perm, m->mutable_view(), kopt), l.weight));
      ASSIGN_OR_RETURN(Tensor * ps, arena.Empty(sv.dtype(), sv.shape()));
      RETURN_IF_ERROR(InTensor(kernels::PermuteMarlinScales(sv, k, o.group_size, ps->mutable_view(), kopt), l.scales));
      replaced[l.weight] = m->view();
      replaced[l.scales] = ps->view();
    } else {
      absl::StatusOr<Shape> gshape_or = kernels::GptqShapeFor(wv.shape());
      if (!gshape_or.ok()) return InTensor(gshape_or.status(), l.weight);
      const Shape gshape = *gshape_or;
      const int64_t k = 8 * gshape[gshape.size() - 2];
      TensorView perm_storage;
      ASSIGN_OR_RETURN(const TensorView* perm, PermFor(file, l.prefix, o.perm_from, gshape, arena, &perm_storage));
      ASSIGN_OR_RETURN(Tensor * g, arena.Empty(DType::kI32, gshape));
      RETURN_IF_ERROR(InTensor(kernels::MarlinToGptq(wv, perm, g->mutable_view(), kopt), l.weight));
      ASSIGN_OR_RETURN(Tensor * us, arena.Empty(sv.dtype(), sv.shape()));
      RETURN_IF_ERROR(
          InTensor(kernels::UnpermuteMarlinScales(sv, k, o.group_size, us->mutable_view(), kopt), l.scales));
      TensorView gw = g->view(), gs = us->view();
      if (l.compressed_tensors) {  // back to [N, K/8] and [N, K/G]
        ASSIGN_OR_RETURN(Tensor * wt, arena.Empty(DType::kI32, SwapLast2(gw.shape())));
        RETURN_IF_ERROR(TransposeLast2(gw, wt));
        ASSIGN_OR_RETURN(Tensor * st, arena.Empty(gs.dtype(), SwapLast2(gs.shape())));
        RETURN_IF_ERROR(TransposeLast2(gs, st));
        gw = wt->view();
        gs = st->view();
      }
      replaced[l.weight] = gw;
      replaced[l.scales] = gs;
    }
  }
  SafetensorsWriter writer;
  for (const auto& e : file.tensors()) {
    auto it = replaced.find(e.name);
    RETURN_IF_ERROR(writer.Add(e.name, it == replaced.end() ? e.view : it->second));
  }
  for (const auto& [k, v] : file.metadata()) writer.SetMetadata(k, v);
  writer.SetMetadata(std::string(kLayoutKey), to_marlin ? "marlin" : "gptq");
  writer.SetMetadata("wsync.marlin.group_size", std::to_string(o.group_size));
  return writer.Write(o.out);
}

}  // namespace

absl::Status QuantizeFile(const QuantizeFileOptions& o) {
  RETURN_IF_ERROR(CheckGroupSize(o.group_size));
  std::vector<std::regex> ignore;
  for (std::string re : o.ignore) {
    if (absl::StartsWith(re, "re:")) re = re.substr(3);
    try {
      ignore.emplace_back(re, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      return absl::InvalidArgumentError(absl::StrCat("--ignore \"", re, "\" is not a valid regex: ", e.what()));
    }
  }
  auto ignored = [&](const std::string& prefix, const std::string& name) {
    for (const auto& re : ignore) {
      if (std::regex_search(prefix, re, std::regex_constants::match_continuous) ||
          std::regex_search(name, re, std::regex_constants::match_continuous)) {
        return true;
      }
    }
    return false;
  };
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(o.in));
  const bool gptq = o.format == QuantFileFormat::kGptq;
  const bool awq = o.format == QuantFileFormat::kAwq;
  kernels::QuantizeOptions q;
  q.group_size = o.group_size;
  q.format = gptq ? kernels::PackFormat::kGptq : kernels::PackFormat::kCompressedTensors;
  q.variant = o.variant;
  q.num_threads = o.threads;
  kernels::AwqQuantizeOptions aq;
  aq.group_size = o.group_size;
  aq.arith = o.arith;
  aq.num_threads = o.threads;
  Arena arena;
  SafetensorsWriter writer;
  for (const auto& e : file.tensors()) {
    std::string prefix;
    const TensorView& v = e.view;
    const bool candidate = StripSuffix(e.name, ".weight", &prefix) && (v.rank() == 2 || v.rank() == 3) &&
                           IsFloating(v.dtype()) && !ignored(prefix, e.name);
    if (!candidate) {
      RETURN_IF_ERROR(writer.Add(e.name, v));
      continue;
    }
    ASSIGN_OR_RETURN(const TensorView wv, arena.Aligned(v, 2));
    if (awq) {
      absl::StatusOr<kernels::AwqShapes> shapes = kernels::AwqShapesFor(v, o.group_size);
      if (!shapes.ok()) return InTensor(shapes.status(), e.name);
      ASSIGN_OR_RETURN(Tensor * qweight, arena.Empty(DType::kI32, shapes->qweight));
      ASSIGN_OR_RETURN(Tensor * qzeros, arena.Empty(DType::kI32, shapes->qzeros));
      ASSIGN_OR_RETURN(Tensor * scales, arena.Empty(v.dtype(), shapes->scales));
      RETURN_IF_ERROR(InTensor(
          kernels::QuantizeAwq(wv, qweight->mutable_view(), qzeros->mutable_view(), scales->mutable_view(), aq),
          e.name));
      RETURN_IF_ERROR(writer.Add(prefix + ".qweight", qweight->view()));
      RETURN_IF_ERROR(writer.Add(prefix + ".qzeros", qzeros->view()));
      RETURN_IF_ERROR(writer.Add(prefix + ".scales", scales->view()));
      continue;
    }
    absl::StatusOr<kernels::QuantizedShapes> shapes = kernels::QuantizedShapesFor(v, o.group_size, q.format);
    if (!shapes.ok()) return InTensor(shapes.status(), e.name);
    if (gptq && v.dim(v.rank() - 2) % 8 != 0) {
      return TensorError(e.name, absl::StrCat("N = ", v.dim(v.rank() - 2),
                                              " is not a multiple of 8: GPTQ qzeros pack 8 columns per word"));
    }
    ASSIGN_OR_RETURN(Tensor * packed, arena.Empty(DType::kI32, shapes->packed));
    ASSIGN_OR_RETURN(Tensor * scales, arena.Empty(v.dtype(), shapes->scales));
    RETURN_IF_ERROR(InTensor(kernels::QuantizeInt4(wv, packed->mutable_view(), scales->mutable_view(), q), e.name));
    const Shape& s = v.shape();
    const int64_t experts = s.size() == 3 ? s[0] : 1, n = s[s.size() - 2], k = s.back();
    const int64_t g = o.group_size == kernels::kChannelwise ? k : o.group_size;
    if (!gptq) {
      // int64, as compressed-tensors writes it (torch.tensor(weight.shape)) and the engine holds it.
      ASSIGN_OR_RETURN(Tensor * shape, arena.Empty(DType::kI64, {static_cast<int64_t>(s.size())}));
      for (size_t i = 0; i < s.size(); ++i) shape->data_as<int64_t>()[i] = s[i];
      RETURN_IF_ERROR(writer.Add(prefix + ".weight_packed", packed->view()));
      RETURN_IF_ERROR(writer.Add(prefix + ".weight_scale", scales->view()));
      RETURN_IF_ERROR(writer.Add(prefix + ".weight_shape", shape->view()));
      continue;
    }
    const Shape zshape = s.size() == 3 ? Shape{experts, k / g, n / 8} : Shape{k / g, n / 8};
    ASSIGN_OR_RETURN(Tensor * qzeros, arena.Empty(DType::kI32, zshape));
    std::fill_n(qzeros->data_as<uint32_t>(), experts * (k / g) * (n / 8), kernels::format::kSymmetricQZeros);
    const Shape gshape = s.size() == 3 ? Shape{experts, k} : Shape{k};
    ASSIGN_OR_RETURN(Tensor * g_idx, arena.Empty(DType::kI32, gshape));
    for (int64_t i = 0; i < experts * k; ++i) g_idx->data_as<int32_t>()[i] = static_cast<int32_t>((i % k) / g);
    RETURN_IF_ERROR(writer.Add(prefix + ".qweight", packed->view()));
    RETURN_IF_ERROR(writer.Add(prefix + ".scales", scales->view()));
    RETURN_IF_ERROR(writer.Add(prefix + ".qzeros", qzeros->view()));
    RETURN_IF_ERROR(writer.Add(prefix + ".g_idx", g_idx->view()));
  }
  for (const auto& [k, v] : file.metadata()) writer.SetMetadata(k, v);
  const char* format_name = awq ? "awq" : (gptq ? "gptq" : "compressed-tensors");
  if (awq) {
    writer.SetMetadata(
        "wsync.quantization",
        absl::StrCat("{\"format\": \"awq\", \"group_size\": ", o.group_size, ", \"arith\": \"",
                     o.arith == kernels::AwqArith::kFp16 ? "fp16" : "fp32", "\", \"bits\": 4, \"zero_point\": true}"));
  } else {
    writer.SetMetadata(
        "wsync.quantization",
        absl::StrCat("{\"format\": \"", format_name, "\", \"group_size\": ", o.group_size, ", \"variant\": \"",
                     o.variant == kernels::QuantVariant::kQat ? "qat" : "slime", "\", \"bits\": 4}"));
  }
  writer.SetMetadata(std::string(kLayoutKey), format_name);
  return writer.Write(o.out);
}

absl::Status AwqMarlinRepackFile(const ConvertFileOptions& o) {
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(o.in));
  RETURN_IF_ERROR(RefuseLayout(file, {"awq-marlin", "marlin", "trtllm"}, "awq-marlin-repack"));
  ASSIGN_OR_RETURN(const std::vector<AwqLayer> layers, FindAwqLayers(file));
  if (layers.empty()) return absl::InvalidArgumentError(absl::StrCat(o.in, ": no AWQ layer (*.qweight) found"));
  Arena arena;
  std::map<std::string, TensorView> replaced;
  const kernels::KernelOptions kopt = Kopts(o.threads);
  for (const AwqLayer& l : layers) {
    ASSIGN_OR_RETURN(const TensorView qv, arena.Aligned(l.qweight->view, 4));
    ASSIGN_OR_RETURN(const TensorView zv, arena.Aligned(l.qzeros->view, 4));
    ASSIGN_OR_RETURN(const TensorView sv, arena.Aligned(l.scales->view, 2));
    absl::StatusOr<Shape> mshape = kernels::AwqMarlinShapeFor(qv.shape());
    if (!mshape.ok()) return InTensor(mshape.status(), l.qweight->name);
    ASSIGN_OR_RETURN(Tensor * m, arena.Empty(DType::kI32, *mshape));
    RETURN_IF_ERROR(InTensor(kernels::AwqToMarlin(qv, m->mutable_view(), kopt), l.qweight->name));
    ASSIGN_OR_RETURN(Tensor * mz, arena.Empty(DType::kI32, zv.shape()));
    RETURN_IF_ERROR(InTensor(kernels::AwqZerosToMarlin(zv, mz->mutable_view(), kopt), l.qzeros->name));
    ASSIGN_OR_RETURN(Tensor * ms, arena.Empty(sv.dtype(), sv.shape()));
    RETURN_IF_ERROR(
        InTensor(kernels::PermuteMarlinScales(sv, l.k, l.group_size, ms->mutable_view(), kopt), l.scales->name));
    replaced[l.qweight->name] = m->view();
    replaced[l.qzeros->name] = mz->view();
    replaced[l.scales->name] = ms->view();
  }
  SafetensorsWriter writer;
  for (const auto& e : file.tensors()) {
    auto it = replaced.find(e.name);
    RETURN_IF_ERROR(writer.Add(e.name, it == replaced.end() ? e.view : it->second));
  }
  CopyMetadata(file, writer);
  writer.SetMetadata(std::string(kLayoutKey), "awq-marlin");
  return writer.Write(o.out);
}

absl::Status TrtllmPreprocessFile(const ConvertFileOptions& o) {
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(o.in));
  RETURN_IF_ERROR(RefuseLayout(file, {"awq-marlin", "marlin", "trtllm", "gptq"}, "trtllm-preprocess"));
  kernels::TrtllmOptions topt;
  topt.arch = o.arch;
  topt.w4afp8 = o.w4afp8;
  topt.num_threads = o.threads;
  Arena arena;
  std::map<std::string, std::vector<std::pair<std::string, TensorView>>> added;  // at the layer's first tensor
  std::set<std::string> dropped;
  // One converted layer: GPTQ-orientation codes and [.., K/G, N] scales (+ AWQ qzeros).
  auto convert = [&](const std::string& prefix, const std::string& first, const TensorView& codes,
                     const TensorView& scales, int group_size, const TensorView* awq_zeros) -> absl::Status {
    const std::string wname = prefix + ".weight";
    absl::StatusOr<Shape> wshape = kernels::TrtllmWeightShapeFor(codes.shape(), topt);
    if (!wshape.ok()) return InTensor(wshape.status(), wname);
    ASSIGN_OR_RETURN(Tensor * w, arena.Empty(DType::kI8, *wshape));
    RETURN_IF_ERROR(InTensor(kernels::PreprocessTrtllm(codes, w->mutable_view(), topt), wname));
    const int64_t k = 8 * codes.dim(codes.rank() - 2);
    absl::StatusOr<kernels::TrtllmScaleLayout> lay = kernels::TrtllmScaleLayoutFor(scales, k, group_size, topt);
    if (!lay.ok()) return InTensor(lay.status(), prefix + ".weight_scale");
    ASSIGN_OR_RETURN(Tensor * s, arena.Empty(lay->dtype, lay->shape));
    RETURN_IF_ERROR(
        InTensor(kernels::TrtllmScales(scales, k, group_size, s->mutable_view(), topt), prefix + ".weight_scale"));
    auto& out = added[first];
    out.emplace_back(wname, w->view());
    out.emplace_back(prefix + ".weight_scale", s->view());
    if (awq_zeros != nullptr) {
      if (o.w4afp8) {
        return TensorError(prefix + ".qzeros",
                           "AWQ zero points cannot be served with W4AFP8 (TRTLLM_INT4.md §3.2: no zeros on that path)");
      }
      ASSIGN_OR_RETURN(Tensor * z, arena.Empty(scales.dtype(), scales.shape()));
      RETURN_IF_ERROR(
          InTensor(kernels::TrtllmZerosFromAwq(*awq_zeros, scales, z->mutable_view(), topt), prefix + ".weight_zero"));
      out.emplace_back(prefix + ".weight_zero", z->view());
    }
    return absl::OkStatus();
  };
  // Compressed-tensors layers: weight_packed [.., N, K/8] and weight_scale [.., N, K/G], transposed.
  ASSIGN_OR_RETURN(const std::vector<Layer> ct_layers, FindLayers(file));
  for (const Layer& l : ct_layers) {
    if (!l.compressed_tensors) continue;  // *.qweight: AWQ, handled below (GPTQ is refused there)
    const SafetensorsEntry& w = *file.Find(l.weight);
    const SafetensorsEntry& s = *file.Find(l.scales);
    RETURN_IF_ERROR(CheckScaleDtype(s));
    if (w.view.rank() != s.view.rank() || (w.view.rank() != 2 && w.view.rank() != 3)) {
      return TensorError(
          l.weight, absl::StrCat("rank must be 2 or 3 and match the scales' (", ShapeToString(s.view.shape()), ")"));
    }
    ASSIGN_OR_RETURN(TensorView wv, arena.Aligned(w.view, 4));
    ASSIGN_OR_RETURN(TensorView sv, arena.Aligned(s.view, 2));
    ASSIGN_OR_RETURN(Tensor * codes, arena.Empty(DType::kI32, SwapLast2(wv.shape())));
    RETURN_IF_ERROR(TransposeLast2(wv, codes));
    ASSIGN_OR_RETURN(Tensor * scales, arena.Empty(sv.dtype(), SwapLast2(sv.shape())));
    RETURN_IF_ERROR(TransposeLast2(sv, scales));
    const int64_t k = 8 * wv.shape().back(), groups = sv.shape().back();
    if (groups <= 0 || k % groups != 0) {
      return TensorError(l.scales, absl::StrCat(groups, " groups per row do not divide K = ", k));
    }
    const int g = groups == 1 ? kernels::kChannelwise : static_cast<int>(k / groups);
    RETURN_IF_ERROR(convert(l.prefix, l.weight, codes->view(), scales->view(), g, nullptr));
    dropped.insert({l.weight, l.scales, l.prefix + ".weight_shape"});
  }
  // AWQ layers: codes from qweight [.., K, N/8], scales as they are.
  ASSIGN_OR_RETURN(const std::vector<AwqLayer> awq_layers, FindAwqLayers(file));
  for (const AwqLayer& l : awq_layers) {
    ASSIGN_OR_RETURN(const TensorView qv, arena.Aligned(l.qweight->view, 4));
    ASSIGN_OR_RETURN(const TensorView zv, arena.Aligned(l.qzeros->view, 4));
    ASSIGN_OR_RETURN(const TensorView sv, arena.Aligned(l.scales->view, 2));
    Shape cshape = qv.shape();
    cshape[cshape.size() - 2] = l.k / 8;
    cshape.back() = l.n;
    ASSIGN_OR_RETURN(Tensor * codes, arena.Empty(DType::kI32, cshape));
    RETURN_IF_ERROR(InTensor(kernels::AwqToGptq(qv, codes->mutable_view(), Kopts(o.threads)), l.qweight->name));
    RETURN_IF_ERROR(convert(l.prefix, l.qweight->name, codes->view(), sv, l.group_size, &zv));
    dropped.insert({l.qweight->name, l.qzeros->name, l.scales->name});
  }
  if (added.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(o.in,
                     ": no INT4 layer found (*.weight_packed + *.weight_scale, or AWQ *.qweight + *.qzeros + "
                     "*.scales)"));
  }
  SafetensorsWriter writer;
  for (const auto& e : file.tensors()) {
    if (auto it = added.find(e.name); it != added.end()) {
      for (const auto& [name, view] : it->second) RETURN_IF_ERROR(writer.Add(name, view));
    }
    if (dropped.count(e.name) == 0) RETURN_IF_ERROR(writer.Add(e.name, e.view));
  }
  CopyMetadata(file, writer);
  writer.SetMetadata(std::string(kLayoutKey), "trtllm");
  writer.SetMetadata(
      "wsync.trtllm",
      absl::StrCat("{\"arch\": \"", o.arch == kernels::TrtllmArch::kSm90 ? "sm90" : "sm80", "\", \"activation\": \"",
                   o.w4afp8 ? "fp8" : "fp16/bf16", "\", \"moe_fc1_order\": \"as given\"}"));
  return writer.Write(o.out);
}

absl::Status MarlinRepackFile(const RepackFileOptions& options) { return Convert(options, true); }
absl::Status MarlinRestoreFile(const RepackFileOptions& options) { return Convert(options, false); }

}  // namespace wsync::tools
