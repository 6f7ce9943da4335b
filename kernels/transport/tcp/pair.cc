#include "kernels/transport/tcp/pair.h"

#include "kernels/engine/wait.h"

namespace tf_rdma {
namespace tcp {

Status Pair::AddRemoteRegion(const RegionDescriptor& region, int* handle) {
  *handle = regions_.Add(region);
  return Status::Ok();
}

Status Pair::Write(int handle, uint64_t offset, const void* src,
                   uint64_t nbytes, uint64_t notice_offset, uint64_t seq) {
  RegionDescriptor region;
  TF_RDMA_RETURN_IF_ERROR(
      regions_.Find(handle, offset, nbytes, notice_offset, &region));
  FrameHeader h;
  h.type = kWrite;
  h.a = region.id;
  h.b = offset;
  h.c = nbytes;
  h.d = notice_offset;
  h.e = seq;
  struct iovec iov[2];
  iov[0].iov_base = &h;
  iov[0].iov_len = sizeof(h);
  iov[1].iov_base = const_cast<void*>(src);
  iov[1].iov_len = nbytes;
  std::lock_guard<std::mutex> lock(*send_mu_);
  return SendAllv(fd_, iov, nbytes > 0 ? 2 : 1);
}

Status ApplyWrite(int fd, const FrameHeader& h, const RegionLookup& lookup) {
  Region* region = lookup(static_cast<uint32_t>(h.a));
  if (region == nullptr) {
    return PermissionDenied("write to region id " + std::to_string(h.a) +
                            ", which this peer was never given");
  }
  if (!region->Contains(h.b, h.c) || !region->Contains(h.d, 8) ||
      h.d % 8 != 0) {
    return InvalidArgument(
        "write of " + std::to_string(h.c) + " bytes at offset " +
        std::to_string(h.b) + " (notice at " + std::to_string(h.d) +
        ") is outside region " + region->shm_name() + " of " +
        std::to_string(region->size()) + " bytes; rejected");
  }
  TF_RDMA_RETURN_IF_ERROR(RecvAll(fd, region->data() + h.b, h.c));
  PublishWord(region->Word(h.d), h.e);
  return Status::Ok();
}

}  // namespace tcp
}  // namespace tf_rdma
