#include "kernels/transport/tcp/pair.h"

#include "kernels/common/wait.h"

namespace tf_rdma {
namespace tcp {

Status Pair::AddRemoteRegion(const RegionDescriptor& region, int* handle) {
  *handle = regions_.Add(region);
  return Status::Ok();
}

namespace {

FrameHeader WriteHeader(uint64_t region, uint64_t offset, uint64_t nbytes,
                        uint64_t notice_offset, uint64_t seq) {
  FrameHeader h;
  h.type = kWrite;
  h.a = region;
  h.b = offset;
  h.c = nbytes;
  h.d = notice_offset;
  h.e = seq;
  return h;
}

}  // namespace

Status Pair::Write(int handle, uint64_t offset, const void* src,
                   uint64_t nbytes, uint64_t notice_offset, uint64_t seq,
                   const Deadline& deadline) {
  RegionDescriptor region;
  TF_RDMA_RETURN_IF_ERROR(
      regions_.Find(handle, offset, nbytes, notice_offset, &region));
  FrameHeader h = WriteHeader(region.id, offset, nbytes, notice_offset, seq);
  return SendFrames(&h, sizeof(h), src, nbytes, deadline);
}

Status Pair::NoticeThenWrite(int handle, uint64_t first_notice_offset,
                             uint64_t first_seq, uint64_t offset,
                             const void* src, uint64_t nbytes,
                             uint64_t notice_offset, uint64_t seq,
                             const Deadline& deadline) {
  RegionDescriptor region;
  TF_RDMA_RETURN_IF_ERROR(
      regions_.Find(handle, 0, 0, first_notice_offset, &region));
  TF_RDMA_RETURN_IF_ERROR(
      regions_.Find(handle, offset, nbytes, notice_offset, &region));
  FrameHeader h[2] = {
      WriteHeader(region.id, 0, 0, first_notice_offset, first_seq),
      WriteHeader(region.id, offset, nbytes, notice_offset, seq)};
  return SendFrames(h, sizeof(h), src, nbytes, deadline);
}

Status Pair::SendFrames(const void* headers, size_t header_bytes,
                        const void* payload, uint64_t nbytes,
                        const Deadline& deadline) {
  struct iovec iov[2];
  iov[0].iov_base = const_cast<void*>(headers);
  iov[0].iov_len = header_bytes;
  iov[1].iov_base = const_cast<void*>(payload);
  iov[1].iov_len = nbytes;
  std::lock_guard<std::mutex> lock(*send_mu_);
  if (broken_) return Unavailable("the connection broke off mid-frame");
  size_t sent = 0;
  Status s = SendAllv(fd_, iov, nbytes > 0 ? 2 : 1, deadline, &sent);
  // Half a frame on the wire: the stream cannot carry another one.
  if (!s.ok() && sent > 0) broken_ = true;
  return s;
}

Status ApplyWrite(int fd, const FrameHeader& h, const RegionLookup& lookup,
                  const std::function<void()>& landed) {
  // Region ids are 32-bit: a larger value names no region (it must not be
  // truncated into one).
  Region* region =
      h.a <= UINT32_MAX ? lookup(static_cast<uint32_t>(h.a)) : nullptr;
  if (region == nullptr) {
    return PermissionDenied("write to region id " + std::to_string(h.a) +
                            ", which this peer was never given");
  }
  TF_RDMA_RETURN_IF_ERROR(
      CheckWriteBounds(h.b, h.c, h.d, region->size(), region->shm_name()));
  TF_RDMA_RETURN_IF_ERROR(RecvAll(fd, region->data() + h.b, h.c));
  std::atomic<uint64_t>* word = region->Word(h.d);
  word->store(h.e, std::memory_order_release);
  if (landed) landed();
  WakeWord(word, region->Sleepers(h.d));
  return Status::Ok();
}

}  // namespace tcp
}  // namespace tf_rdma
