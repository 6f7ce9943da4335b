// The transport contract: one-sided write with a completion notice.
//
// Everything tf_rdma moves between processes — tensor payloads and the
// credits that hand slots back — is one operation:
//
//   Write(handle, offset, src, nbytes, notice_offset, seq)
//     copy nbytes from local memory `src` into the peer's region `handle`
//     at `offset`, then make the 64-bit word at `notice_offset` of that
//     region equal to `seq`, such that a reader who sees the new word also
//     sees the payload.
//
// The reader never takes part: it waits on the notice word in its own memory
// (common/wait.h). That is RDMA semantics, and each backend provides it its
// own way:
//   - shm:   the peer's segment is mapped here; memcpy, release-store, futex
//            wake. No thread on the receiving side is involved.
//   - tcp:   a WRITE frame (header + payload) on the pair's socket; the
//            receiver's progress thread reads the payload straight into the
//            region (bounds-checked there) and publishes the word.
//   - verbs: RDMA WRITE into the registered region (remote address + rkey
//            travel in the region descriptor), then the notice as a small
//            SEND on the same RC queue pair; the reader's progress thread
//            takes it from the completion queue and publishes the word
//            (verbs/pair.h says why not WRITE_WITH_IMM or a fenced write).
//            Regions are registered once, when first exposed to a verbs
//            peer (they are created once, never on the data path).
// A pair is created after the bootstrap handshake on the control connection
// (engine/handshake.cc) has authenticated the peer and chosen the backend,
// by the backend's Transport (below), which the engine gets by name from
// the registry (transport/factory.h) and never names itself; the control
// connection carries the region descriptors.
#ifndef TF_RDMA_TRANSPORT_TRANSPORT_H_
#define TF_RDMA_TRANSPORT_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/common/region.h"
#include "kernels/common/status.h"
#include "kernels/common/wait.h"

namespace tf_rdma {

// What a peer needs to know to write into one of our regions.
struct RegionDescriptor {
  uint32_t id = 0;        // endpoint-local id; tcp frames name the region by it
  uint64_t size = 0;      // bytes; every write is checked against it
  std::string shm_name;   // shm: the segment to map
  uint64_t remote_addr = 0;  // verbs: the registered address
  uint32_t rkey = 0;         // verbs: the remote key
};

// A notice that arrived as a message (verbs): "make the word at `offset` of
// our region `region_id` equal to `seq`". The engine checks it against the
// regions this peer may write before it publishes it.
struct Notice {
  uint32_t region_id = 0;
  uint32_t reserved = 0;
  uint64_t offset = 0;
  uint64_t seq = 0;
};

// The peer's regions a pair was given, by handle, for the backends whose
// writes leave the process (tcp, verbs): each write is checked here against
// the region's size before a byte is sent, and again by the receiver.
// Header-only: the verbs plugin uses it too.
class RemoteRegions {
 public:
  int Add(const RegionDescriptor& region) {
    std::lock_guard<std::mutex> lock(mu_);
    regions_.push_back(region);
    return static_cast<int>(regions_.size()) - 1;
  }
  // Copies out the region of `handle` if the write fits it.
  Status Find(int handle, uint64_t offset, uint64_t nbytes,
              uint64_t notice_offset, RegionDescriptor* out) const {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (handle < 0 || handle >= static_cast<int>(regions_.size())) {
        return InvalidArgument("no remote region with handle " +
                               std::to_string(handle));
      }
      *out = regions_[handle];
    }
    if (offset > out->size || nbytes > out->size - offset || out->size < 8 ||
        notice_offset % 8 != 0 || notice_offset > out->size - 8) {
      return InvalidArgument("write of " + std::to_string(nbytes) +
                             " bytes at offset " + std::to_string(offset) +
                             " (notice at " + std::to_string(notice_offset) +
                             ") does not fit remote region " +
                             std::to_string(out->id) + " of " +
                             std::to_string(out->size) + " bytes");
    }
    return Status::Ok();
  }

 private:
  mutable std::mutex mu_;
  std::vector<RegionDescriptor> regions_;
};

// What a pair's writes did, for endpoint_info() (the backends that count
// them: verbs). Bytes are payload bytes by where the NIC read them from.
struct PairCounters {
  bool reported = false;        // this backend counts
  uint64_t writes = 0;          // writes posted
  uint64_t bytes_in_place = 0;  // read where they lay (no copy)
  uint64_t bytes_inline = 0;    // copied into the work request
  uint64_t bytes_staged = 0;    // copied into a staging area first
  uint64_t requests = 0;        // work requests posted
  uint64_t signaled = 0;        // of which asked for a completion
  uint64_t max_writes_in_flight = 0;  // the most writes posted, not done
};

// One connected peer. Both ends of a connection hold one: the writer of data
// writes payloads through it, the reader writes credits back through it.
class Pair {
 public:
  virtual ~Pair() = default;
  // "shm", "tcp" or "verbs".
  virtual const char* transport() const = 0;
  // Describes our region `id` so that the peer can write it (verbs also
  // registers it with the NIC, once per process).
  virtual Status Expose(uint32_t id, const Region& region,
                        RegionDescriptor* out) {
    out->id = id;
    out->size = region.size();
    out->shm_name = region.shm_name();
    return Status::Ok();
  }
  // Makes a peer region writable through this pair; returns its handle.
  virtual Status AddRemoteRegion(const RegionDescriptor& region,
                                 int* handle) = 0;
  // The one-sided write described above. Checks the bounds locally too.
  // Returns DeadlineExceeded if the write cannot be handed over (tcp: the
  // peer stopped reading) or completed (verbs) by `deadline`; a write cut
  // off half-way leaves the pair broken().
  virtual Status Write(int handle, uint64_t offset, const void* src,
                       uint64_t nbytes, uint64_t notice_offset, uint64_t seq,
                       const Deadline& deadline) = 0;
  // A notice alone (`first_seq` into the word at `first_notice_offset`, no
  // data), then the Write above, applied by the peer in that order. The
  // default makes the two calls; tcp hands both frames to the socket at once
  // (one system call, and the peer's reader finds both in one wake-up).
  virtual Status NoticeThenWrite(int handle, uint64_t first_notice_offset,
                                 uint64_t first_seq, uint64_t offset,
                                 const void* src, uint64_t nbytes,
                                 uint64_t notice_offset, uint64_t seq,
                                 const Deadline& deadline) {
    TF_RDMA_RETURN_IF_ERROR(Write(handle, 0, nullptr, 0, first_notice_offset,
                                  first_seq, deadline));
    return Write(handle, offset, src, nbytes, notice_offset, seq, deadline);
  }
  // Backends whose notices arrive as messages (verbs): a file descriptor the
  // progress thread watches, and the call that drains what arrived. Others:
  // -1, and nothing to drain.
  virtual int notice_fd() const { return -1; }
  virtual Status TakeNotices(std::vector<Notice>* out) { return Status::Ok(); }
  // The connection is gone: fail writes in flight and refuse new ones.
  virtual void Close() {}
  // True once a failed write left the pair unusable (verbs: the queue pair
  // is in the error state); the engine then closes the connection, so that
  // the peer learns it too.
  virtual bool broken() const { return false; }
  // What its writes did so far.
  virtual PairCounters counters() { return PairCounters(); }
};

// Returns the local region a peer may write with this id, or nullptr.
using RegionLookup = std::function<Region*(uint32_t id)>;

// What a backend needs to make the pair of one connection.
struct PairSetup {
  int fd = -1;                    // the control connection's socket
  std::mutex* send_mu = nullptr;  // serializes every frame sent on fd
  bool dialed = false;  // this side dialled (it speaks first in a set-up
                        // exchange) and writes data; the peer writes credits
  std::string peer;     // the peer's task, for messages
};

// One backend, opened once per process (transport/factory.h): it makes the
// pairs of the connections whose handshake chose it.
class Transport {
 public:
  virtual ~Transport() = default;
  // "shm", "tcp" or "verbs".
  virtual const char* name() const = 0;
  // The device it drives, for the log and the endpoint's info ("mlx5_0
  // port 1, RoCE v2, ..."); "" when there is nothing to describe.
  virtual std::string Describe() const { return ""; }
  // Makes the pair of a connection right after its handshake, on the
  // handshake's thread; a set-up exchange on setup.fd (verbs: the queue
  // pair addresses) is bounded by `deadline`.
  virtual Status NewPair(const PairSetup& setup, const Deadline& deadline,
                         std::unique_ptr<Pair>* out) = 0;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_TRANSPORT_H_
