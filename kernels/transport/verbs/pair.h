// The verbs backend: RDMA NICs (InfiniBand, RoCE).
//
// One RC queue pair per connection, brought up over the control connection
// (verbs/factory.cc exchanges the two ends' address lines). Both ends
// write through it: the writer of a region its payloads, the reader its
// credits.
//
// A Write is two work requests on the send queue:
//   1. RDMA WRITE of the payload into the peer's registered region (remote
//      address + rkey from its descriptor). The source is used in place when
//      it lies in memory registered here (a received tensor being forwarded,
//      a collective's channel); small payloads are posted inline; any other
//      source is copied into a registered staging area in chunks, the copy
//      of chunk i+1 overlapping the wire transfer of chunk i.
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
// Write waits until both requests completed (the peer's NIC acknowledged
// them), so that the caller may reuse its buffer and an error surfaces in
// the write that caused it. Cost: one network round trip per write on top
// of the transfer, a few microseconds; writes on one pair are serialized.
#ifndef TF_RDMA_TRANSPORT_VERBS_PAIR_H_
#define TF_RDMA_TRANSPORT_VERBS_PAIR_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <memory>
#include <mutex>
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

 private:
  explicit Pair(Context* context) : context_(context) {}
  Status Init();
  Status PostReceive(uint64_t index);
  Status Post(ibv_send_wr* wr, const Deadline& deadline);
  // Polls the send queue's completions until at most `left` requests are
  // outstanding.
  Status Drain(int left, const Deadline& deadline);
  // The queue pair is in the error state: polls the send completions that
  // are already there and returns the first failure (or OK if none).
  Status ReapSendFailure();
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
  std::atomic<bool> closed_{false};

  // Receives: one posted buffer per notice that may be in flight.
  uint8_t* receives_ = nullptr;
  ibv_mr* receives_mr_ = nullptr;

  RemoteRegions remote_;

  std::mutex write_mu_;  // one Write at a time; guards the fields below
  int outstanding_ = 0;  // posted send requests not yet completed
  Status error_;         // the first failure; every later write returns it
  Notice* notice_ = nullptr;  // the outgoing notice (registered)
  ibv_mr* notice_mr_ = nullptr;
  // Staging area for sources outside registered memory: kStagingChunks
  // chunks, allocated at the first write that needs them.
  uint8_t* staging_ = nullptr;
  ibv_mr* staging_mr_ = nullptr;
  std::vector<bool> staging_busy_;
};

}  // namespace verbs
}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_VERBS_PAIR_H_
