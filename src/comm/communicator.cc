#include "comm/communicator.h"

#include "absl/strings/str_cat.h"

namespace wsync::comm {

absl::string_view BackendName(Backend b) {
  switch (b) {
    case Backend::kMpi: return "mpi";
    case Backend::kGloo: return "gloo";
    case Backend::kNccl: return "nccl";
    case Backend::kShm: return "shm";
    case Backend::kCudaIpc: return "cuda-ipc";
  }
  return "unknown";
}

absl::StatusOr<Backend> ParseBackend(absl::string_view name) {
  if (name == "mpi") return Backend::kMpi;
  if (name == "gloo") return Backend::kGloo;
  if (name == "nccl") return Backend::kNccl;
  if (name == "shm") return Backend::kShm;
  if (name == "cuda-ipc") return Backend::kCudaIpc;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown data-plane backend \"", name, "\" (mpi, gloo, nccl, shm or cuda-ipc)"));
}

bool MovesDeviceMemory(Backend b) { return b == Backend::kNccl || b == Backend::kCudaIpc; }

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Split(int, int, std::string) {
  return absl::UnimplementedError(
      absl::StrCat("Split is not supported by the ", Name(), " backend (MPI and Gloo only)"));
}

absl::Status Await(absl::StatusOr<std::unique_ptr<Work>> work) {
  if (!work.ok()) return work.status();
  return (*work)->Wait();
}

}  // namespace wsync::comm
