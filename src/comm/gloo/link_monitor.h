// Liveness of a member's ring links, independent of Gloo: Gloo does not wake a receive whose data
// was streaming in when the sending peer died, so each member also keeps one idle TCP connection
// to its successor and one from its predecessor (the links every wsync algorithm uses), and a
// watcher thread reports the moment either one closes or fails.
//
// Formation goes through the rendezvous store ("<prefix><rank>" = "host:port").
// Thread-safety: Start/Close from the owner; the callback runs on the watcher thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/store/store.h"

namespace wsync::comm {

class LinkMonitor {
 public:
  // Connects the two links (kDeadlineExceeded / kUnavailable after `timeout`). A group of one has
  // no links and never reports.
  static absl::StatusOr<std::unique_ptr<LinkMonitor>> Create(Store& store, const std::string& prefix, int rank,
                                                             int size, const std::string& host, absl::Duration timeout);
  ~LinkMonitor();

  enum class Link { kPrev, kNext };
  // Starts watching; `on_lost` is called at most once per link, with a message naming the peer.
  void Start(std::function<void(Link, const std::string&)> on_lost);
  // Stops watching and closes both links, so the peers' monitors fire at once. Idempotent.
  void Close();

 private:
  LinkMonitor(int prev_rank, int prev_fd, int next_rank, int next_fd);
  void Watch();

  int prev_rank_, prev_fd_, next_rank_, next_fd_;
  int wake_[2] = {-1, -1};  // a pipe that stops the watcher
  std::function<void(Link, const std::string&)> on_lost_;
  std::thread watcher_;
};

}  // namespace wsync::comm
