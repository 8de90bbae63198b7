// Tensor views and owning buffers: the currency between wsync's stages.
//
// TensorView / MutableTensorView are non-owning (dtype, shape, bytes) triples, cheap to copy; the
// memory belongs to someone else (an mmap'ed safetensors file, a shared-memory segment, a Buffer)
// and must outlive the view. Buffer owns 64-byte-aligned host memory (cache-line and AVX-512
// aligned), move-only, zero-initialized on request only. Tensors are dense and row-major
// (C order); there are no strides.
// Thread-safety: views are values; concurrent reads are safe, concurrent writes to overlapping
// bytes are the caller's problem, as with raw memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"

namespace wsync {

using Shape = absl::InlinedVector<int64_t, 4>;

// Number of elements, 1 for a 0-d shape. Returns InvalidArgument for a negative dimension or an
// element count that overflows int64.
absl::StatusOr<int64_t> NumElements(std::span<const int64_t> shape);
// Byte size of a dense tensor of that dtype and shape, with the same errors (and overflow of bytes).
absl::StatusOr<int64_t> NumBytes(DType dtype, std::span<const int64_t> shape);
// "[4096, 2048]"; "[]" for a 0-d shape.
std::string ShapeToString(std::span<const int64_t> shape);

// A tensor seen as a matrix, as the loader copies blocks of it and sharded delivery cuts them: a
// 0-d tensor is [1, 1], a 1-D [n] is [n, 1], an N-D one its last two dims.
struct MatrixDims {
  int64_t rows = 1;
  int64_t cols = 1;
};
inline MatrixDims MatrixOf(std::span<const int64_t> shape) {
  if (shape.empty()) return {1, 1};
  if (shape.size() == 1) return {shape[0], 1};
  return {shape[shape.size() - 2], shape.back()};
}

class TensorView {
 public:
  TensorView() = default;
  // `bytes.size()` must equal NumBytes(dtype, shape); Make() checks it, this constructor does not.
  TensorView(DType dtype, Shape shape, std::span<const std::byte> bytes)
      : dtype_(dtype), shape_(std::move(shape)), bytes_(bytes) {}
  // Checked constructor: InvalidArgument if the sizes disagree (message names `what`).
  static absl::StatusOr<TensorView> Make(DType dtype, Shape shape, std::span<const std::byte> bytes,
                                         absl::string_view what = "tensor");

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[static_cast<size_t>(i)]; }
  int64_t numel() const;
  std::span<const std::byte> bytes() const { return bytes_; }
  const void* data() const { return bytes_.data(); }
  size_t nbytes() const { return bytes_.size(); }
  // Typed pointer; the caller must know the dtype. Alignment is not guaranteed by safetensors
  // files (see IsAligned); use memcpy-based access where it matters.
  template <typename T>
  const T* data_as() const {
    return reinterpret_cast<const T*>(bytes_.data());
  }
  bool IsAligned(size_t alignment) const { return reinterpret_cast<uintptr_t>(bytes_.data()) % alignment == 0; }
  std::string DebugString() const;  // "BF16[4096, 2048]"

 private:
  DType dtype_ = DType::kU8;
  Shape shape_;
  std::span<const std::byte> bytes_;
};

class MutableTensorView {
 public:
  MutableTensorView() = default;
  MutableTensorView(DType dtype, Shape shape, std::span<std::byte> bytes)
      : dtype_(dtype), shape_(std::move(shape)), bytes_(bytes) {}
  static absl::StatusOr<MutableTensorView> Make(DType dtype, Shape shape, std::span<std::byte> bytes,
                                                absl::string_view what = "tensor");

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[static_cast<size_t>(i)]; }
  int64_t numel() const;
  std::span<std::byte> bytes() const { return bytes_; }
  void* data() const { return bytes_.data(); }
  size_t nbytes() const { return bytes_.size(); }
  template <typename T>
  T* data_as() const {
    return reinterpret_cast<T*>(bytes_.data());
  }
  operator TensorView() const { return TensorView(dtype_, shape_, bytes_); }  // NOLINT

 private:
  DType dtype_ = DType::kU8;
  Shape shape_;
  std::span<std::byte> bytes_;
};

// Owning, 64-byte-aligned memory. Move-only. Allocate() returns uninitialized host memory (no
// page is touched, so allocating a bucket is cheap); AllocateZeroed() returns zeros. Adopt() takes
// memory of another allocator with its release function: device memory of a CUDA device
// (device() >= 0: data() is a device pointer, never dereferenced on the host) or page-locked host
// memory (common/cuda_ipc.h makes both), so that such memory travels through the same pools, bucket
// builders and senders as host buffers.
namespace internal {
// How a Buffer frees its memory (outside Buffer so that its default member initializers are usable
// in Buffer's own defaulted constructor).
struct BufferFree {
  void (*release)(std::byte* data, int device) = nullptr;  // null: std::free
  int device = -1;
  void operator()(std::byte* p) const;
};
}  // namespace internal

class Buffer {
 public:
  static constexpr size_t kAlignment = 64;
  using Release = void (*)(std::byte* data, int device);

  Buffer() = default;
  // A moved-from Buffer is empty: no memory and size 0.
  Buffer(Buffer&& o) noexcept : data_(std::move(o.data_)), size_(std::exchange(o.size_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    data_ = std::move(o.data_);
    size_ = std::exchange(o.size_, 0);
    return *this;
  }
  // ResourceExhausted if the allocation fails.
  static absl::StatusOr<Buffer> Allocate(size_t nbytes);
  static absl::StatusOr<Buffer> AllocateZeroed(size_t nbytes);
  // Owns `data` (nbytes, kAlignment-aligned) and frees it with release(data, device).
  static Buffer Adopt(std::byte* data, size_t nbytes, Release release, int device);

  std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }
  std::span<std::byte> span() const { return {data_.get(), size_}; }
  // The CUDA device whose memory this is; -1 for host memory (pageable or page-locked).
  int device() const { return data_.get_deleter().device; }

 private:
  using Free = internal::BufferFree;
  std::unique_ptr<std::byte, Free> data_;
  size_t size_ = 0;
};

// A tensor that owns its memory: a Buffer plus dtype and shape.
class Tensor {
 public:
  Tensor() = default;
  // Uninitialized memory of NumBytes(dtype, shape).
  static absl::StatusOr<Tensor> Empty(DType dtype, Shape shape);
  static absl::StatusOr<Tensor> Zeros(DType dtype, Shape shape);
  // A deep copy of `view`.
  static absl::StatusOr<Tensor> CopyOf(const TensorView& view);
  // A tensor over `buffer` (host or device memory), which must hold exactly NumBytes(dtype, shape).
  static absl::StatusOr<Tensor> FromBuffer(DType dtype, Shape shape, Buffer buffer);
  int device() const { return buffer_.device(); }  // Buffer::device()

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  size_t nbytes() const { return buffer_.size(); }
  TensorView view() const { return TensorView(dtype_, shape_, buffer_.span()); }
  MutableTensorView mutable_view() { return MutableTensorView(dtype_, shape_, buffer_.span()); }
  template <typename T>
  T* data_as() {
    return reinterpret_cast<T*>(buffer_.data());
  }

 private:
  DType dtype_ = DType::kU8;
  Shape shape_;
  Buffer buffer_;
};

}  // namespace wsync
