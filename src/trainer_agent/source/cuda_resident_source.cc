#include "trainer_agent/source/cuda_resident_source.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cuda_ipc.h"
#include "common/status.h"

namespace wsync::trainer_agent {
namespace {

constexpr uint64_t kAlignment = 256;  // cudaMalloc's, so every tensor starts as a kernel expects

uint64_t AlignUp(uint64_t x) { return (x + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

absl::StatusOr<std::unique_ptr<CudaResidentSource>> CudaResidentSource::Create(const WeightSource& inner,
                                                                               absl::Span<const int> ranks,
                                                                               int device) {
  return Create(inner, ranks, std::vector<int>(ranks.size(), device));
}

absl::StatusOr<std::unique_ptr<CudaResidentSource>> CudaResidentSource::Create(const WeightSource& inner,
                                                                               absl::Span<const int> ranks,
                                                                               absl::Span<const int> devices) {
  if (devices.size() != ranks.size())
    return absl::InvalidArgumentError(
        absl::StrCat("CudaResidentSource: ", devices.size(), " devices for ", ranks.size(), " ranks"));
  std::unique_ptr<CudaResidentSource> out(new CudaResidentSource());
  out->model_ = inner.source_model();
  std::vector<std::string> where;
  for (size_t i = 0; i < ranks.size(); ++i) where.push_back(absl::StrCat(ranks[i], " on cuda:", devices[i]));
  out->description_ = absl::StrCat(inner.Describe(), " resident on the GPU (rank ", absl::StrJoin(where, ", "), ")");
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int rank = ranks[i], device = devices[i];
    ASSIGN_OR_RETURN(RankShard host, inner.OpenRank(rank));
    uint64_t total = 0;
    for (const TensorView& t : host.tensors) total = AlignUp(total) + t.nbytes();
    ASSIGN_OR_RETURN(Buffer memory, AllocateDeviceBuffer(std::max<uint64_t>(total, 1), device));
    RankShard shard;
    shard.global_rank = rank;
    shard.params = host.params;
    shard.cuda_device = device;
    uint64_t offset = 0;
    for (const TensorView& t : host.tensors) {
      offset = AlignUp(offset);
      std::span<std::byte> dst = memory.span().subspan(offset, t.nbytes());
      RETURN_IF_ERROR(Annotate(CopyHostToDevice(dst.data(), t.data(), t.nbytes(), device),
                               absl::StrCat("uploading rank ", rank, "'s tensors")));
      shard.tensors.emplace_back(t.dtype(), t.shape(), dst);
      offset += t.nbytes();
    }
    shard.backing = std::make_shared<Buffer>(std::move(memory));
    out->ranks_.emplace(rank, std::move(shard));
  }
  return out;
}

absl::StatusOr<RankShard> CudaResidentSource::OpenRank(int global_rank, uint64_t) const {
  auto it = ranks_.find(global_rank);
  if (it == ranks_.end())
    return absl::NotFoundError(absl::StrCat(description_, " holds no tensors of rank ", global_rank));
  return it->second;
}

}  // namespace wsync::trainer_agent
