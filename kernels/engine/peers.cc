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
//
// Releasing a peer's regions (matched-call regions only).
//
// The rule above is for regions whose slots pair the n-th send with the
// n-th recv (collectives, hand-written plans): there the step numbers *are*
// the agreement between the two sides. The slots of a rewritten function
// match by call instead (match.cc): a recv takes the copy that names its
// own call, whatever its step, so nothing that outlives a call has to agree
// between the two processes. That is what lets a ParameterServerStrategy
// job go on when a worker dies: the coordinator runs the dead worker's
// steps elsewhere and, once the worker is back, gives it steps again, and
// the parameter servers must neither refuse the new process nor keep the
// old one's memory. So for a region whose slots (as this side has claimed
// them) all match calls, a region lives exactly as long as its writer's
// connection:
//
//   - When the connection ends (the peer died, stopped, restarted, or only
//     lost the connection), the reader *releases* the region: it is taken
//     out of the endpoint's tables and info, its /dev/shm name is removed at
//     once, and its memory is unmapped as soon as nothing can touch it:
//     once no received tensor aliases it (SlotBuffer counts them) and the
//     longest timeout of its slots has passed (every wait that began on it
//     is bounded by that, and recvs that wait on it fail at their next
//     check, within kCheckEveryMs). Copies its tensors still hold go back to
//     no one when released.
//   - The writer, for its part, releases its credit region and forgets the
//     copies' state of its slots (SendRegion::epoch).
//   - The next OPEN of that name, by the same process on a new connection or
//     by a restarted one, gets a fresh region: zeroed sequence and call
//     words, recv slots rebound to it (CurrentRegion), their matching state
//     started again (MatchRecv), and the writer's copies all free.
//
// Calls that were in flight on the old connection fail (they did before:
// a lost connection fails the waits on it at once); no call can take a copy
// that another connection wrote. Cost: one region allocation per reopened
// region, the first time each slot is used after the peer came back, and
// nothing on the data path (a recv reads its ticket's region instead of
// the slot's). A region nobody has claimed a slot of on this side is not
// known to match calls and keeps the rule above.

#include "kernels/engine/engine.h"

#include <algorithm>
#include <chrono>
#include <map>
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

// A new incarnation while the old one is still connected. Taking a new
// incarnation for a restart has consequences for good (in-order regions
// refuse the task from then on), and a holder of the secret could claim any
// task's name with an incarnation of its own. A restarted process's
// predecessor is gone: its connections have ended, or, if this side has not
// seen them end yet (a host that crashed sends no FIN), they no longer
// answer. So before it is taken, the old incarnation is asked, over a
// connection that is still open, for its clock (kImpostorProbeMs at most):
// if it answers, the process that claims its name is another one and is
// refused; if not, it is a restart. The cost: one query round trip, only
// when a task connects with a new incarnation while its old one seems
// connected.
Status Engine::CheckNewIncarnation(const std::string& peer,
                                   const std::string& incarnation) {
  constexpr int64_t kImpostorProbeMs = 1000;
  std::shared_ptr<Connection> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto known = peer_incarnation_.find(peer);
    if (known == peer_incarnation_.end() || known->second.empty() ||
        known->second == incarnation) {
      return Status::Ok();
    }
    for (const auto& c : connections_) {
      if (c->peer == peer && c->incarnation == known->second &&
          !c->gone.load()) {
        old = c;
        break;
      }
    }
  }
  if (!old) return Status::Ok();
  std::map<std::string, std::string> reply;
  Status asked = Request(old, kQuery, {{"what", "clock"}},
                         Deadline(kImpostorProbeMs), &reply);
  if (!asked.ok()) return Status::Ok();  // gone: a restart
  return FailedPrecondition(
      "another process of " + peer + " is connected to " + config_.task +
      " and answers; a second process cannot take its place (two tasks "
      "with one name?)");
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
    std::vector<LocalRegion*> release, refused;
    for (auto& region : regions_) {
      LocalRegion& r = *region;
      if (r.peer != conn->peer || r.name.find("#credit") != std::string::npos ||
          r.retired.load(std::memory_order_relaxed)) {
        continue;
      }
      if (MatchedRegion(r.name.substr(0, r.name.find('#')))) {
        if (r.opened) release.push_back(&r);
        continue;
      }
      if (r.opened && r.refusal.empty()) {
        r.refusal = RestartMessage(r.peer, true);
        if (r.name.find('#') == std::string::npos) refused.push_back(&r);
      }
      r.writer.reset();
    }
    for (LocalRegion* r : release) {
      RetireRegionLocked(r, conn->peer + " restarted");
    }
    // A refused region is refused for good: its memory can go now (when
    // nothing touches it any more, as a released one's), only its name and
    // reason are kept. So a writer task that restarts again and again
    // leaves no segments behind. Beyond kMaxRefusedNames (a holder of the
    // secret restarting on purpose) they keep their memory, still bounded
    // by the region limits.
    constexpr size_t kMaxRefusedNames = 4096;
    for (LocalRegion* r : refused) {
      if (refused_names_.size() >= kMaxRefusedNames) break;
      refused_names_[r->name] = r->refusal;
      RetireRegionLocked(r, conn->peer + " restarted; the region is refused "
                            "from now on");
    }
    for (auto& kv : send_regions_) {
      SendRegion& r = *kv.second;
      if (r.peer != conn->peer || MatchedRegion(kv.first)) continue;
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

bool Engine::MatchedRegion(const std::string& name) {
  auto it = region_kind_.find(name);
  return it != region_kind_.end() && it->second == kKindMatched;
}

void Engine::RetireRegionLocked(LocalRegion* region, const std::string& why) {
  if (region->retired.exchange(true)) return;
  // Its payload areas ("<name>#<tensor>#<n>") go with it.
  std::vector<LocalRegion*> parts = {region};
  const std::string prefix = region->name + "#";
  for (auto& r : regions_) {
    if (r->name.compare(0, prefix.size(), prefix) == 0 &&
        r->name.find("#credit") == std::string::npos &&
        !r->retired.exchange(true)) {
      parts.push_back(r.get());
    }
  }
  int64_t longest = config_.timeout_ms;
  for (RecvSlot* slot : recv_slot_list_) {
    if (slot->spec.region == region->name) {
      longest = std::max(longest, TimeoutFor(slot->spec));
    }
  }
  Clock::time_point not_before =
      Clock::now() + std::chrono::milliseconds(longest + 2 * kCheckEveryMs);
  uint64_t bytes = 0;
  for (LocalRegion* r : parts) {
    auto it = data_regions_.find(r->name);
    if (it != data_regions_.end() && it->second == r) data_regions_.erase(it);
    r->writer.reset();
    int& opened = regions_opened_by_[r->peer];
    if (opened > 0) --opened;  // its memory goes
    uint64_t& held = region_bytes_of_[r->peer];
    held -= std::min<uint64_t>(held, r->memory->size());
    bytes += r->memory->size();
    r->memory->Unlink();
    retired_.push_back(Retired{r, region, not_before});
  }
  Log("released region '" + region->name + "' of " + region->peer + " (" +
      std::to_string(parts.size()) + " segment" +
      (parts.size() == 1 ? "" : "s") + ", " + std::to_string(bytes) +
      " bytes): " + why);
  // Waits on it fail at once (RecvCheck), not at their next periodic check.
  poller_recheck_.store(true);
  RingPoller();
}

void Engine::SweepRetiredLocked() {
  Clock::time_point now = Clock::now();
  size_t kept = 0;
  for (size_t i = 0; i < retired_.size(); ++i) {
    Retired& r = retired_[i];
    if (now >= r.not_before &&
        r.base->held.load(std::memory_order_acquire) == 0) {
      r.region->memory.reset();  // unmaps it
      continue;
    }
    retired_[kept++] = r;
  }
  retired_.resize(kept);
}

void Engine::ReleaseRegionsOfLocked(const std::shared_ptr<Connection>& conn,
                                    const std::string& why) {
  if (!conn->dialed) {
    // The peer wrote here: its matched-call regions go.
    std::vector<LocalRegion*> release;
    for (auto& kv : data_regions_) {
      LocalRegion* r = kv.second;
      if (r->writer == conn && kv.first.find('#') == std::string::npos &&
          MatchedRegion(kv.first)) {
        release.push_back(r);
      }
    }
    for (LocalRegion* r : release) RetireRegionLocked(r, why);
  } else {
    // This process wrote to the peer: its credit regions go, and the slots
    // start their copies again on the next connection (BindSendSlot).
    for (auto& kv : send_regions_) {
      SendRegion& r = *kv.second;
      if (!MatchedRegion(kv.first)) continue;
      std::lock_guard<std::mutex> rl(r.state_mu);
      if (r.conn != conn) continue;
      r.open = false;
      r.conn.reset();
      LocalRegion* credits = r.credit_region;
      if (credits != nullptr && !credits->retired.exchange(true)) {
        credits->memory->Unlink();
        // Sends that still look at it end by their deadline.
        retired_.push_back(Retired{
            credits, credits,
            Clock::now() + std::chrono::milliseconds(config_.timeout_ms +
                                                     2 * kCheckEveryMs)});
        Log("released the credit region of '" + kv.first + "': " + why);
      }
      r.credit_region = nullptr;
    }
  }
  SweepRetiredLocked();
}

Status Engine::CurrentRegion(RecvSlot* slot, LocalRegion** out) {
  LocalRegion* region = slot->region.load(std::memory_order_acquire);
  if (!region->retired.load(std::memory_order_acquire)) {
    *out = region;
    return Status::Ok();
  }
  const SlotSpec& spec = slot->spec;
  LocalRegion* fresh = nullptr;
  TF_RDMA_RETURN_IF_ERROR(FindOrCreateDataRegion(
      spec.region, spec.region_bytes, spec.plan_hash, spec.peer, &fresh));
  for (RecvSlot* other : recv_slot_list_) {
    if (other->spec.region == spec.region) {
      other->region.store(fresh, std::memory_order_release);
    }
  }
  SweepRetiredLocked();
  *out = fresh;
  return Status::Ok();
}

}  // namespace tf_rdma
