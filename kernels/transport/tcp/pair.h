// The TCP backend: any two hosts.
//
// TCP has no one-sided write, so it is emulated: the writer sends a WRITE
// frame (common/wire.h) — header then payload, in one sendmsg — on the pair's
// connection, and the connection's reader thread on the other side
// (engine/connections.cc) reads the payload straight into the region (no
// staging buffer) and publishes the notice word (ApplyWrite). The reader
// checks every frame against the region it names before a byte is written;
// a frame that does not fit closes the connection.
#ifndef TF_RDMA_TRANSPORT_TCP_PAIR_H_
#define TF_RDMA_TRANSPORT_TCP_PAIR_H_

#include <atomic>
#include <functional>
#include <mutex>

#include "kernels/common/region.h"
#include "kernels/common/wire.h"
#include "kernels/transport/transport.h"

namespace tf_rdma {
namespace tcp {

class Pair : public ::tf_rdma::Pair {
 public:
  // `fd` is the connection's socket; `send_mu` serializes every frame sent
  // on it (credits and payloads share the socket).
  Pair(int fd, std::mutex* send_mu) : fd_(fd), send_mu_(send_mu) {}
  const char* transport() const override { return "tcp"; }
  Status AddRemoteRegion(const RegionDescriptor& region, int* handle) override;
  Status Write(int handle, uint64_t offset, const void* src, uint64_t nbytes,
               uint64_t notice_offset, uint64_t seq,
               const Deadline& deadline) override;
  Status NoticeThenWrite(int handle, uint64_t first_notice_offset,
                         uint64_t first_seq, uint64_t offset, const void* src,
                         uint64_t nbytes, uint64_t notice_offset, uint64_t seq,
                         const Deadline& deadline) override;
  bool broken() const override { return broken_; }

 private:
  // Sends the header bytes, then the payload (if any), in one sendmsg under
  // the connection's send lock; a frame cut off by its deadline breaks the
  // connection for good.
  Status SendFrames(const void* headers, size_t header_bytes,
                    const void* payload, uint64_t nbytes,
                    const Deadline& deadline);
  int fd_;
  std::mutex* send_mu_;
  std::atomic<bool> broken_{false};  // a frame was cut off by its deadline
  RemoteRegions regions_;
};

// Applies a WRITE frame whose header `h` was just read from `fd`: checks it,
// reads the payload into the region and publishes the notice. An error means
// nothing was written and the connection must be closed. `landed`, if set,
// runs after the notice word is stored and before its sleepers are woken.
Status ApplyWrite(int fd, const FrameHeader& h, const RegionLookup& lookup,
                  const std::function<void()>& landed = nullptr);

}  // namespace tcp
}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_TCP_PAIR_H_
