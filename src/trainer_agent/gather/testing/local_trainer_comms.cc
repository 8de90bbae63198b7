#include "trainer_agent/gather/testing/local_trainer_comms.h"

#include <set>
#include <utility>

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
  out.ranks.resize(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) out.ranks[static_cast<size_t>(r)].world = out.world[static_cast<size_t>(r)].get();
  struct Kind {
    absl::string_view name;
    std::vector<int> (ParallelLayout::*group)(int) const;
    std::unique_ptr<comm::Communicator> TrainerComms::*member;
  };
  const Kind kinds[] = {{"tp", &ParallelLayout::TpGroup, &TrainerComms::tp},
                        {"etp", &ParallelLayout::EtpGroup, &TrainerComms::etp},
                        {"ep", &ParallelLayout::EpGroup, &TrainerComms::ep}};
  for (const Kind& kind : kinds) {
    std::set<std::vector<int>> groups;
    for (int r = 0; r < n; ++r) groups.insert((layout.*kind.group)(r));
    for (const std::vector<int>& members : groups) {
      ASSIGN_OR_RETURN(std::vector<std::unique_ptr<comm::Communicator>> group,
                       comm::testing::MakeLocalGroup(store, absl::StrCat(name, "/", kind.name, "@", members.front()),
                                                     static_cast<int>(members.size()), timeout));
      for (size_t i = 0; i < members.size(); ++i)
        out.ranks[static_cast<size_t>(members[i])].*kind.member = std::move(group[i]);
    }
  }
  return out;
}

}  // namespace wsync::trainer_agent::testing
