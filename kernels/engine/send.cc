// Send: claiming a step, binding the slot to its peer and its region there,
// waiting for the credit, and the write.

#include "kernels/engine/engine.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

namespace {

// How long a send whose connection was lost tries to dial the peer again.
constexpr int64_t kRedialMs = 1000;

}  // namespace

Status Engine::ClaimSend(const SlotSpec& spec, SendTicket* ticket,
                         uint64_t call, SendSlot** known) {
  if (!started_) return NotStarted();
  ticket->traced_since = trace::Claim();
  SendSlot* slot = known != nullptr ? *known : nullptr;
  if (slot == nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& entry = send_slots_[SlotKey(spec)];
    if (!entry) {
      TF_RDMA_RETURN_IF_ERROR(CheckNewSlot(spec, config_.task));
      entry.reset(new SendSlot());
      entry->spec = spec;
      entry->spec.peer_host = PeerHost(spec.peer);
      if (spec.match_calls) {
        entry->issued.assign(spec.depth, 0);
        entry->busy.assign(spec.depth, 0);
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
  if (spec.match_calls) return Status::Ok();  // the copy is chosen later
  std::lock_guard<std::mutex> lock(slot->mu);
  TF_RDMA_RETURN_IF_ERROR(ClaimStep(&slot->steps, spec, &ticket->step));
  ticket->copy = CopyOf(spec, ticket->step);
  return Status::Ok();
}

Status Engine::BindSendSlot(SendSlot* slot, uint64_t step,
                            const Deadline& deadline, SendBinding* out) {
  std::lock_guard<std::mutex> lock(slot->mu);
  const SlotSpec& spec = slot->spec;
  Status lost;
  if (slot->bound) {
    if (!slot->conn->gone.load(std::memory_order_acquire)) {
      *out = SendBinding{slot->conn, slot->data_handle, slot->stats};
      return Status::Ok();
    }
    // The connection was lost. Dial again, briefly: the peer may be back
    // (or restarted, see "Restarted peers"); a peer that is gone fails the
    // op within kRedialMs with why, not at its timeout.
    lost = CheckPeerAlive(slot->conn, "");
    if (lost.ok()) lost = Unavailable("the connection to " + spec.peer +
                                      " was lost");
    slot->bound = false;
  }
  // Dialling and the OPEN may wait for a peer that is not up yet: the stall
  // inspector names it if that lasts.
  std::shared_ptr<StallWait> stall =
      BeginStall(StallWait::kConnect, nullptr, slot, step, 0);
  struct EndAtReturn {
    Engine* engine;
    const std::shared_ptr<StallWait>& wait;
    ~EndAtReturn() { engine->EndStall(wait); }
  } end_stall{this, stall};
  std::shared_ptr<Connection> conn;
  Status dialed = GetConnection(
      spec.peer,
      lost.ok() ? deadline
                : Deadline(std::min<int64_t>(kRedialMs, deadline.RemainingMs())),
      &conn);
  if (!dialed.ok()) {
    return lost.ok() ? dialed
                     : Status(lost.code(), lost.message() +
                                               "; dialling it again: " +
                                               dialed.message());
  }
  // Several slots share a region; whichever binds first opens it, the others
  // wait for it here and then share its connection, handle and credits.
  SendRegion* region;
  {
    std::lock_guard<std::mutex> elock(mu_);
    auto& entry = send_regions_[spec.region];
    if (entry == nullptr) {
      entry.reset(new SendRegion);
      entry->peer = spec.peer;
    }
    region = entry.get();
    region_kind_[spec.region] |= spec.match_calls ? kKindMatched : kKindInOrder;
  }
  std::lock_guard<std::mutex> rlock(region->mu);
  bool open;
  std::string refusal;
  bool tell = false;
  {
    std::lock_guard<std::mutex> sl(region->state_mu);
    refusal = region->refusal;
    tell = !refusal.empty() && !region->refusal_told;
    if (tell) region->refusal_told = true;
    open = region->open && region->conn == conn;
  }
  if (!refusal.empty()) {
    // The reader restarted: tell the new process too, so that its recvs
    // fail now with the reason rather than wait for data that never comes.
    if (tell && region->credit_region != nullptr) {
      int ignored = -1;
      OpenRemoteRegion(conn, spec.region, spec.region_bytes, spec.plan_hash,
                       region->credit_region->id,
                       *region->credit_region->memory, deadline, &ignored,
                       refusal);
    }
    return FailedPrecondition(refusal);
  }
  if (!open) {
    TF_RDMA_RETURN_IF_ERROR(OpenSendRegion(spec, conn, deadline, region));
  }
  uint64_t epoch;
  {
    std::lock_guard<std::mutex> sl(region->state_mu);
    epoch = region->epoch;
  }
  if (spec.match_calls && slot->epoch != epoch) {
    // The region was opened afresh on the reader (peers.cc): every copy is
    // free there. A copy a send writes now (on the old connection, where
    // it fails) stays busy until that send ends.
    std::fill(slot->issued.begin(), slot->issued.end(), 0);
    slot->epoch = epoch;
  }
  {
    std::lock_guard<std::mutex> dl(slot->dynamic_mu);
    // A dynamic slot's payload area was opened through the old connection:
    // the next tensor opens a new generation through this one.
    if (slot->conn != region->conn) slot->capacity = 0;
  }
  slot->conn = region->conn;
  slot->data_handle = region->data_handle;
  slot->credits = region->credits;
  slot->credits_id = region->credits_id;
  slot->stats = stats_.For(spec.peer, slot->conn->pair->transport());
  slot->bound = true;
  *out = SendBinding{slot->conn, slot->data_handle, slot->stats};
  return Status::Ok();
}

// Asks the peer to set up (or find) its region `name` of `size` bytes that
// this process will write, telling it where our credit region is; returns
// the transport handle of the peer's region.
Status Engine::OpenRemoteRegion(const std::shared_ptr<Connection>& conn,
                                const std::string& name, uint64_t size,
                                const std::string& plan_hash,
                                uint32_t credits_id, const Region& credits,
                                const Deadline& deadline, int* handle,
                                const std::string& refusal,
                                const std::string& landed) {
  RegionDescriptor exposed;
  TF_RDMA_RETURN_IF_ERROR(conn->pair->Expose(credits_id, credits, &exposed));
  std::map<std::string, std::string> request = {
      {"name", name}, {"size", std::to_string(size)}, {"plan_hash", plan_hash}};
  if (!refusal.empty()) request["refusal"] = refusal;
  if (!landed.empty()) request["landed"] = landed;
  EncodeDescriptor(exposed, "credit_", &request);
  std::map<std::string, std::string> reply;
  TF_RDMA_RETURN_IF_ERROR(Request(conn, kOpenRequest, request, deadline, &reply));
  return conn->pair->AddRemoteRegion(DecodeDescriptor(reply, ""), handle);
}

Status Engine::OpenSendRegion(const SlotSpec& spec,
                              const std::shared_ptr<Connection>& conn,
                              const Deadline& deadline, SendRegion* region) {
  // Caller holds region->mu.
  if (region->credit_region == nullptr) {
    std::lock_guard<std::mutex> elock(mu_);
    TF_RDMA_RETURN_IF_ERROR(NewLocalRegion(spec.region + "#credit",
                                           spec.credit_bytes, spec.plan_hash,
                                           spec.peer,
                                           &region->credit_region));
  }
  LocalRegion* credits = region->credit_region;
  {
    std::lock_guard<std::mutex> cl(conn->mu);
    conn->peer_writable.insert(credits->id);
  }
  // In order: where each slot's last written step must have landed, for a
  // reader that sees the region opened on a new connection to check
  // ("Connections that drop", regions.cc). "<word offset>:<step>,...".
  std::string landed;
  {
    std::lock_guard<std::mutex> elock(mu_);
    for (const auto& kv : send_slots_) {
      const SendSlot& s = *kv.second;
      uint64_t step = s.written.load(std::memory_order_relaxed);
      if (s.spec.region != spec.region || s.spec.match_calls || step == 0) {
        continue;
      }
      landed += (landed.empty() ? "" : ",") +
                std::to_string(CopyOffset(s.spec, CopyOf(s.spec, step))) +
                ":" + std::to_string(step);
    }
  }
  int data_handle = -1;
  TF_RDMA_RETURN_IF_ERROR(OpenRemoteRegion(
      conn, spec.region, spec.region_bytes, spec.plan_hash, credits->id,
      *credits->memory, deadline, &data_handle, "", landed));
  std::lock_guard<std::mutex> elock(mu_);
  std::lock_guard<std::mutex> sl(region->state_mu);
  if (!region->refusal.empty()) return FailedPrecondition(region->refusal);
  region->conn = conn;
  region->data_handle = data_handle;
  region->credits = credits->memory.get();
  region->credits_id = credits->id;
  region->open = true;
  ++region->epoch;
  return Status::Ok();
}

namespace {

// The credit value that frees the copy for `step`.
uint64_t CreditNeeded(const SlotSpec& spec, uint64_t step) {
  return step > static_cast<uint64_t>(spec.depth) ? step - spec.depth : 0;
}

// Records an in-order send's step as written (SendSlot::written).
void NoteWritten(const SendTicket& ticket, const Status& s) {
  if (!s.ok() || ticket.slot->spec.match_calls) return;
  std::atomic<uint64_t>& written = ticket.slot->written;
  uint64_t seen = written.load(std::memory_order_relaxed);
  while (seen < ticket.step &&
         !written.compare_exchange_weak(seen, ticket.step,
                                        std::memory_order_relaxed)) {
  }
}

}  // namespace

bool Engine::SendProgress(const SlotSpec& spec, uint64_t* written,
                          uint64_t* released) {
  SendSlot* slot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = send_slots_.find(SlotKey(spec));
    if (it == send_slots_.end()) return false;
    slot = it->second.get();
  }
  std::lock_guard<std::mutex> lock(slot->mu);
  if (!CreditsMapped(*slot)) return false;
  *written = slot->steps.claimed;
  *released = 0;
  for (int64_t c = 0; c < slot->spec.depth; ++c) {
    *released = std::max<uint64_t>(
        *released, CreditWord(slot->credits, slot->spec, c)
                       ->load(std::memory_order_acquire));
  }
  return true;
}

// True if the slot is connected and the copy for the ticket's step is free.
bool Engine::CreditReady(const SendTicket& ticket) const {
  SendSlot* slot = ticket.slot;
  if (!slot->bound.load(std::memory_order_acquire)) return false;
  const SlotSpec& spec = slot->spec;
  if (spec.match_calls) {
    std::lock_guard<std::mutex> lock(slot->mu);
    if (!CreditsMapped(*slot)) return false;  // the send binds it again
    for (int64_t c = 0; c < spec.depth; ++c) {
      if (!slot->busy[c] &&
          CreditWord(slot->credits, spec, c)->load(std::memory_order_acquire) >=
              slot->issued[c]) {
        return true;
      }
    }
    return false;
  }
  return CreditWord(slot->credits, spec, ticket.copy)
             ->load(std::memory_order_acquire) >=
         CreditNeeded(spec, ticket.step);
}

bool Engine::CreditReadyOrWait(SendTicket* ticket) {
  if (CreditReady(*ticket)) return true;
  // Not bound yet: the send connects first, which is no credit wait.
  if (ticket->slot->bound.load(std::memory_order_acquire)) {
    TransferStats::StartWait(&ticket->waiting_since, &stats_.credit_busy);
  }
  return false;
}

bool Engine::TrySendNow(SendTicket* ticket, const void* data,
                        Status* status) {
  if (!CreditReadyOrWait(ticket)) return false;
  *status = FinishSend(*ticket, data);
  return true;
}

bool Engine::TrySendDynamicNow(SendTicket* ticket, const void* data,
                               const DynamicMeta& meta, Status* status) {
  if (!CreditReadyOrWait(ticket)) return false;
  *status = FinishSendDynamic(*ticket, data, meta);
  return true;
}

Status Engine::FinishSend(const SendTicket& ticket, const void* data) {
  Status s = SendStep(ticket, data, nullptr);
  NoteWritten(ticket, s);
  if (!s.ok() && !ticket.slot->spec.match_calls) {
    std::lock_guard<std::mutex> lock(ticket.slot->mu);
    GiveBackStep(&ticket.slot->steps, ticket.step, s);
  }
  return s;
}

Status Engine::FinishSendDynamic(const SendTicket& ticket, const void* data,
                                 const DynamicMeta& meta) {
  Status s = SendStep(ticket, data, &meta);
  NoteWritten(ticket, s);
  if (!s.ok() && !ticket.slot->spec.match_calls) {
    std::lock_guard<std::mutex> lock(ticket.slot->mu);
    GiveBackStep(&ticket.slot->steps, ticket.step, s);
  }
  return s;
}

// Writes a dynamic step's bytes into the current payload area, opening a
// larger one first if they do not fit, and records its generation in meta.
Status Engine::WriteDynamicPayload(const SendTicket& ticket,
                                   const SendBinding& binding,
                                   const void* data, DynamicMeta* meta,
                                   const Deadline& deadline) {
  SendSlot* slot = ticket.slot;
  const SlotSpec& spec = slot->spec;
  if (meta->nbytes == 0) {
    meta->generation = 0;
    return Status::Ok();
  }
  uint64_t generation, capacity;
  int handle;
  {
    std::lock_guard<std::mutex> lock(slot->dynamic_mu);
    if (meta->nbytes > slot->capacity) {
      uint64_t wanted = std::max<uint64_t>(kPageBytes, 2 * slot->capacity);
      while (wanted < meta->nbytes) wanted *= 2;
      uint64_t size = kDynamicHeaderBytes + wanted * spec.depth;
      std::string name = spec.region + "#" + spec.tensor_name + "#" +
                         std::to_string(slot->generation + 1);
      int new_handle = -1;
      TF_RDMA_RETURN_IF_ERROR(OpenRemoteRegion(
          binding.conn, name, size, spec.plan_hash, slot->credits_id,
          *slot->credits, deadline, &new_handle));
      if (slot->capacity > 0 && binding.stats != nullptr) {
        PeerCounters::Add(&binding.stats->dynamic_regrowths, 1);
      }
      slot->generation += 1;
      slot->capacity = wanted;
      slot->payload_handle = new_handle;
    }
    generation = slot->generation;
    capacity = slot->capacity;
    handle = slot->payload_handle;
  }
  uint64_t copy = ticket.copy;
  meta->generation = generation;
  return binding.conn->pair->Write(
      handle, kDynamicHeaderBytes + copy * capacity, data, meta->nbytes,
      copy * kCreditLineBytes, ticket.step, deadline);
}

namespace {

// Ends a send's credit wait, if it had one (begun in TrySendNow, SendStep or
// AcquireCopy): at End() once the copy is free, or when the step ends
// however it ends. Counted for the peer's transport, or for "none" when
// the send has no connection.
class CreditWaitEnd {
 public:
  CreditWaitEnd(TransferStats* stats, const std::string& peer,
                Clock::time_point* since, PeerCounters* const* counters)
      : stats_(stats), peer_(peer), since_(since), counters_(counters) {}
  ~CreditWaitEnd() { End(); }
  void End() {
    if (*since_ == Clock::time_point{}) return;
    PeerCounters* c =
        *counters_ != nullptr ? *counters_ : stats_->For(peer_, kNoTransport);
    TransferStats::EndWait(since_, &stats_->credit_busy, &c->credit_waits,
                           &c->credit_wait_ns);
  }

 private:
  TransferStats* stats_;
  const std::string& peer_;
  Clock::time_point* since_;
  PeerCounters* const* counters_;
};

}  // namespace

Status Engine::SendStep(SendTicket ticket, const void* data,
                        const DynamicMeta* dynamic) {
  SendSlot* slot = ticket.slot;
  const SlotSpec& spec = slot->spec;
  // Built only for an error: every send passes here.
  auto what = [&] {
    return "tf_rdma send of " +
           spec.Describe(spec.match_calls ? ticket.call : ticket.step);
  };
  Deadline deadline(ticket.timeout_ms);
  SendBinding bound;
  CreditWaitEnd credit_wait(&stats_, spec.peer, &ticket.waiting_since,
                            &bound.stats);
  Status s = BindSendSlot(
      slot, spec.match_calls ? ticket.call : ticket.step, deadline, &bound);
  const std::shared_ptr<Connection>& conn = bound.conn;
  if (!s.ok()) {
    return s.code() == Code::kDeadlineExceeded
               ? DeadlineExceeded(what() + ": " + s.message())
               : s.Prefixed(what());
  }
  // Traced: the credit wait, then the write (the call's id, the dynamic
  // payload and the data with its notice), as two phases.
  uint64_t nbytes = spec.nbytes;
  if (dynamic != nullptr) {
    nbytes = dynamic->nbytes;
  } else if (ticket.nbytes != 0 && ticket.nbytes < nbytes) {
    nbytes = ticket.nbytes;
  }
  const uint64_t trace_step = TraceStep(spec, ticket.step, ticket.call);
  trace::Span credit_trace(ticket.traced_since);
  int64_t write_from = 0;
  // The call's id first, then the data and the step's notice: a reader
  // that sees the notice sees the id (writes on a pair apply in order).
  // Without a dynamic payload between them, both go in one hand-over.
  bool call_with_data = false;
  if (spec.match_calls) {
    TF_RDMA_RETURN_IF_ERROR(AcquireCopy(&ticket, conn, deadline, what));
    credit_wait.End();
    write_from = credit_trace.End(trace::kCreditWait, spec.tensor_name, nbytes,
                                  spec.peer, trace_step);
    if (dynamic != nullptr) {
      s = conn->pair->Write(bound.data_handle, 0, nullptr, 0,
                            CopyOffset(spec, ticket.copy) + kCallWordOffset,
                            ticket.call, deadline);
    } else {
      call_with_data = true;
    }
  } else {
    std::atomic<uint64_t>* credit = CreditWord(slot->credits, spec, ticket.copy);
    const uint64_t need = CreditNeeded(spec, ticket.step);
    std::shared_ptr<StallWait> stall;
    if (credit->load(std::memory_order_acquire) < need) {
      TransferStats::StartWait(&ticket.waiting_since, &stats_.credit_busy);
      stall = BeginStall(StallWait::kCredit, nullptr, slot, ticket.step, need);
    }
    s = WaitForWord(credit, need, deadline,
                    [&] {
                      if (ticket.cancelled &&
                          ticket.cancelled->load(std::memory_order_acquire)) {
                        return Cancelled(what() + ": its step was cancelled");
                      }
                      return CheckPeerAlive(conn, what());
                    },
                    /*spin_us=*/0, SleepersOf(credit));
    EndStall(stall);
    if (s.code() == Code::kDeadlineExceeded) {
      s = DeadlineExceeded(s.message() + " waiting for the receiver to "
                           "release the slot it used at step " +
                           std::to_string(need) + StallFacts(stall));
    }
    credit_wait.End();
    write_from = credit_trace.End(trace::kCreditWait, spec.tensor_name, nbytes,
                                  spec.peer, trace_step);
  }
  if (!s.ok() && !spec.match_calls) {
    if (s.code() == Code::kDeadlineExceeded) {
      return DeadlineExceeded(what() + ": " + s.message());
    }
    return s;
  }
  DynamicMeta meta;
  if (dynamic != nullptr) {
    // The payload first, then the meta with the step's notice: the reader
    // sees the notice only after the bytes it describes (same connection,
    // writes applied in order).
    meta = *dynamic;
    if (s.ok()) s = WriteDynamicPayload(ticket, bound, data, &meta, deadline);
    data = &meta;
  }
  uint64_t copy = CopyOffset(spec, ticket.copy);
  if (s.ok()) {
    s = call_with_data
            ? conn->pair->NoticeThenWrite(
                  bound.data_handle, copy + kCallWordOffset, ticket.call,
                  copy + kSlotHeaderBytes, data, nbytes, copy, ticket.step,
                  deadline)
            : conn->pair->Write(bound.data_handle, copy + kSlotHeaderBytes,
                                data, dynamic != nullptr ? spec.nbytes : nbytes,
                                copy, ticket.step, deadline);
    if (s.ok() && bound.stats != nullptr) {
      PeerCounters::Add(&bound.stats->writes, 1);
      PeerCounters::Add(&bound.stats->bytes_sent, nbytes);
    }
    trace::Span::At(write_from)
        .End(trace::kWrite, spec.tensor_name, nbytes, spec.peer, trace_step);
  }
  if (spec.match_calls) {
    std::lock_guard<std::mutex> lock(slot->mu);
    if (s.ok()) slot->issued[ticket.copy] = ticket.step;
    slot->busy[ticket.copy] = 0;
  }
  if (!s.ok()) {
    if (conn->pair->broken()) CloseConnection(conn, s);
    if (s.code() == Code::kDeadlineExceeded) {
      return DeadlineExceeded(what() + ": " + s.message());
    }
    Status alive = CheckPeerAlive(conn, what());
    if (alive.ok()) return s.Prefixed(what());
    // A peer that refuses a write (an RDMA access error) also closes the
    // connection, often before this side has read its own completion: the
    // write's failure names the cause, the closed connection only the
    // consequence, so the error carries both.
    if (alive.message().find(s.message()) == std::string::npos) {
      return Status(alive.code(),
                    alive.message() + "; the write failed: " + s.message());
    }
    return alive;
  }
  return Status::Ok();
}

}  // namespace tf_rdma
