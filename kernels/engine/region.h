// Regions: the preallocated memory that peers write into.
//
// A region is one page-aligned block of memory shared with the peers that
// write into it. Every region is a POSIX shared-memory segment named
// /dev/shm/tfrdma.<pid>.<n> (pid of the owner), so that
//   - a peer on the same host can map it and write with one memcpy (shm),
//   - the progress thread can write TCP payloads straight into it (tcp),
//   - an RDMA NIC can register it once (verbs, a later backend),
//   - and a launcher can find and remove the segments of a process that was
//     killed before it could clean up (the pid is in the name).
// The whole segment is populated when it is created: the memory is allocated
// once, at set-up, never on the data path.
#ifndef TF_RDMA_ENGINE_REGION_H_
#define TF_RDMA_ENGINE_REGION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/engine/status.h"

namespace tf_rdma {

constexpr uint64_t kPageBytes = 4096;

class Region {
 public:
  // Creates and maps a new segment of `size` bytes (a multiple of the page
  // size), zero-filled. The creator owns the name and unlinks it.
  static Status Create(uint64_t size, std::unique_ptr<Region>* out);
  // Maps a peer's segment, checking that it has exactly `size` bytes.
  static Status Open(const std::string& shm_name, uint64_t size,
                     std::unique_ptr<Region>* out);

  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& shm_name() const { return shm_name_; }

  // True when [offset, offset + nbytes) lies inside the region.
  bool Contains(uint64_t offset, uint64_t nbytes) const {
    return offset <= size_ && nbytes <= size_ - offset;
  }
  // The 8-byte notice word at `offset`; the caller checked Contains and
  // 8-byte alignment.
  std::atomic<uint64_t>* Word(uint64_t offset) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(data_ + offset);
  }
  // Removes the name from /dev/shm (owner only; the mapping stays valid).
  void Unlink();

 private:
  Region(std::string shm_name, uint8_t* data, uint64_t size, bool owner)
      : shm_name_(std::move(shm_name)), data_(data), size_(size),
        owner_(owner) {}

  std::string shm_name_;
  uint8_t* data_;
  uint64_t size_;
  bool owner_;
  bool unlinked_ = false;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_ENGINE_REGION_H_
