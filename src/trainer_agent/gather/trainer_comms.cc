#include "trainer_agent/gather/trainer_comms.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace wsync::trainer_agent {
namespace {

absl::StatusOr<std::unique_ptr<comm::Communicator>> SplitGroup(comm::Communicator& world,
                                                               const std::vector<int>& members, absl::string_view kind,
                                                               const comm::CollectiveOptions& options) {
  const int me = world.rank();
  const auto it = std::find(members.begin(), members.end(), me);
  if (it == members.end())
    return absl::InternalError(
        absl::StrCat("rank ", me, " is not in its own ", kind, " group [", absl::StrJoin(members, ", "), "]"));
  const int position = static_cast<int>(it - members.begin());
  const std::string name = absl::StrCat(kind, "@", members.front());
  ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> comm, world.Split(members.front(), position, name));
  // The members, as the sub-communicator orders them, must be the layout's group in its order.
  std::vector<int> got(static_cast<size_t>(comm->size()), -1);
  if (comm->size() == static_cast<int>(members.size())) {
    comm::ConstBytes in{&me, sizeof(int)};
    comm::MutableBytes out{got.data(), got.size() * sizeof(int)};
    RETURN_IF_ERROR(comm::Await(comm->AllGather({&in, 1}, {&out, 1}, options)));
  }
  if (comm->size() != static_cast<int>(members.size()) || comm->rank() != position || got != members)
    return absl::InternalError(absl::StrCat("rank ", me, ": the ", kind, " communicator (rank ", comm->rank(), " of ",
                                            comm->size(), ", members [", absl::StrJoin(got, ", "),
                                            "]) does not match the layout's group [", absl::StrJoin(members, ", "),
                                            "] (position ", position, ")"));
  return comm;
}

}  // namespace

absl::StatusOr<TrainerComms> MakeTrainerComms(comm::Communicator& world, const ParallelLayout& layout,
                                              const comm::CollectiveOptions& options) {
  if (world.size() != layout.world_size())
    return absl::InvalidArgumentError(absl::StrCat("the world has ", world.size(), " ranks, the parallel layout ",
                                                   layout.world_size(), " (", layout.DebugString(), ")"));
  TrainerComms c;
  c.world = &world;
  const int me = world.rank();
  ASSIGN_OR_RETURN(c.tp, SplitGroup(world, layout.TpGroup(me), "tp", options));
  ASSIGN_OR_RETURN(c.etp, SplitGroup(world, layout.EtpGroup(me), "etp", options));
  ASSIGN_OR_RETURN(c.ep, SplitGroup(world, layout.EpGroup(me), "ep", options));
  return c;
}

absl::Status EnsureDeviceComms(TrainerComms& c, const std::vector<int>& devices,
                               const comm::CollectiveOptions& options) {
  if (c.world == nullptr || c.tp == nullptr || c.etp == nullptr || c.ep == nullptr)
    return absl::InvalidArgumentError("EnsureDeviceComms: TrainerComms without its world / tp / etp / ep");
  if (devices.size() != static_cast<size_t>(c.world->size()))
    return absl::InvalidArgumentError(
        absl::StrCat("EnsureDeviceComms: ", devices.size(), " devices for a world of ", c.world->size()));
  for (size_t r = 0; r < devices.size(); ++r)
    if (devices[r] < 0)
      return absl::InvalidArgumentError(absl::StrCat("EnsureDeviceComms: rank ", r, "'s tensors are in host memory"));
  if (c.device.devices == devices) return absl::OkStatus();
  c.device = TrainerComms::Device();  // the old groups end before new ones form on the same GPUs
  const int me = c.world->rank();
  TrainerComms::Device d;
  auto form = [&](comm::Communicator& parent, std::unique_ptr<comm::Communicator>& out,
                  absl::string_view kind) -> absl::Status {
    if (parent.size() == 1) return absl::OkStatus();
    comm::GroupOptions o;
    o.name = absl::StrCat(kind, "@cuda/", parent.group());
    o.cuda_device = devices[static_cast<size_t>(me)];
    o.join_timeout = options.timeout > absl::ZeroDuration() ? options.timeout : absl::Minutes(5);
    o.default_timeout = o.join_timeout;
    ASSIGN_OR_RETURN(out, comm::CreateGroupOver(comm::Backend::kNccl, parent, o, options));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(Annotate(form(*c.tp, d.tp, "tp"), absl::StrCat("rank ", me, ": the device TP group")));
  RETURN_IF_ERROR(Annotate(form(*c.etp, d.etp, "etp"), absl::StrCat("rank ", me, ": the device ETP group")));
  RETURN_IF_ERROR(Annotate(form(*c.ep, d.ep, "ep"), absl::StrCat("rank ", me, ": the device EP group")));
  d.devices = devices;
  c.device = std::move(d);
  return absl::OkStatus();
}

}  // namespace wsync::trainer_agent
