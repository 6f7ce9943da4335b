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
//   spinners took the cores the executor needed). Where the cluster's
//   tasks on the host outnumber its CPUs (shares_cores_), sends do not
//   help at all: the spinning thread would hold a core another task needs.
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
//
// Keeping the poller out of a helped hop. With both in place, a traced chain
// (TF_RDMA_TIMELINE_EVENTS=ops) still spent most of its time in three
// places, each a wake-up or a spin on two vCPUs shared by two tasks:
//
// - *The poller woke for every hop.* It counts itself on the words it
//   watches, so the peer's write woke it even where a helping send took the
//   data; it then slept again on up to 64 words (match_calls watches every
//   copy), tens of microseconds of the receiving task's core per hop: the
//   hops into one task took ~25 us, those out of it ~5 us. So while a send
//   helps, or one completed a recv within the last kAsideUs, the poller
//   *steps aside*: it sleeps on its bell only, for at most kAsideUs, and
//   counts itself on no data word. A help that finds nothing ends that at
//   once (it wakes the poller); otherwise a wait no helper takes is
//   completed at most kAsideUs after its data landed.
// - *It woke for every new wait.* A chain call's 32 recvs on a task woke it
//   32 times, each time to sleep again on all the words so far. A new wait
//   registered while a send helps wakes it no more: the helper sees the
//   wait (it rereads the waits when the bell moves) and the last helper to
//   stop wakes the poller once for all of them (`poller_owed_`).
// - *Helpers spun for recvs that had not started.* TensorFlow starts a
//   chain call's recvs while the chain runs; an answer for a recv whose op
//   was still queued, often behind the helping thread itself, landed where
//   nobody waited and the helper spun out its 200 us. A helper now also
//   watches the data words of every recv slot: data landing where no wait
//   is registered gives the thread back to TensorFlow at once. (Since the
//   rewrite starts a recv only after the send before it in a chain,
//   graph_passes/rewrite.py, such a send usually finds no wait at all and
//   returns at once; the recv it then lets run takes the answer in its
//   inline poll.)
//   And a helper that keeps missing halves its budget with every miss (to
//   an eighth) instead of helping only every 8th time: the same spinning on
//   average, but a chain whose first hops missed (its peer was starting)
//   no longer runs its next hops through the poller.
//
// Together (bench/p2p.py, 4 KiB, H = 64, shm, 2-vCPU VM, 6 runs each,
// alternating with the previous engine): the marginal hop went from
// 20.4-32.6 us (median 28.4) to 11.1-19.7 us (median 13.5); in traced runs
// the chain itself (first send to last) from 1.52 ms to 0.61-0.67 ms.
//
// A wait is completed exactly once: whoever sets `taken` first (a helping
// send, a tcp reader, the poller, an engine thread) runs `done`; the others
// drop it.
// Cost: a send with recvs waiting in its process holds its inter-op thread
// for up to 200 us when no answer comes (never when poll_us is 0), and
// reads the data words of every recv slot of the process (depth per slot)
// when it starts and about every 4 us while it spins; a wait that no
// helper takes may be completed up to kAsideUs after its data landed; and
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
  Region* memory = ticket.region->memory.get();
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
  ticket.slot->waits.fetch_add(1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(poller_mu_);
    waiting_.push_back(p);
    waiting_count_.store(waiting_.size(), std::memory_order_relaxed);
  }
  // A send spinning in HelpRecvsFor watches the new wait from its next
  // round on (it rereads the waits when the bell moves); the poller is
  // woken for it when the last such send stops (HelpRecvsFor), once for
  // all the waits that came meanwhile. Starting the 32 recvs of a chain
  // call woke the poller 32 times, each time to sleep again on up to 64
  // words: most of the call's first hops (bench/p2p.py, 2 vCPUs).
  poller_bell_.fetch_add(1, std::memory_order_seq_cst);
  if (helpers_.load(std::memory_order_seq_cst) > 0) {
    // Either a helper still spinning after this store sees it when it
    // stops, or this thread sees that none is left and wakes the poller.
    poller_owed_.store(true, std::memory_order_seq_cst);
    if (helpers_.load(std::memory_order_seq_cst) > 0) return;
  }
  WakePoller();
}

void Engine::WakeCancelled() {
  poller_recheck_.store(true);
  RingPoller();
}

void Engine::RingPoller() {
  poller_bell_.fetch_add(1, std::memory_order_seq_cst);
  WakePoller();
}

void Engine::WakePoller() {
  // Pairs with the poller's store of poller_asleep_ then load of the bell:
  // either it sees the new bell value, or we see it asleep and wake it.
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
  ticket.slot->waits.fetch_sub(1, std::memory_order_relaxed);
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
  // Where the cluster's tasks on this host outnumber its CPUs, a thread
  // that spins for an answer holds a core that the task sending it (or
  // one with work to do) needs: a ParameterServerStrategy step of a real
  // network (two workers, a ps task and the coordinator on 2 vCPUs, many
  // hundreds of sends a step) ran 1.2 to 1.3x slower than plain PSS
  // helping, and 1.25 to 1.3x faster than it without (MobileNetV2,
  // Inception-v3). As collectives stop spinning there (auto spin).
  if (budget_us <= 0 || shares_cores_) return false;
  // When helping keeps missing (answers come later than the budget, or the
  // cores are busy with other work, where spinning only delays the peer),
  // the budget halves with every miss in a row, down to an eighth: the
  // same spinning per send on average as helping every 8th time with the
  // whole budget, but a send whose answer comes soon still gets it (a
  // chain whose first hops missed while its peer started).
  int misses = help_misses_.load(std::memory_order_relaxed);
  budget_us >>= std::min(misses, 3);
  Helped helped = HelpRecvsFor(budget_us);
  if (helped == Helped::kYes) {
    help_misses_.store(0, std::memory_order_relaxed);
  } else if (helped == Helped::kNo) {
    help_misses_.fetch_add(1, std::memory_order_relaxed);
  }
  return helped == Helped::kYes;
}

Engine::Helped Engine::HelpRecvsFor(int64_t budget_us) {
  Clock::time_point until = Clock::now() + std::chrono::microseconds(budget_us);
  helpers_.fetch_add(1, std::memory_order_seq_cst);
  struct Done {
    Engine* engine;
    bool helped = false;  // or gave the thread back (a chain goes on)
    ~Done() {
      engine->helpers_.fetch_sub(1, std::memory_order_seq_cst);
      if (helped) {
        engine->helped_at_ns_.store(NanosSinceEpoch(Clock::now()),
                                    std::memory_order_relaxed);
      } else {
        // Answers come later than a help: the poller watches the data
        // words again from now on.
        engine->helped_at_ns_.store(0, std::memory_order_seq_cst);
        if (engine->poller_aside_.load(std::memory_order_seq_cst)) {
          engine->poller_owed_.store(true, std::memory_order_seq_cst);
        }
      }
      // Waits that came while this send helped have not been shown to the
      // poller yet (WaitRecvAsync): if so, wake it now.
      if (engine->poller_owed_.load(std::memory_order_seq_cst) &&
          engine->poller_owed_.exchange(false, std::memory_order_seq_cst)) {
        engine->WakePoller();
      }
    }
  } done{this};
  // The data words of every recv slot of the process, and what they held
  // when this help began or last moved with a wait there. Data that lands
  // where no recv waits is for a recv whose op TensorFlow has not started,
  // likely queued behind this very thread (a chain call's recvs start while
  // the chain runs): the thread is given back at once instead of spinning
  // out its budget.
  struct Word {
    const std::atomic<uint64_t>* word;
    uint64_t seen;
    RecvSlot* slot;
  };
  thread_local std::vector<Word> words;
  words.clear();
  {
    thread_local std::vector<RecvSlot*> slots;
    thread_local Engine* slots_of = nullptr;
    uint32_t made = recv_slots_made_.load(std::memory_order_acquire);
    if (slots_of != this || slots.size() != made) {
      std::lock_guard<std::mutex> lock(mu_);
      slots = recv_slot_list_;
      slots_of = this;
    }
    for (RecvSlot* slot : slots) {
      LocalRegion* region = slot->region.load(std::memory_order_acquire);
      if (region->retired.load(std::memory_order_acquire)) continue;
      Region* memory = region->memory.get();
      for (int64_t c = 0; c < slot->spec.depth; ++c) {
        const std::atomic<uint64_t>* word =
            memory->Word(CopyOffset(slot->spec, c));
        words.push_back({word, word->load(std::memory_order_acquire), slot});
      }
    }
  }
  std::vector<std::shared_ptr<PendingRecv>> mine;
  uint32_t seen = ~0u;
  for (int round = 0;; ++round) {
    uint32_t bell = poller_bell_.load(std::memory_order_acquire);
    if (bell != seen) {  // new waits (or a lost peer): look again
      seen = bell;
      std::lock_guard<std::mutex> lock(poller_mu_);
      mine = waiting_;
      if (mine.empty()) return Helped::kNo;
    }
    for (const auto& p : mine) {
      if (!p->taken.load(std::memory_order_relaxed) && p->Landed() &&
          TakePending(p, Status::Ok())) {
        done.helped = true;
        return Helped::kYes;
      }
    }
    for (int i = 0; i < 16; ++i) CpuRelax();
    if ((round & 3) == 3) {
      for (Word& w : words) {
        uint64_t now = w.word->load(std::memory_order_acquire);
        if (now == w.seen) continue;
        if (w.slot->waits.load(std::memory_order_relaxed) == 0) {
          done.helped = true;
          return Helped::kGaveBack;
        }
        w.seen = now;
      }
    }
    if ((round & 15) == 15) {
      if (Clock::now() >= until) return Helped::kNo;
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
    // This cycle reads every wait there is: none is owed to it any more.
    poller_owed_.store(false, std::memory_order_seq_cst);
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
      // A cancelled step rings the bell (CancelWaits): checked at once.
      bool cancelled = p->ticket.cancelled &&
                       p->ticket.cancelled->load(std::memory_order_acquire);
      if (now >= p->next_check || expired || cancelled) {
        RecvSlot* slot = p->ticket.slot;
        std::string what =
            "tf_rdma recv of " +
            slot->spec.Describe(slot->spec.match_calls ? p->ticket.call
                                                       : p->ticket.step);
        Status s = RecvCheck(p->ticket, what);
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
          Schedule([this, p, what] {
            Status s = p->Landed()
                           ? Status::Ok()
                           : RecvTimedOut(p->ticket, what,
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
    // While sends help, or one completed a recv within the last
    // kAsideUs, the poller steps aside: it sleeps on its bell only, for at
    // most kAsideUs, and does not count itself on the data words, so a
    // peer's write does not wake it (see the essay above).
    const bool aside =
        config_.poll_us > 0 &&
        (helpers_.load(std::memory_order_seq_cst) > 0 ||
         NanosSinceEpoch(now) - helped_at_ns_.load(std::memory_order_relaxed) <
             kAsideUs * 1000);
    if (aside) until = now + std::chrono::microseconds(kAsideUs);
    watch.clear();
    watch.push_back(WordWatch{&poller_bell_, bell_seen, false});
    bool landed = false;
    for (auto& p : pending) {
      if (watch.size() + p->words.size() >
              static_cast<size_t>(kMaxWatchedWords) ||
          !have_waitv_) {
        p->handed_off = true;
        Schedule([this, p] {
          // Until this call or another waiter completes it (a match_calls
          // copy can be taken by a sibling recv of the same call between
          // the wait and here). A helping send that takes the wait sets
          // `taken`, which ends the wait of a match_calls slot at its next
          // wake-up: its copy is consumed, and waiting on for it would hold
          // this thread until the deadline, woken by every later write to
          // the slot (with hundreds of recvs a step, as in a
          // ParameterServerStrategy step, such waits piled up and took
          // the CPUs). While a taker only tries (TakePending puts `taken`
          // back when its copy went to a sibling), this one waits again.
          do {
            RecvTicket ticket = p->ticket;
            Status s = RecvStep(&ticket, p->deadline, p->stall, &p->taken);
            if (p->taken.load(std::memory_order_acquire)) continue;
            if (!s.ok() && p->Landed()) s = Status::Ok();
            if (TakePending(p, s)) break;
          } while (!p->taken.load(std::memory_order_acquire));
        });
        continue;
      }
      for (const std::atomic<uint64_t>* word : p->words) {
        if (aside) break;  // asleep on the bell only
        uint64_t v = word->load(std::memory_order_acquire);
        watch.push_back(WordWatch{word, static_cast<uint32_t>(v), true,
                                  SleepersOf(word)});
      }
      if (p->Landed()) landed = true;
      until = std::min(until, std::min(p->next_check, p->deadline.at()));
    }
    if (landed) continue;
    pending.clear();  // drop references while asleep
    poller_aside_.store(aside, std::memory_order_seq_cst);
    if (aside && helpers_.load(std::memory_order_seq_cst) == 0 &&
        helped_at_ns_.load(std::memory_order_seq_cst) == 0) {
      continue;  // a help just failed: watch the words again
    }
    poller_asleep_.store(true, std::memory_order_seq_cst);
    if (poller_bell_.load(std::memory_order_seq_cst) == bell_seen) {
      if (!WaitForAnyWord(watch.data(), static_cast<int>(watch.size()),
                          until)) {
        have_waitv_ = false;  // old kernel: engine threads from now on
      }
    }
    poller_asleep_.store(false, std::memory_order_relaxed);
    poller_aside_.store(false, std::memory_order_relaxed);
  }
}

}  // namespace tf_rdma
