#include "kernels/transport/shm/pair.h"

#include <cstring>

#include "kernels/common/wait.h"

namespace tf_rdma {
namespace shm {

Status Pair::AddRemoteRegion(const RegionDescriptor& region, int* handle) {
  std::unique_ptr<Region> mapped;
  TF_RDMA_RETURN_IF_ERROR(Region::Open(region.shm_name, region.size, &mapped));
  std::lock_guard<std::mutex> lock(mu_);
  regions_.push_back(std::move(mapped));
  *handle = static_cast<int>(regions_.size()) - 1;
  return Status::Ok();
}

Status Pair::Write(int handle, uint64_t offset, const void* src,
                   uint64_t nbytes, uint64_t notice_offset, uint64_t seq,
                   const Deadline& deadline) {
  Region* region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (handle < 0 || handle >= static_cast<int>(regions_.size())) {
      return InvalidArgument("no remote region with handle " +
                             std::to_string(handle));
    }
    region = regions_[handle].get();
  }
  if (!region->Contains(offset, nbytes) ||
      !region->Contains(notice_offset, 8) || notice_offset % 8 != 0) {
    return InvalidArgument(
        "write of " + std::to_string(nbytes) + " bytes at offset " +
        std::to_string(offset) + " (notice at " +
        std::to_string(notice_offset) + ") does not fit region " +
        region->shm_name() + " of " + std::to_string(region->size()) +
        " bytes");
  }
  if (nbytes > 0) std::memcpy(region->data() + offset, src, nbytes);
  PublishWord(region->Word(notice_offset), seq,
              region->Sleepers(notice_offset));
  return Status::Ok();
}

}  // namespace shm
}  // namespace tf_rdma
