#include "trainer_agent/gather/testing/local_trainer_comms.h"

#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/testing/local_group.h"
#include "common/status.h"

namespace wsync::trainer_agent::testing {

void LocalTrainerComms::Abort(absl::string_view reason) {
  for (auto& c : world) c->Abort(reason);
  for (TrainerComms& r : ranks)
    for (auto* c : {r.tp.get(), r.etp.get(), r.ep.get()})
      if (c != nullptr) c->Abort(reason);
}

absl::StatusOr<LocalTrainerComms> MakeLocalTrainerComms(comm::Store& store, const std::string& name,
                                                        const ParallelLayout& layout, absl::Duration timeout) {
  const int n = layout.world_size();
  LocalTrainerComms out;
  ASSIGN_OR_RETURN(out.world, comm::testing::MakeLocalGroup(store, absl::StrCat(name, "/world"), n, timeout));
  // Every rank splits the world as the agent does (MakeTrainerComms: Gloo's Split), each on its thread.
  out.ranks.resize(static_cast<size_t>(n));
  std::vector<absl::Status> status(static_cast<size_t>(n));
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        const auto i = static_cast<size_t>(r);
        auto comms = MakeTrainerComms(*out.world[i], layout, {.timeout = timeout});
        if (comms.ok()) {
          out.ranks[i] = std::move(*comms);
        } else {
          status[i] = comms.status();
          out.world[i]->Abort(comms.status().message());  // the others' Splits fail at once, not at their timeout
        }
      });
  }
  for (const absl::Status& s : status) RETURN_IF_ERROR(s);
  return out;
}

}  // namespace wsync::trainer_agent::testing
