#include "comm/testing/local_group.h"

#include <thread>

namespace wsync::comm::testing {

GroupOptions LocalMemberOptions(Store& store, const std::string& name, int rank, int size, absl::Duration timeout) {
  GroupOptions o;
  o.store = &store;
  o.name = name;
  o.rank = rank;
  o.size = size;
  o.cuda_device = rank;
  o.join_timeout = timeout;
  o.default_timeout = timeout;
  return o;
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeLocalGroup(Store& store, const std::string& name,
                                                                          int size, absl::Duration timeout,
                                                                          Backend backend) {
  std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> joined;
  for (int r = 0; r < size; ++r) joined.emplace_back(absl::UnknownError("not joined"));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back(
        [&, r] { joined[r] = CreateGroup(backend, LocalMemberOptions(store, name, r, size, timeout)); });
  }
  for (auto& t : threads) t.join();
  std::vector<std::unique_ptr<Communicator>> out;
  for (auto& j : joined) {
    if (!j.ok()) return j.status();
    out.push_back(std::move(*j));
  }
  return out;
}

}  // namespace wsync::comm::testing
