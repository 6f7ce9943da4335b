#include "kernels/engine/region.h"

#include <fcntl.h>
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
  std::string name = "/tfrdma." + std::to_string(getpid()) + "." +
                     std::to_string(next_region_number++);
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return ErrnoStatus("shm_open(" + name + ")", errno);
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return ErrnoStatus("ftruncate(" + name + ", " + std::to_string(size) + ")",
                       err);
  }
  uint8_t* data = nullptr;
  Status s = MapFd(fd, size, &data);
  close(fd);
  if (!s.ok()) {
    shm_unlink(name.c_str());
    return s.Prefixed("creating region " + name);
  }
  out->reset(new Region(name, data, size, /*owner=*/true));
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
  out->reset(new Region(shm_name, data, size, /*owner=*/false));
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
}

}  // namespace tf_rdma
