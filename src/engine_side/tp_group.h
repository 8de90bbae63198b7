// The engine's TP group over its whole life: formed at start, and formed again every time it
// breaks (a rank was killed, hung past the idle timeout, or restarted), so that restarting the one
// rank that died brings the engine back without restarting the others.
//
// Epochs. Every formation is a fresh Gloo group named `wsync-engine/<engine>/tp/<token>` in the
// engine's rendezvous store (served by rank 0, `--tp-store`). Rank 0 chooses the token
// ("<random instance id>-<n>", new for every formation and for every rank-0 process) and publishes
// it as `wsync-engine/<engine>/tp/epoch`; once a formation completes it sets `<group>/formed`.
// Every rank also publishes its RolloutEngine address as `<group>/address/<rank>` (rank 0's is the
// redirection target of the others' Generate).
//   rank 0    publish a new token, form (join timeout), attach, wait until the group breaks,
//             detach (which aborts the communicator: the other ranks notice at once), repeat.
//             A formation that times out (a rank is still down) is retried with a new token.
//   rank r>0  wait for a token it has not formed yet and that is not already formed without it
//             (a restarted rank must not join the epoch its previous life was part of), form,
//             attach, wait until the group breaks, detach, repeat. A store that is unreachable (rank
//             0 restarting) is retried every 200 ms; a restarted rank 0 serves a fresh store on the
//             same --tp-store address, with a new instance id.
// While no group is attached the rank is UNHEALTHY ("re-forming") and refuses requests; it keeps
// its weights. Ends when `cancelled()` returns true or the core shuts down.
//
// Thread-safety: RunTpGroup runs on its own thread; it is the only caller of the core's
// AttachGroup / DetachGroup / GroupFailed. Stop it (cancelled) and join it before EngineCore::Shutdown.
#pragma once

#include <functional>
#include <string>

#include "absl/time/time.h"
#include "comm/store/store.h"
#include "engine_side/core.h"

namespace wsync::engine_side {

struct TpGroupOptions {
  std::string engine_id;
  int tp_rank = 0, tp_size = 1;
  std::string host = "127.0.0.1";  // where this rank's Gloo endpoints listen
  std::string address;             // this rank's RolloutEngine address
  absl::Duration join_timeout = absl::Minutes(5);
  absl::Duration default_timeout = absl::Seconds(60);
};

// Runs the loop above until `cancelled()` (polled) or the core stops. `store`: rank 0's own
// MemoryStore on rank 0, a client of it elsewhere (not owned).
void RunTpGroup(EngineCore* core, comm::Store* store, const TpGroupOptions& options,
                const std::function<bool()>& cancelled);

}  // namespace wsync::engine_side
