#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace wsync {
namespace {

using Json = nlohmann::json;

absl::Status Bad(absl::string_view file, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors file ", file, ": ", what));
}
absl::Status BadTensor(absl::string_view file, absl::string_view tensor, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors file ", file, ", tensor \"", tensor, "\": ", what));
}

uint64_t ReadLE64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// A JSON integer as a non-negative value <= max, or an error naming `field`.
absl::StatusOr<uint64_t> NonNegativeInt(const Json& j, uint64_t max) {
  if (j.is_number_unsigned()) {
    const uint64_t v = j.get<uint64_t>();
    if (v > max) return absl::InvalidArgumentError(absl::StrCat("value ", v, " is too large"));
    return v;
  }
  if (j.is_number_integer())
    return absl::InvalidArgumentError(absl::StrCat("value ", j.get<int64_t>(), " is negative"));
  return absl::InvalidArgumentError(absl::StrCat("expected an integer, got ", j.dump()));
}

// Parses JSON, rejecting duplicate keys at any depth (nlohmann would silently keep the last).
absl::StatusOr<Json> ParseJsonNoDuplicates(absl::string_view text, absl::string_view file) {
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  Json::parser_callback_t cb = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start: keys.emplace_back(); break;
      case Json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second && duplicate.empty())
          duplicate = parsed.get<std::string>();
        break;
      default: break;
    }
    return true;
  };
  Json j = Json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad(file, "header is not well-formed JSON");
  if (!duplicate.empty()) return Bad(file, absl::StrCat("duplicate key \"", duplicate, "\" in header"));
  return j;
}

}  // namespace

absl::StatusOr<SafetensorsLayout> ParseSafetensors(std::span<const std::byte> file, absl::string_view file_name) {
  if (file.size() < 8)
    return Bad(file_name, absl::StrCat("file is ", file.size(), " bytes, shorter than the 8-byte header length"));
  const uint64_t n = ReadLE64(file.data());
  if (n > file.size() - 8)
    return Bad(file_name,
               absl::StrCat("header length ", n, " runs past the end of the file (", file.size(), " bytes)"));
  if (n > kSafetensorsMaxHeaderBytes)
    return Bad(file_name, absl::StrCat("header length ", n, " exceeds the limit of ", kSafetensorsMaxHeaderBytes));
  if (n < 2) return Bad(file_name, absl::StrCat("header length ", n, " is too short for a JSON object"));
  absl::string_view text(reinterpret_cast<const char*>(file.data() + 8), n);
  if (text.front() != '{') return Bad(file_name, "header does not start with '{'");

  ASSIGN_OR_RETURN(Json header, ParseJsonNoDuplicates(text, file_name));
  if (!header.is_object()) return Bad(file_name, "header is not a JSON object");

  SafetensorsLayout layout;
  layout.header_bytes = n;
  layout.data_offset = 8 + n;
  const uint64_t data_size = file.size() - layout.data_offset;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Bad(file_name, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          return Bad(file_name, absl::StrCat("__metadata__ value of \"", m.key(), "\" is not a string"));
        layout.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (name.empty()) return Bad(file_name, "a tensor has an empty name");
    if (!v.is_object()) return BadTensor(file_name, name, "entry is not an object");
    for (auto f = v.begin(); f != v.end(); ++f)
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets")
        return BadTensor(file_name, name, absl::StrCat("unexpected field \"", f.key(), "\""));
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || sh == v.end() || off == v.end())
      return BadTensor(file_name, name, "entry needs \"dtype\", \"shape\" and \"data_offsets\"");
    if (!dt->is_string()) return BadTensor(file_name, name, "dtype is not a string");
    auto dtype = ParseSafetensorsDType(dt->get<std::string>());
    if (!dtype.ok()) return BadTensor(file_name, name, dtype.status().message());

    SafetensorsRecord rec;
    rec.name = name;
    rec.dtype = *dtype;
    if (!sh->is_array()) return BadTensor(file_name, name, "shape is not an array");
    for (const Json& d : *sh) {
      auto dim = NonNegativeInt(d, static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
      if (!dim.ok())
        return BadTensor(file_name, name, absl::StrCat("bad shape ", sh->dump(), ": ", dim.status().message()));
      rec.shape.push_back(static_cast<int64_t>(*dim));
    }
    if (!off->is_array() || off->size() != 2)
      return BadTensor(file_name, name, absl::StrCat("data_offsets must be [begin, end], got ", off->dump()));
    auto begin = NonNegativeInt((*off)[0], std::numeric_limits<uint64_t>::max());
    auto end = NonNegativeInt((*off)[1], std::numeric_limits<uint64_t>::max());
    if (!begin.ok() || !end.ok()) return BadTensor(file_name, name, absl::StrCat("bad data_offsets ", off->dump()));
    rec.begin = *begin;
    rec.end = *end;
    if (rec.begin > rec.end)
      return BadTensor(file_name, name,
                       absl::StrCat("data_offsets [", rec.begin, ", ", rec.end, "] end before they begin"));
    if (rec.end > data_size)
      return BadTensor(file_name, name,
                       absl::StrCat("data_offsets [", rec.begin, ", ", rec.end, "] run past the data section (",
                                    data_size, " bytes)"));
    auto nbytes = NumBytes(rec.dtype, rec.shape);
    if (!nbytes.ok()) return BadTensor(file_name, name, nbytes.status().message());
    if (static_cast<uint64_t>(*nbytes) != rec.end - rec.begin)
      return BadTensor(
          file_name, name,
          absl::StrCat(SafetensorsName(rec.dtype), ShapeToString(rec.shape), " needs ", *nbytes,
                       " bytes but data_offsets [", rec.begin, ", ", rec.end, "] hold ", rec.end - rec.begin));
    layout.records.push_back(std::move(rec));
  }
  std::sort(layout.records.begin(), layout.records.end(), [](const SafetensorsRecord& a, const SafetensorsRecord& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.name < b.name;
  });
  // Non-overlap: among non-empty tensors sorted by begin, each must start at or after the
  // furthest end seen so far.
  const SafetensorsRecord* furthest = nullptr;
  for (const auto& r : layout.records) {
    if (r.begin == r.end) continue;
    if (furthest != nullptr && r.begin < furthest->end)
      return BadTensor(file_name, r.name,
                       absl::StrCat("data_offsets [", r.begin, ", ", r.end, "] overlap tensor \"", furthest->name,
                                    "\" [", furthest->begin, ", ", furthest->end, "]"));
    if (furthest == nullptr || r.end > furthest->end) furthest = &r;
  }
  return layout;
}

// ----------------------------------------------------------------------------------------------

struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (addr != nullptr && addr != MAP_FAILED) munmap(addr, size);
  }
};

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("cannot open safetensors file ", path));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoToStatus(err, absl::StrCat("cannot stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Bad(path, "not a regular file");
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<size_t>(st.st_size);
  if (mapping->size > 0) {
    mapping->addr = mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping->addr == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      mapping->addr = nullptr;
      return ErrnoToStatus(err, absl::StrCat("cannot mmap ", path));
    }
  }
  ::close(fd);
  std::span<const std::byte> bytes(static_cast<const std::byte*>(mapping->addr), mapping->size);
  ASSIGN_OR_RETURN(SafetensorsLayout layout, ParseSafetensors(bytes, path));

  SafetensorsFile f;
  f.path_ = path;
  f.metadata_ = std::move(layout.metadata);
  f.tensors_.reserve(layout.records.size());
  for (auto& r : layout.records) {
    const size_t nbytes = static_cast<size_t>(r.end - r.begin);
    std::span<const std::byte> data =
        nbytes == 0 ? std::span<const std::byte>() : bytes.subspan(layout.data_offset + r.begin, nbytes);
    f.index_.emplace(r.name, f.tensors_.size());
    f.tensors_.push_back({std::move(r.name), TensorView(r.dtype, std::move(r.shape), data)});
  }
  f.mapping_ = std::move(mapping);
  return f;
}

const SafetensorsEntry* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

size_t SafetensorsFile::file_size() const { return mapping_ ? mapping_->size : 0; }

// ----------------------------------------------------------------------------------------------

absl::Status SafetensorsWriter::Add(std::string name, TensorView view) {
  if (name.empty()) return absl::InvalidArgumentError("safetensors writer: empty tensor name");
  if (name == "__metadata__") return absl::InvalidArgumentError("safetensors writer: \"__metadata__\" is reserved");
  if (names_.count(name) != 0)
    return absl::InvalidArgumentError(absl::StrCat("safetensors writer: duplicate tensor \"", name, "\""));
  auto expected = NumBytes(view.dtype(), view.shape());
  if (!expected.ok() || static_cast<uint64_t>(*expected) != view.nbytes())
    return absl::InvalidArgumentError(absl::StrCat("safetensors writer: tensor \"", name, "\" ", view.DebugString(),
                                                   " has ", view.nbytes(), " bytes"));
  names_.insert(name);
  entries_.push_back({std::move(name), std::move(view)});
  return absl::OkStatus();
}

void SafetensorsWriter::SetMetadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

namespace {

absl::Status WriteAll(int fd, const void* data, size_t n, absl::string_view path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SafetensorsWriter::Write(const std::string& path) const {
  // Largest item size first keeps every tensor aligned to its element size; ties keep Add order.
  std::vector<const SafetensorsEntry*> order;
  for (const auto& e : entries_) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return ItemSize(a->view.dtype()) > ItemSize(b->view.dtype());
  });
  Json header = Json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  uint64_t offset = 0;
  for (const auto* e : order) {
    Json shape = Json::array();
    for (int64_t d : e->view.shape()) shape.push_back(d);
    header[e->name] = {{"dtype", std::string(SafetensorsName(e->view.dtype()))},
                       {"shape", shape},
                       {"data_offsets", {offset, offset + e->view.nbytes()}}};
    offset += e->view.nbytes();
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {  // a name that is not valid UTF-8
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors writer: cannot encode header for ", path, ": ", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));

  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  // O_EXCL on a unique name; mode 0666 filtered by the umask, as for any new file.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(dir, "/.", base, ".tmp.", getpid(), ".", counter.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("cannot create a temporary file beside ", path));
  auto fail = [&](absl::Status s) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  };
  if (auto s = WriteAll(fd, len, 8, path); !s.ok()) return fail(s);
  if (auto s = WriteAll(fd, text.data(), text.size(), path); !s.ok()) return fail(s);
  for (const auto* e : order)
    if (auto s = WriteAll(fd, e->view.data(), e->view.nbytes(), path); !s.ok()) return fail(s);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoToStatus(err, absl::StrCat("cannot close ", tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoToStatus(err, absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace wsync
