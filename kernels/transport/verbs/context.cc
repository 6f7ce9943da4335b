#include "kernels/transport/verbs/context.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "kernels/transport/verbs/pair.h"

namespace tf_rdma {
namespace verbs {
namespace {

std::string Strerror(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

// Checks one integer setting; the message names the variable users set.
Status CheckRange(const char* variable, int64_t value, int64_t lo,
                  int64_t hi) {
  if (value >= lo && value <= hi) return Status::Ok();
  return InvalidArgument(std::string(variable) + "=" + std::to_string(value) +
                         " is not an integer in [" + std::to_string(lo) +
                         ", " + std::to_string(hi) + "]");
}

Status CheckSettings(const VerbsSettings& s) {
  TF_RDMA_RETURN_IF_ERROR(CheckRange("TF_RDMA_VERBS_PORT", s.port, 0, 255));
  TF_RDMA_RETURN_IF_ERROR(
      CheckRange("TF_RDMA_VERBS_GID_INDEX", s.gid_index, -1, 255));
  if (s.mtu != 0 && s.mtu != 256 && s.mtu != 512 && s.mtu != 1024 &&
      s.mtu != 2048 && s.mtu != 4096) {
    return InvalidArgument("TF_RDMA_VERBS_MTU=" + std::to_string(s.mtu) +
                           " is not one of 256, 512, 1024, 2048, 4096");
  }
  TF_RDMA_RETURN_IF_ERROR(CheckRange("TF_RDMA_VERBS_SL", s.service_level, 0, 15));
  TF_RDMA_RETURN_IF_ERROR(
      CheckRange("TF_RDMA_VERBS_TRAFFIC_CLASS", s.traffic_class, 0, 255));
  TF_RDMA_RETURN_IF_ERROR(CheckRange("TF_RDMA_VERBS_TIMEOUT", s.timeout, 1, 31));
  TF_RDMA_RETURN_IF_ERROR(
      CheckRange("TF_RDMA_VERBS_RETRY_COUNT", s.retry_count, 0, 7));
  TF_RDMA_RETURN_IF_ERROR(
      CheckRange("TF_RDMA_VERBS_QUEUE_DEPTH", s.queue_depth, 4, 32768));
  TF_RDMA_RETURN_IF_ERROR(CheckRange("TF_RDMA_VERBS_ODP", s.odp, 0, 1));
  return CheckRange("TF_RDMA_VERBS_INLINE", s.inline_bytes, 0, 1024);
}

// True when the process may lock any amount of memory (CAP_IPC_LOCK, bit 14
// of the effective capabilities).
bool HasIpcLock() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    unsigned long long caps = std::strtoull(line.c_str() + 7, nullptr, 16);
    return (caps >> 14) & 1;
  }
  return false;
}

Status CheckMemlock(uint64_t needed) {
  struct rlimit limit;
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return Status::Ok();
  if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= needed ||
      HasIpcLock()) {
    return Status::Ok();
  }
  return FailedPrecondition(
      "the locked-memory limit is " + std::to_string(limit.rlim_cur >> 10) +
      " KiB (ulimit -l), below the " + std::to_string(needed >> 10) +
      " KiB that registering regions needs: raise it (ulimit -l unlimited; "
      "LimitMEMLOCK=infinity under systemd; --ulimit memlock=-1 in docker)");
}

std::string DeviceNames(ibv_device** list, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) {
    if (i) out += ", ";
    out += ibv_get_device_name(list[i]);
  }
  return out;
}

// IPv4 addresses `host` resolves to, as IPv4-mapped GIDs' last 4 bytes.
std::set<uint32_t> Ipv4Of(const std::string& host) {
  std::set<uint32_t> out;
  if (host.empty() || host == "0.0.0.0" || host == "*") return out;
  struct addrinfo hints, *res = nullptr;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_INET;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (auto* a = res; a != nullptr; a = a->ai_next) {
    out.insert(reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr.s_addr);
  }
  freeaddrinfo(res);
  return out;
}

bool IsIpv4Mapped(const ibv_gid& gid) {
  for (int i = 0; i < 10; ++i) {
    if (gid.raw[i] != 0) return false;
  }
  return gid.raw[10] == 0xff && gid.raw[11] == 0xff;
}

std::string Ipv4Text(const ibv_gid& gid) {
  char text[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, gid.raw + 12, text, sizeof(text));
  return text;
}

// How well a port suits this endpoint: 2 when it is active and has a GID
// with one of the endpoint's IPv4 addresses (RoCE), 1 when it is active,
// 0 otherwise.
int PortScore(ibv_context* context, uint8_t port, const ibv_port_attr& attr,
              const std::set<uint32_t>& local) {
  if (attr.state != IBV_PORT_ACTIVE) return 0;
  if (attr.link_layer != IBV_LINK_LAYER_ETHERNET || local.empty()) return 1;
  for (int i = 0; i < attr.gid_tbl_len; ++i) {
    ibv_gid_entry entry;
    if (ibv_query_gid_ex(context, port, i, &entry, 0) != 0) continue;
    uint32_t addr;
    std::memcpy(&addr, entry.gid.raw + 12, 4);
    if (IsIpv4Mapped(entry.gid) && local.count(addr)) return 2;
  }
  return 1;
}

// The best PortScore of a device's ports (only `port` if non-zero), opening
// the device just to look.
int DeviceScore(ibv_device* device, int port, const std::set<uint32_t>& local) {
  ibv_context* context = ibv_open_device(device);
  if (context == nullptr) return 0;
  int best = 0;
  ibv_device_attr attr;
  if (ibv_query_device(context, &attr) == 0) {
    for (int p = 1; p <= attr.phys_port_cnt; ++p) {
      ibv_port_attr port_attr;
      if ((port != 0 && port != p) ||
          ibv_query_port(context, static_cast<uint8_t>(p), &port_attr) != 0) {
        continue;
      }
      best = std::max(best, PortScore(context, static_cast<uint8_t>(p),
                                      port_attr, local));
    }
  }
  ibv_close_device(context);
  return best;
}

ibv_mtu MtuFromBytes(int bytes) {
  switch (bytes) {
    case 256: return IBV_MTU_256;
    case 512: return IBV_MTU_512;
    case 1024: return IBV_MTU_1024;
    case 2048: return IBV_MTU_2048;
    default: return IBV_MTU_4096;
  }
}

}  // namespace

Status Context::Open(const VerbsSettings& settings,
                     std::unique_ptr<Context>* out) {
  TF_RDMA_RETURN_IF_ERROR(CheckSettings(settings));
  // Registered pages must not be shared copy-on-write with a child process
  // (TensorFlow and Python fork): marks them MADV_DONTFORK. Must come
  // before any other verbs call; a no-op where the kernel makes it
  // unnecessary.
  ibv_fork_init();
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) {
    int err = errno;
    return Unavailable(Strerror("libibverbs cannot list RDMA devices", err) +
                       (std::ifstream("/sys/class/infiniband").good() ||
                                err != ENOSYS
                            ? ""
                            : " (the kernel has no RDMA support: "
                              "/sys/class/infiniband is absent)"));
  }
  std::unique_ptr<Context> c(new Context());
  c->settings_ = settings;
  c->local_ = Ipv4Of(settings.local_host);
  // The named device; else the one whose active port carries the
  // endpoint's address (multi-NIC hosts), else the first with an active
  // port, else the first (whose ports' states then explain the failure).
  ibv_device* chosen = nullptr;
  int best = -1;
  for (int i = 0; i < n; ++i) {
    if (!settings.device.empty()) {
      if (settings.device == ibv_get_device_name(list[i])) chosen = list[i];
      continue;
    }
    int score = n == 1 ? 0 : DeviceScore(list[i], settings.port, c->local_);
    if (score > best) {
      best = score;
      chosen = list[i];
    }
  }
  Status s;
  if (n == 0) {
    s = Unavailable(
        "no RDMA devices: libibverbs found none" +
        std::string(std::ifstream("/sys/class/infiniband").good()
                        ? " although /sys/class/infiniband exists (is the "
                          "user-space provider for the NIC installed? "
                          "Debian/Ubuntu: ibverbs-providers)"
                        : " (/sys/class/infiniband is absent: the kernel has "
                          "no RDMA support, or no RDMA driver is loaded)"));
  } else if (chosen == nullptr) {
    s = InvalidArgument("TF_RDMA_VERBS_DEVICE='" + settings.device +
                        "' is not an RDMA device here; devices: " +
                        DeviceNames(list, n));
  } else {
    c->name_ = ibv_get_device_name(chosen);
    c->context_ = ibv_open_device(chosen);
    if (c->context_ == nullptr) {
      s = Unavailable(Strerror("opening RDMA device " + c->name_, errno) +
                      " (check the permissions of /dev/infiniband)");
    }
  }
  ibv_free_device_list(list);
  TF_RDMA_RETURN_IF_ERROR(s);
  // Asynchronous events are read when a pair fails (AsyncCause), never
  // waited for.
  int flags = fcntl(c->context_->async_fd, F_GETFL);
  if (flags < 0 ||
      fcntl(c->context_->async_fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return Internal(Strerror("making the asynchronous event fd non-blocking",
                             errno));
  }
  TF_RDMA_RETURN_IF_ERROR(c->ChoosePort());
  c->pd_ = ibv_alloc_pd(c->context_);
  if (c->pd_ == nullptr) {
    return Unavailable(Strerror("ibv_alloc_pd on " + c->name_, errno));
  }
  TF_RDMA_RETURN_IF_ERROR(c->ChooseGid());
  c->OpenOnDemandPaging();
  // Last, so that a machine without a device says so first.
  TF_RDMA_RETURN_IF_ERROR(CheckMemlock(settings.min_memlock));
  *out = std::move(c);
  return Status::Ok();
}

Status Context::ChoosePort() {
  ibv_device_attr device;
  if (ibv_query_device(context_, &device) != 0) {
    return Unavailable(Strerror("querying RDMA device " + name_, errno));
  }
  if (settings_.queue_depth > device.max_qp_wr ||
      settings_.queue_depth > device.max_cqe) {
    return InvalidArgument(
        "TF_RDMA_VERBS_QUEUE_DEPTH=" + std::to_string(settings_.queue_depth) +
        " is more than " + name_ + " allows (" +
        std::to_string(std::min(device.max_qp_wr, device.max_cqe)) +
        " work requests per queue)");
  }
  // An emulated device says so in its firmware version (softnic:
  // "softnic (emulated)"), as `tf-rdma doctor` reads it; Describe repeats
  // it, so that no number measured on one passes for a NIC's.
  emulated_ = std::strstr(device.fw_ver, "(emulated)") != nullptr;
  // The asked-for port; else the active port that carries the endpoint's
  // address, else the first active one.
  std::string states;
  int best_score = 0;
  ibv_port_attr best;
  for (int p = 1; p <= device.phys_port_cnt; ++p) {
    if (settings_.port != 0 && settings_.port != p) continue;
    ibv_port_attr attr;
    if (ibv_query_port(context_, static_cast<uint8_t>(p), &attr) != 0) {
      return Unavailable(Strerror("querying port " + std::to_string(p) +
                                      " of " + name_,
                                  errno));
    }
    if (attr.state != IBV_PORT_ACTIVE) {
      states += (states.empty() ? "" : ", ") + std::string("port ") +
                std::to_string(p) + " is " + ibv_port_state_str(attr.state);
      continue;
    }
    int score = PortScore(context_, static_cast<uint8_t>(p), attr, local_);
    if (score > best_score) {
      best_score = score;
      best = attr;
      port_ = static_cast<uint8_t>(p);
    }
  }
  if (best_score > 0) {
    ethernet_ = best.link_layer == IBV_LINK_LAYER_ETHERNET;
    lid_ = best.lid;
    gid_tbl_len_ = best.gid_tbl_len;
    max_message_ = best.max_msg_sz;
    mtu_ = best.active_mtu;
    if (settings_.mtu != 0 && MtuFromBytes(settings_.mtu) < mtu_) {
      mtu_ = MtuFromBytes(settings_.mtu);
    }
    return Status::Ok();
  }
  if (settings_.port > device.phys_port_cnt) {
    return InvalidArgument("TF_RDMA_VERBS_PORT=" +
                           std::to_string(settings_.port) + " but " + name_ +
                           " has " + std::to_string(device.phys_port_cnt) +
                           " port(s)");
  }
  return Unavailable("no active port on RDMA device " + name_ + " (" + states +
                     "; check the cable and the subnet manager)");
}

Status Context::ChooseGid() {
  // InfiniBand routes by LID: GID 0 unless one was asked for. RoCE needs a
  // GID: the one asked for, else the RoCE v2 GID whose IPv4 address is the
  // host this endpoint listens on (the interface that carries the
  // ClusterSpec's address), else the first RoCE v2 GID with an IPv4
  // address, else the first RoCE v2 GID, else the first non-empty one.
  if (settings_.gid_index >= 0) {
    if (settings_.gid_index >= gid_tbl_len_) {
      return InvalidArgument(
          "TF_RDMA_VERBS_GID_INDEX=" + std::to_string(settings_.gid_index) +
          " but port " + std::to_string(port_) + " of " + name_ + " has " +
          std::to_string(gid_tbl_len_) + " GIDs");
    }
    gid_index_ = settings_.gid_index;
    if (ibv_query_gid(context_, port_, gid_index_, &gid_) != 0) {
      return Unavailable(Strerror("reading GID " + std::to_string(gid_index_) +
                                      " of " + name_,
                                  errno));
    }
    bool empty = true;
    for (uint8_t b : gid_.raw) empty = empty && b == 0;
    if (empty) {
      return InvalidArgument("TF_RDMA_VERBS_GID_INDEX=" +
                             std::to_string(gid_index_) + " names an empty "
                             "GID on port " + std::to_string(port_) + " of " +
                             name_ + " (`tf-rdma doctor` lists the GIDs)");
    }
    gid_what_ = "GID " + std::to_string(gid_index_) + " (set)";
    return Status::Ok();
  }
  if (!ethernet_) {
    gid_index_ = 0;
    ibv_query_gid(context_, port_, 0, &gid_);
    gid_what_ = "LID " + std::to_string(lid_);
    return Status::Ok();
  }
  const std::set<uint32_t>& local = local_;
  int best = -1, best_rank = 0;
  ibv_gid best_gid = {};
  for (int i = 0; i < gid_tbl_len_; ++i) {
    ibv_gid_entry entry;
    if (ibv_query_gid_ex(context_, port_, i, &entry, 0) != 0) continue;
    bool empty = true;
    for (uint8_t b : entry.gid.raw) empty = empty && b == 0;
    if (empty) continue;
    bool v2 = entry.gid_type == IBV_GID_TYPE_ROCE_V2;
    bool ipv4 = IsIpv4Mapped(entry.gid);
    uint32_t addr;
    std::memcpy(&addr, entry.gid.raw + 12, 4);
    int rank = v2 && ipv4 && local.count(addr) ? 4 : v2 && ipv4 ? 3 : v2 ? 2 : 1;
    if (rank > best_rank) {
      best = i;
      best_rank = rank;
      best_gid = entry.gid;
    }
  }
  if (best < 0) {
    return Unavailable("port " + std::to_string(port_) + " of " + name_ +
                       " has no usable GID (is an IP address configured on "
                       "its network interface?)");
  }
  gid_index_ = best;
  gid_ = best_gid;
  gid_what_ = std::string(best_rank >= 2 ? "RoCE v2" : "RoCE v1") + " GID " +
              std::to_string(best) +
              (IsIpv4Mapped(gid_) ? " (" + Ipv4Text(gid_) + ")" : "");
  return Status::Ok();
}

void Context::OpenOnDemandPaging() {
  // Implicit on-demand paging (ibv_reg_mr(3), "implicit ODP"): one memory
  // region over the whole address space, whose pages the NIC faults in as
  // it reads them and whose translations the kernel invalidates when a
  // mapping changes (MMU notifiers). Writers can then send any tensor where
  // it lies, with no copy and no registration per buffer, and no risk of
  // reading stale pages after TensorFlow frees and the allocator reuses an
  // address. Needs the device to support it for RC requests that read
  // local memory (SEND and RDMA WRITE; mlx5 from ConnectX-4 does).
  if (!settings_.odp) {
    odp_what_ = "off (TF_RDMA_VERBS_ODP=off)";
    return;
  }
  ibv_device_attr_ex attr;
  std::memset(&attr, 0, sizeof(attr));
  const uint32_t rc_needed = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_WRITE;
  if (ibv_query_device_ex(context_, nullptr, &attr) != 0 ||
      !(attr.odp_caps.general_caps & IBV_ODP_SUPPORT_IMPLICIT) ||
      (attr.odp_caps.per_transport_caps.rc_odp_caps & rc_needed) !=
          rc_needed) {
    odp_what_ = "not supported by the device (writes from tensors are staged)";
    return;
  }
  odp_mr_ = ibv_reg_mr(pd_, nullptr, SIZE_MAX,
                       IBV_ACCESS_ON_DEMAND | IBV_ACCESS_LOCAL_WRITE);
  if (odp_mr_ == nullptr) {
    odp_what_ = Strerror("registration failed", errno) +
                " (writes from tensors are staged)";
    return;
  }
  odp_what_ = "implicit";
}

Context::~Context() {
  if (odp_mr_ != nullptr) ibv_dereg_mr(odp_mr_);
  for (auto& kv : registered_) ibv_dereg_mr(kv.second);
  if (pd_ != nullptr) ibv_dealloc_pd(pd_);
  if (context_ != nullptr) ibv_close_device(context_);
}

std::string Context::Describe() const {
  return name_ + (emulated_ ? " (emulated)" : "") + " port " +
         std::to_string(port_) + ", " +
         (ethernet_ ? "RoCE" : "InfiniBand") + ", " + gid_what_ + ", MTU " +
         std::to_string(128 << static_cast<int>(mtu_)) + ", on-demand paging " +
         odp_what_;
}

Status Context::NewPair(std::unique_ptr<VerbsPair>* out) {
  std::unique_ptr<Pair> pair;
  TF_RDMA_RETURN_IF_ERROR(Pair::Create(this, &pair));
  *out = std::move(pair);
  return Status::Ok();
}

Status Context::Register(const uint8_t* data, uint64_t size, uint32_t* rkey) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = registered_.find(reinterpret_cast<uintptr_t>(data));
  if (it != registered_.end()) {  // regions never change size
    *rkey = it->second->rkey;
    return Status::Ok();
  }
  // Never IBV_ACCESS_RELAXED_ORDERING: the notice protocol (pair.h) needs
  // the payload placed before the receive completion that follows it.
  ibv_mr* mr = ibv_reg_mr(pd_, const_cast<uint8_t*>(data), size,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (mr == nullptr) {
    int err = errno;
    Status s = Unavailable(Strerror("registering " + std::to_string(size) +
                                        " bytes with " + name_,
                                    err));
    if (err == ENOMEM || err == EPERM) {
      s = Unavailable(s.message() +
                      " (the locked-memory limit, ulimit -l, is too low)");
    }
    return s;
  }
  registered_[reinterpret_cast<uintptr_t>(data)] = mr;
  *rkey = mr->rkey;
  return Status::Ok();
}

std::string Context::AsyncCause(uint32_t qp_num) {
  std::lock_guard<std::mutex> lock(mu_);
  ibv_async_event event;
  while (ibv_get_async_event(context_, &event) == 0) {
    switch (event.event_type) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
        qp_events_.emplace(event.element.qp->qp_num, event.event_type);
        break;
      default:
        break;
    }
    ibv_ack_async_event(&event);
  }
  auto it = qp_events_.find(qp_num);
  if (it == qp_events_.end()) return "";
  std::string why = ibv_event_type_str(it->second);
  switch (it->second) {
    case IBV_EVENT_QP_ACCESS_ERR:
      why += ": the peer wrote outside the regions this end registered, or "
             "with a stale key";
      break;
    case IBV_EVENT_QP_REQ_ERR:
      why += ": the peer sent a request this end cannot accept (a message "
             "longer than a posted receive, or than the path MTU)";
      break;
    default:
      break;
  }
  return why;
}

bool Context::FindLocal(const void* data, uint64_t nbytes, uint32_t* lkey) {
  uintptr_t start = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = registered_.upper_bound(start);
  if (it != registered_.begin()) {
    --it;
    if (start + nbytes <= it->first + it->second->length) {
      *lkey = it->second->lkey;
      return true;
    }
  }
  if (odp_mr_ == nullptr) return false;
  *lkey = odp_mr_->lkey;
  return true;
}

}  // namespace verbs
}  // namespace tf_rdma

// The plugin's entry point (transport/verbs/device.h). Nothing may throw
// across it.
extern "C" __attribute__((visibility("default"))) tf_rdma::VerbsDevice*
tf_rdma_verbs_open_v2(uint64_t abi, const tf_rdma::VerbsSettings& settings,
                      tf_rdma::Status* why) {
  if (abi != tf_rdma::kVerbsAbi) {
    *why = tf_rdma::Unavailable(
        "the verbs plugin was built from other tf_rdma sources than the op "
        "library; rebuild both");
    return nullptr;
  }
  try {
    std::unique_ptr<tf_rdma::verbs::Context> context;
    *why = tf_rdma::verbs::Context::Open(settings, &context);
    return why->ok() ? context.release() : nullptr;
  } catch (const std::exception& e) {
    *why = tf_rdma::Internal(std::string("opening the RDMA device: ") +
                             e.what());
    return nullptr;
  }
}
