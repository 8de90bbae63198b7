#include "comm/testing/local_group.h"

#include <thread>

namespace wsync::comm::testing {

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeLocalGroup(Store& store, const std::string& name,
                                                                          int size, absl::Duration timeout) {
  std::vector<absl::StatusOr<std::unique_ptr<Communicator>>> joined;
  for (int r = 0; r < size; ++r) joined.emplace_back(absl::UnknownError("not joined"));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      GroupOptions o;
      o.store = &store;
      o.name = name;
      o.rank = r;
      o.size = size;
      o.join_timeout = timeout;
      o.default_timeout = timeout;
      joined[r] = CreateGroup(Backend::kGloo, o);
    });
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
