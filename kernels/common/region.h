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
//
// Segments of a process that died without cleaning up (SIGKILL, a crash)
// would stay in /dev/shm until reboot, and since pids are reused (pid_max is
// often 32768, and TensorFlow's threads use pids too) a later process with
// the same pid would find its names taken. So the owner holds a shared
// flock on its segment for as long as the region exists; the kernel drops
// the lock when the process dies, however it dies. RemoveStaleSegments,
// run when an engine starts, removes every tfrdma segment it can lock
// exclusively and that is still linked, i.e. whose owner is gone. The lock,
// not the pid, decides, so a live process in another pid namespace that
// shares /dev/shm is safe (a name its segment holds is skipped). The race
// with a segment being created is closed on the owner's side: it takes its
// lock without waiting, and if a collector got there first it gives the
// name up (the collector removes it) and takes the next one. Only a holder
// of a segment's lock removes its name, and the owner removes it before it
// lets go of the lock. Each owned region keeps one fd open for the lock.
#ifndef TF_RDMA_COMMON_REGION_H_
#define TF_RDMA_COMMON_REGION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/common/status.h"
#include "kernels/common/wait.h"

namespace tf_rdma {

constexpr uint64_t kPageBytes = 4096;

// The size of the file system under /dev/shm, where every region lives, in
// bytes; 0 if it cannot be read.
uint64_t ShmBytes();

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
  // The sleepers' count of the notice word at `offset` (wait.h), or null
  // where the region ends before it: a writer then always wakes.
  std::atomic<uint32_t>* Sleepers(uint64_t offset) const {
    return Contains(offset, kSleepersOffset + sizeof(uint32_t))
               ? SleepersOf(Word(offset))
               : nullptr;
  }
  // Removes the name from /dev/shm (owner only; the mapping stays valid).
  void Unlink();

 private:
  Region(std::string shm_name, uint8_t* data, uint64_t size, bool owner,
         int lock_fd)
      : shm_name_(std::move(shm_name)), data_(data), size_(size),
        owner_(owner), lock_fd_(lock_fd) {}

  std::string shm_name_;
  uint8_t* data_;
  uint64_t size_;
  bool owner_;
  int lock_fd_;  // owner: the segment's fd, holding the shared flock
  bool unlinked_ = false;
};

// What a collection of stale segments did.
struct StaleSegments {
  std::vector<std::string> removed;  // their names in /dev/shm
  uint64_t bytes = 0;                // their total size
  // "<name>: <why>" for the segments that could not be looked at (no
  // permission, ...). A name that is not a regular file (a directory, a
  // link, a FIFO) is no segment: skipped, not an error.
  std::vector<std::string> errors;
};

// Removes the tfrdma segments in /dev/shm whose owner process is gone (no
// one holds their lock): every such segment, or with `owner_pids` only those
// named for one of these pids (a launcher cleaning up after its own
// processes). Segments of live processes are never touched. The one
// collector: the engine runs it when it starts and when a peer on this host
// dies, the launcher (through tf_rdma/_native.py) when its processes exit.
StaleSegments CollectStaleSegments(const std::vector<int64_t>& owner_pids = {});

// CollectStaleSegments() for all owners: how many it removed, and their
// total bytes in `bytes` (may be null).
int RemoveStaleSegments(uint64_t* bytes);

}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_REGION_H_
