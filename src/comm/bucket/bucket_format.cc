#include "comm/bucket/bucket_format.h"

#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/status.h"
#include "common/tensor.h"

namespace wsync::comm {

std::string DescribeBucket(const v1::BucketManifest& m) {
  return absl::StrCat("stage ", m.pp_stage(), " bucket ", m.index());
}

v1::DType ToProto(DType t) {
  switch (t) {
    case DType::kBF16: return v1::DTYPE_BF16;
    case DType::kF16: return v1::DTYPE_F16;
    case DType::kF32: return v1::DTYPE_F32;
    case DType::kI32: return v1::DTYPE_I32;
    case DType::kI64: return v1::DTYPE_I64;
    case DType::kI8: return v1::DTYPE_I8;
    case DType::kU8: return v1::DTYPE_U8;
    case DType::kF8E4M3: return v1::DTYPE_F8_E4M3;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProto(v1::DType t) {
  switch (t) {
    case v1::DTYPE_BF16: return DType::kBF16;
    case v1::DTYPE_F16: return DType::kF16;
    case v1::DTYPE_F32: return DType::kF32;
    case v1::DTYPE_I32: return DType::kI32;
    case v1::DTYPE_I64: return DType::kI64;
    case v1::DTYPE_I8: return DType::kI8;
    case v1::DTYPE_U8: return DType::kU8;
    case v1::DTYPE_F8_E4M3: return DType::kF8E4M3;
    default: break;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", static_cast<int>(t)));
}

namespace {

absl::Status CheckBlock(const v1::BucketManifest& m, const v1::BucketEntry& e, DType dtype) {
  const auto& b = e.block();
  const auto& shape = e.tensor().shape();
  const std::string where = absl::StrCat(DescribeBucket(m), ": ", e.tensor().name());
  if (shape.size() > 2)
    return absl::InvalidArgumentError(absl::StrCat(where, ": a block of a ", shape.size(), "-dim tensor"));
  const MatrixDims dims = MatrixOf(std::span<const int64_t>(shape.data(), static_cast<size_t>(shape.size())));
  if (b.row0() < 0 || b.rows() <= 0 || b.col0() < 0 || b.cols() <= 0 || b.row0() > dims.rows - b.rows() ||
      b.col0() > dims.cols - b.cols()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": block rows [", b.row0(), ", ", b.row0() + b.rows(), ") x columns [", b.col0(), ", ",
                     b.col0() + b.cols(), ") does not lie inside its ", dims.rows, " x ", dims.cols, " matrix"));
  }
  // rows * cols <= the tensor's numel, which ValidateManifest bounded by 2^62. A delta of the block
  // is at most its bytes.
  const uint64_t want = static_cast<uint64_t>(b.rows()) * static_cast<uint64_t>(b.cols()) * ItemSize(dtype);
  if ((e.has_delta() ? e.nbytes() > want : e.nbytes() != want) || e.split_offset() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a ", b.rows(), " x ", b.cols(), " block holds ", want,
                                                   " bytes, the entry says ", e.nbytes(), " at split offset ",
                                                   e.split_offset()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateManifest(const v1::BucketManifest& m, uint64_t data_bytes) {
  if (m.nbytes() != data_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(DescribeBucket(m), ": the manifest says ", m.nbytes(), " bytes, ", data_bytes, " arrived"));
  }
  for (const auto& e : m.entries()) {
    const std::string name = e.tensor().name();
    if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(DescribeBucket(m), ": an entry has no name"));
    auto dtype = FromProto(e.tensor().dtype());
    if (!dtype.ok())
      return absl::InvalidArgumentError(absl::StrCat(DescribeBucket(m), ": ", name, ": ", dtype.status().message()));
    uint64_t numel = 1;
    for (int64_t d : e.tensor().shape()) {
      if (d < 0 || (d > 0 && numel > (uint64_t{1} << 62) / static_cast<uint64_t>(d))) {
        return absl::InvalidArgumentError(absl::StrCat(DescribeBucket(m), ": ", name, ": bad shape"));
      }
      numel *= static_cast<uint64_t>(d);
    }
    const uint64_t whole = numel * ItemSize(*dtype);
    if (e.has_block()) RETURN_IF_ERROR(CheckBlock(m, e, *dtype));
    if (e.has_delta()) {
      // A delta's payload is never larger than the tensor (PlanDelta sends it dense then), and it
      // needs a base to apply onto.
      if (e.split_offset() != 0 || m.base_version() == 0 || e.delta().encoding() > 2)
        return absl::InvalidArgumentError(absl::StrCat(DescribeBucket(m), ": ", name, ": a delta entry with ",
                                                       e.split_offset() != 0 ? "a split offset"
                                                       : m.base_version() == 0
                                                           ? "no base version"
                                                           : absl::StrCat("encoding ", e.delta().encoding())));
    }
    if (e.total_nbytes() != whole || e.split_offset() + e.nbytes() > whole) {
      return absl::InvalidArgumentError(
          absl::StrCat(DescribeBucket(m), ": ", name, ": ", e.nbytes(), " bytes at split offset ", e.split_offset(),
                       " of ", e.total_nbytes(), " do not fit its dtype and shape (", whole, " bytes)"));
    }
    if (e.offset() > data_bytes || e.nbytes() > data_bytes - e.offset()) {
      return absl::InvalidArgumentError(absl::StrCat(DescribeBucket(m), ": ", name, ": bytes [", e.offset(), ", ",
                                                     e.offset() + e.nbytes(), ") lie outside the ", data_bytes,
                                                     "-byte bucket"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckHeader(const BucketHeader& header, uint64_t index) {
  if (header.manifest_bytes > kMaxManifestBytes) {
    return absl::DataLossError(absl::StrCat("bucket ", index, ": its header announces a ", header.manifest_bytes,
                                            "-byte manifest (at most ", kMaxManifestBytes, "): a corrupt framing"));
  }
  return absl::OkStatus();
}

BucketTag ManifestChecksumTag(absl::string_view manifest_bytes) {
  const uint64_t sum = Xxh3_64(std::as_bytes(std::span(manifest_bytes.data(), manifest_bytes.size())));
  BucketTag tag{};
  for (size_t i = 0; i < sizeof(sum); ++i) tag[i] = static_cast<std::byte>((sum >> (8 * i)) & 0xff);
  return tag;
}

absl::Status CheckManifestChecksum(const BucketTag& tag, absl::string_view manifest_bytes, uint64_t index) {
  if (tag != ManifestChecksumTag(manifest_bytes)) {
    return absl::DataLossError(absl::StrCat("bucket ", index, ": the ", manifest_bytes.size(),
                                            "-byte manifest does not match its checksum: a corrupt framing"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::BucketManifest> DecodeManifest(const BucketHeader& header, absl::string_view manifest_bytes,
                                                  uint64_t index) {
  RETURN_IF_ERROR(CheckHeader(header, index));
  v1::BucketManifest m;
  if (manifest_bytes.size() != header.manifest_bytes ||
      !m.ParseFromArray(manifest_bytes.data(), static_cast<int>(manifest_bytes.size()))) {
    return absl::DataLossError(absl::StrCat("bucket ", index, ": the ", manifest_bytes.size(),
                                            "-byte manifest does not parse: a corrupt framing"));
  }
  if (absl::Status s = ValidateManifest(m, header.data_bytes); !s.ok()) {
    return absl::DataLossError(absl::StrCat(s.message(), ": a corrupt framing"));
  }
  if (m.index() != index) {
    return absl::DataLossError(absl::StrCat(DescribeBucket(m), ": expected bucket ", index, " (lost or reordered)"));
  }
  return m;
}

}  // namespace wsync::comm
