// Bounded waiting on a 64-bit notice word.
//
// Every wait in tf_rdma is a wait for a 64-bit word in a region to reach a
// value: a receiver waits for the sequence word of a slot copy to reach the
// step it expects, a sender waits for the credit word of a copy to say that
// the tensor which last used that copy was released. Writers (a memcpy by the
// peer over shared memory, the progress thread for TCP) publish the word with
// a release store and then wake sleepers.
//
// The waiter spins for a few microseconds first (a transfer that is already in
// flight usually lands within that time, and a futex round trip costs more),
// or for as long as its caller asks (a latency-bound collective, collective.cc),
// then sleeps on a futex keyed on the low 32 bits of the word, so an idle wait
// burns no CPU. The futex is process-shared, so it works on a word in a shared
// mapping that another process writes. Sleeps are cut into slices of at most
// 50 ms so that a dead peer (`check`) or the deadline ends the wait promptly
// even if nobody ever wakes us.
//
// Waking only sleepers. A FUTEX_WAKE costs a system call (about 0.3 µs on a
// VM) even when nobody sleeps, which is the usual case in a spinning
// exchange: a small allreduce paid two per rank and call. So a notice word
// of a region has a count of the threads asleep on it beside it
// (kSleepersOffset bytes on, inside the 64-byte slot header or credit line
// that the word starts): a waiter counts itself before its last look at the
// word and sleeps only if the word has not moved, and a writer, after
// storing the word, wakes only where the count is not zero. Both sides order
// their store before their load (sequentially consistent), so either the
// waiter sees the new value or the writer sees the waiter: no wake is lost.
// A count a waiter never took back (its process died asleep) only costs the
// writer its wake-ups again; a count a peer overwrote can delay a wake-up by
// at most one 50 ms slice.
#ifndef TF_RDMA_COMMON_WAIT_H_
#define TF_RDMA_COMMON_WAIT_H_

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

#include "kernels/common/status.h"

namespace tf_rdma {

using Clock = std::chrono::steady_clock;

// A point in time after which a wait gives up.
// Longer than any wait needs (a year), far from the clock's range.
constexpr int64_t kMaxDeadlineMs = int64_t{365} * 24 * 3600 * 1000;

class Deadline {
 public:
  // Bounds beyond kMaxDeadlineMs (about 292 years would overflow the
  // clock's nanoseconds and wrap into the past) are clamped to it.
  explicit Deadline(int64_t timeout_ms)
      : timeout_ms_(timeout_ms),
        at_(Clock::now() +
            std::chrono::milliseconds(std::min(timeout_ms, kMaxDeadlineMs))) {}
  bool Expired() const { return Clock::now() >= at_; }
  int64_t timeout_ms() const { return timeout_ms_; }
  // Milliseconds left, never negative.
  int64_t RemainingMs() const;
  Clock::time_point at() const { return at_; }

 private:
  int64_t timeout_ms_;
  Clock::time_point at_;
};

// Where a region's notice word keeps the count of its sleepers: bytes after
// the word (the call word sits between them in a slot header).
constexpr uint64_t kSleepersOffset = 16;

// The sleepers' count of a notice word of a region (see above). Only for a
// word at the start of a slot header or credit line: the count lies inside.
inline std::atomic<uint32_t>* SleepersOf(const std::atomic<uint64_t>* word) {
  return reinterpret_cast<std::atomic<uint32_t>*>(
      reinterpret_cast<uintptr_t>(word) + kSleepersOffset);
}

// Returns the word's value once it is >= target (acquire ordering), or
// DeadlineExceeded / the first non-ok status of `check` (called about every
// 50 ms while sleeping; may be empty). Spins for `spin_us` microseconds
// before the first sleep where that is longer than the few it always spins.
// `sleepers`: the word's count (SleepersOf) where its writers wake only
// counted sleepers; null for a word whose writers always wake.
Status WaitForWord(const std::atomic<uint64_t>* word, uint64_t target,
                   const Deadline& deadline,
                   const std::function<Status()>& check, int64_t spin_us = 0,
                   std::atomic<uint32_t>* sleepers = nullptr);

// One word of a WaitForAnyWord: sleep while its low 32 bits equal `seen`.
// `shared`: the word may be in memory another process maps (a region);
// false for words in this process's own memory (faster futex key).
// `sleepers`: as for WaitForWord.
struct WordWatch {
  const void* word;
  uint32_t seen;
  bool shared;
  std::atomic<uint32_t>* sleepers = nullptr;
};

// The most words one WaitForAnyWord sleeps on (the kernel's limit).
constexpr int kMaxWatchedWords = 128;

// Sleeps until any watched word is woken (PublishWord / WakeLocalWord) or no
// longer holds its `seen` value, or until `until`, or spuriously; the caller
// re-checks its words. One futex_waitv system call (Linux >= 5.16). Returns
// false, without sleeping, where the kernel does not have it.
bool WaitForAnyWord(const WordWatch* words, int n, Clock::time_point until);

// Wakes every sleeper on a word of this process's own memory (shared =
// false in WordWatch).
void WakeLocalWord(std::atomic<uint32_t>* word);

// This thread's CPU time in ns: what the cost benches (tfrdma_trace_bench,
// tfrdma_stall_bench) count, so that a busy machine preempting the thread
// does not add to it.
inline int64_t ThreadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// A hint to the CPU that this thread is busy-waiting.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Polling on the caller's thread: what the inline paths (a p2p recv's
// PollRecv, a oneshot collective's blocks) do before they hand a wait to an
// engine thread.
// What: `look` until it returns true or `until` passes. Between two looks
// the pause-spin waits one pause (26 ns, 68 cycles, on the 2-vCPU AMD EPYC
// VM), so that what lands is seen about that soon; the clock (25 ns a read
// there) is read every kLooksPerClockRead looks. Where `yields` (this host
// runs more of the cluster's tasks than it has CPUs), each look is followed
// by a yield and a read of the clock instead: the peer being polled for is
// then often runnable on this very core, and a pause-spin would hold the
// core from it for the whole budget.
// Why: looking every 32 pauses (0.8 µs there), two processes exchanging
// 4 KiB through shared memory in C took 0.51 to 0.58 µs an exchange
// against 0.10 to 0.12 µs looking every pause (2026-12-06); at P = 4 on 2
// vCPUs, 4 KiB loops of oneshot allreduces took 578 to 583 µs a call with
// the pause-spin and 448 µs with the yield (docs/benchmarks.md, "Small
// messages"); with two p2p tasks on one vCPU, the 4 KiB hop of a chain of
// 64 took 110 to 138 µs with the pause-spin and 62 to 93 µs with the yield
// (2026-12-07).
// Cost: at most the budget of the caller's clock (a yield can overrun it by
// the time slice it gave away).
constexpr uint32_t kLooksPerClockRead = 32;

template <typename Look>
bool PollFor(const Look& look, Clock::time_point until, bool yields) {
  for (uint32_t n = 1;; ++n) {
    if (look()) return true;
    if ((yields || n % kLooksPerClockRead == 0) && Clock::now() >= until) {
      return false;
    }
    if (yields) {
      sched_yield();
    } else {
      CpuRelax();
    }
  }
}

// Stores `value` with release ordering and wakes every sleeper on the word:
// with `sleepers` (the word's count, SleepersOf) only where one is counted,
// without, always.
void PublishWord(std::atomic<uint64_t>* word, uint64_t value,
                 const std::atomic<uint32_t>* sleepers = nullptr);

// Wakes every sleeper on a word whose new value was already stored (release)
// by the caller: PublishWord in two halves, for a writer with work to do in
// between (the tcp reader completing a waiting recv itself, poller.cc).
void WakeWord(std::atomic<uint64_t>* word,
              const std::atomic<uint32_t>* sleepers = nullptr);

}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_WAIT_H_
