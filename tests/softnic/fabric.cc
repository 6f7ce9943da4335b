// The emulated fabric: how a queue pair's messages reach the process that
// owns the destination QP, and what that process's "NIC" does with them.
//
// Directory. Every process that uses the device joins a host-wide directory
// (TF_RDMA_SOFTNIC_DIR, default /tmp/tf_rdma-softnic-<uid>):
//   p.<pid>.<nonce>.lock  held with a POSIX record lock while the process
//                         lives (the kernel drops it when the process dies,
//                         however it dies; not inherited across fork);
//   p.<pid>.<nonce>.sock  the process's listening Unix stream socket;
//   qp.<qpn>              a symlink to "<pid>.<nonce>": who owns QP <qpn>.
// QP numbers are host-wide unique (symlink creation is atomic), which is
// what lets the plugin exchange bare QP numbers out of band, as it does
// with a real NIC. Entries of dead processes are swept when a process
// joins; the nonce keeps a recycled pid from inheriting them.
//
// Wire. The first message on a requester QP opens a stream to the
// destination's process and sends a hello (source and destination QP
// numbers, the route it was given at RTR: DLID/DGID, its path MTU, its
// retry settings). Then each work request is one request header plus its
// payload, and the responder answers each with one 8-byte response (ACK or
// a NAK syndrome), in order. The requester's work request completes when
// its response arrives (IBA 9.7.5.1: RC completes on the ACK), so a
// successful completion means the data is placed in the responder's memory.
//
// Responder (the progress thread of the target process). Per request, as a
// responder NIC does (IBA 9.7.5.1, 9.7.4.1.x): a QP that is missing, not in
// RTR/RTS, connected to another QP, or a route that names no GID/LID of
// this port: the packet is silently dropped, so the requester retransmits
// after its ACK timeout and after retry_cnt retries completes
// IBV_WC_RETRY_EXC_ERR; here the responder holds the message and re-checks
// it at the requester's timeout instead of the requester resending it (the
// outcome and its timing are the same, the bytes cross once). A PSN behind
// the expected one is a duplicate: acknowledged, not executed. A PSN ahead
// is a sequence error: the requester's retries cannot fix it. An RDMA WRITE
// is checked against the QP's access flags and the MR that the rkey names
// (same PD, REMOTE_WRITE, the range inside it; a zero-length WRITE checks
// nothing, IBA 9.7.4.1.3); a SEND needs a posted receive (else RNR NAK and
// the requester retries after the responder's min_rnr_timer, rnr_retry
// times, 7 = forever) large enough, with valid local keys. Access and
// length violations are NAKed, complete with an error status on the
// requester, and move both QPs to the Error state (class C/D errors).
// Payloads are read from the socket straight into the registered memory,
// one message at a time per stream, so on one QP every earlier message is
// placed before a later one's receive completion is generated.
//
// Requester failures detected here: no directory entry, a refused or reset
// connection, end of stream (the peer process died): the QP's outstanding
// WRs complete IBV_WC_RETRY_EXC_ERR after (retry_cnt + 1) * ACK timeout,
// the QP moves to Error and flushes the rest.
//
// Costs and limits: a message crosses one Unix socket (two copies in the
// kernel). Streams are read without blocking, so a requester stalled
// mid-message holds back only its own stream. The "NIC" runs on the
// process's threads: a stopped (SIGSTOP) process acknowledges nothing until
// it resumes, where a real NIC would go on placing and acknowledging; and
// an alive but slow responder never causes a retry error.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>

#include "tests/softnic/softnic.h"
#include "tests/softnic/wire.h"

namespace softnic {

// ---------------------------------------------------------------------------
// Small helpers.

int MtuBytes(ibv_mtu mtu) {
  int code = static_cast<int>(mtu);
  return code >= 1 && code <= 5 ? 128 << code : 0;
}

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

int64_t AckTimeoutNs(uint8_t timeout) {
  if (timeout == 0) return 0;
  return static_cast<int64_t>(4096) << timeout;  // 4.096 us * 2^timeout
}

int64_t RnrTimerNs(uint8_t encoded) {
  // Microseconds, IBA table 45 (encoding 0 is the longest, 655.36 ms).
  static const int64_t kMicros[32] = {
      655360, 10,    20,    30,    40,    60,    80,    120,
      160,    240,   320,   480,   640,   960,   1280,  1920,
      2560,   3840,  5120,  7680,  10240, 15360, 20480, 30720,
      40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return kMicros[encoded & 31] * 1000;
}

uint32_t Packets(uint64_t length, uint32_t mtu_bytes) {
  if (length == 0 || mtu_bytes == 0) return 1;
  return static_cast<uint32_t>((length + mtu_bytes - 1) / mtu_bytes);
}

bool GidEntry::empty() const {
  for (uint8_t b : gid.raw) {
    if (b != 0) return false;
  }
  return true;
}

namespace {

// Descriptors this library owns, closed in a child after fork() so that a
// child never keeps a dead parent's sockets looking alive to its peers.
constexpr int kFdSlots = 8192;
std::atomic<int> g_fds[kFdSlots];
std::atomic<bool> g_fds_ready{false};

void RegisterFd(int fd) {
  if (!g_fds_ready.exchange(true)) {
    for (auto& slot : g_fds) slot.store(-1);
  }
  for (auto& slot : g_fds) {
    int expected = -1;
    if (slot.compare_exchange_strong(expected, fd)) return;
  }
}

void CloseFd(int fd) {
  if (fd < 0) return;
  for (auto& slot : g_fds) {
    int expected = fd;
    if (slot.compare_exchange_strong(expected, -1)) break;
  }
  close(fd);
}

bool SendAll(int fd, struct iovec* iov, int count) {
  while (count > 0) {
    msghdr msg = {};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(std::min(count, 1024));
    ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0) return false;
    size_t left = static_cast<size_t>(sent);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return true;
}

uint64_t RandomU64() {
  uint64_t v = 0;
  if (getrandom(&v, sizeof(v), 0) != sizeof(v)) {
    v = static_cast<uint64_t>(NowNs()) ^ (static_cast<uint64_t>(getpid()) << 32);
  }
  return v;
}

}  // namespace

// A requester QP's connection to the responder's process. The QP and the
// progress thread share it; the descriptor closes with the last owner.
class Link {
 public:
  Link(int fd, uint64_t id, uint32_t qpn) : fd(fd), id(id), qpn(qpn) {}
  ~Link() { CloseFd(fd); }
  const int fd;
  const uint64_t id;
  const uint32_t qpn;
  bool hello_sent = false;  // the QP's send engine only
  // Progress thread only: a response split across reads.
  uint8_t partial[sizeof(WireResponse)];
  size_t partial_len = 0;
};

constexpr int kParkedRnr = 1;
constexpr int kParkedDropped = 2;

// What the responder does with one request (Fabric::Decide).
struct Decision {
  enum Kind { kBlocked, kRespond, kPlace } kind = kRespond;
  int why = 0;                 // kBlocked: kParkedRnr or kParkedDropped
  int64_t rnr_interval_ns = 0;
  uint8_t syndrome = kAck;     // kRespond
  bool close_after = false;
  // A responder-side error, applied after the NAK is sent (a NIC NAKs at
  // once; its host learns of the error later).
  bool responder_error = false;
  ibv_event_type event = IBV_EVENT_QP_FATAL;
  ibv_wc_status recv_error = IBV_WC_SUCCESS;  // the receive WQE's status
  std::vector<std::pair<uint8_t*, uint64_t>> targets;  // kPlace
  std::vector<Mr*> busy;
  bool has_recv = false;
  RecvEntry recv;
  uint32_t packets = 1;
};

// A stream from some requester QP into this process (progress thread only).
// It is read without blocking, a message taking its bytes as they come, so
// a requester that stalls mid-message (stopped, or slow to send) holds
// back only its own stream, as a NIC holds back only that QP.
struct Inbound {
  enum Stage { kHello, kHeader, kPayload, kDiscard };
  uint64_t id = 0;
  int fd = -1;
  Stage stage = kHello;
  uint8_t buf[sizeof(WireHello)];  // a hello or request header, in part
  size_t have = 0;
  WireHello hello = {};
  WireRequest request = {};
  // kPayload: where the request's bytes go; kDiscard: how many to drop.
  Decision place;
  size_t target = 0;
  uint64_t target_done = 0;
  uint64_t discard_left = 0;
  uint8_t discard_syndrome = kAck;  // answered once discarded
  // A request the responder holds back (its payload still in the socket):
  bool parked = false;
  int why = 0;             // kParkedRnr or kParkedDropped
  int64_t left = 0;        // retries left; -1 = forever
  int64_t interval_ns = 0;
  int64_t deadline_ns = 0;
};

namespace {
constexpr uint64_t kListenId = 1;
constexpr uint64_t kWakeId = 2;
// How a step of an inbound stream ended.
enum Step { kMore, kWait, kGone };
}  // namespace

class Fabric {
 public:
  explicit Fabric(Nic* nic) : nic_(nic) {}

  bool Join();
  void Loop();
  std::shared_ptr<Link> Connect(Qp* qp, WireHello* hello);
  bool AllocateQpn(uint32_t* qpn);
  void ReleaseQpn(uint32_t qpn);
  void Wake() {
    uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) {
      // Already pending: the loop wakes anyway.
    }
  }
  void Shutdown();  // at exit: leave the directory

  std::map<uint64_t, std::shared_ptr<Link>> links;  // under nic->mu

 private:
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  bool OwnerAlive(const std::string& owner) const;
  void Sweep();
  void AcceptAll();
  void HandleInbound(Inbound* in);
  Step ReadHeader(Inbound* in, size_t want);
  Step ReadPayload(Inbound* in);
  Step DiscardPayload(Inbound* in);
  Step FinishPlacement(Inbound* in);
  void HandleLink(uint64_t id);
  Step Evaluate(Inbound* in);
  Decision Decide(Inbound* in);
  Decision Fail(Qp* qp, ibv_event_type event, uint8_t syndrome);
  Step Park(Inbound* in, const Decision& d);
  void Unpark(Inbound* in);
  void Respond(Inbound* in, uint8_t syndrome);
  void CloseInbound(Inbound* in);
  void ApplyResponderError(Inbound* in, const Decision& d);
  void RunTimers();
  int NextTimeoutMs();

  Nic* nic_;
  std::string dir_, self_;
  int lock_fd_ = -1, listen_fd_ = -1, epoll_fd_ = -1, wake_fd_ = -1;
  std::atomic<uint64_t> next_id_{3};
  std::map<uint64_t, std::unique_ptr<Inbound>> inbound_;  // progress thread
};

// ---------------------------------------------------------------------------
// Settings and the process-wide NIC.

namespace {

bool ParseInt(const char* name, int64_t lo, int64_t hi, int64_t* out,
              std::string* why) {
  const char* text = getenv(name);
  if (text == nullptr || *text == '\0') return true;
  char* end = nullptr;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) {
    *why = std::string(name) + "='" + text + "' is not an integer in [" +
           std::to_string(lo) + ", " + std::to_string(hi) + "]";
    return false;
  }
  *out = v;
  return true;
}

}  // namespace

bool Settings::FromEnvironment(Settings* s, std::string* why) {
  const char* link = getenv("TF_RDMA_SOFTNIC_LINK");
  if (link != nullptr && *link != '\0') {
    if (strcmp(link, "roce") == 0) {
      s->roce = true;
    } else if (strcmp(link, "ib") == 0) {
      s->roce = false;
    } else {
      *why = std::string("TF_RDMA_SOFTNIC_LINK='") + link +
             "' is not 'roce' or 'ib'";
      return false;
    }
  }
  const char* state = getenv("TF_RDMA_SOFTNIC_PORT_STATE");
  if (state != nullptr && *state != '\0') {
    if (strcmp(state, "active") == 0) {
      s->port_active = true;
    } else if (strcmp(state, "down") == 0) {
      s->port_active = false;
    } else {
      *why = std::string("TF_RDMA_SOFTNIC_PORT_STATE='") + state +
             "' is not 'active' or 'down'";
      return false;
    }
  }
  int64_t lid = s->lid, mtu = 4096, devices = 1, odp = 1;
  if (!ParseInt("TF_RDMA_SOFTNIC_LID", 1, 0xbfff, &lid, why) ||
      !ParseInt("TF_RDMA_SOFTNIC_MTU", 256, 4096, &mtu, why) ||
      !ParseInt("TF_RDMA_SOFTNIC_DEVICES", 0, 1, &devices, why) ||
      !ParseInt("TF_RDMA_SOFTNIC_ODP", 0, 1, &odp, why) ||
      !ParseInt("TF_RDMA_SOFTNIC_DELAY_US", 0, 60000000, &s->delay_us, why) ||
      !ParseInt("TF_RDMA_SOFTNIC_SEND_DELAY_US", 0, 60000000, &s->send_delay_us,
                why) ||
      !ParseInt("TF_RDMA_SOFTNIC_DROP_AFTER", 0, INT64_MAX, &s->drop_after,
                why) ||
      !ParseInt("TF_RDMA_SOFTNIC_CORRUPT_RKEY", 1, INT64_MAX,
                &s->corrupt_rkey, why)) {
    return false;
  }
  s->lid = static_cast<uint16_t>(lid);
  s->devices = devices == 1;
  s->odp = odp == 1;
  switch (mtu) {
    case 256: s->mtu = IBV_MTU_256; break;
    case 512: s->mtu = IBV_MTU_512; break;
    case 1024: s->mtu = IBV_MTU_1024; break;
    case 2048: s->mtu = IBV_MTU_2048; break;
    case 4096: s->mtu = IBV_MTU_4096; break;
    default:
      *why = "TF_RDMA_SOFTNIC_MTU=" + std::to_string(mtu) +
             " is not one of 256, 512, 1024, 2048, 4096";
      return false;
  }
  const char* dir = getenv("TF_RDMA_SOFTNIC_DIR");
  s->dir = dir != nullptr && *dir != '\0'
               ? dir
               : "/tmp/tf_rdma-softnic-" + std::to_string(getuid());
  if (s->dir.size() > 60) {  // sun_path holds 108 bytes with the names
    *why = "TF_RDMA_SOFTNIC_DIR='" + s->dir + "' is longer than 60 bytes";
    return false;
  }
  return true;
}

namespace {

pthread_mutex_t g_nic_mu = PTHREAD_MUTEX_INITIALIZER;
Nic* g_nic = nullptr;

void AfterForkInChild() {
  // The parent's NIC (its thread did not come along) is abandoned; its
  // sockets are closed here so that peers see the parent alone.
  g_nic_mu = PTHREAD_MUTEX_INITIALIZER;
  g_nic = nullptr;
  if (g_fds_ready.load()) {
    for (auto& slot : g_fds) {
      int fd = slot.exchange(-1);
      if (fd >= 0) close(fd);
    }
  }
}

void LeaveAtExit() {
  if (g_nic != nullptr && g_nic->fabric() != nullptr) {
    g_nic->fabric()->Shutdown();
  }
}

// The port's GID table (IBA 4.1.1; RoCE: the kernel's per-netdev table).
// InfiniBand: the port GID, fe80::/64 + the port GUID. RoCE: that default
// GID as RoCE v1 and v2, then each IPv4 address of this host (all
// interfaces: the emulated port carries them all) IPv4-mapped
// (::ffff:a.b.c.d), as RoCE v1 and v2.
std::vector<GidEntry> BuildGidTable(bool roce) {
  std::vector<GidEntry> table(kGidTableLen);
  for (auto& e : table) {
    memset(&e, 0, sizeof(e));
  }
  GidEntry link_local;
  memset(&link_local, 0, sizeof(link_local));
  link_local.gid.raw[0] = 0xfe;
  link_local.gid.raw[1] = 0x80;
  uint64_t port_guid = kNodeGuid + 1;
  for (int i = 0; i < 8; ++i) {
    link_local.gid.raw[8 + i] = static_cast<uint8_t>(port_guid >> (56 - 8 * i));
  }
  if (!roce) {
    link_local.type = IBV_GID_TYPE_IB;
    table[0] = link_local;
    return table;
  }
  size_t next = 0;
  link_local.type = IBV_GID_TYPE_ROCE_V1;
  table[next++] = link_local;
  link_local.type = IBV_GID_TYPE_ROCE_V2;
  table[next++] = link_local;
  ifaddrs* addrs = nullptr;
  if (getifaddrs(&addrs) != 0) return table;
  std::set<uint32_t> seen;
  for (ifaddrs* a = addrs; a != nullptr && next + 2 <= table.size();
       a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    uint32_t addr = reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr;
    if (!seen.insert(addr).second) continue;
    GidEntry e;
    memset(&e, 0, sizeof(e));
    e.gid.raw[10] = 0xff;
    e.gid.raw[11] = 0xff;
    memcpy(e.gid.raw + 12, &addr, 4);
    e.ifindex = if_nametoindex(a->ifa_name);
    e.type = IBV_GID_TYPE_ROCE_V1;
    table[next++] = e;
    e.type = IBV_GID_TYPE_ROCE_V2;
    table[next++] = e;
  }
  freeifaddrs(addrs);
  return table;
}

}  // namespace

Nic* Nic::Get() {
  pthread_mutex_lock(&g_nic_mu);
  static bool hooks = false;
  if (!hooks) {
    pthread_atfork(nullptr, nullptr, AfterForkInChild);
    atexit(LeaveAtExit);
    hooks = true;
  }
  if (g_nic == nullptr || g_nic->pid_ != getpid()) {
    Settings settings;
    std::string why;
    if (!Settings::FromEnvironment(&settings, &why)) {
      pthread_mutex_unlock(&g_nic_mu);
      fprintf(stderr, "softnic (emulated RDMA device): %s\n", why.c_str());
      errno = EINVAL;
      return nullptr;
    }
    Nic* nic = new Nic();
    nic->settings = settings;
    nic->gids = BuildGidTable(settings.roce);
    nic->pid_ = getpid();
    g_nic = nic;
  }
  Nic* nic = g_nic;
  pthread_mutex_unlock(&g_nic_mu);
  return nic;
}

bool Nic::Start() {
  std::lock_guard<std::mutex> lock(mu);
  if (fabric_ != nullptr) return true;
  std::unique_ptr<Fabric> fabric(new Fabric(this));
  if (!fabric->Join()) return false;
  fabric_ = fabric.release();
  Fabric* f = fabric_;
  std::thread([f] { f->Loop(); }).detach();
  return true;
}

bool Nic::AllocateQpn(uint32_t* qpn) { return fabric_->AllocateQpn(qpn); }
void Nic::ReleaseQpn(uint32_t qpn) { fabric_->ReleaseQpn(qpn); }
void Nic::Wake() {
  if (fabric_ != nullptr) fabric_->Wake();
}

// ---------------------------------------------------------------------------
// Completions and QP state changes (mu held).

void Nic::PushCompletion(Cq* cq, const Completion& c, bool solicited) {
  const ibv_wc& wc = c.wc;
  if (static_cast<int>(cq->entries.size()) >= cq->capacity) {
    // IBA 11.4.2.1 / 10.10.2: a CQ overrun is an affiliated asynchronous
    // error; the completion is lost.
    if (!cq->overrun) {
      cq->overrun = true;
      RaiseCqEvent(cq, IBV_EVENT_CQ_ERR);
    }
    return;
  }
  cq->entries.push_back(c);
  // ibv_req_notify_cq(3): with solicited_only, only a solicited receive or
  // an unsuccessful completion raises the event; one event per arming.
  if (cq->armed &&
      (!cq->solicited_only || solicited || wc.status != IBV_WC_SUCCESS)) {
    cq->armed = false;
    if (cq->channel != nullptr) {
      uint64_t handle = reinterpret_cast<uintptr_t>(cq);
      if (write(cq->channel->write_fd, &handle, sizeof(handle)) < 0) {
        // A full pipe already wakes the reader.
      }
    }
  }
}

void Nic::CompleteSend(Qp* qp, const SendEntry& e, ibv_wc_status status) {
  ibv_wc wc;
  memset(&wc, 0, sizeof(wc));
  wc.wr_id = e.wr_id;
  wc.status = status;
  wc.opcode = e.opcode;
  wc.byte_len = e.length;
  wc.qp_num = qp->qp.qp_num;
  PushCompletion(qp->send_cq, {wc, qp->qp.qp_num, qp->epoch, e.seq, true},
                 false);
}

void Nic::CompleteRecv(Qp* qp, const RecvEntry& r, ibv_wc wc, bool solicited) {
  wc.wr_id = r.wr_id;
  wc.qp_num = qp->qp.qp_num;
  PushCompletion(qp->recv_cq, {wc, qp->qp.qp_num, qp->epoch, r.seq, false},
                 solicited);
}

void Nic::RetireAcked(Qp* qp) {
  // IBA 10.8.3: send WRs complete in the order they were posted;
  // ibv_post_send(3): an unsignaled WR that succeeds generates no
  // completion (sq_sig_all=0).
  while (!qp->outstanding.empty() && qp->outstanding.front().acked) {
    SendEntry e = qp->outstanding.front();
    qp->outstanding.pop_front();
    if (e.signaled || qp->sq_sig_all) CompleteSend(qp, e, IBV_WC_SUCCESS);
  }
}

void Nic::MoveToError(Qp* qp) {
  qp->qp.state = IBV_QPS_ERR;
  // Errors always complete, signaled or not (rxe does the same).
  for (const SendEntry& e : qp->outstanding) {
    if (e.acked && e.failed == IBV_WC_SUCCESS) {
      if (e.signaled || qp->sq_sig_all) CompleteSend(qp, e, IBV_WC_SUCCESS);
      continue;
    }
    CompleteSend(qp, e,
                 e.failed != IBV_WC_SUCCESS ? e.failed : IBV_WC_WR_FLUSH_ERR);
  }
  qp->outstanding.clear();
  DropUnsent(qp);
  for (const RecvEntry& r : qp->receives) {
    ibv_wc wc;
    memset(&wc, 0, sizeof(wc));
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    CompleteRecv(qp, r, wc, false);
  }
  qp->receives.clear();
  if (qp->link) {
    shutdown(qp->link->fd, SHUT_RDWR);
    qp->link.reset();
  }
  qp->lost_since_ns = 0;
}

void Nic::ResetQp(Qp* qp) {
  // IBA 10.3.1 Reset: the work queues are emptied without completions.
  qp->qp.state = IBV_QPS_RESET;
  qp->outstanding.clear();
  DropUnsent(qp);
  qp->receives.clear();
  if (qp->link) {
    shutdown(qp->link->fd, SHUT_RDWR);
    qp->link.reset();
  }
  qp->lost_since_ns = 0;
  qp->next_psn = 0;
  qp->expected_psn = 0;
  ++qp->epoch;
  qp->sq_posted = qp->sq_retired = qp->rq_posted = qp->rq_retired = 0;
  uint8_t port = qp->attr.port_num;
  memset(&qp->attr, 0, sizeof(qp->attr));
  qp->attr.port_num = port;
}

namespace {
struct AsyncRecord {
  uint64_t element;
  uint32_t type;
  uint32_t reserved;
};
}  // namespace

void Nic::RaiseQpEvent(Qp* qp, ibv_event_type type) {
  Context* c = ToContext(qp->qp.context);
  AsyncRecord r = {reinterpret_cast<uintptr_t>(qp), static_cast<uint32_t>(type), 0};
  if (write(c->async_write_fd, &r, sizeof(r)) < 0) {
    // Nobody reads the async events: dropped, as a full kernel queue would.
  }
}

void Nic::RaiseCqEvent(Cq* cq, ibv_event_type type) {
  Context* c = ToContext(cq->cq.context);
  AsyncRecord r = {reinterpret_cast<uintptr_t>(cq), static_cast<uint32_t>(type), 0};
  if (write(c->async_write_fd, &r, sizeof(r)) < 0) {
    // As above.
  }
}

void Nic::MarkLost(Qp* qp) {
  if (qp->lost_since_ns == 0) {
    qp->lost_since_ns = NowNs();
    Wake();
  }
}

bool Nic::RouteMatches(uint16_t dlid, bool is_global,
                       const uint8_t* dgid) const {
  // A packet reaches this port when its DLID is the port's (InfiniBand)
  // and, with a GRH, its DGID is one of the port's GIDs; RoCE routes by
  // the DGID alone.
  if (!settings.roce && dlid != settings.lid) return false;
  if (settings.roce && !is_global) return false;
  if (!is_global) return true;
  for (const GidEntry& e : gids) {
    if (!e.empty() && memcmp(e.gid.raw, dgid, 16) == 0) return true;
  }
  return false;
}

bool Nic::HasLink(const Qp* qp) const { return static_cast<bool>(qp->link); }

void Nic::Enqueue(Qp* qp, Transmission t) {
  for (Mr* mr : t.busy) ++mr->busy;
  qp->to_send.push_back(std::move(t));
  if (!qp->engine.joinable()) qp->engine = std::thread([this, qp] { RunEngine(qp); });
  qp->send_cv.notify_one();
}

void Nic::DropUnsent(Qp* qp) {
  for (Transmission& t : qp->to_send) {
    for (Mr* mr : t.busy) --mr->busy;
  }
  if (!qp->to_send.empty()) idle.notify_all();
  qp->to_send.clear();
}

void Nic::StopEngine(Qp* qp, std::unique_lock<std::mutex>* lock) {
  qp->stopping = true;
  DropUnsent(qp);
  if (qp->link) shutdown(qp->link->fd, SHUT_RDWR);  // unblocks a send
  qp->send_cv.notify_one();
  lock->unlock();
  if (qp->engine.joinable()) qp->engine.join();
}

void Nic::RunEngine(Qp* qp) {
  std::unique_lock<std::mutex> lock(mu);
  while (true) {
    qp->send_cv.wait(lock, [qp] { return qp->stopping || !qp->to_send.empty(); });
    if (qp->stopping) return;
    Transmission t = std::move(qp->to_send.front());
    qp->to_send.pop_front();
    lock.unlock();
    int64_t wait_ns = t.not_before_ns - NowNs();
    if (wait_ns > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(wait_ns));
    bool sent = Transmit(qp, t);
    lock.lock();
    for (Mr* mr : t.busy) --mr->busy;
    if (!t.busy.empty()) idle.notify_all();
    if (!sent && qp->qp.state == IBV_QPS_RTS) MarkLost(qp);
  }
}

bool Nic::Transmit(Qp* qp, const Transmission& t) {
  std::shared_ptr<Link> link;
  WireHello hello;
  memset(&hello, 0, sizeof(hello));
  {
    std::lock_guard<std::mutex> lock(mu);
    if (qp->lost_since_ns != 0 || qp->qp.state != IBV_QPS_RTS) return false;
    link = qp->link;
    hello.magic = kHelloMagic;
    hello.src_qpn = qp->qp.qp_num;
    hello.dst_qpn = qp->attr.dest_qp_num;
    hello.mtu_bytes = static_cast<uint32_t>(MtuBytes(qp->attr.path_mtu));
    hello.dlid = qp->attr.ah_attr.dlid;
    hello.slid = settings.roce ? 0 : settings.lid;
    hello.is_global = qp->attr.ah_attr.is_global;
    hello.rnr_retry = qp->attr.rnr_retry;
    hello.retry_cnt = qp->attr.retry_cnt;
    hello.timeout = qp->attr.timeout;
    memcpy(hello.dgid, qp->attr.ah_attr.grh.dgid.raw, 16);
  }
  if (!link) {
    link = fabric_->Connect(qp, &hello);
    if (!link) return false;
  }
  std::vector<struct iovec> iov;
  iov.reserve(t.payload.size() + 2);
  if (!link->hello_sent) iov.push_back({&hello, sizeof(hello)});
  iov.push_back({const_cast<WireRequest*>(&t.request), sizeof(t.request)});
  for (const struct iovec& v : t.payload) {
    if (v.iov_len > 0) iov.push_back(v);
  }
  if (!SendAll(link->fd, iov.data(), static_cast<int>(iov.size()))) {
    return false;
  }
  link->hello_sent = true;
  return true;
}

Fabric* Nic::fabric() { return fabric_; }

// ---------------------------------------------------------------------------
// The directory.

bool Fabric::Join() {
  dir_ = nic_->settings.dir;
  if (mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) return false;
  char nonce[17];
  snprintf(nonce, sizeof(nonce), "%08x",
           static_cast<unsigned>(RandomU64() & 0xffffffffu));
  self_ = std::to_string(getpid()) + "." + nonce;
  // The lock is taken under a temporary name and renamed into place, so a
  // sweeper never sees our lock file unlocked.
  std::string tmp = Path(".tmp." + self_);
  lock_fd_ = open(tmp.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  if (lock_fd_ < 0) return false;
  struct flock fl = {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  if (fcntl(lock_fd_, F_SETLK, &fl) != 0 ||
      rename(tmp.c_str(), Path("p." + self_ + ".lock").c_str()) != 0) {
    int err = errno;
    unlink(tmp.c_str());
    errno = err;
    return false;
  }
  RegisterFd(lock_fd_);
  listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) return false;
  RegisterFd(listen_fd_);
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::string sock = Path("p." + self_ + ".sock");
  snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", sock.c_str());
  unlink(sock.c_str());
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listen_fd_, SOMAXCONN) != 0) {
    return false;
  }
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (epoll_fd_ < 0 || wake_fd_ < 0) return false;
  RegisterFd(epoll_fd_);
  RegisterFd(wake_fd_);
  epoll_event ev = {};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenId;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  ev.data.u64 = kWakeId;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  Sweep();
  return true;
}

bool Fabric::OwnerAlive(const std::string& owner) const {
  // Never called for ourselves: closing a descriptor of our own lock file
  // would drop our lock (POSIX record locks are per process and file).
  if (owner == self_) return true;
  int fd = open(Path("p." + owner + ".lock").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct flock fl = {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  bool alive = fcntl(fd, F_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
  close(fd);
  return alive;
}

void Fabric::Sweep() {
  std::vector<std::string> names;
  if (auto* d = opendir(dir_.c_str())) {
    while (dirent* e = readdir(d)) names.push_back(e->d_name);
    closedir(d);
  }
  for (const std::string& name : names) {
    if (name.rfind("p.", 0) == 0 && name.size() > 7 &&
        name.compare(name.size() - 5, 5, ".lock") == 0) {
      std::string owner = name.substr(2, name.size() - 7);
      if (!OwnerAlive(owner)) {
        unlink(Path(name).c_str());
        unlink(Path("p." + owner + ".sock").c_str());
      }
    } else if (name.rfind("qp.", 0) == 0) {
      char target[64];
      ssize_t n = readlink(Path(name).c_str(), target, sizeof(target) - 1);
      if (n > 0) {
        target[n] = '\0';
        if (!OwnerAlive(target)) unlink(Path(name).c_str());
      }
    } else if (name.rfind(".tmp.", 0) == 0) {
      struct stat st;
      if (stat(Path(name).c_str(), &st) == 0 && time(nullptr) - st.st_mtime > 60) {
        unlink(Path(name).c_str());
      }
    }
  }
}

bool Fabric::AllocateQpn(uint32_t* qpn) {
  for (int attempt = 0; attempt < 1000; ++attempt) {
    // QP numbers 0 and 1 are special (IBA 10.2.5); 24 bits.
    uint32_t n = 0x100 + static_cast<uint32_t>(RandomU64() % (0xffffff - 0x100));
    std::string entry = Path("qp." + std::to_string(n));
    if (symlink(self_.c_str(), entry.c_str()) == 0) {
      *qpn = n;
      return true;
    }
    if (errno != EEXIST) return false;
  }
  errno = EAGAIN;
  return false;
}

void Fabric::ReleaseQpn(uint32_t qpn) {
  unlink(Path("qp." + std::to_string(qpn)).c_str());
}

void Fabric::Shutdown() {
  // Leaves the directory at a normal exit (a killed process is swept).
  unlink(Path("p." + self_ + ".sock").c_str());
  std::vector<uint32_t> qpns;
  if (nic_->mu.try_lock()) {
    for (auto& kv : nic_->qps) qpns.push_back(kv.first);
    nic_->mu.unlock();
  }
  for (uint32_t qpn : qpns) ReleaseQpn(qpn);
  unlink(Path("p." + self_ + ".lock").c_str());
}

std::shared_ptr<Link> Fabric::Connect(Qp* qp, WireHello* hello) {
  char target[64];
  ssize_t n = readlink(Path("qp." + std::to_string(hello->dst_qpn)).c_str(),
                       target, sizeof(target) - 1);
  if (n <= 0) return nullptr;  // no such QP on this fabric
  target[n] = '\0';
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  snprintf(addr.sun_path, sizeof(addr.sun_path), "%s",
           Path(std::string("p.") + target + ".sock").c_str());
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return nullptr;
  }
  int bytes = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  RegisterFd(fd);
  auto link = std::make_shared<Link>(fd, next_id_++, qp->qp.qp_num);
  {
    std::lock_guard<std::mutex> lock(nic_->mu);
    if (qp->qp.state != IBV_QPS_RTS || qp->lost_since_ns != 0) return nullptr;
    qp->link = link;
    links[link->id] = link;
  }
  epoll_event ev = {};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = link->id;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  return link;
}

// ---------------------------------------------------------------------------
// The progress thread.

void Fabric::Loop() {
  epoll_event events[64];
  while (true) {
    int n = epoll_wait(epoll_fd_, events, 64, NextTimeoutMs());
    if (n < 0 && errno != EINTR) return;
    for (int i = 0; i < n; ++i) {
      uint64_t id = events[i].data.u64;
      if (id == kListenId) {
        AcceptAll();
      } else if (id == kWakeId) {
        uint64_t count;
        while (read(wake_fd_, &count, sizeof(count)) > 0) {
        }
      } else {
        auto it = inbound_.find(id);
        if (it != inbound_.end()) {
          HandleInbound(it->second.get());
        } else {
          HandleLink(id);
        }
      }
    }
    RunTimers();
  }
}

int Fabric::NextTimeoutMs() {
  int64_t now = NowNs();
  int64_t next = now + 1000000000ll;
  for (auto& kv : inbound_) {
    if (kv.second->parked) next = std::min(next, kv.second->deadline_ns);
  }
  {
    std::lock_guard<std::mutex> lock(nic_->mu);
    for (auto& kv : nic_->qps) {
      Qp* qp = kv.second;
      int64_t t = AckTimeoutNs(qp->attr.timeout);
      if (qp->lost_since_ns != 0 && !qp->outstanding.empty() && t > 0) {
        next = std::min(next, qp->lost_since_ns + t * (qp->attr.retry_cnt + 1));
      }
    }
  }
  if (next <= now) return 0;
  return static_cast<int>((next - now + 999999) / 1000000);
}

void Fabric::RunTimers() {
  int64_t now = NowNs();
  std::vector<Inbound*> due;
  for (auto& kv : inbound_) {
    if (kv.second->parked && kv.second->deadline_ns <= now) {
      due.push_back(kv.second.get());
    }
  }
  for (Inbound* in : due) {
    if (Evaluate(in) == kMore) HandleInbound(in);
  }
  std::lock_guard<std::mutex> lock(nic_->mu);
  for (auto& kv : nic_->qps) {
    Qp* qp = kv.second;
    int64_t t = AckTimeoutNs(qp->attr.timeout);
    if (qp->lost_since_ns == 0 || qp->outstanding.empty() || t == 0) continue;
    if (now >= qp->lost_since_ns + t * (qp->attr.retry_cnt + 1)) {
      // IBA 9.7.6.1.3: the retry count is exhausted without an ACK.
      qp->outstanding.front().failed = IBV_WC_RETRY_EXC_ERR;
      nic_->MoveToError(qp);
    }
  }
}

void Fabric::AcceptAll() {
  while (true) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    // Blocking for the (small) responses; reads pass MSG_DONTWAIT.
    int flags = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    RegisterFd(fd);
    auto in = std::make_unique<Inbound>();
    in->id = next_id_++;
    in->fd = fd;
    epoll_event ev = {};
    ev.events = EPOLLIN;
    ev.data.u64 = in->id;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
    inbound_[in->id] = std::move(in);
  }
}

void Fabric::CloseInbound(Inbound* in) {
  if (in->stage == Inbound::kPayload && !in->place.busy.empty()) {
    // A message cut off midway (the requester died): the bytes that came
    // are placed, as a NIC would have placed the packets that came.
    std::lock_guard<std::mutex> lock(nic_->mu);
    for (Mr* mr : in->place.busy) --mr->busy;
    nic_->idle.notify_all();
  }
  if (!in->parked) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, in->fd, nullptr);
  CloseFd(in->fd);
  inbound_.erase(in->id);
}

Step Fabric::ReadHeader(Inbound* in, size_t want) {
  while (in->have < want) {
    ssize_t got = recv(in->fd, in->buf + in->have, want - in->have, MSG_DONTWAIT);
    if (got > 0) {
      in->have += static_cast<size_t>(got);
    } else if (got < 0 && errno == EINTR) {
      continue;
    } else if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return kWait;
    } else {
      CloseInbound(in);  // the requester's process is gone
      return kGone;
    }
  }
  in->have = 0;
  return kMore;
}

Step Fabric::ReadPayload(Inbound* in) {
  auto& targets = in->place.targets;
  while (in->target < targets.size()) {
    uint64_t left = targets[in->target].second - in->target_done;
    if (left == 0) {
      ++in->target;
      in->target_done = 0;
      continue;
    }
    ssize_t got = recv(in->fd, targets[in->target].first + in->target_done,
                       static_cast<size_t>(std::min<uint64_t>(left, 1 << 30)),
                       MSG_DONTWAIT);
    if (got > 0) {
      in->target_done += static_cast<uint64_t>(got);
    } else if (got < 0 && errno == EINTR) {
      continue;
    } else if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return kWait;
    } else {
      CloseInbound(in);
      return kGone;
    }
  }
  return kMore;
}

Step Fabric::DiscardPayload(Inbound* in) {
  static uint8_t sink[1 << 16];
  while (in->discard_left > 0) {
    ssize_t got = recv(in->fd, sink,
                       static_cast<size_t>(std::min<uint64_t>(in->discard_left, sizeof(sink))),
                       MSG_DONTWAIT);
    if (got > 0) {
      in->discard_left -= static_cast<uint64_t>(got);
    } else if (got < 0 && errno == EINTR) {
      continue;
    } else if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return kWait;
    } else {
      CloseInbound(in);
      return kGone;
    }
  }
  return kMore;
}

void Fabric::HandleInbound(Inbound* in) {
  // Level-triggered: a bounded number of messages per call, so that one
  // busy stream does not starve the others.
  for (int budget = 0; budget < 64 && !in->parked; ++budget) {
    switch (in->stage) {
      case Inbound::kHello:
        if (ReadHeader(in, sizeof(WireHello)) != kMore) return;
        memcpy(&in->hello, in->buf, sizeof(in->hello));
        if (in->hello.magic != kHelloMagic) {
          CloseInbound(in);
          return;
        }
        in->stage = Inbound::kHeader;
        break;
      case Inbound::kHeader:
        if (ReadHeader(in, sizeof(WireRequest)) != kMore) return;
        memcpy(&in->request, in->buf, sizeof(in->request));
        if (Evaluate(in) != kMore) return;
        break;
      case Inbound::kPayload:
        if (ReadPayload(in) != kMore || FinishPlacement(in) != kMore) return;
        break;
      case Inbound::kDiscard:
        if (DiscardPayload(in) != kMore) return;
        Respond(in, in->discard_syndrome);
        in->stage = Inbound::kHeader;
        break;
    }
  }
}

void Fabric::Respond(Inbound* in, uint8_t syndrome) {
  WireResponse r = {};
  r.psn = in->request.psn;
  r.syndrome = syndrome;
  struct iovec iov = {&r, sizeof(r)};
  SendAll(in->fd, &iov, 1);  // a requester that is gone does not need it
}

Step Fabric::Park(Inbound* in, const Decision& d) {
  int64_t now = NowNs();
  bool exhausted = false;
  if (!in->parked || in->why != d.why) {
    // First hold for this reason.
    if (!in->parked) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, in->fd, nullptr);
    in->parked = true;
    in->why = d.why;
    if (d.why == kParkedRnr) {
      // IBA 9.7.5.2.8: the requester retries an RNR NAK after the
      // responder's RNR timer, rnr_retry times (7: without limit).
      int r = in->hello.rnr_retry;
      in->left = r == 7 ? -1 : r;
      in->interval_ns = d.rnr_interval_ns;
    } else {
      // Dropped: the requester waits its ACK timeout, retry_cnt times after
      // the first transmission (timeout 0: forever).
      int64_t t = AckTimeoutNs(in->hello.timeout);
      in->left = t == 0 ? -1 : in->hello.retry_cnt + 1;
      in->interval_ns = t == 0 ? 100000000ll : t;
    }
    exhausted = in->left == 0;  // rnr_retry 0: the first RNR NAK is final
  } else {
    exhausted = in->left > 0 && --in->left == 0;  // still held at a retry
  }
  if (exhausted) {
    // The requester gives up: its WR fails, its QP moves to Error and sends
    // nothing more, so this stream ends here.
    Respond(in, d.why == kParkedRnr ? kNakRnr : kNakRetry);
    CloseInbound(in);
    return kGone;
  }
  in->deadline_ns = now + in->interval_ns;
  return kWait;
}

void Fabric::Unpark(Inbound* in) {
  if (!in->parked) return;
  in->parked = false;
  epoll_event ev = {};
  ev.events = EPOLLIN;
  ev.data.u64 = in->id;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, in->fd, &ev);
}

Decision Fabric::Fail(Qp* qp, ibv_event_type event, uint8_t syndrome) {
  // A responder-side class C/D error (IBA 9.9.3.1.3): NAK to the requester,
  // then an affiliated asynchronous event and the responder's QP to Error
  // (ApplyResponderError).
  (void)qp;
  Decision d;
  d.kind = Decision::kRespond;
  d.syndrome = syndrome;
  d.close_after = true;
  d.responder_error = true;
  d.event = event;
  return d;
}

void Fabric::ApplyResponderError(Inbound* in, const Decision& d) {
  std::lock_guard<std::mutex> lock(nic_->mu);
  auto it = nic_->qps.find(in->hello.dst_qpn);
  if (it == nic_->qps.end()) return;
  Qp* qp = it->second;
  if (d.recv_error != IBV_WC_SUCCESS && !qp->receives.empty()) {
    RecvEntry taken = qp->receives.front();
    qp->receives.pop_front();
    ibv_wc wc;
    memset(&wc, 0, sizeof(wc));
    wc.opcode = IBV_WC_RECV;
    wc.status = d.recv_error;
    nic_->CompleteRecv(qp, taken, wc, false);
  }
  nic_->RaiseQpEvent(qp, d.event);
  nic_->MoveToError(qp);
}

Decision Fabric::Decide(Inbound* in) {
  const WireHello& h = in->hello;
  const WireRequest& r = in->request;
  Decision d;
  auto it = nic_->qps.find(h.dst_qpn);
  Qp* qp = it == nic_->qps.end() ? nullptr : it->second;
  bool accepts = qp != nullptr &&
                 (qp->qp.state == IBV_QPS_RTR || qp->qp.state == IBV_QPS_RTS) &&
                 qp->attr.dest_qp_num == h.src_qpn &&
                 nic_->RouteMatches(h.dlid, h.is_global != 0, h.dgid);
  if (!accepts) {
    if (getenv("TF_RDMA_SOFTNIC_DEBUG") != nullptr) {
      fprintf(stderr,
              "softnic: dropped a request for QP %u from QP %u: %s (psn %u)\n",
              h.dst_qpn, h.src_qpn,
              qp == nullptr ? "no such QP"
              : !(qp->qp.state == IBV_QPS_RTR || qp->qp.state == IBV_QPS_RTS)
                  ? "QP not in RTR/RTS"
              : qp->attr.dest_qp_num != h.src_qpn ? "QP connected elsewhere"
                                                  : "route names no GID/LID here",
              r.psn);
    }
    d.kind = Decision::kBlocked;
    d.why = kParkedDropped;
    return d;
  }
  // IBA 9.7.5.1.1 PSN checks (24-bit serial arithmetic).
  uint32_t diff = (r.psn - qp->expected_psn) & 0xffffff;
  if (diff != 0) {
    d.kind = Decision::kRespond;
    if (diff & 0x800000) {
      d.syndrome = kAck;  // duplicate: acknowledged, not executed again
    } else {
      d.syndrome = kNakRetry;  // sequence error the requester cannot fix
      d.close_after = true;
      if (getenv("TF_RDMA_SOFTNIC_DEBUG") != nullptr) {
        fprintf(stderr, "softnic: QP %u expected PSN %u, got %u from QP %u\n",
                h.dst_qpn, qp->expected_psn, r.psn, h.src_qpn);
      }
    }
    return d;
  }
  uint32_t mtu = static_cast<uint32_t>(MtuBytes(qp->attr.path_mtu));
  if (h.mtu_bytes > mtu && r.length > mtu) {
    // A packet longer than the responder's path MTU: invalid request.
    return Fail(qp, IBV_EVENT_QP_REQ_ERR, kNakInvalid);
  }
  d.packets = Packets(r.length, h.mtu_bytes);
  bool write = r.op == kOpWrite || r.op == kOpWriteImm;
  bool needs_receive = r.op != kOpWrite;
  if (r.op < kOpWrite || r.op > kOpSendImm) {
    return Fail(qp, IBV_EVENT_QP_REQ_ERR, kNakInvalid);
  }
  if (needs_receive && qp->receives.empty()) {
    // IBA 9.7.5.2.8: no receive WQE, RNR NAK.
    d.kind = Decision::kBlocked;
    d.why = kParkedRnr;
    d.rnr_interval_ns = RnrTimerNs(qp->attr.min_rnr_timer);
    return d;
  }
  if (write && r.length > 0) {
    // IBA 10.6.3.3 / ibv_reg_mr(3): the rkey must name an MR of the QP's
    // PD with REMOTE_WRITE, the range must lie inside it, and the QP must
    // allow remote writes (IBV_ACCESS_REMOTE_WRITE in qp_access_flags).
    auto m = nic_->mrs.find(r.rkey);
    Mr* mr = m == nic_->mrs.end() ? nullptr : m->second;
    uint64_t start = r.remote_addr;
    uint64_t mr_start = mr ? reinterpret_cast<uintptr_t>(mr->mr.addr) : 0;
    if (!(qp->attr.qp_access_flags & IBV_ACCESS_REMOTE_WRITE) || mr == nullptr ||
        mr->pd != qp->pd || !(mr->access & IBV_ACCESS_REMOTE_WRITE) ||
        start < mr_start || start + r.length < start ||
        start + r.length > mr_start + mr->mr.length) {
      return Fail(qp, IBV_EVENT_QP_ACCESS_ERR, kNakAccess);
    }
    d.targets.push_back({reinterpret_cast<uint8_t*>(start), r.length});
    d.busy.push_back(mr);
  }
  if (needs_receive) {
    RecvEntry& recv = qp->receives.front();
    if (!write) {
      uint64_t capacity = 0;
      for (const ibv_sge& s : recv.sges) capacity += s.length;
      if (r.length > capacity) {
        // IBA 9.9.3.1.3 (C9-?) message longer than the receive buffer: local
        // length error at the responder, invalid request at the requester.
        Decision e = Fail(qp, IBV_EVENT_QP_REQ_ERR, kNakInvalid);
        e.recv_error = IBV_WC_LOC_LEN_ERR;
        return e;
      }
      uint64_t left = r.length;
      for (const ibv_sge& s : recv.sges) {
        if (left == 0) break;
        uint64_t take = std::min<uint64_t>(s.length, left);
        auto m = nic_->mrs.find(s.lkey);
        Mr* mr = m == nic_->mrs.end() ? nullptr : m->second;
        uint64_t mr_start = mr ? reinterpret_cast<uintptr_t>(mr->mr.addr) : 0;
        if (mr == nullptr || mr->pd != qp->pd ||
            !(mr->access & IBV_ACCESS_LOCAL_WRITE) || s.addr < mr_start ||
            s.addr + take > mr_start + mr->mr.length) {
          // The receive WQE names memory it may not write: local protection
          // error at the responder, remote operation error at the requester.
          Decision e = Fail(qp, IBV_EVENT_QP_ACCESS_ERR, kNakOperation);
          e.recv_error = IBV_WC_LOC_PROT_ERR;
          return e;
        }
        d.targets.push_back({reinterpret_cast<uint8_t*>(s.addr), take});
        d.busy.push_back(mr);
        left -= take;
      }
    }
    d.has_recv = true;
    d.recv = recv;
    qp->receives.pop_front();
  }
  for (Mr* mr : d.busy) ++mr->busy;
  d.kind = Decision::kPlace;
  return d;
}

Step Fabric::Evaluate(Inbound* in) {
  Decision d;
  {
    std::lock_guard<std::mutex> lock(nic_->mu);
    d = Decide(in);
  }
  if (d.kind == Decision::kBlocked) return Park(in, d);
  Unpark(in);
  if (d.kind == Decision::kRespond) {
    if (d.close_after) {
      // The NAK first; this stream carries nothing more the requester will
      // count on, so the rest of it is dropped with the connection.
      Respond(in, d.syndrome);
      if (d.responder_error) ApplyResponderError(in, d);
      CloseInbound(in);
      return kGone;
    }
    in->stage = Inbound::kDiscard;  // a duplicate: acknowledged, not placed
    in->discard_left = in->request.length;
    in->discard_syndrome = d.syndrome;
    return kMore;
  }
  if (nic_->settings.delay_us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(nic_->settings.delay_us));
  }
  in->stage = Inbound::kPayload;
  in->place = std::move(d);
  in->target = 0;
  in->target_done = 0;
  return kMore;
}

Step Fabric::FinishPlacement(Inbound* in) {
  const WireRequest& r = in->request;
  Decision& d = in->place;
  uint8_t syndrome = kAck;
  {
    std::lock_guard<std::mutex> lock(nic_->mu);
    for (Mr* mr : d.busy) --mr->busy;
    if (!d.busy.empty()) nic_->idle.notify_all();
    d.busy.clear();
    auto it = nic_->qps.find(in->hello.dst_qpn);
    Qp* qp = it == nic_->qps.end() ? nullptr : it->second;
    if (qp != nullptr &&
        (qp->qp.state == IBV_QPS_RTR || qp->qp.state == IBV_QPS_RTS)) {
      qp->expected_psn = (qp->expected_psn + d.packets) & 0xffffff;
      if (d.has_recv) {
        ibv_wc wc;
        memset(&wc, 0, sizeof(wc));
        wc.status = IBV_WC_SUCCESS;
        wc.opcode = r.op == kOpWriteImm ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
        wc.byte_len = r.length;
        wc.src_qp = in->hello.src_qpn;
        wc.slid = in->hello.slid;
        if (r.op == kOpWriteImm || r.op == kOpSendImm) {
          wc.wc_flags = IBV_WC_WITH_IMM;
          wc.imm_data = r.imm;
        }
        nic_->CompleteRecv(qp, d.recv, wc, r.solicited != 0);
      }
    } else {
      syndrome = kNakRetry;  // the QP left RTR/RTS while the data arrived
    }
  }
  in->place = Decision();
  in->stage = Inbound::kHeader;
  Respond(in, syndrome);
  if (syndrome != kAck) {
    CloseInbound(in);
    return kGone;
  }
  return kMore;
}

void Fabric::HandleLink(uint64_t id) {
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> lock(nic_->mu);
    auto it = links.find(id);
    if (it == links.end()) return;
    link = it->second;
  }
  bool closed = false;
  std::vector<WireResponse> responses;
  while (true) {
    uint8_t buf[4096];
    size_t have = link->partial_len;
    memcpy(buf, link->partial, have);
    ssize_t got = recv(link->fd, buf + have, sizeof(buf) - have, MSG_DONTWAIT);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (got <= 0) {
      closed = true;
      break;
    }
    size_t total = have + static_cast<size_t>(got);
    size_t whole = total / sizeof(WireResponse);
    for (size_t i = 0; i < whole; ++i) {
      WireResponse r;
      memcpy(&r, buf + i * sizeof(r), sizeof(r));
      responses.push_back(r);
    }
    link->partial_len = total - whole * sizeof(WireResponse);
    memcpy(link->partial, buf + whole * sizeof(WireResponse), link->partial_len);
  }
  std::lock_guard<std::mutex> lock(nic_->mu);
  auto it = nic_->qps.find(link->qpn);
  Qp* qp = it == nic_->qps.end() ? nullptr : it->second;
  bool current = qp != nullptr && qp->link == link;
  for (const WireResponse& r : responses) {
    if (!current || qp->qp.state != IBV_QPS_RTS) break;
    SendEntry* e = nullptr;
    for (SendEntry& s : qp->outstanding) {
      if (!s.acked && s.failed == IBV_WC_SUCCESS && s.psn == r.psn) {
        e = &s;
        break;
      }
    }
    if (e == nullptr) continue;
    if (r.syndrome == kAck) {
      e->acked = true;
      nic_->RetireAcked(qp);
      continue;
    }
    switch (r.syndrome) {
      case kNakRnr: e->failed = IBV_WC_RNR_RETRY_EXC_ERR; break;
      case kNakAccess: e->failed = IBV_WC_REM_ACCESS_ERR; break;
      case kNakInvalid: e->failed = IBV_WC_REM_INV_REQ_ERR; break;
      case kNakOperation: e->failed = IBV_WC_REM_OP_ERR; break;
      default: e->failed = IBV_WC_RETRY_EXC_ERR; break;
    }
    nic_->MoveToError(qp);
    current = false;
  }
  if (closed) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, link->fd, nullptr);
    links.erase(id);
    if (qp != nullptr && qp->link == link) {
      // The responder's process is gone (or dropped us): nothing more is
      // acknowledged on this connection.
      qp->link.reset();
      nic_->MarkLost(qp);
    }
  }
}

}  // namespace softnic
