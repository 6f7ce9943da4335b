// The stall inspector: a wait that lasts names who is late, and where.
//
// What. A send or recv that has to sleep (a recv whose data has not landed,
// a send whose copy the reader has not released, each block of a
// collective) registers its wait here while it sleeps; so does a send while
// it connects (dials its peer and opens its region there), which waits for
// as long as the peer is not up. One watchdog thread
// looks at the registered waits every quarter of a second; a wait older
// than TF_RDMA_STALL_WARNING (EngineConfig::stall_warning_ms) gets one log
// line, for the oldest wait of its slot (one line per stalled slot, however
// many ops wait on it), again at 2x, 4x, ... the warning while it lasts:
//
//   tf_rdma[/job:worker/task:1]: stall: allreduce 'grads' step 5 waits
//   1.0 s for block 12 from /job:worker/task:0, which is in step 5 of it
//   (has completed 4); it itself waits: allreduce 'grads' step 5 waits
//   1.0 s for block 11 from /job:worker/task:2
//
// The line names the tensor (or the collective and its call), this task's
// step (the call's id with match_calls, as SlotSpec::Describe), how long it
// has waited, the peer, and the peer's own position for that slot, which
// the peer itself gives: a `what=position` query (query.cc) on the control
// connection, answered from its engine state by AnswerPosition (the last
// step it wrote or took on the slot, whether it waits on it, the calls of
// the collective it completed and whether it is in one), together with the
// waits the peer itself is sleeping in. A chain ("worker:1 waits for
// worker:0, which waits for worker:2") is read off one line. A peer that
// does not answer within kAskMs (stopped, hung, overloaded) is said to, and
// the line gives what this side knows instead: the slot's sequence words
// hold the peer's last written step, its credit words the last step the
// peer released.
//
// A wait that times out (TF_RDMA_TIMEOUT) carries the same facts in its
// error, asked afresh (bounded by kAskAtTimeoutMs, so that the error stays
// within the timeout's second of grace) or, if the peer does not answer,
// as last learnt (StallFacts).
//
// Why here. A stall is visible only to the side that waits, and what it
// waits for is the state of another process: only the peer can say whether
// it is behind, blocked on a third task, or gone. Its reader thread answers
// control frames even while every transfer between the two is stuck.
//
// Cost. Nothing for a transfer that does not wait: a wait registers only
// once it sleeps (the poller, a thread blocked on a word), at the points
// where the counters (stats.h) already note that a wait began; that is a
// mutex, a small allocation and a vector push, against the microseconds to
// seconds the wait lasts. The watchdog thread starts with the first wait and
// sleeps on a condition variable while nothing waits; while something does
// it wakes every kScanMs and walks the list. Questions to peers and the log
// run on engine threads (Schedule), never on the poller, so a peer that
// does not answer delays only its own line.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/common/text.h"
#include "kernels/engine/engine.h"
#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

namespace {

// How long a question to a peer may take: for a stall line, and when a
// wait has timed out (its error is due; the reliability contract gives it
// timeout + 1 s in all).
constexpr int64_t kAskMs = 1000;
constexpr int64_t kAskAtTimeoutMs = 250;
// How often the watchdog looks at the waits (at most; less for a warning
// below a second).
constexpr int64_t kScanMs = 250;
// The peer's waits an answer lists.
constexpr size_t kWaitsAnswered = 2;

// The collectives running on this thread (RunCollective), innermost last.
struct CollectiveCall {
  std::string instance;
  std::string describe;
  uint64_t call = 0;
};
thread_local std::vector<CollectiveCall> t_collectives;

std::string Seconds(Clock::duration d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s",
                std::chrono::duration<double>(d).count());
  return buf;
}

// "step 7", or with match_calls "call 7" (as SlotSpec::Describe).
std::string StepWord(const SlotSpec& spec, uint64_t step) {
  return (spec.match_calls ? "call " : "step ") + std::to_string(step);
}

}  // namespace

uint64_t Engine::WaitBusyNs(Clock::time_point now) const {
  return stats_.credit_busy.BusyNs(now) + stats_.data_busy.BusyNs(now);
}

void Engine::CollectiveBegin(const std::string& instance, uint64_t call) {
  const Clock::time_point now = Clock::now();
  const uint64_t busy = WaitBusyNs(now);
  std::lock_guard<std::mutex> lock(stall_mu_);
  CollectivePosition& c = collectives_[instance];
  c.running = call;
  c.began = now;
  c.busy_at_begin_ns = busy;
}

void Engine::CollectiveWaitsBegin(const std::string& instance,
                                  const std::string& describe,
                                  uint64_t call) {
  t_collectives.push_back(CollectiveCall{instance, describe, call});
}

void Engine::CollectiveWaitsEnd() {
  if (!t_collectives.empty()) t_collectives.pop_back();
}

void Engine::CountCollective(bool inline_path) {
  PeerCounters::Add(inline_path ? &stats_.collectives_inline
                                : &stats_.collectives_handed_off,
                    1);
}

void Engine::CollectiveEnd(const std::string& instance, bool ok) {
  const Clock::time_point now = Clock::now();
  const uint64_t busy = WaitBusyNs(now);
  std::lock_guard<std::mutex> lock(stall_mu_);
  auto it = collectives_.try_emplace(instance).first;
  CollectivePosition& c = it->second;
  last_collective_ = &it->first;
  last_collective_call_ = c.running;
  last_collective_began_ = c.began;
  last_collective_ended_ = now;
  last_collective_waited_ns_ =
      busy > c.busy_at_begin_ns ? busy - c.busy_at_begin_ns : 0;
  c.completed = std::max(c.completed, c.running);
  c.running = 0;
  c.failed = !ok;
}

int64_t Engine::StallBench(int64_t n) {
  // Never freed: a peer's question may still read a wait of it (slots live
  // as long as the engine).
  static RecvSlot* slot = [] {
    RecvSlot* s = new RecvSlot();
    s->spec.tensor_name = "bench/tensor:0";
    s->spec.peer = "/job:worker/task:1";
    return s;
  }();
  int64_t start = ThreadCpuNs();
  for (int64_t i = 0; i < n; ++i) {
    EndStall(BeginStall(StallWait::kData, slot, nullptr,
                        static_cast<uint64_t>(i + 1), 0));
  }
  return ThreadCpuNs() - start;
}

std::shared_ptr<StallWait> Engine::BeginStall(int kind, RecvSlot* recv,
                                              SendSlot* send, uint64_t step,
                                              uint64_t need) {
  auto w = std::make_shared<StallWait>();
  w->kind = kind;
  w->recv = recv;
  w->send = send;
  w->spec = recv != nullptr ? &recv->spec : &send->spec;
  w->step = step;
  w->need = need;
  if (!t_collectives.empty()) {
    w->collective = t_collectives.back().describe;
    w->instance = t_collectives.back().instance;
    w->collective_step = t_collectives.back().call;
  }
  w->since = Clock::now();
  const int64_t warning = config_.stall_warning_ms;
  w->next_report = w->since + std::chrono::milliseconds(
                                  warning > 0 ? warning : kMaxDeadlineMs);
  {
    std::lock_guard<std::mutex> lock(stall_mu_);
    stalls_.push_back(w);
    if (watchdog_asleep_) stall_cv_.notify_one();
  }
  if (warning > 0) {
    std::call_once(watchdog_once_, [this] {
      std::thread([this] {
        NameThisThread("tfrdma-watchdog");
        WatchdogLoop();
      }).detach();
    });
  }
  return w;
}

void Engine::EndStall(const std::shared_ptr<StallWait>& wait) {
  if (!wait) return;
  std::lock_guard<std::mutex> lock(stall_mu_);
  auto it = std::find(stalls_.begin(), stalls_.end(), wait);
  if (it == stalls_.end()) return;
  *it = std::move(stalls_.back());
  stalls_.pop_back();
}

void Engine::WatchdogLoop() {
  std::unique_lock<std::mutex> lock(stall_mu_);
  while (true) {
    if (stalls_.empty()) {
      watchdog_asleep_ = true;
      stall_cv_.wait(lock, [this] { return !stalls_.empty(); });
      watchdog_asleep_ = false;
    }
    const int64_t warning = config_.stall_warning_ms;
    const int64_t scan =
        warning > 0 ? std::max<int64_t>(10, std::min(kScanMs, warning / 4))
                    : kScanMs;
    stall_cv_.wait_for(lock, std::chrono::milliseconds(scan));
    if (warning <= 0 || !started_.load()) continue;
    // The oldest due wait of each slot (and direction) is reported; the
    // others on that slot are due again with it. A slot whose report is
    // still asking its peer stays due until that report is done.
    const Clock::time_point now = Clock::now();
    using SlotWay = std::pair<const SlotSpec*, int>;
    std::set<SlotWay> asking;
    for (const auto& w : stalls_) {
      if (w->asking) asking.insert(SlotWay(w->spec, w->kind));
    }
    std::map<SlotWay, std::shared_ptr<StallWait>> due;
    for (const auto& w : stalls_) {
      if (now < w->next_report || asking.count(SlotWay(w->spec, w->kind))) {
        continue;
      }
      int64_t next = warning;
      while (w->since + std::chrono::milliseconds(next) <= now &&
             next < kMaxDeadlineMs / 2) {
        next *= 2;
      }
      w->next_report = w->since + std::chrono::milliseconds(next);
      auto& oldest = due[SlotWay(w->spec, w->kind)];
      if (!oldest || w->since < oldest->since) oldest = w;
    }
    std::vector<std::shared_ptr<StallWait>> report;
    for (auto& kv : due) {
      kv.second->asking = true;
      report.push_back(kv.second);
    }
    if (report.empty()) continue;
    lock.unlock();
    for (auto& w : report) Schedule([this, w] { ReportStall(w); });
    lock.lock();
  }
}

void Engine::ReportStall(const std::shared_ptr<StallWait>& wait) {
  // How long it had waited when the report began (the question may take
  // up to kAskMs more).
  std::string subject = StallSubject(*wait, Clock::now());
  bool answered = false;
  std::string position = PeerPosition(*wait, Deadline(kAskMs), &answered);
  std::string line = "stall: " + subject + ", which " + position;
  {
    std::lock_guard<std::mutex> lock(stall_mu_);
    wait->asking = false;
    if (answered) {
      wait->learnt = position;
      wait->learnt_at = Clock::now();
    }
  }
  Log(line);
}

std::string Engine::StallSubject(const StallWait& w, Clock::time_point now) {
  const SlotSpec& spec = *w.spec;
  const std::string waits = " waits " + Seconds(now - w.since) + " for ";
  const bool data = w.kind == StallWait::kData;
  if (w.kind == StallWait::kConnect) {
    std::string head = w.collective.empty()
                           ? "send of tensor '" + spec.tensor_name + "' " +
                                 StepWord(spec, w.step)
                           : w.collective + " step " +
                                 std::to_string(w.collective_step);
    return head + " waits " + Seconds(now - w.since) + " to connect to " +
           spec.peer + " and open its region there";
  }
  if (!w.collective.empty()) {
    std::string head = w.collective + " step " +
                       std::to_string(w.collective_step) + waits;
    return data ? head + "block " + std::to_string(w.step) + " from " +
                      spec.peer
                : head + spec.peer + " to take block " +
                      std::to_string(w.need);
  }
  std::string head = std::string(data ? "recv" : "send") + " of tensor '" +
                     spec.tensor_name + "' " + StepWord(spec, w.step) + waits;
  if (data) return head + "its data from " + spec.peer;
  if (spec.match_calls) {
    return head + spec.peer + " to release one of its " +
           std::to_string(spec.depth) + " copies";
  }
  return head + spec.peer + " to release step " + std::to_string(w.need) +
         " of it";
}

std::string Engine::PeerPosition(const StallWait& w, const Deadline& deadline,
                                 bool* answered) {
  const SlotSpec& spec = *w.spec;
  std::vector<std::string> connected;
  if (w.kind == StallWait::kConnect) connected = ConnectedPeers();
  if (w.kind == StallWait::kConnect &&
      std::find(connected.begin(), connected.end(), spec.peer) ==
          connected.end()) {
    *answered = false;
    return "has not accepted a connection from this side yet (not started, "
           "or not reachable at its address)";
  }
  std::map<std::string, std::string> fields = {
      {"what", "position"},
      {"slot", SlotKey(spec)},
      // The side the peer holds.
      {"side", w.kind == StallWait::kData ? "send" : "recv"},
      {"tensor", spec.tensor_name}};
  if (!w.instance.empty()) fields["collective"] = w.instance;
  std::map<std::string, std::string> reply;
  Status s = Query(spec.peer, fields, deadline, &reply);
  *answered = s.ok() && !reply["position"].empty();
  if (*answered) {
    std::string out = Printable(reply["position"], 300);
    if (!reply["waits"].empty()) {
      out += "; it itself waits: " + Printable(reply["waits"], 600);
    }
    return out;
  }
  std::string why;
  if (s.code() == Code::kDeadlineExceeded) {
    why = "does not answer (no reply within " +
          std::to_string(deadline.timeout_ms()) +
          " ms: stopped, hung or overloaded)";
  } else if (s.ok()) {
    why = "gave no position (an older tf_rdma)";
  } else {
    why = "cannot be asked (" + s.message() + ")";
  }
  return why + "; " + LocalFacts(w);
}

std::string Engine::LocalFacts(const StallWait& w) {
  const SlotSpec& spec = *w.spec;
  const std::string unit = w.collective.empty() ? "step " : "block ";
  if (w.kind == StallWait::kData) {
    RecvSlot* slot = w.recv;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!slot->region.load(std::memory_order_acquire)->writer) {
        return "it has not connected to write here yet";
      }
    }
    Region* memory = slot->region.load(std::memory_order_acquire)->memory.get();
    uint64_t last = 0, call = 0;
    for (int64_t c = 0; c < spec.depth; ++c) {
      uint64_t at = CopyOffset(spec, c);
      uint64_t step = memory->Word(at)->load(std::memory_order_acquire);
      if (step > last) {
        last = step;
        call = memory->Word(at + kCallWordOffset)
                   ->load(std::memory_order_relaxed);
      }
    }
    if (last == 0) return "it has written nothing here yet";
    if (spec.match_calls) {
      return "the last it wrote here was call " + std::to_string(call) +
             " (its step " + std::to_string(last) + " on this slot)";
    }
    return "the last it wrote here was " + unit + std::to_string(last);
  }
  SendSlot* slot = w.send;
  if (w.kind == StallWait::kConnect) {
    return "this side is connected to it and waits for its answer";
  }
  // A send that is binding the slot holds its lock while it dials.
  std::unique_lock<std::mutex> slot_lock(slot->mu, std::try_to_lock);
  if (!slot_lock.owns_lock()) return "this side is connecting to it";
  if (!CreditsMapped(*slot)) return "this side has not connected to it";
  uint64_t released = 0;
  for (int64_t c = 0; c < spec.depth; ++c) {
    released = std::max<uint64_t>(
        released,
        CreditWord(slot->credits, spec, c)->load(std::memory_order_acquire));
  }
  if (released == 0) return "it has released nothing here yet";
  return "the last it released here was " + unit + std::to_string(released);
}

std::string Engine::StallFacts(const std::shared_ptr<StallWait>& wait) {
  if (!wait) return "";
  bool answered = false;
  std::string position =
      PeerPosition(*wait, Deadline(kAskAtTimeoutMs), &answered);
  std::string out = "; " + wait->spec->peer + " " + position;
  if (!answered) {
    std::lock_guard<std::mutex> lock(stall_mu_);
    if (!wait->learnt.empty()) {
      out += "; " + Seconds(Clock::now() - wait->learnt_at) +
             " ago it said it " + wait->learnt;
    }
  }
  return out;
}

void Engine::AnswerPosition(const std::map<std::string, std::string>& fields,
                            std::map<std::string, std::string>* reply) {
  auto field = [&](const char* key) {
    auto it = fields.find(key);
    return it == fields.end() ? std::string() : it->second;
  };
  const std::string key = field("slot"), side = field("side"),
                    instance = field("collective");
  const Clock::time_point now = Clock::now();
  std::vector<std::shared_ptr<StallWait>> waits;
  CollectivePosition coll;
  bool coll_known = false;
  {
    std::lock_guard<std::mutex> lock(stall_mu_);
    waits = stalls_;
    auto it = collectives_.find(instance);
    if (it != collectives_.end()) {
      coll = it->second;
      coll_known = true;
    }
  }
  std::sort(waits.begin(), waits.end(),
            [](const std::shared_ptr<StallWait>& a,
               const std::shared_ptr<StallWait>& b) {
              return a->since < b->since;
            });
  std::string position;
  // Set for a transfer: its slot, whose own waits the position names.
  const SlotSpec* asked = nullptr;
  if (!instance.empty()) {
    if (!coll_known) {
      position = "has not started this collective";
    } else if (coll.running != 0) {
      position = "is in step " + std::to_string(coll.running) +
                 " of it (has completed " + std::to_string(coll.completed) +
                 ")";
    } else {
      position = "has completed step " + std::to_string(coll.completed) +
                 " of it and is not in it" +
                 (coll.failed ? " (its last call failed)" : "");
    }
  } else if (side == "send") {
    SendSlot* slot = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = send_slots_.find(key);
      if (it != send_slots_.end()) slot = it->second.get();
    }
    if (slot == nullptr) {
      position = "has not sent this tensor yet";
    } else {
      asked = &slot->spec;
      std::shared_ptr<StallWait> waiting;
      for (const auto& w : waits) {
        if (w->send == slot && w->kind == StallWait::kCredit) {
          if (!waiting || w->step < waiting->step) waiting = w;
        }
      }
      // The slot's mutex is held while a send connects: ask, don't wait.
      std::unique_lock<std::mutex> lock(slot->mu, std::try_to_lock);
      if (!lock.owns_lock()) {
        position = "is busy on this slot (connecting or choosing a copy)";
      } else if (slot->spec.match_calls) {
        uint64_t written = slot->steps.claimed;
        lock.unlock();
        position = "has written " + std::to_string(written) +
                   " tensors on this slot" +
                   (waiting ? " and waits " + Seconds(now - waiting->since) +
                                  " for a free copy to write call " +
                                  std::to_string(waiting->step)
                            : " and is not waiting to send it");
      } else {
        uint64_t claimed = slot->steps.claimed;
        lock.unlock();
        uint64_t written = waiting ? waiting->step - 1 : claimed;
        position = "has written step " + std::to_string(written) + " of it" +
                   (waiting ? " and waits " + Seconds(now - waiting->since) +
                                  " for a credit to write step " +
                                  std::to_string(waiting->step)
                            : " and is not waiting to send it");
      }
    }
  } else {
    RecvSlot* slot = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = recv_slots_.find(key);
      if (it != recv_slots_.end()) slot = it->second.get();
    }
    if (slot == nullptr) {
      position = "has not received this tensor yet";
    } else {
      asked = &slot->spec;
      std::shared_ptr<StallWait> waiting;
      for (const auto& w : waits) {
        if (w->recv == slot && w->kind == StallWait::kData) {
          if (!waiting || w->step < waiting->step) waiting = w;
        }
      }
      uint64_t taken = 0;
      std::unique_lock<std::mutex> lock(slot->mu, std::try_to_lock);
      if (lock.owns_lock()) {
        taken = slot->steps.claimed;
        for (uint64_t t : slot->taken) taken = std::max(taken, t);
        lock.unlock();
      }
      if (waiting) {
        position = "waits " + Seconds(now - waiting->since) + " for " +
                   StepWord(slot->spec, waiting->step) + " of it";
      } else if (taken == 0) {
        position = "is not waiting for it";
      } else {
        position = "has taken step " + std::to_string(taken) +
                   " of it and is not waiting for it (a copy is released "
                   "when the last use of its tensor ends)";
      }
    }
  }
  (*reply)["position"] = position;
  // Its own waits (the asked slot's aside: the position says them), the
  // oldest first: where a chain of waits goes on.
  std::string listed;
  size_t n = 0;
  for (const auto& w : waits) {
    if (n == kWaitsAnswered) break;
    if (asked != nullptr && w->spec == asked) continue;
    listed += (listed.empty() ? "" : "; ") + StallSubject(*w, now);
    ++n;
  }
  if (!listed.empty()) (*reply)["waits"] = listed;
}

}  // namespace tf_rdma
