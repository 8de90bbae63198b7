// The one place that knows which backends were compiled in (STYLE.md §1).
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/shm/shm_communicator.h"
#include "common/cuda_ipc.h"

#if WSYNC_WITH_MPI
#include "comm/mpi/mpi_communicator.h"
#endif
#if WSYNC_WITH_GLOO
#include "comm/gloo/gloo_communicator.h"
#endif
#if WSYNC_WITH_NCCL
#include "comm/nccl/nccl_communicator.h"
#endif

namespace wsync::comm {
namespace {

[[maybe_unused]] absl::Status NotBuilt(Backend b) {
  return absl::UnimplementedError(absl::StrCat("wsync was built without the ", BackendName(b), " backend"));
}

}  // namespace

bool BackendCompiledIn(Backend b) {
  switch (b) {
    case Backend::kMpi: return WSYNC_WITH_MPI;
    case Backend::kGloo: return WSYNC_WITH_GLOO;
    case Backend::kNccl: return WSYNC_WITH_NCCL;
    case Backend::kShm: return true;
    case Backend::kCudaIpc: return CudaIpcCompiled();
  }
  return false;
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorld(const MpiOptions& options) {
#if WSYNC_WITH_MPI
  return CreateMpiWorldCommunicator(options);
#else
  (void)options;
  return NotBuilt(Backend::kMpi);
#endif
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateGroup(Backend backend, const GroupOptions& options) {
  switch (backend) {
    case Backend::kGloo:
#if WSYNC_WITH_GLOO
      return GlooCommunicator::Create(options);
#else
      return NotBuilt(backend);
#endif
    case Backend::kNccl:
#if WSYNC_WITH_NCCL
      return CreateNcclCommunicator(options);
#else
      return NotBuilt(backend);
#endif
    case Backend::kShm: return ShmCommunicator::Create(options);
    case Backend::kCudaIpc: return ShmCommunicator::Create(options, ShmCommunicator::Ring::kDevice);
    case Backend::kMpi:
      return absl::InvalidArgumentError(
          "an MPI group is not formed through the store: use CreateMpiWorld() and Split()");
  }
  return absl::InvalidArgumentError("unknown backend");
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateGroupOver(Backend backend, Communicator& parent,
                                                              const GroupOptions& options,
                                                              const CollectiveOptions& collective,
                                                              const absl::Status& ready) {
  if (backend != Backend::kNccl)
    return absl::UnimplementedError(
        absl::StrCat("a ", BackendName(backend), " group is not formed over another group (only nccl is)"));
#if WSYNC_WITH_NCCL
  return CreateNcclCommunicatorOver(parent, options, collective, ready);
#else
  (void)parent;
  (void)options;
  (void)collective;
  (void)ready;
  return NotBuilt(backend);
#endif
}

}  // namespace wsync::comm
