// Blocking-work threads: the engine's pool for work that may block (each
// item in a bounded wait): binding a send to its peer, a collective's steps,
// recv waits the poller hands off.
#ifndef TF_RDMA_ENGINE_THREAD_POOL_H_
#define TF_RDMA_ENGINE_THREAD_POOL_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>

namespace tf_rdma {

// Grows on demand, so that no item waits behind another; a thread idle for
// 30 s exits. Threads are detached: the pool must outlive them (the
// engine's is never destroyed).
class ThreadPool {
 public:
  // `log` is told when no thread can be started (a pids limit); it must
  // not block.
  explicit ThreadPool(std::function<void(const std::string&)> log)
      : log_(std::move(log)) {}
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs `fn` on a pool thread (or, when no thread can be had at all, on
  // this one).
  void Schedule(std::function<void()> fn);

 private:
  void Run();

  std::function<void(const std::string&)> log_;
  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  int threads_ = 0;
  int idle_ = 0;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_ENGINE_THREAD_POOL_H_
