// The verbs backend: RDMA NICs (InfiniBand, RoCE).
//
// One RC queue pair per connection, brought up over the control connection
// (verbs/factory.cc exchanges the two ends' address lines). Both ends
// write through it: the writer of a region its payloads, the reader its
// credits.
//
// A Write is two or more work requests on the send queue:
//   1. RDMA WRITE of the payload into the peer's registered region (remote
//      address + rkey from its descriptor). Where the NIC reads it from:
//      - in place, when the source lies in memory registered here (a
//        received tensor being forwarded, a collective's channel) or when
//        the device has implicit on-demand paging (context.h): then any
//        tensor TensorFlow allocated is read where it lies, no copy;
//      - inline, in the work request itself, for small payloads;
//      - staged otherwise: copied into a registered area in 1 MiB chunks,
//        the copy of chunk i+1 overlapping the wire transfer of chunk i.
//   2. The notice, a 24-byte SEND {region id, notice offset, seq}. The
//      reader's progress thread takes it from its completion queue (woken
//      through the completion channel's fd in the engine's epoll set),
//      checks it against the regions this peer may write, and publishes the
//      word, exactly as the tcp backend does for a WRITE frame.
// Why a SEND and not the alternatives the design named: WRITE_WITH_IMM has
// 32 immediate bits, too few to name a notice word and a 64-bit sequence;
// an 8-byte RDMA WRITE of the word itself behind the payload (fenced or not)
// is not ordered by the InfiniBand specification for a reader polling
// memory — the fence flag orders only behind RDMA READs and atomics — so a
// reader could see the word before the payload on some platforms. A receive
// completion, in contrast, is generated only after every earlier message on
// the RC queue pair has been placed. A SEND costs the same on the wire as a
// zero-length WRITE_WITH_IMM, and both consume one posted receive.
//
// Many writes in flight. Each op thread posts its write's requests under a
// lock and then waits, without it, until its own notice has
// completed (the peer's NIC acknowledged it; the caller may then reuse its
// buffer, and an error surfaces in the write that caused it). Writes from
// different threads to one peer therefore overlap on the wire instead of
// each paying a round trip in turn. Signalling is selective: only the
// notice, each staging chunk (its completion frees the chunk) and every
// (queue depth / 2)-th request ask for a completion. RC completes requests
// in the order they were posted, so one completion retires every request
// before it, and a full send queue always holds a signalled request, so
// room always comes back. Completions are reaped by whoever gets there
// first: a waiting writer spins on the queue for 50 us (the common, short
// case), then sleeps until the engine's progress thread, woken by the
// completion channel, reaps them and wakes it. Requests are numbered in
// post order (the work request id), so a failed completion names the write
// it belongs to: that write gets the device's status; writes posted after
// it are flushed and say that an earlier write on the connection failed,
// and why.
#ifndef TF_RDMA_TRANSPORT_VERBS_PAIR_H_
#define TF_RDMA_TRANSPORT_VERBS_PAIR_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/wait.h"
#include "kernels/transport/verbs/context.h"

namespace tf_rdma {
namespace verbs {

class Pair : public VerbsPair {
 public:
  static Status Create(Context* context, std::unique_ptr<Pair>* out);
  ~Pair() override;

  std::string address() const override;
  Status Connect(const std::string& peer_address) override;

  Status Expose(uint32_t id, const Region& region,
                RegionDescriptor* out) override;
  Status AddRemoteRegion(const RegionDescriptor& region, int* handle) override;
  Status Write(int handle, uint64_t offset, const void* src, uint64_t nbytes,
               uint64_t notice_offset, uint64_t seq,
               const Deadline& deadline) override;
  int notice_fd() const override;
  Status TakeNotices(std::vector<Notice>* out) override;
  void Close() override;
  bool broken() const override { return closed_; }
  PairCounters counters() override;

 private:
  explicit Pair(Context* context) : context_(context) {}
  Status Init();
  Status PostReceive(uint64_t index);
  // Posts one request (the caller holds mu_), first waiting for room in the
  // send queue; `signal` asks for a completion, which the signalling rule
  // may add. Returns its number.
  Status Post(ibv_send_wr* wr, bool signal, const Deadline& deadline,
              std::unique_lock<std::mutex>* lock, uint64_t* number);
  // Polls the send completion queue once and accounts what it returns
  // (caller holds mu_); true when it found any.
  bool Reap();
  // Waits (caller holds mu_ through `lock`) until `ready` holds, reaping
  // completions itself for a short spin, then relying on the progress
  // thread. Fails the pair when the deadline passes first.
  template <typename Ready>
  Status AwaitSend(const Ready& ready, const Deadline& deadline,
                   std::unique_lock<std::mutex>* lock);
  // The outcome of the write whose requests are numbered [first, last], or
  // false while it is still in flight.
  bool Outcome(uint64_t first, uint64_t last, Status* out) const;
  Status StagingBuffer(uint64_t* chunk, const Deadline& deadline,
                       std::unique_lock<std::mutex>* lock);
  Status Fail(const Status& why);  // the pair is unusable from now on
  void ReleaseStaging();           // closed and idle: unpin the staging area

  Context* context_;
  ibv_comp_channel* channel_ = nullptr;
  ibv_cq* send_cq_ = nullptr;
  ibv_cq* recv_cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  uint32_t psn_ = 0;
  bool notice_inline_ = false;   // the notice fits the inline size
  uint32_t payload_inline_ = 0;  // payloads up to this go inline
  uint32_t max_message_ = 1u << 30;
  uint64_t queue_depth_ = 0;
  std::atomic<bool> closed_{false};

  // Receives: one posted buffer per notice that may be in flight.
  uint8_t* receives_ = nullptr;
  ibv_mr* receives_mr_ = nullptr;

  RemoteRegions remote_;

  // One write posts at a time, so that a write's requests have consecutive
  // numbers (a failed completion names its write); taken before mu_, and
  // held while the write waits for room, but not for its completion.
  std::mutex post_mu_;
  std::mutex mu_;  // guards the fields below
  std::condition_variable reaped_;  // completions were accounted
  uint64_t posted_ = 0;     // requests posted, ever (a request's number)
  uint64_t completed_ = 0;  // every request up to this number completed
  uint64_t failed_ = 0;     // the first request that failed, 0 = none
  uint64_t unsignaled_ = 0;  // unsignaled requests since the last signalled
  int writes_in_flight_ = 0;
  Status error_;  // the first failure; every later write returns it
  // Outgoing notices, one per request number modulo the queue depth
  // (registered): a notice's buffer is reused only after its request left
  // the queue, and with inline notices it is read at once anyway.
  Notice* notices_ = nullptr;
  ibv_mr* notices_mr_ = nullptr;
  // Staging area for sources outside registered memory: kStagingChunks
  // chunks, allocated at the first write that needs them; chunk i is free
  // once request staging_users_[i] completed.
  uint8_t* staging_ = nullptr;
  ibv_mr* staging_mr_ = nullptr;
  std::vector<uint64_t> staging_users_;
  PairCounters counters_;  // under mu_
};

}  // namespace verbs
}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_VERBS_PAIR_H_
