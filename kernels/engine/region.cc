#include "kernels/engine/region.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace tf_rdma {
namespace {

std::atomic<uint64_t> next_region_number{0};

Status MapFd(int fd, uint64_t size, uint8_t** data) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) return ErrnoStatus("mmap", errno);
  *data = static_cast<uint8_t*>(p);
  return Status::Ok();
}

}  // namespace

Status Region::Create(uint64_t size, std::unique_ptr<Region>* out) {
  if (size == 0 || size % kPageBytes != 0) {
    return InvalidArgument("region size " + std::to_string(size) +
                           " is not a positive multiple of " +
                           std::to_string(kPageBytes));
  }
  // A name can be taken by a segment that a dead process with our pid left
  // behind (the next collection removes it), or be lost to a collector that
  // locked it first (header comment): then try the next number.
  constexpr int kMaxNameTries = 64;
  std::string name;
  int fd = -1;
  for (int tries = 0; fd < 0; ++tries) {
    name = "/tfrdma." + std::to_string(getpid()) + "." +
           std::to_string(next_region_number++);
    fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
      if (errno != EEXIST || tries + 1 >= kMaxNameTries) {
        return ErrnoStatus("shm_open(" + name + ")", errno);
      }
      continue;
    }
    if (flock(fd, LOCK_SH | LOCK_NB) != 0) {
      close(fd);  // a collector holds it and will remove the name
      fd = -1;
      if (tries + 1 >= kMaxNameTries) {
        return Internal("could not create a shared-memory segment: " +
                        std::to_string(kMaxNameTries) +
                        " names in a row were taken");
      }
    }
  }
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return ErrnoStatus("ftruncate(" + name + ", " + std::to_string(size) + ")",
                       err);
  }
  uint8_t* data = nullptr;
  Status s = MapFd(fd, size, &data);
  if (!s.ok()) {
    close(fd);
    shm_unlink(name.c_str());
    return s.Prefixed("creating region " + name);
  }
  out->reset(new Region(name, data, size, /*owner=*/true, fd));
  return Status::Ok();
}

Status Region::Open(const std::string& shm_name, uint64_t size,
                    std::unique_ptr<Region>* out) {
  if (shm_name.rfind("/tfrdma.", 0) != 0 ||
      shm_name.find('/', 1) != std::string::npos) {
    return InvalidArgument("'" + shm_name + "' is not a tf_rdma segment name");
  }
  int fd = shm_open(shm_name.c_str(), O_RDWR, 0);
  if (fd < 0) return ErrnoStatus("shm_open(" + shm_name + ")", errno);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    return ErrnoStatus("fstat(" + shm_name + ")", err);
  }
  if (static_cast<uint64_t>(st.st_size) != size) {
    close(fd);
    return InvalidArgument("segment " + shm_name + " has " +
                           std::to_string(st.st_size) + " bytes, expected " +
                           std::to_string(size));
  }
  uint8_t* data = nullptr;
  Status s = MapFd(fd, size, &data);
  close(fd);
  if (!s.ok()) return s.Prefixed("mapping " + shm_name);
  out->reset(new Region(shm_name, data, size, /*owner=*/false,
                        /*lock_fd=*/-1));
  return Status::Ok();
}

void Region::Unlink() {
  if (owner_ && !unlinked_) {
    shm_unlink(shm_name_.c_str());
    unlinked_ = true;
  }
}

Region::~Region() {
  Unlink();
  munmap(data_, size_);
  if (lock_fd_ >= 0) close(lock_fd_);
}

int RemoveStaleSegments(uint64_t* bytes) {
  if (bytes != nullptr) *bytes = 0;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (struct dirent* entry = readdir(dir)) {
    std::string name = std::string("/") + entry->d_name;
    if (name.rfind("/tfrdma.", 0) != 0) continue;
    int fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0);
    if (fd < 0) continue;  // gone meanwhile, or not ours to open
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) {  // no owner holds it
      struct stat st;
      uint64_t size = fstat(fd, &st) == 0 ? st.st_size : 0;
      if (shm_unlink(name.c_str()) == 0) {
        ++removed;
        if (bytes != nullptr) *bytes += size;
      }
    }
    close(fd);
  }
  closedir(dir);
  return removed;
}

}  // namespace tf_rdma
