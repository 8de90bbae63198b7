#include "engine_model/engine_weights.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checksum.h"
#include "common/cuda_ipc.h"
#include "common/parallel_for.h"
#include "common/status.h"

namespace wsync::engine_model {

absl::Status EngineWeights::Add(EngineBuffer b) {
  if (index_.contains(b.name))
    return absl::InvalidArgumentError(absl::StrCat("engine buffer ", b.name, " registered twice"));
  ASSIGN_OR_RETURN(const int64_t want, NumBytes(b.dtype, b.shape));
  if (static_cast<int64_t>(b.nbytes) != want) {
    return absl::InvalidArgumentError(absl::StrCat("engine buffer ", b.name, ": ", b.nbytes, " bytes for ",
                                                   SafetensorsName(b.dtype), ShapeToString(b.shape), ", which needs ",
                                                   want));
  }
  if (want > 0 && b.data == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("engine buffer ", b.name, " has no memory"));
  index_[b.name] = buffers_.size();
  buffers_.push_back(std::move(b));
  return absl::OkStatus();
}

const EngineBuffer* EngineWeights::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &buffers_[it->second];
}

absl::StatusOr<MutableTensorView> EngineWeights::View(absl::string_view name) const {
  const EngineBuffer* b = Find(name);
  if (b == nullptr) return absl::NotFoundError(absl::StrCat("no engine buffer named ", name));
  return MutableTensorView(b->dtype, b->shape, std::span<std::byte>(static_cast<std::byte*>(b->data), b->nbytes));
}

absl::Status EngineWeights::CheckMatches(const EngineLayout& layout) const {
  std::vector<std::string> problems;
  for (const EngineParam& p : layout.params()) {
    const EngineBuffer* b = Find(p.name);
    if (b == nullptr) {
      problems.push_back(absl::StrCat(p.name, " is not registered"));
      continue;
    }
    const DType dt = p.dtype_in(ParamForm::kEngine);
    if (b->dtype != dt || b->shape != p.engine_shape) {
      problems.push_back(absl::StrCat(p.name, " is ", SafetensorsName(b->dtype), ShapeToString(b->shape), ", want ",
                                      SafetensorsName(dt), ShapeToString(p.engine_shape)));
      continue;
    }
    if (reinterpret_cast<uintptr_t>(b->data) % ItemSize(dt) != 0)
      problems.push_back(absl::StrCat(p.name, " is not ", ItemSize(dt), "-byte aligned"));
  }
  for (const EngineBuffer& b : buffers_)
    if (layout.FindParam(b.name) < 0) problems.push_back(absl::StrCat(b.name, " is not a parameter of the layout"));
  std::vector<const EngineBuffer*> by_addr;
  for (const EngineBuffer& b : buffers_)
    if (b.nbytes > 0) by_addr.push_back(&b);
  std::sort(by_addr.begin(), by_addr.end(), [](const EngineBuffer* a, const EngineBuffer* b) {
    return reinterpret_cast<uintptr_t>(a->data) < reinterpret_cast<uintptr_t>(b->data);
  });
  for (size_t i = 1; i < by_addr.size(); ++i) {
    const auto end = reinterpret_cast<uintptr_t>(by_addr[i - 1]->data) + by_addr[i - 1]->nbytes;
    if (reinterpret_cast<uintptr_t>(by_addr[i]->data) < end)
      problems.push_back(absl::StrCat(by_addr[i - 1]->name, " and ", by_addr[i]->name, " overlap"));
  }
  if (problems.empty()) return absl::OkStatus();
  constexpr size_t kShown = 32;
  const size_t n = problems.size();
  if (n > kShown) problems.resize(kShown);
  return absl::InvalidArgumentError(absl::StrCat("engine buffers do not match the engine layout (", n, " problems): ",
                                                 absl::StrJoin(problems, "; "), n > kShown ? "; ..." : ""));
}

absl::StatusOr<std::unique_ptr<OwnedEngineWeights>> OwnedEngineWeights::Allocate(const EngineLayout& layout) {
  std::unique_ptr<OwnedEngineWeights> o(new OwnedEngineWeights());
  o->memory_.reserve(layout.params().size());
  for (const EngineParam& p : layout.params()) {
    const DType dt = p.dtype_in(ParamForm::kEngine);
    ASSIGN_OR_RETURN(const int64_t bytes, NumBytes(dt, p.engine_shape));
    auto buf = Buffer::AllocateZeroed(static_cast<size_t>(bytes));
    if (!buf.ok()) return Annotate(buf.status(), absl::StrCat("engine buffer for ", p.name));
    EngineBuffer b{p.name, dt, p.engine_shape, buf->data(), static_cast<size_t>(bytes)};
    o->memory_.push_back(std::move(*buf));
    RETURN_IF_ERROR(o->weights_.Add(std::move(b)));
  }
  return o;
}

absl::StatusOr<std::vector<uint64_t>> EngineWeights::Checksums(int threads) const {
  std::vector<uint64_t> sums(buffers_.size());
  ParallelFor(static_cast<int64_t>(buffers_.size()), threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const EngineBuffer& b = buffers_[static_cast<size_t>(i)];
      if (!b.on_device()) sums[static_cast<size_t>(i)] = Xxh3_64({static_cast<const std::byte*>(b.data), b.nbytes});
    }
  });
  Buffer host;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const EngineBuffer& b = buffers_[i];
    if (!b.on_device()) continue;
    if (host.size() < b.nbytes) {
      ASSIGN_OR_RETURN(host, Buffer::Allocate(b.nbytes));
    }
    RETURN_IF_ERROR(Annotate(CopyDeviceToHost(host.data(), b.data, b.nbytes, b.cuda_device),
                             absl::StrCat("checksum of engine buffer ", b.name)));
    sums[i] = Xxh3_64({static_cast<const std::byte*>(host.data()), b.nbytes});
  }
  return sums;
}

size_t EngineWeights::device_buffers() const {
  return static_cast<size_t>(
      std::count_if(buffers_.begin(), buffers_.end(), [](const EngineBuffer& b) { return b.on_device(); }));
}

}  // namespace wsync::engine_model
