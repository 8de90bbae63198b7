#include "trainer_agent/convert/hf_convert.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace wsync::trainer_agent {
namespace {

Shape WithRows(const Shape& shape, int64_t rows) {
  Shape s = shape;
  s[0] = rows;
  return s;
}

absl::Status CheckFull(const MegatronParam& p, const TensorView& full) {
  if (full.dtype() != p.dtype || full.shape() != p.full_shape)
    return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": full tensor is ", full.DebugString(),
                                                   ", expected ", SafetensorsName(p.dtype),
                                                   ShapeToString(p.full_shape)));
  auto want = NumBytes(p.dtype, p.full_shape);
  if (!want.ok() || static_cast<int64_t>(full.nbytes()) != *want)
    return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": full tensor holds ", full.nbytes(),
                                                   " bytes, its shape needs ", want.ok() ? *want : -1));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Tensor> WidenToF32(const TensorView& v) {
  if (v.dtype() != DType::kBF16 && v.dtype() != DType::kF16)
    return absl::InvalidArgumentError(absl::StrCat("cannot widen ", v.DebugString(), " to F32: not BF16 or F16"));
  ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(DType::kF32, v.shape()));
  const size_t n = static_cast<size_t>(v.numel());
  std::vector<uint16_t> tmp(n);
  std::memcpy(tmp.data(), v.data(), n * 2);  // safetensors data may be unaligned
  if (v.dtype() == DType::kBF16) {
    ConvertBF16ToF32(tmp.data(), t.data_as<float>(), n);
  } else {
    ConvertF16ToF32(tmp.data(), t.data_as<float>(), n);
  }
  return t;
}

absl::StatusOr<HfRowMap> HfRowMapFor(const ModelConfig& model, const MegatronParam& p) {
  if (p.full_shape.empty())
    return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": a 0-d parameter has no row mapping"));
  if (!p.kept_rows.empty() && p.hf_op != HfOp::kCopy)
    return absl::InternalError(absl::StrCat(p.global_name, ": kept rows on a parameter that is not copied"));
  const int64_t rows = p.full_shape[0];
  HfRowMap m;
  switch (p.hf_op) {
    case HfOp::kCopy:
      if (p.kept_rows.empty()) {
        m.hf_shapes = {p.full_shape};
        m.pieces = {{0, 0, 0, rows}};
        break;
      }
      m.hf_shapes = {WithRows(p.full_shape, static_cast<int64_t>(p.kept_rows.size()))};
      for (size_t k = 0; k < p.kept_rows.size(); ++k) {
        const int64_t row = p.kept_rows[k];
        if (row < 0 || row >= rows)
          return absl::InvalidArgumentError(
              absl::StrCat(p.global_name, ": kept row ", row, " is outside its ", rows, " rows"));
        HfRowPiece* last = m.pieces.empty() ? nullptr : &m.pieces.back();
        if (last != nullptr && last->full_row + last->rows == row) {
          ++last->rows;  // a run of consecutive kept rows is one piece
        } else {
          m.pieces.push_back({0, row, static_cast<int64_t>(k), 1});
        }
      }
      break;
    case HfOp::kVocab:
      if (model.vocab_size > rows)
        return absl::InvalidArgumentError(
            absl::StrCat(p.global_name, ": ", rows, " rows hold less than vocab_size=", model.vocab_size));
      m.hf_shapes = {WithRows(p.full_shape, model.vocab_size)};
      m.pieces = {{0, 0, 0, model.vocab_size}};
      break;
    case HfOp::kGlu: {
      if (rows % 2 != 0)
        return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": gated fc1 has an odd row count ", rows));
      const int64_t f = rows / 2;
      m.hf_shapes = {WithRows(p.full_shape, f), WithRows(p.full_shape, f)};
      m.pieces = {{0, 0, 0, f}, {1, f, 0, f}};
      break;
    }
    case HfOp::kQkv: {
      const int64_t nh = model.num_attention_heads, ng = model.num_key_value_heads, hd = model.head_dim;
      if (ng <= 0 || nh % ng != 0 || rows != (nh + 2 * ng) * hd)
        return absl::InvalidArgumentError(absl::StrCat(p.global_name, ": ", rows, " rows do not split into ", nh,
                                                       " query heads and ", ng, " groups of head_dim ", hd));
      const int64_t n_rep = nh / ng;
      m.hf_shapes = {WithRows(p.full_shape, nh * hd), WithRows(p.full_shape, ng * hd), WithRows(p.full_shape, ng * hd)};
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t base = g * (n_rep + 2) * hd;
        m.pieces.push_back({0, base, g * n_rep * hd, n_rep * hd});
        m.pieces.push_back({1, base + n_rep * hd, g * hd, hd});
        m.pieces.push_back({2, base + (n_rep + 1) * hd, g * hd, hd});
      }
      break;
    }
  }
  if (m.hf_shapes.size() != p.hf_names.size())
    return absl::InternalError(
        absl::StrCat(p.global_name, ": ", p.hf_names.size(), " HF names for ", m.hf_shapes.size(), " HF tensors"));
  return m;
}

absl::StatusOr<std::vector<model::HfTensor>> ToHf(const ModelConfig& model, const MegatronParam& p, TensorView full,
                                                  const MemorySpace& space, Buffer* scratch) {
  RETURN_IF_ERROR(CheckFull(p, full));
  std::vector<model::HfTensor> out;
  if (!p.sent || p.pruned) return out;
  ASSIGN_OR_RETURN(HfRowMap map, HfRowMapFor(model, p));
  const int64_t row_bytes = static_cast<int64_t>(full.nbytes()) / p.full_shape[0];
  const std::byte* base = full.bytes().data();
  // An HF tensor that is one piece of whole rows is a view of `full`; the others are gathered.
  std::vector<const HfRowPiece*> only(map.hf_shapes.size(), nullptr);
  std::vector<int> pieces(map.hf_shapes.size(), 0);
  for (const HfRowPiece& piece : map.pieces) {
    ++pieces[static_cast<size_t>(piece.hf_index)];
    only[static_cast<size_t>(piece.hf_index)] = &piece;
  }
  auto is_view = [&](size_t i) {
    return pieces[i] == 1 && only[i]->hf_row == 0 && only[i]->rows == map.hf_shapes[i][0];
  };
  constexpr uint64_t kAlign = 256;
  auto align = [](uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; };
  if (scratch != nullptr) {  // room for every gathered tensor, one after the other
    uint64_t need = 0;
    for (size_t i = 0; i < map.hf_shapes.size(); ++i) {
      if (is_view(i)) continue;
      ASSIGN_OR_RETURN(const int64_t nbytes, NumBytes(p.dtype, map.hf_shapes[i]));
      need = align(need) + static_cast<uint64_t>(nbytes);
    }
    if (need > 0 && (scratch->size() < need || MemorySpace::Of(*scratch) != space)) {
      *scratch = Buffer();
      ASSIGN_OR_RETURN(*scratch, space.Allocate(need));
    }
  }
  uint64_t used = 0;
  out.resize(map.hf_shapes.size());
  for (size_t i = 0; i < map.hf_shapes.size(); ++i) {
    model::HfTensor& t = out[i];
    t.name = p.hf_names[i];
    const Shape& shape = map.hf_shapes[i];
    if (is_view(i)) {
      t.view = TensorView(p.dtype, shape,
                          full.bytes().subspan(static_cast<size_t>(only[i]->full_row * row_bytes),
                                               static_cast<size_t>(shape[0] * row_bytes)));
      continue;
    }
    ASSIGN_OR_RETURN(const int64_t nbytes, NumBytes(p.dtype, shape));
    std::span<std::byte> into;
    if (scratch != nullptr) {
      used = align(used);
      into = scratch->span().subspan(used, static_cast<size_t>(nbytes));
      used += static_cast<uint64_t>(nbytes);
    } else {
      ASSIGN_OR_RETURN(Buffer buffer, space.Allocate(static_cast<size_t>(nbytes)));
      ASSIGN_OR_RETURN(t.owned, Tensor::FromBuffer(p.dtype, shape, std::move(buffer)));
      into = t.owned.mutable_view().bytes();
    }
    for (const HfRowPiece& piece : map.pieces)
      if (piece.hf_index == static_cast<int>(i))
        RETURN_IF_ERROR(space.Copy(into.data() + piece.hf_row * row_bytes, base + piece.full_row * row_bytes,
                                   static_cast<size_t>(piece.rows * row_bytes)));
    t.view = TensorView(p.dtype, shape, into);
  }
  return out;
}

absl::StatusOr<Tensor> HfToMegatronFull(const ModelConfig& model, const MegatronParam& p,
                                        const model::HfCheckpoint& hf) {
  ASSIGN_OR_RETURN(HfRowMap map, HfRowMapFor(model, p));
  std::vector<TensorView> sources(map.hf_shapes.size());
  std::vector<Tensor> widened(map.hf_shapes.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    ASSIGN_OR_RETURN(TensorView v, hf.Get(p.hf_names[i]));
    if (v.shape() != map.hf_shapes[i])
      return absl::InvalidArgumentError(absl::StrCat("HF tensor \"", p.hf_names[i], "\" is ", v.DebugString(),
                                                     ", expected shape ", ShapeToString(map.hf_shapes[i]), " (for ",
                                                     p.global_name, ")"));
    if (v.dtype() != p.dtype) {
      if (p.dtype == DType::kF32 && (v.dtype() == DType::kBF16 || v.dtype() == DType::kF16)) {
        ASSIGN_OR_RETURN(widened[i], WidenToF32(v));
        v = widened[i].view();
      } else {
        return absl::InvalidArgumentError(absl::StrCat("HF tensor \"", p.hf_names[i], "\" is ", v.DebugString(),
                                                       ", expected dtype ", SafetensorsName(p.dtype), " (for ",
                                                       p.global_name, ")"));
      }
    }
    sources[i] = v;
  }
  int64_t covered = 0;
  for (const HfRowPiece& piece : map.pieces) covered += piece.rows;
  const bool padded = covered < p.full_shape[0];
  ASSIGN_OR_RETURN(Tensor full, padded ? Tensor::Zeros(p.dtype, p.full_shape) : Tensor::Empty(p.dtype, p.full_shape));
  const int64_t row_bytes = static_cast<int64_t>(full.nbytes()) / p.full_shape[0];
  std::byte* dst = full.mutable_view().bytes().data();
  for (const HfRowPiece& piece : map.pieces)
    std::memcpy(dst + piece.full_row * row_bytes,
                sources[static_cast<size_t>(piece.hf_index)].bytes().data() + piece.hf_row * row_bytes,
                static_cast<size_t>(piece.rows * row_bytes));
  return full;
}

absl::StatusOr<std::vector<model::HfTensorSpec>> HfTensorSpecs(const ModelConfig& model, int64_t mtp_num_layers) {
  ASSIGN_OR_RETURN(std::vector<MegatronParam> plan, PlanFullModel(model, mtp_num_layers));
  std::vector<model::HfTensorSpec> out;
  for (const MegatronParam& p : plan) {
    if (!p.sent) continue;
    ASSIGN_OR_RETURN(HfRowMap map, HfRowMapFor(model, p));
    for (size_t i = 0; i < map.hf_shapes.size(); ++i) out.push_back({p.hf_names[i], p.dtype, map.hf_shapes[i]});
  }
  return out;
}

}  // namespace wsync::trainer_agent
