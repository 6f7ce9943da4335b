// Restarted peers.
//
// A task that dies and is started again (same task, same plan) is a new
// process: its step counters start at 1, its regions are new, and the
// regions it had opened on its peers hold the old process's steps. Each
// engine therefore draws a random incarnation id when it starts and sends it
// in the handshake; the first one seen for a task is remembered, and a later
// connection with another one means the task restarted.
//
// The two sides can continue only from a step they agree on. For a region
// the old process never opened there is nothing to disagree about: the new
// process opens it and starts at step 1, like any first writer. For a region
// it had opened, the survivor is at step N and the newcomer at step 1;
// rather than guess which steps the other side holds (tcp may have lost
// frames in flight, a shm writer may have left a half-written copy), tf_rdma
// refuses that region on both sides with an error that says the peer
// restarted and what to do: restart every task of the job, which then start
// together from step 1 (Keras BackupAndRestore, or the user's checkpoints,
// resume the training). Ops waiting on such a region fail at once, not at
// their timeout; the new process's ops get the same message from the OPEN
// that the survivor refuses. A connection that drops while both processes
// live (same incarnations) is dialled again and continues.

#include "kernels/engine/engine.h"

#include <memory>
#include <string>
#include <vector>

#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

std::string Engine::RestartMessage(const std::string& peer, bool peer_writes) {
  return peer + " restarted (a new process connected in its place) after " +
         (peer_writes ? "it had started writing to " + config_.task
                      : config_.task + " had started writing to it") +
         "; tf_rdma does not resume transfers half-way through a job: "
         "restart every task of the job so that all start again from step 1 "
         "(Keras BackupAndRestore or your checkpoints resume the training)";
}

void Engine::NotePeerIncarnation(const std::shared_ptr<Connection>& conn) {
  std::vector<std::shared_ptr<Connection>> stale;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::string& known = peer_incarnation_[conn->peer];
    if (known.empty() || known == conn->incarnation) {
      known = conn->incarnation;
      return;
    }
    known = conn->incarnation;
    Log(conn->peer + " restarted: it connected as a new process");
    for (auto& region : regions_) {
      LocalRegion& r = *region;
      if (r.peer != conn->peer || r.name.find("#credit") != std::string::npos) {
        continue;
      }
      if (r.opened && r.refusal.empty()) r.refusal = RestartMessage(r.peer, true);
      r.writer.reset();
    }
    for (auto& kv : send_regions_) {
      SendRegion& r = *kv.second;
      if (r.peer != conn->peer) continue;
      std::lock_guard<std::mutex> rl(r.state_mu);
      if (r.open && r.refusal.empty()) {
        r.refusal = RestartMessage(r.peer, false);
      }
    }
    for (const auto& c : connections_) {
      if (c->peer == conn->peer && c->incarnation != conn->incarnation) {
        stale.push_back(c);
      }
    }
  }
  for (const auto& c : stale) {
    CloseConnection(c, Unavailable(conn->peer + " restarted"));
  }
  poller_recheck_.store(true);
  RingPoller();
}

}  // namespace tf_rdma
