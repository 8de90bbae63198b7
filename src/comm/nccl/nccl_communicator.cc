#include "comm/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "comm/queued_communicator.h"
#include "comm/rendezvous.h"
#include "comm/store/store.h"
#include "common/status.h"

namespace wsync::comm {
namespace {

absl::Status CudaStatus(cudaError_t e, absl::string_view call) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, ": ", cudaGetErrorString(e)));
}

absl::Status NcclStatus(ncclResult_t r, absl::string_view call) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  const absl::StatusCode code =
      (r == ncclRemoteError || r == ncclSystemError) ? absl::StatusCode::kUnavailable : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(call, ": ", ncclGetErrorString(r)));
}

#define WSYNC_CUDA_RETURN_IF_ERROR(call) RETURN_IF_ERROR(CudaStatus((call), #call))
#define WSYNC_NCCL_RETURN_IF_ERROR(call) RETURN_IF_ERROR(NcclStatus((call), #call))

class NcclCommunicator final : public QueuedCommunicator {
 public:
  NcclCommunicator(const GroupOptions& options)
      : QueuedCommunicator(options.name, options.rank, options.size, options.default_timeout),
        device_(options.cuda_device) {
    StartWorker();
  }
  ~NcclCommunicator() override { Shutdown().IgnoreError(); }

  absl::string_view Name() const override { return "nccl"; }
  MemorySpace space() const override { return MemorySpace::Cuda(device_); }

  // Runs on the worker (the device is per thread): create the stream, event and communicator.
  // The communicator is initialised non-blocking and polled until it is ready, fails, `timeout`
  // passes or `cancelled` (may be empty; asked every 200 ms) says so; the last three abort it.
  absl::Status Init(const ncclUniqueId& id, absl::Duration timeout, const std::function<bool()>& cancelled) {
    return RunOnWorker([&]() -> absl::Status {
      WSYNC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
      WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      WSYNC_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
      WSYNC_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ordered_, cudaEventDisableTiming));
      WSYNC_CUDA_RETURN_IF_ERROR(cudaMalloc(&scratch_, sizeof(float)));
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      WSYNC_NCCL_RETURN_IF_ERROR(ncclCommInitRankConfig(&comm_, size(), id, rank(), &config));
      const auto abort_with = [this](absl::Status s) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        return s;
      };
      const absl::Time deadline = absl::Now() + timeout;
      absl::Time next_ask = absl::Now() + absl::Milliseconds(200);
      for (;;) {
        ncclResult_t state = ncclSuccess;
        if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
          return abort_with(NcclStatus(r, "ncclCommGetAsyncError"));
        }
        if (state == ncclSuccess) return absl::OkStatus();
        if (state != ncclInProgress) return abort_with(NcclStatus(state, "ncclCommInitRankConfig"));
        const absl::Time now = absl::Now();
        if (now > deadline) {
          return abort_with(absl::DeadlineExceededError(
              absl::StrCat("ncclCommInitRankConfig did not finish within ", absl::FormatDuration(timeout))));
        }
        if (cancelled && now >= next_ask) {
          if (cancelled()) return abort_with(absl::CancelledError("ncclCommInitRankConfig was cancelled"));
          next_ask = now + absl::Milliseconds(200);
        }
        absl::SleepFor(absl::Microseconds(100));
      }
    });
  }

 protected:
  absl::Status DoBroadcast(const OpContext& ctx, absl::Span<const MutableBytes> buffers, int root) override {
    RETURN_IF_ERROR(AfterEnqueuedWork());
    WSYNC_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (const auto& b : buffers) {
      if (b.nbytes == 0) continue;
      WSYNC_NCCL_RETURN_IF_ERROR(ncclBroadcast(b.data, b.data, b.nbytes, ncclUint8, root, comm_, stream_));
    }
    WSYNC_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
    return Complete(ctx);
  }
  absl::Status DoAllGather(const OpContext& ctx, absl::Span<const ConstBytes> inputs,
                           absl::Span<const MutableBytes> outputs) override {
    RETURN_IF_ERROR(AfterEnqueuedWork());
    WSYNC_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].nbytes == 0) continue;
      WSYNC_NCCL_RETURN_IF_ERROR(
          ncclAllGather(inputs[i].data, outputs[i].data, inputs[i].nbytes, ncclUint8, comm_, stream_));
    }
    WSYNC_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
    return Complete(ctx);
  }
  absl::Status DoAllGatherV(const OpContext& ctx, ConstBytes input, MutableBytes output,
                            absl::Span<const size_t> bytes_per_rank) override {
    RETURN_IF_ERROR(AfterEnqueuedWork());
    size_t off = 0;
    WSYNC_NCCL_RETURN_IF_ERROR(ncclGroupStart());
    for (int r = 0; r < size(); ++r) {
      auto* block = static_cast<char*>(output.data) + off;
      if (bytes_per_rank[r] > 0) {
        const void* send = r == rank() ? input.data : block;
        WSYNC_NCCL_RETURN_IF_ERROR(ncclBroadcast(send, block, bytes_per_rank[r], ncclUint8, r, comm_, stream_));
      }
      off += bytes_per_rank[r];
    }
    WSYNC_NCCL_RETURN_IF_ERROR(ncclGroupEnd());
    return Complete(ctx);
  }
  absl::Status DoAllReduceSum(const OpContext& ctx, absl::Span<float> data) override {
    if (data.empty()) return absl::OkStatus();
    RETURN_IF_ERROR(AfterEnqueuedWork());
    WSYNC_NCCL_RETURN_IF_ERROR(
        ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat32, ncclSum, comm_, stream_));
    return Complete(ctx);
  }
  absl::Status DoBarrier(const OpContext& ctx) override {
    RETURN_IF_ERROR(AfterEnqueuedWork());
    WSYNC_NCCL_RETURN_IF_ERROR(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_));
    return Complete(ctx);
  }
  void Interrupt() override {}  // Complete() watches the aborted flag and aborts the communicator
  absl::Status ReleaseBackend() override {
    if (comm_ != nullptr) {
      // A non-blocking communicator finalizes asynchronously (ncclCommFinalize returns
      // ncclInProgress): poll it to the end, bounded, before ncclCommDestroy; abort on an error or
      // after 10 s (a peer that never finalizes).
      bool finalized = false;
      if (!broken()) {
        ncclResult_t r = ncclCommFinalize(comm_);
        const absl::Time until = absl::Now() + absl::Seconds(10);
        ncclResult_t state = r;
        while (state == ncclInProgress && absl::Now() < until) {
          absl::SleepFor(absl::Microseconds(200));
          if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
        }
        finalized = (r == ncclSuccess || r == ncclInProgress) && state == ncclSuccess;
      }
      if (finalized)
        ncclCommDestroy(comm_);
      else
        ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    if (event_) cudaEventDestroy(event_);
    if (ordered_) cudaEventDestroy(ordered_);
    if (stream_) cudaStreamDestroy(stream_);
    if (scratch_) cudaFree(scratch_);
    return absl::OkStatus();
  }

 private:
  // The communicator's stream is non-blocking, so it does not wait for the device's legacy default
  // stream by itself; the buffers of an operation are filled there (MemorySpace's copies, the
  // kernels of kernels/: a bucket built on the device, a header copied up), and the operation
  // must start after them.
  absl::Status AfterEnqueuedWork() {
    WSYNC_CUDA_RETURN_IF_ERROR(cudaEventRecord(ordered_, cudaStreamLegacy));
    WSYNC_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ordered_, 0));
    return absl::OkStatus();
  }
  // Waits for the operation just launched: the event, NCCL's asynchronous errors, the deadline
  // and Abort. Any failure aborts the NCCL communicator, so the buffers are released.
  absl::Status Complete(const OpContext& ctx) {
    // A non-blocking communicator may return ncclInProgress from the launch (its first operation
    // connects its peers lazily): nothing is on the stream until its state leaves ncclInProgress,
    // so an event recorded earlier would complete at once, before NCCL touched the buffers.
    for (;;) {
      ncclResult_t state = ncclSuccess;
      if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess)
        return AbortWith(NcclStatus(r, "ncclCommGetAsyncError"));
      if (state == ncclSuccess) break;
      if (state != ncclInProgress) return AbortWith(NcclStatus(state, "NCCL launch"));
      absl::Status s = ctx.Check();
      if (!s.ok()) return AbortWith(s);
      absl::SleepFor(absl::Microseconds(20));
    }
    WSYNC_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, stream_));
    for (;;) {
      cudaError_t q = cudaEventQuery(event_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) return AbortWith(CudaStatus(q, "cudaEventQuery"));
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) return AbortWith(NcclStatus(state, "NCCL"));
      absl::Status s = ctx.Check();
      if (!s.ok()) return AbortWith(s);
      absl::SleepFor(absl::Microseconds(20));
    }
  }
  absl::Status AbortWith(absl::Status s) {
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    return s;
  }

  int device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;
  cudaEvent_t ordered_ = nullptr;  // AfterEnqueuedWork
  float* scratch_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const GroupOptions& options) {
  const std::string where =
      absl::StrCat("forming nccl group \"", options.name, "\" as rank ", options.rank, "/", options.size);
  if (options.store == nullptr) return absl::InvalidArgumentError(absl::StrCat(where, ": no rendezvous store"));
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": no CUDA device"));
  }
  const absl::Time deadline = absl::Now() + options.join_timeout;
  RETURN_IF_ERROR(Annotate(JoinGroup(*options.store, options.name, options.rank, options.size, options.host,
                                     options.join_timeout, options.cancelled),
                           where));
  ncclUniqueId id;
  const std::string key = absl::StrCat(options.name, "/nccl_id");
  if (options.rank == 0) {
    RETURN_IF_ERROR(Annotate(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"), where));
    RETURN_IF_ERROR(
        Annotate(options.store->Set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id))), where));
  } else {
    RETURN_IF_ERROR(Annotate(WaitUnlessCancelled(*options.store, {key}, deadline - absl::Now(), options.cancelled,
                                                 "waiting for the unique id"),
                             where));
    ASSIGN_OR_RETURN(std::string bytes, options.store->Get(key, deadline - absl::Now()));
    if (bytes.size() != sizeof(id)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the unique id has ", bytes.size(), " bytes, not ", sizeof(id)));
    }
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  auto comm = std::make_unique<NcclCommunicator>(options);
  RETURN_IF_ERROR(
      Annotate(comm->Init(id, std::max(deadline - absl::Now(), absl::Seconds(1)), options.cancelled), where));
  return std::unique_ptr<Communicator>(std::move(comm));
}

// One member's part of the unique-id exchange over a parent group: whether it can form the group
// (a GPU), and rank 0's id.
struct IdRecord {
  int32_t ok = 0;
  int32_t reserved = 0;
  ncclUniqueId id;
};

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicatorOver(Communicator& parent,
                                                                         const GroupOptions& options,
                                                                         const CollectiveOptions& collective,
                                                                         const absl::Status& ready) {
  GroupOptions o = options;
  o.rank = parent.rank();
  o.size = parent.size();
  const std::string where =
      absl::StrCat("forming nccl group \"", o.name, "\" over ", parent.Name(), " group \"", parent.group(),
                   "\" as rank ", o.rank, "/", o.size, " on cuda:", o.cuda_device);
  // Every member takes part in the exchange, so that a member without its GPU fails the group on
  // every member at once instead of leaving the others in ncclCommInitRankConfig.
  IdRecord mine;
  int devices = 0;
  absl::Status local = ready;
  if (!local.ok()) {
    // Not ready: take part in the exchange only, so that the others fail with us.
  } else if (cudaGetDeviceCount(&devices) != cudaSuccess || o.cuda_device < 0 || o.cuda_device >= devices)
    local = absl::FailedPreconditionError(
        absl::StrCat("rank ", o.rank, " has no CUDA device ", o.cuda_device, " (", devices, " visible)"));
  else if (o.rank == 0)
    local = NcclStatus(ncclGetUniqueId(&mine.id), "ncclGetUniqueId");
  mine.ok = local.ok() ? 1 : 0;
  std::vector<IdRecord> all(static_cast<size_t>(o.size));
  ConstBytes in{&mine, sizeof(mine)};
  MutableBytes out{all.data(), all.size() * sizeof(IdRecord)};
  RETURN_IF_ERROR(Annotate(Await(parent.AllGather({&in, 1}, {&out, 1}, collective)),
                           absl::StrCat(where, ": exchanging the unique id")));
  if (!local.ok()) return Annotate(local, where);
  for (int r = 0; r < o.size; ++r)
    if (all[static_cast<size_t>(r)].ok == 0)
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": rank ", r, " cannot join (no GPU, no unique id, or an earlier group failed there)"));
  auto comm = std::make_unique<NcclCommunicator>(o);
  RETURN_IF_ERROR(Annotate(comm->Init(all[0].id, o.join_timeout, o.cancelled), where));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace wsync::comm
