#include "kernels/engine/thread_pool.h"

#include <chrono>
#include <system_error>
#include <thread>
#include <utility>

#include "kernels/common/thread_name.h"

namespace tf_rdma {

void ThreadPool::Schedule(std::function<void()> fn) {
  // Every queued item may block until its deadline, so an item must never
  // wait behind another: unless there are at least as many idle threads as
  // queued items, start a thread. (An idle thread only leaves the idle count
  // when it takes an item, so a wake-up in flight is still counted.)
  std::unique_lock<std::mutex> lock(mu_);
  queue_.push_back(std::move(fn));
  if (idle_ >= static_cast<int>(queue_.size())) {
    cv_.notify_one();
    return;
  }
  try {
    std::thread([this] {
      NameThisThread("tfrdma-engine");
      Run();
    }).detach();
    ++threads_;
  } catch (const std::system_error& e) {
    // No thread to be had (a pids limit): the item waits for a pool thread
    // that finishes its own (every item is bounded), or, with none, runs
    // here (bounded too). Never a crash.
    bool inline_run = threads_ == 0;
    std::function<void()> item;
    if (inline_run) {
      item = std::move(queue_.back());
      queue_.pop_back();
    }
    lock.unlock();
    log_(std::string("cannot start an engine thread (") + e.what() + "); " +
         (inline_run ? "running the work on this thread"
                     : "the work waits for a busy thread"));
    if (inline_run) item();
  }
}

void ThreadPool::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    while (queue_.empty()) {
      ++idle_;
      bool woke = cv_.wait_for(lock, std::chrono::seconds(30),
                               [this] { return !queue_.empty(); });
      --idle_;
      if (!woke) {
        --threads_;
        return;
      }
    }
    std::function<void()> item = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    item();
    lock.lock();
  }
}

}  // namespace tf_rdma
