// Matching calls (SlotSpec::match_calls).
//
// The in-order protocol pairs the writer's n-th send on a slot with the
// reader's n-th recv: each side counts its own ops. That is right while one
// call of a function runs at a time, and wrong as soon as calls overlap (two
// client threads calling one rewritten function, asynchronous training):
// the writer's step k and the reader's step k can then belong to different
// calls, and a call silently receives another call's tensor. A call that
// fails between its send and its recv leaves the two counts apart the same
// way.
//
// A rewritten function's ops therefore match by call instead. TensorFlow
// runs every component of one multi-device function call, on every task,
// with the same step id (it keys its own Send/Recv rendezvous by it), and
// each planned edge moves exactly once per call. So:
//   writer: take any copy that is free (not being written, and released by
//     the reader since its last write), give it the slot's next step, write
//     the call's id into the copy's header (kCallWordOffset), then the data
//     with the step as the notice.
//   reader: take the copy whose notice is newer than what it last took from
//     that copy and whose header names its own call; release it as before
//     (the copy's credit word := its step).
// Copies are chosen when the data is written, not when an op claims its
// step: with copies bound in claim order, two calls that reach two slots in
// opposite orders could each hold the copy the other waits for. With free
// choice, a call that waits for a copy waits only for calls that will finish
// without it, as long as no more than `depth` calls are in flight, which the
// Python side bounds (tf_rdma/decorator.py). More calls in flight than that
// (say, two client processes) are still correct, but may wait for each
// other until the timeout.
//
// A copy no recv will ever take — its call's recv failed (Abandon), or never
// ran because the call failed elsewhere — would keep its copy forever. The
// reader drops such copies when it sees them: at once for a call whose recv
// failed, and after the slot's timeout for any other call's copy that nobody
// took (a live call's recv starts with its call, long before that).
//
// Cost: one extra notice-only write per send (the call id: a store on shm, a
// frame header on tcp, a message on verbs) and a scan of `depth` header
// words per recv.

#include "kernels/engine/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

Status Engine::AcquireCopy(SendTicket* ticket,
                           const std::shared_ptr<Connection>& conn,
                           const Deadline& deadline,
                           const std::function<std::string()>& what) {
  SendSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  std::vector<WordWatch> watch;
  Clock::time_point next_check = Clock::now();
  std::shared_ptr<StallWait> stall;  // registered once no copy is free
  struct EndStallAtExit {
    Engine* engine;
    std::shared_ptr<StallWait>* stall;
    ~EndStallAtExit() { engine->EndStall(*stall); }
  } end_stall{this, &stall};
  while (true) {
    bool writing = false;  // a copy is busy: it frees without a notice
    watch.clear();
    {
      std::lock_guard<std::mutex> lock(slot->mu);
      for (int64_t c = 0; c < spec.depth; ++c) {
        std::atomic<uint64_t>* credit = CreditWord(slot->credits, spec, c);
        uint64_t released = credit->load(std::memory_order_acquire);
        if (slot->busy[c]) {
          writing = true;
        } else if (released >= slot->issued[c]) {
          slot->busy[c] = 1;
          ticket->copy = static_cast<uint64_t>(c);
          ticket->step = ++slot->steps.claimed;
          return Status::Ok();
        }
        watch.push_back(WordWatch{credit, static_cast<uint32_t>(released),
                                  true, SleepersOf(credit)});
      }
    }
    // No copy is free: a credit wait (counted by SendStep, stats.h).
    TransferStats::StartWait(&ticket->waiting_since, &stats_.credit_busy);
    if (!stall) {
      stall = BeginStall(StallWait::kCredit, nullptr, slot, ticket->call, 0);
    }
    Clock::time_point now = Clock::now();
    if (now >= deadline.at()) {
      return DeadlineExceeded(
          what() + ": timed out after " +
          std::to_string(deadline.timeout_ms()) +
          " ms waiting for the receiver to release one of the slot's " +
          std::to_string(spec.depth) + " copies (the calls in flight hold " +
          "them)" + StallFacts(stall));
    }
    if (now >= next_check) {
      if (ticket->cancelled &&
          ticket->cancelled->load(std::memory_order_acquire)) {
        return Cancelled(what() + ": its step was cancelled");
      }
      TF_RDMA_RETURN_IF_ERROR(CheckPeerAlive(conn, what()));
      next_check = now + std::chrono::milliseconds(kCheckEveryMs);
    }
    Clock::time_point until = std::min(deadline.at(), next_check);
    if (writing) {
      until = std::min(until, now + std::chrono::microseconds(20));
    }
    if (!WaitForAnyWord(watch.data(), static_cast<int>(watch.size()), until)) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

bool Engine::MatchRecv(RecvTicket* ticket, bool take) {
  RecvSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  // A released region (its writer went away, peers.cc) holds no copy for
  // anyone any more: the recv fails at its next check (RecvCheck).
  if (ticket->region->retired.load(std::memory_order_acquire)) return false;
  Region* memory = ticket->region->memory.get();
  std::vector<RecvTicket> dropped;
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    if (slot->matched_region != ticket->region) {
      // The first recv in a fresh region: its writer starts from step 1.
      slot->matched_region = ticket->region;
      std::fill(slot->taken.begin(), slot->taken.end(), 0);
      std::fill(slot->seen_step.begin(), slot->seen_step.end(), 0);
      slot->abandoned.clear();
    }
    Clock::time_point now{};
    for (int64_t c = 0; c < spec.depth; ++c) {
      uint64_t at = CopyOffset(spec, c);
      uint64_t step = memory->Word(at)->load(std::memory_order_acquire);
      if (step <= slot->taken[c]) continue;
      uint64_t call =
          memory->Word(at + kCallWordOffset)->load(std::memory_order_relaxed);
      auto gone = std::find(slot->abandoned.begin(), slot->abandoned.end(),
                            call);
      bool drop = gone != slot->abandoned.end();
      if (drop) {
        slot->abandoned.erase(gone);
      } else if (call == ticket->call) {
        if (!found || step < ticket->step) {
          found = true;
          ticket->step = step;
          ticket->copy = static_cast<uint64_t>(c);
        }
        continue;
      } else {
        if (now == Clock::time_point{}) now = Clock::now();
        if (slot->seen_step[c] != step) {
          slot->seen_step[c] = step;
          slot->seen_at[c] = now;
        }
        drop = now - slot->seen_at[c] >
               std::chrono::milliseconds(TimeoutFor(spec));
      }
      if (drop) {
        slot->taken[c] = step;
        RecvTicket orphan = *ticket;
        orphan.step = step;
        orphan.copy = static_cast<uint64_t>(c);
        orphan.call = call;
        dropped.push_back(orphan);
      }
    }
    if (found && take) slot->taken[ticket->copy] = ticket->step;
  }
  for (const RecvTicket& orphan : dropped) {
    Log("dropped the " + spec.Describe(orphan.call) +
        ": no recv of that call took it (the call failed)");
    Release(orphan);
  }
  if (found) {
    ticket->payload =
        memory->data() + CopyOffset(spec, ticket->copy) + kSlotHeaderBytes;
  }
  return found;
}

Status Engine::WaitForMatch(RecvTicket* ticket, const Deadline& deadline,
                            const std::shared_ptr<StallWait>& stall,
                            const std::atomic<bool>* taken) {
  RecvSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  Region* memory = ticket->region->memory.get();
  auto what = [&] { return "tf_rdma recv of " + spec.Describe(ticket->call); };
  std::vector<WordWatch> watch(spec.depth);
  Clock::time_point next_check =
      Clock::now() + std::chrono::milliseconds(kCheckEveryMs);
  while (true) {
    for (int64_t c = 0; c < spec.depth; ++c) {
      const std::atomic<uint64_t>* word = memory->Word(CopyOffset(spec, c));
      watch[c] = WordWatch{
          word, static_cast<uint32_t>(word->load(std::memory_order_acquire)),
          true, SleepersOf(word)};
    }
    if (MatchRecv(ticket, /*take=*/false)) return Status::Ok();
    // Completed by another waiter (a helping send took the copy): its
    // call's data will not come again, so waiting on would last until
    // the deadline, waking with every write to the slot.
    if (taken != nullptr && taken->load(std::memory_order_acquire)) {
      return Cancelled(what() + ": completed by another waiter");
    }
    Clock::time_point now = Clock::now();
    if (now >= deadline.at()) {
      return RecvTimedOut(*ticket, what(),
                          DeadlineExceeded("timed out after " +
                                           std::to_string(deadline.timeout_ms()) +
                                           " ms"),
                          stall);
    }
    if (now >= next_check) {
      TF_RDMA_RETURN_IF_ERROR(RecvCheck(*ticket, what()));
      next_check = now + std::chrono::milliseconds(kCheckEveryMs);
    }
    if (!WaitForAnyWord(watch.data(), static_cast<int>(watch.size()),
                        std::min(deadline.at(), next_check))) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void Engine::Abandon(const RecvTicket& ticket) {
  {
    std::lock_guard<std::mutex> lock(ticket.slot->mu);
    std::deque<uint64_t>& abandoned = ticket.slot->abandoned;
    abandoned.push_back(ticket.call);
    if (abandoned.size() > static_cast<size_t>(kMaxSlotDepth)) {
      abandoned.pop_front();
    }
  }
  RecvTicket scan = ticket;
  MatchRecv(&scan, /*take=*/false);  // drops the copy if it already landed
}

}  // namespace tf_rdma
