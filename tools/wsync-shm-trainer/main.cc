// wsync-shm-trainer: plays the training processes of an shm: source, one per Megatron rank
// (launch it like Megatron: mpirun -np WORLD, beside `wsync-trainer-agent --source shm:NAME`).
// It uses only the C API of libwsync_trainer_client (wsync_trainer_client.h), as a training
// process would; the weights of step i come from the rank's file of the i-th --from directory
// (Megatron source directories made by wsync-shard), standing in for an optimizer step.
//
//   mpirun -np 4 wsync-shm-trainer --name job42 --from step1/ --from step2/ [--after-sync CMD]
//
// Rank r is --rank, or MPI's rank (MPI is used only for the barrier after --after-sync).
//
// For every step: begin_update, overwrite every tensor in place, end_update, then
// request_sync(version = first-version + i, wait). Rank 0 then runs CMD (bash -c, with
// WSYNC_VERSION and WSYNC_FROM set) before the next step, e.g. `wsyncctl verify`; every rank
// waits for the sync itself, so no rank writes step i+1 while step i is read.
// --cuda-device N: the rank's tensors live in one CUDA allocation on device N (declared with
// wsync_client_add_cuda_tensor, by IPC handle), as a GPU trainer's parameters do; each step is
// copied there. The trainer agent then reads them from the device.
// Exit status: 0 when every step synced (and CMD succeeded), 1 otherwise, 2 for bad flags.
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/config.h"
#include "common/cuda_ipc.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "trainer_client/wsync_trainer_client.h"

namespace {

int Die(const std::string& what) {
  std::fprintf(stderr, "wsync-shm-trainer: %s\n", what.c_str());
  return 1;
}

// A failed rank ends the whole job (as a training job would), so no peer waits in a barrier.
int Abort(const std::string& what) {
  Die(what);
  MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

std::string ReadFile(const std::string& path) {
  auto text = wsync::ReadTextFile(path);
  return text.ok() ? *text : std::string();
}

int EnvRank() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"}) {
    if (const char* s = std::getenv(v)) return std::atoi(s);
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("wsync-shm-trainer: training processes for an shm: weight source (one per rank, under mpirun)");
  std::string name;
  int rank = EnvRank();
  std::vector<std::string> steps;
  std::string after;
  uint64_t first_version = 1;
  double timeout_s = 600;
  if (const char* n = std::getenv("WSYNC_SHM_NAME")) name = n;
  app.add_option("--name", name, "NAME of the agents' --source shm:NAME (default $WSYNC_SHM_NAME)");
  app.add_option("--rank", rank, "Megatron global rank (default: from mpirun's environment)");
  app.add_option("--from", steps, "Megatron source directory holding the weights of one step (repeat)")->required();
  app.add_option("--first-version", first_version, "Version of the first step")->check(CLI::PositiveNumber);
  app.add_option("--after-sync", after, "Rank 0 runs this (bash -c) after each sync; its failure stops the run");
  app.add_option("--timeout", timeout_s, "Bound on connecting, registering and each sync, seconds");
  int cuda_device = -1;
  app.add_option("--cuda-device", cuda_device, "keep the tensors in CUDA memory on this device (IPC handles)")
      ->check(CLI::Range(0, 1023));
  std::string start_after;
  if (const char* f = std::getenv("WSYNC_START_FILE")) start_after = f;
  app.add_option("--start-after", start_after,
                 "Register at once, but take the first step only once this file exists (default $WSYNC_START_FILE; "
                 "wsync-local creates it when every rollout agent has joined)");
  CLI11_PARSE(app, argc, argv);
  if (name.empty()) {
    std::fprintf(stderr, "wsync-shm-trainer: --name (or $WSYNC_SHM_NAME) is required\n");
    return 2;
  }
  const int64_t timeout_ms = static_cast<int64_t>(timeout_s * 1000);
  MPI_Init(&argc, &argv);
  if (rank < 0) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char rank_file[32];
  std::snprintf(rank_file, sizeof(rank_file), "/rank-%05d.safetensors", rank);

  wsync_client* c = nullptr;
  if (wsync_client_open(name.c_str(), rank, timeout_ms, &c) != WSYNC_OK) return Abort(wsync_last_error());
  int rc = 0;
  std::unique_ptr<wsync::CudaAllocation> device_memory;  // --cuda-device: every tensor, 256-byte aligned
  std::map<std::string, uint64_t> device_offset;
  for (size_t i = 0; i < steps.size() && rc == 0; ++i) {
    auto file = wsync::SafetensorsFile::Open(steps[i] + rank_file);
    if (!file.ok()) {
      rc = Abort(file.status().ToString());
      break;
    }
    if (i == 0) {  // declare the parameters as the trainer holds them, then register
      std::string handle;
      if (cuda_device >= 0) {
        uint64_t total = 0;
        for (const auto& e : file->tensors()) {
          device_offset[e.name] = total;
          total += (e.view.nbytes() + 255) / 256 * 256;
        }
        auto mem = wsync::AllocateCuda(std::max<uint64_t>(total, 256), cuda_device);
        auto h = mem.ok() ? (*mem)->IpcHandle() : absl::StatusOr<std::string>(mem.status());
        if (!h.ok()) {
          rc = Abort(h.status().ToString());
          break;
        }
        device_memory = std::move(*mem);
        handle = *h;
      }
      for (const auto& e : file->tensors()) {
        std::vector<int64_t> shape(e.view.shape().begin(), e.view.shape().end());
        const std::string dtype(wsync::SafetensorsName(e.view.dtype()));
        const int ok = cuda_device >= 0
                           ? wsync_client_add_cuda_tensor(c, e.name.c_str(), dtype.c_str(), shape.data(),
                                                          static_cast<int>(shape.size()), handle.data(), handle.size(),
                                                          cuda_device, device_offset[e.name])
                           : wsync_client_add_tensor(c, e.name.c_str(), dtype.c_str(), shape.data(),
                                                     static_cast<int>(shape.size()));
        if (ok != WSYNC_OK) rc = Abort(wsync_last_error());
      }
      const std::string config = ReadFile(steps[0] + "/config.json"), parallel = ReadFile(steps[0] + "/parallel.json");
      if (rc == 0 && wsync_client_register(c, config.c_str(), parallel.c_str(), timeout_ms) != WSYNC_OK)
        rc = Abort(std::string("register: ") + wsync_last_error());
      if (rc) break;
      std::printf("rank %d: registered %zu tensors with shm:%s\n", rank, file->tensors().size(), name.c_str());
    }
    if (i == 0 && !start_after.empty()) {
      const int64_t deadline = static_cast<int64_t>(timeout_s * 10);
      int64_t waited = 0;
      while (access(start_after.c_str(), F_OK) != 0 && waited++ < deadline) usleep(100000);
      if (access(start_after.c_str(), F_OK) != 0) {
        rc = Abort(start_after + " did not appear within the timeout");
        break;
      }
    }
    // One "optimizer step": the new weights, written in place under the update lock.
    if (wsync_client_begin_update(c, timeout_ms) != WSYNC_OK) {
      rc = Abort(wsync_last_error());
      break;
    }
    for (const auto& e : file->tensors()) {
      if (device_memory) {
        auto at = device_offset.find(e.name);
        const absl::Status s = at == device_offset.end()
                                   ? absl::NotFoundError("not a registered tensor")
                                   : wsync::CopyHostToDevice(static_cast<char*>(device_memory->data()) + at->second,
                                                             e.view.data(), e.view.nbytes(), cuda_device);
        if (!s.ok()) {
          rc = Abort("step " + steps[i] + ": tensor " + e.name + ": " + s.ToString());
          break;
        }
        continue;
      }
      uint64_t nbytes = 0;
      void* dst = wsync_client_tensor(c, e.name.c_str(), &nbytes);
      if (dst == nullptr || nbytes != e.view.nbytes()) {
        rc = Abort("step " + steps[i] + ": tensor " + e.name + " differs from the registered set");
        break;
      }
      std::memcpy(dst, e.view.data(), nbytes);
    }
    wsync_client_end_update(c);
    if (rc) break;
    const uint64_t version = first_version + i;
    wsync_sync_info info{};
    if (wsync_client_request_sync(c, version, /*wait=*/1, timeout_ms, &info) != WSYNC_OK) {
      rc = Abort("version " + std::to_string(version) + ": " + wsync_last_error());
      break;
    }
    std::printf("rank %d: version %llu synced (sync %llu%s)\n", rank, static_cast<unsigned long long>(info.version),
                static_cast<unsigned long long>(info.sync_id),
                info.coalesced ? ", requested by another rank first" : "");
    std::fflush(stdout);
    if (!after.empty()) {
      // Like a training job's barrier: nobody starts the next step before rank 0's check is done.
      int ok = 1;
      if (rank == 0) {
        setenv("WSYNC_VERSION", std::to_string(version).c_str(), 1);
        setenv("WSYNC_FROM", steps[i].c_str(), 1);
        setenv("WSYNC_AFTER_SYNC", after.c_str(), 1);
        ok = std::system("bash -c \"$WSYNC_AFTER_SYNC\"") == 0;
      }
      MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
      if (!ok) rc = Abort("--after-sync failed after version " + std::to_string(version));
    }
  }
  wsync_client_close(c);
  MPI_Finalize();
  return rc;
}
