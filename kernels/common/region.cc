#include "kernels/common/region.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

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

// The error for a /dev/shm that cannot hold `size` more bytes: what was
// asked, what the file system has, and the two ways out.
Status ShmFullStatus(uint64_t size) {
  std::string have = "its size is unknown";
  struct statvfs fs;
  if (statvfs("/dev/shm", &fs) == 0) {
    uint64_t total = static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize;
    uint64_t avail = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
    have = "it has " + std::to_string(avail) + " of " +
           std::to_string(total) + " bytes free";
  }
  // Every region is a /dev/shm segment whatever the pair's transport
  // (region.h), so only more space helps, not another transport.
  return ResourceExhausted(
      "/dev/shm cannot hold a shared-memory region of " +
      std::to_string(size) + " bytes (" + have +
      "); every tf_rdma region lives in /dev/shm, whatever the transport. "
      "Give the container a larger /dev/shm (docker run --shm-size=2g; "
      "Kubernetes: an emptyDir with medium: Memory mounted on /dev/shm); "
      "`tf-rdma doctor --plan-bytes N` compares it with a plan's bytes");
}

}  // namespace

uint64_t ShmBytes() {
  struct statvfs fs;
  if (statvfs("/dev/shm", &fs) != 0) return 0;
  return static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize;
}

Status Region::Create(uint64_t size, std::unique_ptr<Region>* out) {
  if (size == 0 || size % kPageBytes != 0) {
    return InvalidArgument("region size " + std::to_string(size) +
                           " is not a positive multiple of " +
                           std::to_string(kPageBytes));
  }
  // A name can be taken: by a live segment of a process with the same pid
  // in another pid namespace, or by a dead process's segment that no
  // collection has removed yet. Then try the next number. A name can also be
  // lost to a collector that locked it first (region.h): give it up.
  constexpr int kMaxNamesTaken = 1 << 16;
  constexpr int kMaxNamesLost = 64;
  std::string name;
  int fd = -1;
  for (int taken = 0, lost = 0; fd < 0;) {
    name = "/tfrdma." + std::to_string(getpid()) + "." +
           std::to_string(next_region_number++);
    fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
      if (errno != EEXIST || ++taken >= kMaxNamesTaken) {
        return ErrnoStatus("shm_open(" + name + ")", errno);
      }
      continue;
    }
    if (flock(fd, LOCK_SH | LOCK_NB) != 0) {
      int err = errno;
      if (err != EWOULDBLOCK) {
        shm_unlink(name.c_str());
        close(fd);
        return ErrnoStatus("flock(" + name + ")", err);
      }
      close(fd);  // the collector that holds it removes the name
      fd = -1;
      if (++lost >= kMaxNamesLost) {
        return Internal("could not create a shared-memory segment: " +
                        std::to_string(kMaxNamesLost) +
                        " new names in a row were locked by a collector");
      }
    }
  }
  // From here on the name is removed before the fd (and its lock) goes, so
  // that no other process can take the name for a segment of its own and
  // see it removed by us.
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    shm_unlink(name.c_str());
    close(fd);
    return ErrnoStatus("ftruncate(" + name + ", " + std::to_string(size) + ")",
                       err);
  }
  // Reserve every page now. ftruncate only sets the size and MAP_POPULATE's
  // failures are ignored, so on a full /dev/shm (Docker's default is 64 MiB)
  // the first touch of an unbacked page would be a SIGBUS in the middle of a
  // copy. posix_fallocate fails here instead, with ENOSPC.
  int err = posix_fallocate(fd, 0, static_cast<off_t>(size));
  if (err == EINTR) err = posix_fallocate(fd, 0, static_cast<off_t>(size));
  if (err != 0) {
    shm_unlink(name.c_str());
    close(fd);
    if (err == ENOSPC || err == EFBIG) return ShmFullStatus(size);
    return ErrnoStatus("posix_fallocate(" + name + ", " +
                           std::to_string(size) + ")",
                       err);
  }
  uint8_t* data = nullptr;
  Status s = MapFd(fd, size, &data);
  if (!s.ok()) {
    shm_unlink(name.c_str());
    close(fd);
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

namespace {

// "tfrdma.<digits>.<digits>": a name Region::Create makes. Its owner's pid
// (the first number) goes to `pid`, -1 if it is too large to be one.
bool IsSegmentName(const char* name, int64_t* pid) {
  constexpr int64_t kMaxPid = int64_t{1} << 40;
  const char* p = name;
  if (std::strncmp(p, "tfrdma.", 7) != 0) return false;
  p += 7;
  *pid = 0;
  for (int part = 0; part < 2; ++part) {
    if (!std::isdigit(static_cast<unsigned char>(*p))) return false;
    while (std::isdigit(static_cast<unsigned char>(*p))) {
      if (part == 0 && *pid >= 0) {
        *pid = *pid > kMaxPid ? -1 : *pid * 10 + (*p - '0');
      }
      ++p;
    }
    if (part == 0 && *p++ != '.') return false;
  }
  return *p == '\0';
}

}  // namespace

StaleSegments CollectStaleSegments(const std::vector<int64_t>& owner_pids) {
  StaleSegments out;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return out;
  while (struct dirent* entry = readdir(dir)) {
    int64_t pid = 0;
    if (!IsSegmentName(entry->d_name, &pid)) continue;
    if (!owner_pids.empty() &&
        std::find(owner_pids.begin(), owner_pids.end(), pid) ==
            owner_pids.end()) {
      continue;
    }
    // Not a regular file (a directory, a link, a FIFO): no segment.
    struct stat st;
    if (fstatat(dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode)) {
      continue;
    }
    std::string name = std::string("/") + entry->d_name;
    int fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY,
                      0);
    if (fd < 0) {
      // Gone meanwhile: nothing to do. Not ours to open: reported.
      if (errno != ENOENT) {
        out.errors.push_back(std::string(entry->d_name) + ": " +
                             std::strerror(errno));
      }
      continue;
    }
    // Locked exclusively: no owner holds it. Still linked: no other
    // collector removed it (and the name is not a newer segment's: only a
    // holder of this lock unlinks this one).
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
        flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &st) == 0 &&
        st.st_nlink > 0 && shm_unlink(name.c_str()) == 0) {
      out.removed.push_back(entry->d_name);
      out.bytes += st.st_size;
    }
    close(fd);
  }
  closedir(dir);
  return out;
}

int RemoveStaleSegments(uint64_t* bytes) {
  StaleSegments stale = CollectStaleSegments();
  if (bytes != nullptr) *bytes = stale.bytes;
  return static_cast<int>(stale.removed.size());
}

}  // namespace tf_rdma
