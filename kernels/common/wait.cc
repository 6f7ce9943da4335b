#include "kernels/common/wait.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>

namespace tf_rdma {
namespace {

static_assert(sizeof(std::atomic<uint64_t>) == 8, "notice words are 8 bytes");

// The futex sits on the low half of the 64-bit word (little-endian x86/arm).
uint32_t* LowHalf(const std::atomic<uint64_t>* word) {
  return reinterpret_cast<uint32_t*>(const_cast<std::atomic<uint64_t>*>(word));
}

constexpr int kSpinIterations = 1000;  // ~10-40 us, by CPU
constexpr int64_t kSliceMs = 50;

}  // namespace

Status ErrnoStatus(const std::string& what, int err) {
  return Internal(what + ": " + std::strerror(err));
}

int64_t Deadline::RemainingMs() const {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                  at_ - Clock::now())
                  .count();
  return left > 0 ? left : 0;
}

Status WaitForWord(const std::atomic<uint64_t>* word, uint64_t target,
                   const Deadline& deadline,
                   const std::function<Status()>& check, int64_t spin_us,
                   std::atomic<uint32_t>* sleepers) {
  for (int i = 0; i < kSpinIterations; ++i) {
    if (word->load(std::memory_order_acquire) >= target) return Status::Ok();
    CpuRelax();
  }
  if (spin_us > 0) {
    Clock::time_point until = Clock::now() + std::chrono::microseconds(spin_us);
    do {
      for (int i = 0; i < 64; ++i) {
        if (word->load(std::memory_order_acquire) >= target) {
          return Status::Ok();
        }
        CpuRelax();
      }
    } while (Clock::now() < until);
  }
  while (true) {
    uint64_t seen = word->load(std::memory_order_acquire);
    if (seen >= target) return Status::Ok();
    if (check) {
      Status s = check();
      if (!s.ok()) {
        // The word may have moved since it was read: a peer that published
        // and then stopped (its goodbye is what check() saw) did deliver.
        return word->load(std::memory_order_acquire) >= target ? Status::Ok()
                                                                : s;
      }
    }
    int64_t left = deadline.RemainingMs();
    if (left <= 0) {
      return DeadlineExceeded("timed out after " +
                              std::to_string(deadline.timeout_ms()) + " ms");
    }
    int64_t slice = left < kSliceMs ? left : kSliceMs;
    struct timespec ts;
    ts.tv_sec = slice / 1000;
    ts.tv_nsec = (slice % 1000) * 1000000;
    if (sleepers != nullptr) {
      // Counted first, then the last look: a writer that stores after this
      // look sees the count and wakes us (see wait.h).
      sleepers->fetch_add(1, std::memory_order_seq_cst);
      seen = word->load(std::memory_order_seq_cst);
      if (seen >= target) {
        sleepers->fetch_sub(1, std::memory_order_relaxed);
        return Status::Ok();
      }
    }
    // Returns at once (EAGAIN) if the low half moved since `seen`.
    syscall(SYS_futex, LowHalf(word), FUTEX_WAIT,
            static_cast<uint32_t>(seen), &ts, nullptr, 0);
    if (sleepers != nullptr) {
      sleepers->fetch_sub(1, std::memory_order_relaxed);
    }
  }
}

namespace {

// WaitForAnyWord's counts: taken for every watched word that has one,
// given back when the sleep ends. Unmoved() says whether every such word
// still holds its `seen` value after counting (else there is no need to
// sleep).
class CountedSleep {
 public:
  CountedSleep(const WordWatch* words, int n) : words_(words), n_(n) {
    for (int i = 0; i < n_; ++i) {
      if (words_[i].sleepers != nullptr) {
        words_[i].sleepers->fetch_add(1, std::memory_order_seq_cst);
      }
    }
  }
  ~CountedSleep() {
    for (int i = 0; i < n_; ++i) {
      if (words_[i].sleepers != nullptr) {
        words_[i].sleepers->fetch_sub(1, std::memory_order_relaxed);
      }
    }
  }
  bool Unmoved() const {
    for (int i = 0; i < n_; ++i) {
      if (words_[i].sleepers == nullptr) continue;
      const auto* word =
          static_cast<const std::atomic<uint64_t>*>(words_[i].word);
      if (static_cast<uint32_t>(word->load(std::memory_order_seq_cst)) !=
          words_[i].seen) {
        return false;
      }
    }
    return true;
  }

 private:
  const WordWatch* words_;
  int n_;
};

}  // namespace

bool WaitForAnyWord(const WordWatch* words, int n, Clock::time_point until) {
  if (n > kMaxWatchedWords) n = kMaxWatchedWords;
  CountedSleep counted(words, n);
  if (!counted.Unmoved()) return true;  // a watched word moved: no sleep
  if (n == 1) {  // a plain futex wait does, on every kernel
    auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(
                    until - Clock::now())
                    .count();
    if (left <= 0) return true;
    struct timespec ts;
    ts.tv_sec = left / 1000000000;
    ts.tv_nsec = left % 1000000000;
    syscall(SYS_futex, const_cast<void*>(words[0].word),
            words[0].shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, words[0].seen,
            &ts, nullptr, 0);
    return true;
  }
#ifdef __NR_futex_waitv
  struct futex_waitv waiters[kMaxWatchedWords];
  for (int i = 0; i < n; ++i) {
    waiters[i].val = words[i].seen;
    waiters[i].uaddr = reinterpret_cast<uintptr_t>(words[i].word);
    waiters[i].flags = FUTEX_32 | (words[i].shared ? 0 : FUTEX_PRIVATE_FLAG);
    waiters[i].__reserved = 0;
  }
  // futex_waitv takes an absolute CLOCK_MONOTONIC time, which is what
  // steady_clock reads on Linux.
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                until.time_since_epoch())
                .count();
  if (ns < 0) ns = 0;
  struct timespec ts;
  ts.tv_sec = ns / 1000000000;
  ts.tv_nsec = ns % 1000000000;
  long r = syscall(__NR_futex_waitv, waiters, n, 0, &ts, CLOCK_MONOTONIC);
  return !(r < 0 && errno == ENOSYS);
#else
  (void)words;
  (void)n;
  (void)until;
  return false;
#endif
}

void WakeLocalWord(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE,
          INT_MAX, nullptr, nullptr, 0);
}

void PublishWord(std::atomic<uint64_t>* word, uint64_t value,
                 const std::atomic<uint32_t>* sleepers) {
  word->store(value, std::memory_order_release);
  WakeWord(word, sleepers);
}

void WakeWord(std::atomic<uint64_t>* word,
              const std::atomic<uint32_t>* sleepers) {
  if (sleepers != nullptr) {
    // The store before the look at the count (a waiter counts itself
    // before its last look at the word: see wait.h).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (sleepers->load(std::memory_order_relaxed) == 0) return;
  }
  syscall(SYS_futex, LowHalf(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace tf_rdma
