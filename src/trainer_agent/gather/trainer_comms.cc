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

namespace {

// Every rank's `mine` (one int32 each, world rank order).
absl::StatusOr<std::vector<int32_t>> GatherInts(comm::Communicator& world, int32_t mine,
                                                const comm::CollectiveOptions& options, absl::string_view what) {
  std::vector<int32_t> all(static_cast<size_t>(world.size()));
  comm::ConstBytes in{&mine, sizeof(mine)};
  comm::MutableBytes out{all.data(), all.size() * sizeof(int32_t)};
  RETURN_IF_ERROR(Annotate(comm::Await(world.AllGather({&in, 1}, {&out, 1}, options)), what));
  return all;
}

}  // namespace

absl::Status EnsureDeviceComms(TrainerComms& c, const std::vector<int>& devices, bool dense, bool experts,
                               const comm::CollectiveOptions& options) {
  if (c.world == nullptr || c.tp == nullptr || c.etp == nullptr || c.ep == nullptr)
    return absl::InvalidArgumentError("EnsureDeviceComms: TrainerComms without its world / tp / etp / ep");
  if (devices.size() != static_cast<size_t>(c.world->size()))
    return absl::InvalidArgumentError(
        absl::StrCat("EnsureDeviceComms: ", devices.size(), " devices for a world of ", c.world->size()));
  for (size_t r = 0; r < devices.size(); ++r)
    if (devices[r] < 0)
      return absl::InvalidArgumentError(absl::StrCat("EnsureDeviceComms: rank ", r, "'s tensors are in host memory"));
  const int me = c.world->rank();
  // Form anew when any rank's groups are missing, stale or for other devices (every rank decides
  // the same from the vote).
  const bool fresh = !c.device.stale && c.device.devices == devices;
  ASSIGN_OR_RETURN(const std::vector<int32_t> stale,
                   GatherInts(*c.world, fresh ? 0 : 1, options, "agreeing on the device gathers' groups"));
  if (std::all_of(stale.begin(), stale.end(), [](int32_t v) { return v == 0; })) return absl::OkStatus();
  c.device = TrainerComms::Device();  // the old groups end before new ones form on the same GPUs
  TrainerComms::Device d;
  absl::Status status;  // the first failure on this rank; later groups still take part in the exchanges
  auto form = [&](comm::Communicator& parent, bool wanted, std::unique_ptr<comm::Communicator>& out,
                  absl::string_view kind) {
    if (!wanted || parent.size() == 1) return;
    comm::GroupOptions o;
    o.name = absl::StrCat(kind, "@cuda/", parent.group());
    o.cuda_device = devices[static_cast<size_t>(me)];
    o.join_timeout = options.timeout > absl::ZeroDuration() ? options.timeout : absl::Minutes(5);
    o.default_timeout = o.join_timeout;
    auto g = comm::CreateGroupOver(comm::Backend::kNccl, parent, o, options, status);
    if (g.ok())
      out = std::move(*g);
    else if (status.ok())
      status = Annotate(g.status(), absl::StrCat("rank ", me, ": the device ", kind, " group"));
  };
  // Every member of a TP group gathers dense parameters or none does (same dp, cp); likewise the
  // ETP and EP groups for experts (same edp): each group is formed by all its members or by none.
  form(*c.tp, dense, d.tp, "tp");
  form(*c.etp, experts, d.etp, "etp");
  form(*c.ep, experts, d.ep, "ep");
  ASSIGN_OR_RETURN(const std::vector<int32_t> failed,
                   GatherInts(*c.world, status.ok() ? 0 : static_cast<int32_t>(status.code()), options,
                              "agreeing that the device gathers' groups formed"));
  if (!status.ok()) return status;
  for (size_t r = 0; r < failed.size(); ++r)
    if (failed[r] != 0)
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", r, " could not form its device gather groups (",
                       absl::StatusCodeToString(static_cast<absl::StatusCode>(failed[r])), "; its log says why)"));
  d.devices = devices;
  c.device = std::move(d);
  return absl::OkStatus();
}

}  // namespace wsync::trainer_agent
