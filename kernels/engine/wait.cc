#include "kernels/engine/wait.h"

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
                   const std::function<Status()>& check) {
  for (int i = 0; i < kSpinIterations; ++i) {
    if (word->load(std::memory_order_acquire) >= target) return Status::Ok();
    CpuRelax();
  }
  while (true) {
    uint64_t seen = word->load(std::memory_order_acquire);
    if (seen >= target) return Status::Ok();
    if (check) TF_RDMA_RETURN_IF_ERROR(check());
    int64_t left = deadline.RemainingMs();
    if (left <= 0) {
      return DeadlineExceeded("timed out after " +
                              std::to_string(deadline.timeout_ms()) + " ms");
    }
    int64_t slice = left < kSliceMs ? left : kSliceMs;
    struct timespec ts;
    ts.tv_sec = slice / 1000;
    ts.tv_nsec = (slice % 1000) * 1000000;
    // Returns at once (EAGAIN) if the low half moved since `seen`.
    syscall(SYS_futex, LowHalf(word), FUTEX_WAIT,
            static_cast<uint32_t>(seen), &ts, nullptr, 0);
  }
}

void PublishWord(std::atomic<uint64_t>* word, uint64_t value) {
  word->store(value, std::memory_order_release);
  syscall(SYS_futex, LowHalf(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace tf_rdma
