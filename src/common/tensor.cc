#include "common/tensor.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace wsync {

absl::StatusOr<int64_t> NumElements(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension in shape ", ShapeToString(shape)));
    if (__builtin_mul_overflow(n, d, &n))
      return absl::InvalidArgumentError(absl::StrCat("element count of shape ", ShapeToString(shape), " overflows"));
  }
  return n;
}

absl::StatusOr<int64_t> NumBytes(DType dtype, std::span<const int64_t> shape) {
  auto n = NumElements(shape);
  if (!n.ok()) return n.status();
  int64_t bytes = 0;
  if (__builtin_mul_overflow(*n, static_cast<int64_t>(ItemSize(dtype)), &bytes))
    return absl::InvalidArgumentError(absl::StrCat("byte size of shape ", ShapeToString(shape), " overflows"));
  return bytes;
}

std::string ShapeToString(std::span<const int64_t> shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

namespace {
int64_t Product(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
absl::Status CheckSize(DType dtype, const Shape& shape, size_t nbytes, absl::string_view what) {
  auto expected = NumBytes(dtype, shape);
  if (!expected.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", expected.status().message()));
  if (static_cast<uint64_t>(*expected) != nbytes)
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", SafetensorsName(dtype), ShapeToString(shape), " needs ",
                                                   *expected, " bytes, got ", nbytes));
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<TensorView> TensorView::Make(DType dtype, Shape shape, std::span<const std::byte> bytes,
                                            absl::string_view what) {
  if (auto s = CheckSize(dtype, shape, bytes.size(), what); !s.ok()) return s;
  return TensorView(dtype, std::move(shape), bytes);
}
int64_t TensorView::numel() const { return Product(shape_); }
std::string TensorView::DebugString() const { return absl::StrCat(SafetensorsName(dtype_), ShapeToString(shape_)); }

absl::StatusOr<MutableTensorView> MutableTensorView::Make(DType dtype, Shape shape, std::span<std::byte> bytes,
                                                          absl::string_view what) {
  if (auto s = CheckSize(dtype, shape, bytes.size(), what); !s.ok()) return s;
  return MutableTensorView(dtype, std::move(shape), bytes);
}
int64_t MutableTensorView::numel() const { return Product(shape_); }

void internal::BufferFree::operator()(std::byte* p) const {
  if (release != nullptr) {
    release(p, device);
  } else {
    std::free(p);
  }
}

Buffer Buffer::Adopt(std::byte* data, size_t nbytes, Release release, int device) {
  Buffer b;
  b.data_ = std::unique_ptr<std::byte, Free>(data, Free{release, device});
  b.size_ = data == nullptr ? 0 : nbytes;
  return b;
}

absl::StatusOr<Buffer> Buffer::Allocate(size_t nbytes) {
  Buffer b;
  if (nbytes == 0) return b;
  const size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
  if (rounded < nbytes) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", nbytes, " bytes"));
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", nbytes, " bytes"));
  b.data_.reset(static_cast<std::byte*>(p));
  b.size_ = nbytes;
  return b;
}

absl::StatusOr<Buffer> Buffer::AllocateZeroed(size_t nbytes) {
  auto b = Allocate(nbytes);
  if (b.ok() && nbytes > 0) std::memset(b->data(), 0, nbytes);
  return b;
}

absl::StatusOr<Tensor> Tensor::Empty(DType dtype, Shape shape) {
  auto nbytes = NumBytes(dtype, shape);
  if (!nbytes.ok()) return nbytes.status();
  auto buf = Buffer::Allocate(static_cast<size_t>(*nbytes));
  if (!buf.ok()) return buf.status();
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.buffer_ = std::move(*buf);
  return t;
}

absl::StatusOr<Tensor> Tensor::Zeros(DType dtype, Shape shape) {
  auto t = Empty(dtype, std::move(shape));
  if (t.ok() && t->nbytes() > 0) std::memset(t->buffer_.data(), 0, t->nbytes());
  return t;
}

absl::StatusOr<Tensor> Tensor::FromBuffer(DType dtype, Shape shape, Buffer buffer) {
  auto nbytes = NumBytes(dtype, shape);
  if (!nbytes.ok()) return nbytes.status();
  if (buffer.size() != static_cast<size_t>(*nbytes))
    return absl::InvalidArgumentError(absl::StrCat("a ", SafetensorsName(dtype), ShapeToString(shape), " tensor needs ",
                                                   *nbytes, " bytes, the buffer holds ", buffer.size()));
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.buffer_ = std::move(buffer);
  return t;
}

absl::StatusOr<Tensor> Tensor::CopyOf(const TensorView& view) {
  auto t = Empty(view.dtype(), view.shape());
  if (!t.ok()) return t;
  if (t->nbytes() != view.nbytes())
    return absl::InvalidArgumentError(absl::StrCat("CopyOf: view ", view.DebugString(), " has ", view.nbytes(),
                                                   " bytes, its shape needs ", t->nbytes()));
  if (view.nbytes() > 0) std::memcpy(t->buffer_.data(), view.data(), view.nbytes());
  return t;
}

}  // namespace wsync
