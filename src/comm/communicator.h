// The data plane: one collective interface over MPI, Gloo and NCCL, in the manner of c10d.
//
//   Communicator   a group of `size()` processes; this process is `rank()`. Every operation takes
//                  many buffers at once (one collective for a batch, not one per tensor), returns a
//                  Work at once, and runs in issue order on the communicator's worker (CPU) or
//                  stream (NCCL). Collectives must be issued in the same order, with the same
//                  sizes, on every member.
//   Factories      CreateMpiWorld (the `mpirun` world, then Split for the TP/EP/PP/DP groups; a Gloo
//                  world formed through a store splits the same way),
//                  CreateGroup (Gloo or NCCL among separately launched processes that only share a
//                  rendezvous Store, see store/store.h). Backends are compiled in where their
//                  library exists; the `#if`s live only in factory.cc.
//
// Bounded and abortable, always:
//   - every operation has a timeout: CollectiveOptions::timeout, else the group default. When it
//     passes the operation fails with kDeadlineExceeded and the communicator is broken;
//   - Abort(reason), from any thread, makes every in-flight and later operation fail fast with
//     kAborted (and reason);
//   - a member that dies or closes its connections gives kUnavailable on its peers;
//   - group formation that misses a member fails within its timeout naming the missing ranks.
// After any failure the communicator is broken: later operations fail at once with kAborted naming
// the first failure. Errors name the operation, group, rank, root and sizes.
//
// Thread-safety: all methods may be called from any thread; operations issued from several threads
// run in the order the calls took the communicator's lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/work.h"
#include "common/memory_space.h"

namespace wsync::comm {

class Store;

// kShm: processes on one host through one shared-memory segment (the colocated mode; shm/).
// kCudaIpc: the same protocol with its ring in one CUDA allocation every member opens by IPC handle
// (the colocated mode on GPUs: buckets move device to device; shm/, ShmCommunicator::Ring::kDevice).
enum class Backend { kMpi, kGloo, kNccl, kShm, kCudaIpc };
absl::string_view BackendName(Backend b);                      // "mpi" | "gloo" | "nccl" | "shm" | "cuda-ipc"
absl::StatusOr<Backend> ParseBackend(absl::string_view name);  // kInvalidArgument otherwise
bool BackendCompiledIn(Backend b);
// Whether the backend's operations move device memory (nccl, cuda-ipc): its members need a GPU.
bool MovesDeviceMemory(Backend b);

// A region of memory an operation reads or writes: host memory for MPI and Gloo, device memory
// of the communicator's device for NCCL. Not owned.
struct MutableBytes {
  void* data = nullptr;
  size_t nbytes = 0;
};
struct ConstBytes {
  const void* data = nullptr;
  size_t nbytes = 0;
};

// Per-operation options (c10d's kUnsetTimeout convention: zero means "the group default").
struct CollectiveOptions {
  absl::Duration timeout = absl::ZeroDuration();
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual absl::string_view Name() const = 0;  // the backend: "mpi" | "gloo" | "nccl" | "shm"
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& group() const = 0;  // the group's name, for messages and metrics
  // Where the buffers of its operations must be: host memory (MPI, Gloo, shm), or the memory of
  // the communicator's CUDA device (NCCL).
  virtual MemorySpace space() const { return MemorySpace::Host(); }

  // Every rank's `buffers` (same count and sizes everywhere) receive root's. In place.
  virtual absl::StatusOr<std::unique_ptr<Work>> Broadcast(absl::Span<const MutableBytes> buffers, int root,
                                                          const CollectiveOptions& options = {}) = 0;

  // outputs[i] (size() x inputs[i].nbytes) receives every rank's inputs[i], in rank order.
  // inputs[i] may alias this rank's block of outputs[i].
  virtual absl::StatusOr<std::unique_ptr<Work>> AllGather(absl::Span<const ConstBytes> inputs,
                                                          absl::Span<const MutableBytes> outputs,
                                                          const CollectiveOptions& options = {}) = 0;

  // Variable sizes: rank r contributes bytes_per_rank[r] bytes (input.nbytes must equal
  // bytes_per_rank[rank()]); output (their sum) receives them back to back in rank order.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllGatherV(ConstBytes input, MutableBytes output,
                                                           absl::Span<const size_t> bytes_per_rank,
                                                           const CollectiveOptions& options = {}) = 0;

  // In-place float32 sum over the group, identical bits on every rank (the summation order is
  // rank order on CPU backends). For the reference engine's tensor parallelism; small data.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllReduceSum(absl::Span<float> data,
                                                             const CollectiveOptions& options = {}) = 0;

  virtual absl::StatusOr<std::unique_ptr<Work>> Barrier(const CollectiveOptions& options = {}) = 0;

  // MPI and Gloo: a sub-communicator of the members passing the same `color` (ranks ordered by
  // `key`, then by rank), named `name` (Gloo: formed through the store this group was formed
  // through). Collective over this communicator; blocking. Others return kUnimplemented naming
  // the backend.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key, std::string name);

  // Makes every in-flight and later operation fail with kAborted carrying `reason`. Any thread,
  // never blocks for long, idempotent (the first reason is kept).
  virtual void Abort(absl::string_view reason) = 0;

  // Finishes the operations already issued (each bounded by its timeout), then releases the
  // backend's resources. Later operations fail with kAborted. Returns the first failure seen.
  virtual absl::Status Shutdown() = 0;
};

// Blocks on an issued operation: the status of issuing it, else of Wait().
absl::Status Await(absl::StatusOr<std::unique_ptr<Work>> work);

// --- Factories ------------------------------------------------------------------------------------

struct MpiOptions {
  std::string name = "world";
  absl::Duration default_timeout = absl::Minutes(5);
};
// Initializes MPI (requesting MPI_THREAD_MULTIPLE, see mpi/mpi_communicator.h) on first use and
// returns MPI_COMM_WORLD. MPI is finalized when the last MPI communicator is destroyed.
// kUnimplemented if wsync was built without MPI; kFailedPrecondition if the thread level is less.
absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorld(const MpiOptions& options = {});

struct GroupOptions {
  Store* store = nullptr;  // not owned; the rendezvous (the coordinator's, through GrpcStoreClient)
  std::string name;        // the group's key prefix in the store; unique per group instance
  int rank = 0;
  int size = 1;
  std::string host = "127.0.0.1";  // the address this member listens on (Gloo)
  int cuda_device = 0;             // NCCL
  absl::Duration join_timeout = absl::Seconds(60);
  absl::Duration default_timeout = absl::Minutes(5);
  // Polled while waiting for the other members (every 200 ms): true gives up with kCancelled (a
  // sync aborted while its group was forming).
  std::function<bool()> cancelled;
};
// Forms a Gloo, NCCL or shm group through the store. Blocks until every member has joined, or fails
// with kDeadlineExceeded after join_timeout naming the members that did not.
absl::StatusOr<std::unique_ptr<Communicator>> CreateGroup(Backend backend, const GroupOptions& options);
// A group of `parent`'s members on another backend, with `parent`'s ranks: NCCL only (the trainer's
// device gathers: its TP / ETP / EP groups on the GPUs). Rank 0's ncclUniqueId is all-gathered over
// `parent` with every member's readiness (no store; options.store, rank, size and host are not
// used), then the communicator is initialised on options.cuda_device within options.join_timeout.
// Collective over `parent`: every member calls it, in the same order as its other collectives. A
// member whose `ready` is an error (an earlier group failed on it) still takes part in the exchange
// and returns `ready`; the others then fail too, so no member is left in NCCL's formation.
// Errors: kUnimplemented for another backend or a build without NCCL; kFailedPrecondition, on
// every member, naming the first member without its GPU or not ready; the parent's AllGather
// errors; NCCL's.
absl::StatusOr<std::unique_ptr<Communicator>> CreateGroupOver(Backend backend, Communicator& parent,
                                                              const GroupOptions& options,
                                                              const CollectiveOptions& collective = {},
                                                              const absl::Status& ready = absl::OkStatus());

}  // namespace wsync::comm
