#include "tests/integration/comm_scenarios.h"

#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/testing/pattern.h"
#include "common/status.h"

namespace wsync::comm::testing {

absl::Status Expect(bool cond, const std::string& what) {
  return cond ? absl::OkStatus() : absl::InternalError(absl::StrCat("expectation failed: ", what));
}

absl::Status CheckBytes(const void* p, size_t n, uint64_t seed, const std::string& what) {
  size_t first = 0;
  const size_t wrong = CountWrong(p, n, seed, &first);
  if (wrong == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", wrong, " wrong bytes of ", n, ", first at ", first));
}

absl::Status Collectives(comm::Communicator& comm) {
  const int n = comm.size(), me = comm.rank();
  const std::vector<size_t> sizes = {0, 1, 7, 4099, (size_t{1} << 20) + 3, (size_t{9} << 20) + 5};
  for (size_t si = 0; si < sizes.size(); ++si) {
    const size_t sz = sizes[si];
    const int root = static_cast<int>(si) % n;
    // Broadcast, three buffers of different sizes in one call.
    std::vector<std::vector<char>> bufs = {std::vector<char>(sz), std::vector<char>(sz / 2 + 1), std::vector<char>(0)};
    std::vector<comm::MutableBytes> mb;
    for (size_t b = 0; b < bufs.size(); ++b) {
      if (me == root) FillPattern(bufs[b].data(), bufs[b].size(), 1000 * si + b);
      mb.push_back({bufs[b].data(), bufs[b].size()});
    }
    RETURN_IF_ERROR(comm::Await(comm.Broadcast(mb, root)));
    for (size_t b = 0; b < bufs.size(); ++b) {
      RETURN_IF_ERROR(CheckBytes(bufs[b].data(), bufs[b].size(), 1000 * si + b, absl::StrCat("broadcast size ", sz)));
    }
    // AllGather, two buffers; the second in place.
    std::vector<char> in(sz), out(sz * n), out2((sz + 5) * n);
    FillPattern(in.data(), sz, 7000 + 100 * si + me);
    FillPattern(out2.data() + (sz + 5) * me, sz + 5, 8000 + 100 * si + me);
    std::vector<comm::ConstBytes> ins = {{in.data(), sz}, {out2.data() + (sz + 5) * me, sz + 5}};
    std::vector<comm::MutableBytes> outs = {{out.data(), out.size()}, {out2.data(), out2.size()}};
    RETURN_IF_ERROR(comm::Await(comm.AllGather(ins, outs)));
    for (int r = 0; r < n; ++r) {
      RETURN_IF_ERROR(CheckBytes(out.data() + sz * r, sz, 7000 + 100 * si + r, absl::StrCat("allgather size ", sz)));
      RETURN_IF_ERROR(CheckBytes(out2.data() + (sz + 5) * r, sz + 5, 8000 + 100 * si + r, "allgather in place"));
    }
    // AllGatherV: rank r contributes (sz * (r + 1)) % 5003 bytes, rank 1 none.
    std::vector<size_t> per(n);
    for (int r = 0; r < n; ++r) per[r] = r == 1 ? 0 : (sz * (r + 1)) % 5003 + (sz > 1000 ? sz : 0);
    std::vector<char> vin(per[me]), vout(std::accumulate(per.begin(), per.end(), size_t{0}));
    FillPattern(vin.data(), vin.size(), 9000 + 100 * si + me);
    RETURN_IF_ERROR(comm::Await(comm.AllGatherV({vin.data(), vin.size()}, {vout.data(), vout.size()}, per)));
    size_t off = 0;
    for (int r = 0; r < n; ++r) {
      RETURN_IF_ERROR(CheckBytes(vout.data() + off, per[r], 9000 + 100 * si + r, "allgatherv"));
      off += per[r];
    }
  }
  // AllReduceSum: exact small integers, so the expected sum is exact.
  std::vector<float> v(1001);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((me + 1) * (i % 17));
  RETURN_IF_ERROR(comm::Await(comm.AllReduceSum(absl::MakeSpan(v))));
  for (size_t i = 0; i < v.size(); ++i) {
    RETURN_IF_ERROR(Expect(v[i] == static_cast<float>(n * (n + 1) / 2 * (i % 17)), "allreduce sum"));
  }
  RETURN_IF_ERROR(comm::Await(comm.Barrier()));
  // Arguments are checked before anything is sent, and the group stays usable.
  std::vector<char> small(4), wrong(3);
  comm::ConstBytes bi{small.data(), 4};
  comm::MutableBytes bo{wrong.data(), 3};
  auto bad = comm.AllGather({&bi, 1}, {&bo, 1});
  RETURN_IF_ERROR(Expect(absl::IsInvalidArgument(bad.status()), "a mis-sized output is refused"));
  comm::MutableBytes bb{small.data(), 4};
  RETURN_IF_ERROR(Expect(absl::IsInvalidArgument(comm.Broadcast({&bb, 1}, n).status()), "a bad root is refused"));
  return comm::Await(comm.Barrier());
}

absl::Status BigTransfers(comm::Communicator& comm) {
  const int me = comm.rank(), n = comm.size();
  {
    const size_t sz = (size_t{2} << 30) + 4097;
    std::vector<char> buf(sz);
    if (me == 0) FillPattern(buf.data(), sz, 42);
    comm::MutableBytes b{buf.data(), sz};
    RETURN_IF_ERROR(comm::Await(comm.Broadcast({&b, 1}, 0)));
    RETURN_IF_ERROR(CheckBytes(buf.data(), sz, 42, "2 GiB + 4097 B broadcast"));
  }
  {
    const size_t per = (size_t{1} << 30) + 3;
    std::vector<size_t> sizes(n, per);
    std::vector<char> in(per), out(per * n);
    FillPattern(in.data(), per, 50 + me);
    RETURN_IF_ERROR(comm::Await(comm.AllGatherV({in.data(), per}, {out.data(), out.size()}, sizes)));
    for (int r = 0; r < n; ++r) RETURN_IF_ERROR(CheckBytes(out.data() + per * r, per, 50 + r, "1 GiB allgatherv"));
  }
  return absl::OkStatus();
}

}  // namespace wsync::comm::testing
