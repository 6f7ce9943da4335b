// The shared-memory backend: peers on the same host.
//
// The reader's regions are POSIX shared-memory segments; the writer maps each
// one once (AddRemoteRegion) and a Write is then exactly one memcpy into the
// reader's slot followed by a release-store of the notice word and a futex
// wake. There is no thread on the receiving side and no copy on arrival: the
// recv op's tensor aliases the bytes this memcpy wrote.
#ifndef TF_RDMA_TRANSPORT_SHM_PAIR_H_
#define TF_RDMA_TRANSPORT_SHM_PAIR_H_

#include <memory>
#include <mutex>
#include <vector>

#include "kernels/common/region.h"
#include "kernels/transport/transport.h"

namespace tf_rdma {
namespace shm {

class Pair : public ::tf_rdma::Pair {
 public:
  const char* transport() const override { return "shm"; }
  Status AddRemoteRegion(const RegionDescriptor& region, int* handle) override;
  Status Write(int handle, uint64_t offset, const void* src, uint64_t nbytes,
               uint64_t notice_offset, uint64_t seq,
               const Deadline& deadline) override;

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<Region>> regions_;  // indexed by handle
};

}  // namespace shm
}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_SHM_PAIR_H_
