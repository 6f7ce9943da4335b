// Recv: claiming a step, waiting for the data, handing it out, and
// returning the credit.

#include "kernels/engine/engine.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

Status Engine::ClaimRecv(const SlotSpec& spec, RecvTicket* ticket,
                         uint64_t call, RecvSlot** known) {
  if (!started_) return NotStarted();
  ticket->traced_since = trace::Claim();
  RecvSlot* slot = known != nullptr ? *known : nullptr;
  if (slot == nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& entry = recv_slots_[SlotKey(spec)];
    if (!entry) {
      TF_RDMA_RETURN_IF_ERROR(CheckNewSlot(spec, config_.task));
      LocalRegion* region = nullptr;
      Status s = FindOrCreateDataRegion(spec.region, spec.region_bytes,
                                        spec.plan_hash, spec.peer, &region);
      if (!s.ok()) {
        RefuseWriter(spec.region, s);
        return s;
      }
      region_kind_[spec.region] |= spec.match_calls ? kKindMatched : kKindInOrder;
      entry.reset(new RecvSlot());
      entry->spec = spec;
      entry->spec.peer_host = PeerHost(spec.peer);
      entry->region.store(region, std::memory_order_release);
      recv_slot_list_.push_back(entry.get());
      recv_slots_made_.fetch_add(1, std::memory_order_release);
      if (spec.match_calls) {
        entry->taken.assign(spec.depth, 0);
        entry->seen_step.assign(spec.depth, 0);
        entry->seen_at.assign(spec.depth, Clock::time_point{});
      }
    } else {
      TF_RDMA_RETURN_IF_ERROR(CheckSameSlot(spec, entry->spec));
    }
    slot = entry.get();
    if (known != nullptr) *known = slot;
  }
  ticket->slot = slot;
  ticket->call = call;
  ticket->timeout_ms = TimeoutFor(spec);
  ticket->region = slot->region.load(std::memory_order_acquire);
  if (ticket->region->retired.load(std::memory_order_acquire)) {
    // Its writer went away (peers.cc): this recv waits in the fresh region.
    std::lock_guard<std::mutex> lock(mu_);
    TF_RDMA_RETURN_IF_ERROR(CurrentRegion(slot, &ticket->region));
  }
  if (spec.match_calls) return Status::Ok();  // the copy is found later
  std::lock_guard<std::mutex> lock(slot->mu);
  TF_RDMA_RETURN_IF_ERROR(ClaimStep(&slot->steps, spec, &ticket->step));
  ticket->copy = CopyOf(spec, ticket->step);
  return Status::Ok();
}

bool Engine::TryRecvNow(RecvTicket* ticket) {
  RecvSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  if (spec.match_calls) return MatchRecv(ticket, /*take=*/true);
  uint64_t copy = CopyOffset(spec, ticket->copy);
  Region* memory = ticket->region->memory.get();
  if (memory->Word(copy)->load(std::memory_order_acquire) < ticket->step) {
    return false;
  }
  ticket->payload = memory->data() + copy + kSlotHeaderBytes;
  return true;
}

bool Engine::TakeRecvNow(RecvTicket* ticket) {
  if (TryRecvNow(ticket)) {
    CountRecv(ticket, true);
    TraceDataWait(*ticket);
    return true;
  }
  TransferStats::StartWait(&ticket->waiting_since, &stats_.data_busy);
  return false;
}

void Engine::CancelRecv(RecvTicket* ticket, const Status& why) {
  GiveBackRecv(ticket, why);
  CountRecv(ticket, false);
}

bool Engine::PollRecv(RecvTicket* ticket) {
  if (TakeRecvNow(ticket)) return true;
  // A slot whose data never lands within the poll (a recv that starts long
  // before its sender, as in a chain of hops started by one call) would
  // only hold TensorFlow's thread: after two misses in a row, poll only
  // every 8th step, to notice when the pattern changes.
  std::atomic<int>& misses = ticket->slot->poll_misses;
  uint32_t poll = ticket->slot->polls.fetch_add(1, std::memory_order_relaxed);
  if (misses.load(std::memory_order_relaxed) >= 2 && poll % 8 != 0) {
    return false;
  }
  if (PollRecvFor(ticket)) {
    misses.store(0, std::memory_order_relaxed);
    CountRecv(ticket, true);
    TraceDataWait(*ticket);
    return true;
  }
  misses.fetch_add(1, std::memory_order_relaxed);
  return false;
}

bool Engine::PollRecvFor(RecvTicket* ticket) {
  return PollFor([&] { return TryRecvNow(ticket); },
                 Clock::now() + std::chrono::microseconds(config_.poll_us),
                 shares_cores_);
}

Status Engine::FinishRecv(RecvTicket* ticket) {
  Deadline deadline(ticket->timeout_ms);
  std::shared_ptr<StallWait> stall;
  while (!TryRecvNow(ticket)) {
    TransferStats::StartWait(&ticket->waiting_since, &stats_.data_busy);
    if (!stall) {
      stall = BeginStall(StallWait::kData, ticket->slot, nullptr,
                         TraceStep(ticket->slot->spec, ticket->step,
                                   ticket->call),
                         0);
    }
    Status s = RecvStep(ticket, deadline, stall);
    if (!s.ok()) {
      EndStall(stall);
      GiveBackRecv(ticket, s);
      CountRecv(ticket, false);
      return s;
    }
    if (!ticket->slot->spec.match_calls) break;
  }
  EndStall(stall);
  CountRecv(ticket, true);
  TraceDataWait(*ticket);
  return Status::Ok();
}

PeerCounters* Engine::RecvCounters(RecvSlot* slot) {
  PeerCounters* c = slot->region.load(std::memory_order_acquire)
                        ->stats.load(std::memory_order_acquire);
  return c != nullptr ? c : stats_.For(slot->spec.peer, kNoTransport);
}

void Engine::CountRecv(RecvTicket* ticket, bool ok) {
  const SlotSpec& spec = ticket->slot->spec;
  PeerCounters* c = RecvCounters(ticket->slot);
  TransferStats::EndWait(&ticket->waiting_since, &stats_.data_busy,
                         &c->data_waits, &c->data_wait_ns);
  if (!ok) return;
  PeerCounters::Add(&c->receives, 1);
  // A dynamic slot's bytes are the tensor's, counted by ResolveDynamic.
  if (!spec.dynamic) {
    PeerCounters::Add(&c->bytes_received,
                      ticket->nbytes != 0 && ticket->nbytes < spec.nbytes
                          ? ticket->nbytes
                          : spec.nbytes);
  }
}

void Engine::GiveBackRecv(RecvTicket* ticket, const Status& why) {
  if (ticket->slot->spec.match_calls) {
    Abandon(*ticket);
    return;
  }
  std::lock_guard<std::mutex> lock(ticket->slot->mu);
  GiveBackStep(&ticket->slot->steps, ticket->step, why);
}

Status Engine::RecvCheck(const RecvTicket& ticket, const std::string& what) {
  if (ticket.cancelled && ticket.cancelled->load(std::memory_order_acquire)) {
    return Cancelled(what + ": its step was cancelled");
  }
  std::shared_ptr<Connection> writer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    LocalRegion* region = ticket.region;
    if (!region->refusal.empty()) {
      return FailedPrecondition(what + ": " + region->refusal);
    }
    if (region->retired.load(std::memory_order_relaxed)) {
      return Unavailable(what + ": " + ticket.slot->spec.peer +
                         " went away (its connection ended) while this recv "
                         "waited; its region here was released");
    }
    writer = region->writer;
  }
  return CheckPeerAlive(writer, what);
}

Status Engine::RecvTimedOut(const RecvTicket& ticket, const std::string& what,
                            const Status& timeout,
                            const std::shared_ptr<StallWait>& stall) {
  bool connected;
  {
    std::lock_guard<std::mutex> lock(mu_);
    connected = ticket.region->writer != nullptr;
  }
  return DeadlineExceeded(
      what + ": " + timeout.message() + " waiting for the data" +
      (connected ? "" : " (the peer never connected)") + StallFacts(stall));
}

Status Engine::RecvStep(RecvTicket* ticket, const Deadline& deadline,
                        const std::shared_ptr<StallWait>& stall,
                        const std::atomic<bool>* taken) {
  RecvSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  if (spec.match_calls) return WaitForMatch(ticket, deadline, stall, taken);
  // Built only for an error: every recv passes here.
  auto what = [&] { return "tf_rdma recv of " + spec.Describe(ticket->step); };
  uint64_t copy = CopyOffset(spec, ticket->copy);
  Region* memory = ticket->region->memory.get();
  Status s = WaitForWord(memory->Word(copy), ticket->step, deadline,
                         [&] { return RecvCheck(*ticket, what()); },
                         ticket->spin_us, memory->Sleepers(copy));
  if (!s.ok()) {
    if (s.code() == Code::kDeadlineExceeded) {
      return RecvTimedOut(*ticket, what(), s, stall);
    }
    return s;
  }
  ticket->payload = memory->data() + copy + kSlotHeaderBytes;
  return Status::Ok();
}

Status Engine::ResolveDynamic(RecvTicket* ticket, DynamicMeta* meta) {
  RecvSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  std::memcpy(meta, ticket->payload, sizeof(DynamicMeta));
  auto what = [&] {
    return "tf_rdma recv of " +
           spec.Describe(spec.match_calls ? ticket->call : ticket->step);
  };
  if (meta->rank > static_cast<uint64_t>(kMaxDynamicRank)) {
    return InvalidArgument(what() + ": the sender wrote rank " +
                           std::to_string(meta->rank) + ", more than " +
                           std::to_string(kMaxDynamicRank));
  }
  if (meta->nbytes == 0) return Status::Ok();  // payload stays the meta
  std::string name = spec.region + "#" + spec.tensor_name + "#" +
                     std::to_string(meta->generation);
  LocalRegion* area = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = data_regions_.find(name);
    if (it != data_regions_.end()) area = it->second;
  }
  if (area == nullptr || area->peer != spec.peer ||
      area->plan_hash != spec.plan_hash) {
    return Internal(what() + ": payload area '" + name +
                    "' of the sender's generation " +
                    std::to_string(meta->generation) +
                    " was never opened by " + spec.peer);
  }
  uint64_t size = area->memory->size();
  uint64_t capacity =
      size > kDynamicHeaderBytes ? (size - kDynamicHeaderBytes) / spec.depth : 0;
  if (meta->nbytes > capacity) {
    return InvalidArgument(what() + ": " + std::to_string(meta->nbytes) +
                           " bytes do not fit the payload area '" + name +
                           "' of " + std::to_string(capacity) +
                           " bytes per copy");
  }
  ticket->payload =
      area->memory->data() + kDynamicHeaderBytes + ticket->copy * capacity;
  PeerCounters::Add(&RecvCounters(slot)->bytes_received, meta->nbytes);
  return Status::Ok();
}

void Engine::HoldRegion(const RecvTicket& ticket, int delta) {
  if (ticket.region != nullptr) {
    ticket.region->held.fetch_add(delta, std::memory_order_acq_rel);
  }
}

void Engine::Release(const RecvTicket& ticket) {
  RecvSlot* slot = ticket.slot;
  const SlotSpec& spec = slot->spec;
  std::shared_ptr<Connection> writer;
  int handle;
  uint64_t line =
      static_cast<uint64_t>(spec.credit_index) * spec.depth + ticket.copy;
  // In order, the credit is kept to be sent again if the writer opens the
  // region on a new connection (regions.cc, "Connections that drop").
  std::unique_lock<std::mutex> credit_lock(ticket.region->credit_mu,
                                           std::defer_lock);
  if (!spec.match_calls) {
    credit_lock.lock();
    ticket.region->credits_sent[line] = ticket.step;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The ticket's region: a copy of a released region goes back to no one
    // (its writer went away; a fresh writer starts on fresh copies).
    writer = ticket.region->writer;
    handle = ticket.region->credit_handle;
  }
  if (!writer || stopping_) return;
  trace::Span release(ticket.traced_since);
  Status s = writer->pair->Write(handle, 0, nullptr, 0,
                                 line * kCreditLineBytes, ticket.step,
                                 Deadline(config_.timeout_ms));
  release.End(trace::kRelease, spec.tensor_name, spec.nbytes, spec.peer,
              TraceStep(spec, ticket.step, ticket.call));
  if (!s.ok() && writer->pair->broken()) CloseConnection(writer, s);
  if (!s.ok() && CheckPeerAlive(writer, "").ok()) {
    Log("could not return the credit of " +
        spec.Describe(spec.match_calls ? ticket.call : ticket.step) + ": " +
        s.message());
  }
}

}  // namespace tf_rdma
