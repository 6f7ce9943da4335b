// Transfer counters: what tf_rdma.stats() reports (docs/observability.md,
// "Counters").
//
// Every send and recv adds to the counters of the (peer, transport) it moved
// data with: payload bytes, tensors (or collective blocks) moved, and the
// waits it had to make. A wait counts when the op could not go on at once:
// a send whose copy had not been released yet (credit wait), a recv whose
// data had not landed when it first looked (data wait); its time runs from
// that first look until the op goes on or fails.
//
// Cost on the data path: relaxed atomic adds, no locks. The table maps
// (peer, transport) to its counters under a mutex, but only when a slot
// binds to a connection (send) or a writer opens a region (recv); the op
// keeps the pointer. Counters are never freed, so a pointer stays valid for
// the life of the process, across reconnections and endpoint restarts.
// Reading takes relaxed loads of live counters: a snapshot is not atomic
// across counters (an op may have added its bytes but not yet its count).
//
// Waits of concurrent ops overlap, so their summed times can exceed the wall
// time. For "what fraction of the time was this process waiting", each kind
// of wait also has a busy clock: the wall time during which at least one op
// of the process waited. Its Begin/End take a mutex, on wait paths only
// (which poll or sleep anyway); every Begin is matched by one End.
#ifndef TF_RDMA_ENGINE_STATS_H_
#define TF_RDMA_ENGINE_STATS_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "kernels/common/wait.h"

namespace tf_rdma {

// The transport name of counters for waits on a peer that never connected
// (a recv that timed out before its writer opened the region).
constexpr const char* kNoTransport = "none";

// The counters of one (peer, transport). Wait times in nanoseconds.
struct PeerCounters {
  std::atomic<uint64_t> bytes_sent{0};      // payload written to the peer
  std::atomic<uint64_t> bytes_received{0};  // payload taken from the peer
  std::atomic<uint64_t> writes{0};    // tensors or blocks written to it
  std::atomic<uint64_t> receives{0};  // tensors or blocks taken from it
  std::atomic<uint64_t> credit_waits{0};
  std::atomic<uint64_t> credit_wait_ns{0};
  std::atomic<uint64_t> data_waits{0};
  std::atomic<uint64_t> data_wait_ns{0};
  // A dynamic tensor did not fit its payload area: a larger one was opened.
  std::atomic<uint64_t> dynamic_regrowths{0};

  static void Add(std::atomic<uint64_t>* counter, uint64_t n) {
    counter->fetch_add(n, std::memory_order_relaxed);
  }
};

// Wall time during which at least one wait of a kind was in progress.
class BusyClock {
 public:
  void Begin(Clock::time_point now);
  void End(Clock::time_point now);
  // Busy nanoseconds so far, the wait in progress included.
  uint64_t BusyNs(Clock::time_point now) const;
  int waiting() const;

 private:
  mutable std::mutex mu_;
  int waiting_ = 0;
  Clock::time_point since_{};
  uint64_t busy_ns_ = 0;
};

class TransferStats {
 public:
  // The counters of (peer, transport), created on first use.
  PeerCounters* For(const std::string& peer, const std::string& transport);

  // A wait that had not started starts now: *since is set and the kind's
  // busy clock begins. Does nothing if *since is already set.
  static void StartWait(Clock::time_point* since, BusyClock* busy);
  // Ends a wait begun with StartWait, if any: adds one wait and its time to
  // `count` and `ns`, ends the busy clock, and clears *since.
  static void EndWait(Clock::time_point* since, BusyClock* busy,
                      std::atomic<uint64_t>* count, std::atomic<uint64_t>* ns);

  // {"peers": [{"peer", "transport", <each counter>}, ...] sorted by peer
  // then transport, "credit_wait_busy_ns", "data_wait_busy_ns",
  // "credit_waiting", "data_waiting" (ops waiting now)}.
  std::string Json() const;

  BusyClock credit_busy;
  BusyClock data_busy;
  // Collective calls by the thread they completed on (collective.cc, the
  // inline path): the op's own, or an engine thread's after a hand-off.
  std::atomic<uint64_t> collectives_inline{0};
  std::atomic<uint64_t> collectives_handed_off{0};

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, std::unique_ptr<PeerCounters>>
      table_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_ENGINE_STATS_H_
