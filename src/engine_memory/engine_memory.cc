#include "engine_memory/engine_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/bucket/stream.h"
#include "common/status.h"

namespace wsync::engine_memory {

EngineMemory::~EngineMemory() {
  for (const Mapping& m : mappings_)
    if (m.addr != nullptr && m.size > 0) munmap(m.addr, m.size);
}

std::vector<std::string> EngineMemory::segments() const {
  std::vector<std::string> out;
  for (const Mapping& m : mappings_) out.push_back(m.name);
  return out;
}

namespace {

absl::Status CheckSegmentName(const std::string& name) {
  // POSIX: "/name", no further slashes; Linux limits the name to NAME_MAX.
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 255 ||
      name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory segment name \"", name, "\" is not of the form \"/name\""));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<EngineMemory>> MapEngineMemory(
    const google::protobuf::RepeatedPtrField<v1::EngineParam>& params) {
  std::unique_ptr<EngineMemory> mem(new EngineMemory());
  absl::flat_hash_map<std::string, size_t> by_name;    // segment -> index in mappings_
  absl::flat_hash_map<std::string, size_t> by_handle;  // device/handle -> index in handles_
  for (const v1::EngineParam& p : params) {
    const std::string what = absl::StrCat("engine param \"", p.name(), "\"");
    if (p.name().empty()) return absl::InvalidArgumentError("an engine param has no name");
    auto dtype = comm::FromProto(p.dtype());
    if (!dtype.ok()) return Annotate(dtype.status(), what);
    Shape shape(p.shape().begin(), p.shape().end());
    auto want = NumBytes(*dtype, shape);
    if (!want.ok()) return Annotate(want.status(), what);
    if (p.nbytes() != static_cast<uint64_t>(*want)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": nbytes ", p.nbytes(), " but ", SafetensorsName(*dtype),
                                                     ShapeToString(shape), " needs ", *want));
    }
    if (!p.memory().cuda_ipc_handle().empty()) {
      // Device memory: one mapping per distinct allocation; the buffer is the device memory itself.
      const std::string key = absl::StrCat(p.memory().cuda_device(), "/", p.memory().cuda_ipc_handle());
      auto h = by_handle.find(key);
      if (h == by_handle.end()) {
        auto mapping = OpenCudaIpc(p.memory().cuda_ipc_handle(), p.memory().cuda_device());
        if (!mapping.ok()) return Annotate(mapping.status(), what);
        h = by_handle.emplace(key, mem->handles_.size()).first;
        mem->handles_.push_back(std::move(*mapping));
      }
      const CudaIpcMapping& m = *mem->handles_[h->second];
      const uint64_t off = p.memory().offset();
      if (off > m.size() || p.nbytes() > m.size() - off) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", off, ", ", off + p.nbytes(),
                                                       ") lie outside the ", m.size(),
                                                       "-byte CUDA allocation of its IPC handle"));
      }
      engine_model::EngineBuffer b;
      b.name = p.name();
      b.dtype = *dtype;
      b.shape = std::move(shape);
      b.data = static_cast<std::byte*>(m.data()) + off;
      b.nbytes = p.nbytes();
      b.cuda_device = m.device();
      RETURN_IF_ERROR(mem->weights_.Add(std::move(b)));
      mem->param_bytes_ += p.nbytes();
      continue;
    }
    const std::string& seg = p.memory().shm_name();
    if (seg.empty())
      return absl::InvalidArgumentError(absl::StrCat(what, ": no shared-memory segment or CUDA IPC handle"));
    RETURN_IF_ERROR(Annotate(CheckSegmentName(seg), what));
    auto it = by_name.find(seg);
    if (it == by_name.end()) {
      const int fd = shm_open(seg.c_str(), O_RDWR, 0);
      if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("opening shared-memory segment ", seg, " of ", what));
      struct stat st;
      if (fstat(fd, &st) != 0) {
        const int err = errno;
        close(fd);
        return ErrnoToStatus(err, absl::StrCat("stat of shared-memory segment ", seg));
      }
      absl::Status refuse;
      if (!S_ISREG(st.st_mode)) {
        refuse = absl::InvalidArgumentError(absl::StrCat("shared-memory segment ", seg, " is not a regular segment"));
      } else if ((st.st_mode & 07777) != 0600) {
        refuse = absl::PermissionDeniedError(absl::StrFormat(
            "shared-memory segment %s has mode %04o; engines must create their weight segments with mode 0600", seg,
            st.st_mode & 07777));
      } else if (st.st_uid != geteuid()) {
        refuse = absl::PermissionDeniedError(absl::StrCat("shared-memory segment ", seg, " is owned by uid ", st.st_uid,
                                                          ", not by this agent's uid ", geteuid()));
      } else if (st.st_size <= 0) {
        refuse = absl::InvalidArgumentError(absl::StrCat("shared-memory segment ", seg, " is empty"));
      }
      if (!refuse.ok()) {
        close(fd);
        return refuse;
      }
      const size_t size = static_cast<size_t>(st.st_size);
      void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      const int err = errno;
      close(fd);
      if (addr == MAP_FAILED) return ErrnoToStatus(err, absl::StrCat("mapping shared-memory segment ", seg));
      it = by_name.emplace(seg, mem->mappings_.size()).first;
      mem->mappings_.push_back({seg, addr, size});
    }
    const EngineMemory::Mapping& m = mem->mappings_[it->second];
    const uint64_t off = p.memory().offset();
    if (off > m.size || p.nbytes() > m.size - off) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", off, ", ", off + p.nbytes(),
                                                     ") lie outside the ", m.size, "-byte segment ", seg));
    }
    engine_model::EngineBuffer b;
    b.name = p.name();
    b.dtype = *dtype;
    b.shape = std::move(shape);
    b.data = static_cast<std::byte*>(m.addr) + off;
    b.nbytes = p.nbytes();
    RETURN_IF_ERROR(mem->weights_.Add(std::move(b)));
    mem->param_bytes_ += p.nbytes();
  }
  return mem;
}

}  // namespace wsync::engine_memory
