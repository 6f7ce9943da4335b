// Waiting for a recv's data without a thread per wait: the poller, and sends
// that help it.
//
// A recv whose data is not there after its inline poll (PollRecv) needs
// something to wait for it. That used to be one engine thread per wait,
// asleep on the futex of its sequence word, which then called the op's
// `done`; TensorFlow's executor queues the op's successors on its inter-op
// pool, which woke one of its threads for them. In a client-driven chain of
// 4 KiB hops between two tasks (bench/p2p.py, 2-vCPU VM) a hop took about
// 140 us on average, of which about 60 us was the futex wake-up of the
// engine thread (a sleeping vCPU has to be woken by the hypervisor) and
// about 50 us the wake-up of TensorFlow's thread for the next op; the memcpy
// itself is a microsecond. In such a chain every recv starts with the call
// and waits for many hops, so the inline poll cannot catch the data.
//
// Two changes remove both wake-ups from a hop:
//
// - *Sends help.* A send op that has written its data, on TensorFlow's
//   thread, polls the process's waiting recvs for up to kHelpPollFactor x
//   poll_us (200 us by default) and completes the first whose data lands,
//   right there (HelpRecvs). An answer often follows a send (a chain, a
//   ping-pong, a request and its reply); completing it on an inter-op
//   thread lets the executor queue the successors on that thread's own
//   queue, which it runs next: nothing is woken, and a hop of the chain
//   costs about what the ping-pong's does. Only the thread that just sent
//   spins, so on two vCPUs at most one thread per task burns a core (an
//   earlier variant with a spinning thread per process was slower: the
//   spinners took the cores the executor needed).
// - *One poller per process* owns every other wait: instead of a thread per
//   wait, one thread sleeps in a single futex_waitv (Linux >= 5.16) on the
//   sequence words of up to 127 waits plus its doorbell (new waits, lost
//   connections), completes whatever landed, and sleeps again. It never
//   spins: an idle wait costs no CPU. It wakes at least every kCheckEveryMs
//   to check peers and deadlines as WaitForWord does, so every wait stays
//   bounded by its timeout and a dead peer or a refused plan fails it with
//   the same messages. Waits beyond 127, or all of them on a kernel without
//   futex_waitv, are handed to engine threads (RecvStep) as before.
// - *tcp readers complete.* Over tcp the data is written by the reader
//   thread of the connection (connections.cc), which is awake anyway: it
//   stores the notice word, completes the recvs whose data landed
//   (CompleteLandedRecvs) and only then wakes the word's sleepers, so the
//   poller is not one more wake-up between the data and the op. It leaves
//   them to a send spinning in HelpRecvsFor (`helpers_`), whose thread runs
//   the successors without waking anyone.
//
// A wait is completed exactly once: whoever sets `taken` first (a helping
// send, a tcp reader, the poller, an engine thread) runs `done`; the others
// drop it.
// Cost: a send with recvs waiting in its process holds its inter-op thread
// for up to 200 us when no answer comes (never when poll_us is 0), and
// `done` runs on whichever thread completes the wait, so it must be short
// (TensorFlow's only queues the successors). Sends that wait for a credit
// still use engine threads: in practice their credit is already there.

#include "kernels/engine/engine.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

struct Engine::PendingRecv {
  Engine* engine;
  RecvTicket ticket;
  RecvDone done;
  Deadline deadline{0};
  // The sequence words to watch: the copy's, or with match_calls every
  // copy's (the data may land in any).
  std::vector<const std::atomic<uint64_t>*> words;
  Clock::time_point next_check;       // poller thread only
  bool handed_off = false;            // poller thread only
  bool timing_out = false;            // poller thread only
  // The wait's registration with the stall inspector (stall.cc), ended by
  // whoever completes the wait.
  std::shared_ptr<StallWait> stall;
  std::atomic<bool> taken{false};     // whoever sets it completes the wait

  bool Landed() {
    if (ticket.slot->spec.match_calls) {
      RecvTicket peek = ticket;
      return engine->MatchRecv(&peek, /*take=*/false);
    }
    return words[0]->load(std::memory_order_acquire) >= ticket.step;
  }
};

void Engine::WaitRecvAsync(const RecvTicket& ticket, RecvDone done) {
  const SlotSpec& spec = ticket.slot->spec;
  Region* memory = ticket.slot->region->memory.get();
  auto p = std::make_shared<PendingRecv>();
  p->engine = this;
  p->ticket = ticket;
  // A recv that waits here waits for its data (PollRecv began the wait).
  TransferStats::StartWait(&p->ticket.waiting_since, &stats_.data_busy);
  p->done = std::move(done);
  p->deadline = Deadline(ticket.timeout_ms);
  p->stall = BeginStall(StallWait::kData, ticket.slot, nullptr,
                        TraceStep(spec, ticket.step, ticket.call), 0);
  if (spec.match_calls) {
    for (int64_t c = 0; c < spec.depth; ++c) {
      p->words.push_back(memory->Word(CopyOffset(spec, c)));
    }
  } else {
    p->words.push_back(memory->Word(CopyOffset(spec, ticket.copy)));
  }
  p->next_check = Clock::now() + std::chrono::milliseconds(kCheckEveryMs);
  std::call_once(poller_once_, [this] {
    std::thread([this] {
      NameThisThread("tfrdma-poller");
      PollerLoop();
    }).detach();
  });
  {
    std::lock_guard<std::mutex> lock(poller_mu_);
    waiting_.push_back(p);
    waiting_count_.store(waiting_.size(), std::memory_order_relaxed);
  }
  RingPoller();
}

void Engine::RingPoller() {
  // Pairs with the poller's store of poller_asleep_ then load of the bell:
  // either it sees the new bell value, or we see it asleep and wake it.
  poller_bell_.fetch_add(1, std::memory_order_seq_cst);
  if (poller_asleep_.load(std::memory_order_seq_cst)) {
    WakeLocalWord(&poller_bell_);
  }
}

bool Engine::TakePending(const std::shared_ptr<PendingRecv>& p,
                         const Status& s) {
  if (p->taken.exchange(true, std::memory_order_acq_rel)) return false;
  RecvTicket ticket = p->ticket;
  if (s.ok() && !TryRecvNow(&ticket)) {
    // match_calls: another recv of the same call took the copy first.
    p->taken.store(false, std::memory_order_release);
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(poller_mu_);
    auto it = std::find(waiting_.begin(), waiting_.end(), p);
    if (it != waiting_.end()) waiting_.erase(it);
    waiting_count_.store(waiting_.size(), std::memory_order_relaxed);
  }
  EndStall(p->stall);
  if (s.ok()) {
    TraceDataWait(ticket);
  } else {
    GiveBackRecv(&ticket, s);
  }
  CountRecv(&ticket, s.ok());
  p->done(s, ticket);
  return true;
}

bool Engine::HelpRecvs() {
  if (waiting_count_.load(std::memory_order_relaxed) == 0) return false;
  int64_t budget_us = config_.poll_us * kHelpPollFactor;
  if (budget_us <= 0) return false;
  // When helping keeps missing (answers come later than the budget, or the
  // cores are busy with other work, where spinning only delays the peer),
  // help only every 8th time, to notice when that changes.
  int misses = help_misses_.load(std::memory_order_relaxed);
  if (misses >= 2 && help_calls_.fetch_add(1, std::memory_order_relaxed) % 8) {
    return false;
  }
  bool helped = HelpRecvsFor(budget_us);
  if (helped) {
    help_misses_.store(0, std::memory_order_relaxed);
  } else {
    help_misses_.fetch_add(1, std::memory_order_relaxed);
  }
  return helped;
}

bool Engine::HelpRecvsFor(int64_t budget_us) {
  Clock::time_point until = Clock::now() + std::chrono::microseconds(budget_us);
  helpers_.fetch_add(1, std::memory_order_relaxed);
  struct Done {
    std::atomic<int>* helpers;
    ~Done() { helpers->fetch_sub(1, std::memory_order_relaxed); }
  } done{&helpers_};
  std::vector<std::shared_ptr<PendingRecv>> mine;
  uint32_t seen = ~0u;
  for (int round = 0;; ++round) {
    uint32_t bell = poller_bell_.load(std::memory_order_acquire);
    if (bell != seen) {  // new waits (or a lost peer): look again
      seen = bell;
      std::lock_guard<std::mutex> lock(poller_mu_);
      mine = waiting_;
      if (mine.empty()) return false;
    }
    for (const auto& p : mine) {
      if (!p->taken.load(std::memory_order_relaxed) && p->Landed() &&
          TakePending(p, Status::Ok())) {
        return true;
      }
    }
    for (int i = 0; i < 16; ++i) CpuRelax();
    if ((round & 15) == 15) {
      if (Clock::now() >= until) return false;
      // Every ~15 us: let a thread that is ready on this core run (on a
      // busy machine it may be the one that has to answer).
      if ((round & 31) == 31) sched_yield();
    }
  }
}

void Engine::CompleteLandedRecvs() {
  if (waiting_count_.load(std::memory_order_relaxed) == 0) return;
  // A send is spinning for an answer (HelpRecvsFor): it takes the recv
  // and runs its successors on its own thread, which wakes nobody.
  if (helpers_.load(std::memory_order_relaxed) > 0) return;
  std::vector<std::shared_ptr<PendingRecv>> mine;
  {
    std::lock_guard<std::mutex> lock(poller_mu_);
    mine = waiting_;
  }
  for (const auto& p : mine) {
    if (!p->taken.load(std::memory_order_relaxed) && p->Landed()) {
      TakePending(p, Status::Ok());
    }
  }
}

void Engine::PollerLoop() {
  std::vector<std::shared_ptr<PendingRecv>> pending;
  std::vector<WordWatch> watch;
  uint32_t bell_seen = 0;
  while (true) {
    bell_seen = poller_bell_.load(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lock(poller_mu_);
      pending = waiting_;
    }
    Clock::time_point now = Clock::now();
    if (poller_recheck_.exchange(false)) {
      for (auto& p : pending) p->next_check = now;
    }
    size_t kept = 0;
    for (size_t i = 0; i < pending.size(); ++i) {
      std::shared_ptr<PendingRecv>& p = pending[i];
      if (p->taken.load(std::memory_order_relaxed)) continue;
      if (p->Landed()) {
        TakePending(p, Status::Ok());
        continue;
      }
      if (p->timing_out) continue;  // an engine thread completes it
      bool expired = now >= p->deadline.at();
      if (now >= p->next_check || expired) {
        RecvSlot* slot = p->ticket.slot;
        std::string what =
            "tf_rdma recv of " + slot->spec.Describe(p->ticket.step);
        Status s = RecvCheck(slot, what);
        if (s.ok() && expired) {
          if (p->Landed()) {
            TakePending(p, Status::Ok());
            continue;
          }
          // The timeout's message asks the peer for its position (up to
          // 250 ms, stall.cc): on an engine thread, not on this one, which
          // serves every other wait.
          p->timing_out = true;
          p->handed_off = true;
          Schedule([this, p, slot, what] {
            Status s = p->Landed()
                           ? Status::Ok()
                           : RecvTimedOut(slot, what,
                                          DeadlineExceeded(
                                              "timed out after " +
                                              std::to_string(
                                                  p->deadline.timeout_ms()) +
                                              " ms"),
                                          p->stall);
            TakePending(p, s);
          });
          continue;
        }
        if (!s.ok()) {
          TakePending(p, s);
          continue;
        }
        p->next_check = now + std::chrono::milliseconds(kCheckEveryMs);
      }
      if (!p->handed_off) pending[kept++] = p;
    }
    pending.resize(kept);

    // Sleep until a watched word moves, news, or the next check is due.
    // Waits beyond what one futex_waitv takes go to engine threads.
    Clock::time_point until = now + std::chrono::seconds(10);
    watch.clear();
    watch.push_back(WordWatch{&poller_bell_, bell_seen, false});
    bool landed = false;
    for (auto& p : pending) {
      if (watch.size() + p->words.size() >
              static_cast<size_t>(kMaxWatchedWords) ||
          !have_waitv_) {
        p->handed_off = true;
        Schedule([this, p] {
          // Until this call completes it (a match_calls copy can be taken
          // by a sibling recv of the same call between the wait and here).
          do {
            RecvTicket ticket = p->ticket;
            Status s = RecvStep(&ticket, p->deadline, p->stall);
            if (!s.ok() && p->Landed()) s = Status::Ok();
            if (TakePending(p, s)) break;
          } while (!p->taken.load(std::memory_order_acquire));
        });
        continue;
      }
      for (const std::atomic<uint64_t>* word : p->words) {
        uint64_t v = word->load(std::memory_order_acquire);
        watch.push_back(WordWatch{word, static_cast<uint32_t>(v), true,
                                  SleepersOf(word)});
      }
      if (p->Landed()) landed = true;
      until = std::min(until, std::min(p->next_check, p->deadline.at()));
    }
    if (landed) continue;
    pending.clear();  // drop references while asleep
    poller_asleep_.store(true, std::memory_order_seq_cst);
    if (poller_bell_.load(std::memory_order_seq_cst) == bell_seen) {
      if (!WaitForAnyWord(watch.data(), static_cast<int>(watch.size()),
                          until)) {
        have_waitv_ = false;  // old kernel: engine threads from now on
      }
    }
    poller_asleep_.store(false, std::memory_order_relaxed);
  }
}

}  // namespace tf_rdma
