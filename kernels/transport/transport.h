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
// (engine/wait.h). That is RDMA semantics, and each backend provides it its
// own way:
//   - shm:   the peer's segment is mapped here; memcpy, release-store, futex
//            wake. No thread on the receiving side is involved.
//   - tcp:   a WRITE frame (header + payload) on the pair's socket; the
//            receiver's progress thread reads the payload straight into the
//            region (bounds-checked there) and publishes the word.
//   - verbs: RDMA WRITE into the registered region (remote address + rkey
//            travel in the region descriptor), then the notice as an 8-byte
//            RDMA WRITE fenced behind it (or WRITE_WITH_IMM); completions are
//            polled by the progress thread. Regions are registered once
//            (they are created once, never on the data path).
// A pair is created after the bootstrap handshake on the control connection
// (engine.cc) has authenticated the peer and chosen the backend; the control
// connection carries the region descriptors.
#ifndef TF_RDMA_TRANSPORT_TRANSPORT_H_
#define TF_RDMA_TRANSPORT_TRANSPORT_H_

#include <cstdint>
#include <string>

#include "kernels/engine/status.h"

namespace tf_rdma {

// What a peer needs to know to write into one of our regions.
struct RegionDescriptor {
  uint32_t id = 0;        // endpoint-local id; tcp frames name the region by it
  uint64_t size = 0;      // bytes; every write is checked against it
  std::string shm_name;   // shm: the segment to map
  uint64_t remote_addr = 0;  // verbs: the registered address
  uint32_t rkey = 0;         // verbs: the remote key
};

// One connected peer, as seen by the side that writes.
class Pair {
 public:
  virtual ~Pair() = default;
  // "shm", "tcp" or "verbs".
  virtual const char* transport() const = 0;
  // Makes a peer region writable through this pair; returns its handle.
  virtual Status AddRemoteRegion(const RegionDescriptor& region,
                                 int* handle) = 0;
  // The one-sided write described above. Checks the bounds locally too.
  virtual Status Write(int handle, uint64_t offset, const void* src,
                       uint64_t nbytes, uint64_t notice_offset,
                       uint64_t seq) = 0;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_TRANSPORT_H_
