// softnic: an emulated RDMA NIC in user space, for tests and for trying the
// verbs transport on a machine without one. NEVER a production data path.
//
// What it is: a drop-in libibverbs.so.1 (same soname, same symbol versions
// as rdma-core's, built against the system's <infiniband/verbs.h>), so that
// the unmodified verbs plugin (tf_rdma/_tf_rdma_verbs.so) loads against it
// when its directory comes first on LD_LIBRARY_PATH:
//
//   make softnic
//   LD_LIBRARY_PATH=$PWD/build/softnic TF_RDMA_TRANSPORT=verbs python ...
//
// It shows one device, `softnic0` (node GUID "SOFTNIC0", firmware version
// "softnic (emulated)"), with one ACTIVE port: RoCE v2 by default (a GID
// table with an IPv4-mapped entry per address of this host), InfiniBand with
// a LID when TF_RDMA_SOFTNIC_LINK=ib. Every process that opens it is one
// port of the same emulated fabric.
//
// How data moves (fabric.cc says more): a queue pair's messages travel over
// a Unix stream socket to the process that owns the destination QP number;
// a progress thread there checks each request the way a responder NIC does
// (QP state, PSN, rkey, bounds, access, posted receives) and places the
// payload straight into that process's registered memory, then acknowledges;
// the requester's work request completes on the acknowledgement. So the
// bytes really cross address spaces, in order, and the checks a NIC makes
// are made where a NIC makes them.
//
// The semantics follow the InfiniBand Architecture Specification, Volume 1
// (IBA) and the libibverbs man pages (ibv_post_send(3), ibv_modify_qp(3),
// ibv_reg_mr(3), ...); each rule cites its source where it is implemented.
// What is not emulated fails loudly (EOPNOTSUPP, or EINVAL where the
// kernel would): UD/UC/XRC queue pairs, SRQs, RDMA READ and atomics, memory
// windows, address handles, SQD/SQE states, on-demand paging on the
// responder side (ODP memory as an RDMA target).
//
// Knobs (environment, read when the first process-wide state is created):
//   TF_RDMA_SOFTNIC_LINK        roce (default) | ib
//   TF_RDMA_SOFTNIC_LID         the port's LID in IB mode (default 1)
//   TF_RDMA_SOFTNIC_MTU         the port's active MTU in bytes (default 4096)
//   TF_RDMA_SOFTNIC_PORT_STATE  active (default) | down
//   TF_RDMA_SOFTNIC_DEVICES     1 (default) | 0: no device at all
//   TF_RDMA_SOFTNIC_ODP         1 (default) | 0: no on-demand paging (the
//                               device then advertises none, as rxe or
//                               older NICs)
//   TF_RDMA_SOFTNIC_DIR         the host-wide directory of QP numbers and
//                               sockets (default /tmp/tf_rdma-softnic-<uid>)
//   TF_RDMA_SOFTNIC_DELAY_US    the responder waits this long before
//                               placing each incoming message
//   TF_RDMA_SOFTNIC_SEND_DELAY_US the requester reads a WR's payload this
//                               long after it was posted (widens the window
//                               in which a buffer reused before its
//                               completion is caught)
//   TF_RDMA_SOFTNIC_DROP_AFTER  after this many messages sent by this
//                               process, its link drops every later one
//                               (their WRs complete RETRY_EXC_ERR)
//   TF_RDMA_SOFTNIC_CORRUPT_RKEY the n-th (1-based) RDMA WRITE posted by
//                               this process carries a corrupted rkey
//                               (REM_ACCESS_ERR)
//   TF_RDMA_SOFTNIC_DEBUG       set: dropped requests and PSN mismatches
//                               are logged to stderr
#ifndef TF_RDMA_TESTS_SOFTNIC_SOFTNIC_H_
#define TF_RDMA_TESTS_SOFTNIC_SOFTNIC_H_

#include <infiniband/verbs.h>
#include <stdint.h>
#include <sys/uio.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/softnic/wire.h"

namespace softnic {

constexpr char kDeviceName[] = "softnic0";
constexpr char kFirmware[] = "softnic (emulated)";
constexpr uint64_t kNodeGuid = 0x534f46544e494330ull;  // "SOFTNIC0"

// Device limits (ibv_query_device(3)); rxe's where it has one.
constexpr int kMaxQp = 65536;
constexpr int kMaxQpWr = 16384;
constexpr int kMaxCq = 65536;
constexpr int kMaxCqe = 32767;
constexpr int kMaxSge = 32;
constexpr int kMaxMr = 1 << 20;
constexpr int kMaxPd = 65536;
constexpr int kMaxRdAtom = 16;
constexpr uint32_t kMaxInline = 256;
constexpr uint32_t kMaxMsgSize = 1u << 31;  // the port's max_msg_sz
constexpr int kGidTableLen = 16;
constexpr int kPkeyTableLen = 1;

// The settings of this process's port (the TF_RDMA_SOFTNIC_* knobs above).
struct Settings {
  bool roce = true;
  uint16_t lid = 1;
  ibv_mtu mtu = IBV_MTU_4096;
  bool port_active = true;
  bool devices = true;
  std::string dir;
  int64_t delay_us = 0;
  int64_t send_delay_us = 0;
  int64_t drop_after = -1;
  int64_t corrupt_rkey = -1;
  bool odp = true;  // implicit on-demand paging for RC SEND and RDMA WRITE

  // Reads the environment; false (with *why) on a malformed value.
  static bool FromEnvironment(Settings* out, std::string* why);
};

struct GidEntry {
  ibv_gid gid;
  ibv_gid_type type;
  uint32_t ifindex;
  bool empty() const;
};

// The objects handed to the application embed the public verbs struct as
// their first member, so a pointer to one converts to the other.

class Nic;

struct Context {
  verbs_context vctx;  // ibv_context is its last member (verbs.h)
  Nic* nic = nullptr;
  int async_write_fd = -1;
  int null_fd = -1;    // stands in for the uverbs command fd
};

struct Pd {
  ibv_pd pd;
  int users = 0;  // MRs and QPs that name it
};

class Mr {
 public:
  ibv_mr mr;
  Pd* pd = nullptr;
  int access = 0;
  int busy = 0;           // placements or transmissions using it now
  uint64_t pinned = 0;    // bytes counted against RLIMIT_MEMLOCK
  bool implicit = false;  // implicit ODP: covers every address
};

struct Channel {
  ibv_comp_channel channel;
  int write_fd = -1;
};

// A completion and the work queue slot it frees when polled.
struct Completion {
  ibv_wc wc;
  uint32_t qpn;
  uint64_t epoch;  // the QP's epoch (a reset starts a new one)
  uint64_t seq;    // the WR's position in its queue
  bool send;
};

struct Cq {
  ibv_cq cq;
  Channel* channel = nullptr;
  std::deque<Completion> entries;
  int capacity = 0;
  bool armed = false;
  bool solicited_only = false;
  bool overrun = false;
  uint32_t events_reported = 0;  // events read by ibv_get_cq_event
  int users = 0;                 // QPs that use it
};

class Link;

// A send work request from post to completion.
struct SendEntry {
  uint64_t wr_id = 0;
  uint64_t seq = 0;
  ibv_wc_opcode opcode = IBV_WC_SEND;
  uint32_t length = 0;
  uint32_t psn = 0;
  bool signaled = false;
  bool acked = false;
  ibv_wc_status failed = IBV_WC_SUCCESS;  // set: completes with this status
};

// A request posted but not yet on the wire: its payload is read from the
// registered memory only when the QP's send engine transmits it, after
// ibv_post_send returned, as a NIC reads it by DMA after the doorbell
// (inline data excepted: copied at post, ibv_post_send(3)).
struct Transmission {
  WireRequest request;
  std::vector<uint8_t> inline_copy;
  std::vector<struct iovec> payload;
  std::vector<class Mr*> busy;  // pinned until transmitted
  int64_t not_before_ns = 0;
};

struct RecvEntry {
  uint64_t wr_id = 0;
  uint64_t seq = 0;
  std::vector<ibv_sge> sges;
};

struct Qp {
  ibv_qp qp;
  Pd* pd = nullptr;
  Cq* send_cq = nullptr;
  Cq* recv_cq = nullptr;
  ibv_qp_cap cap = {};
  bool sq_sig_all = false;
  ibv_qp_attr attr = {};  // what modify_qp set (state in qp.state)

  // Work queue slots (ibv_post_send(3) ENOMEM when full): a WR holds its
  // slot until its completion, or a later one of its queue, is polled;
  // an unsignaled WR is freed by the next signaled one, as on hardware.
  uint64_t epoch = 0;
  uint64_t sq_posted = 0, sq_retired = 0;
  uint64_t rq_posted = 0, rq_retired = 0;

  // Requester. The send engine, a thread of this QP (started at the first
  // post), puts `to_send` on the wire in order; the link is its own.
  std::deque<Transmission> to_send;
  std::condition_variable send_cv;
  std::thread engine;
  bool stopping = false;
  std::shared_ptr<Link> link;  // to the responder's process
  uint32_t next_psn = 0;
  std::deque<SendEntry> outstanding;
  int64_t lost_since_ns = 0;  // messages are not getting through

  // Responder.
  uint32_t expected_psn = 0;
  std::deque<RecvEntry> receives;
};

// Process-wide state: the registries, the fabric endpoint and its progress
// thread (fabric.cc). One mutex, `mu`, guards every field of every object
// above except where noted; no thread holds it while blocked on a socket.
class Nic {
 public:
  // The process's NIC; a fresh one after fork(). nullptr with errno set
  // when a knob is malformed (the message goes to stderr).
  static Nic* Get();

  std::mutex mu;
  std::condition_variable idle;  // an Mr's busy count dropped
  Settings settings;
  std::vector<GidEntry> gids;  // the port's GID table, kGidTableLen entries

  std::map<uint32_t, Mr*> mrs;  // by key (lkey == rkey)
  std::map<uint32_t, Qp*> qps;  // by QP number
  std::set<Cq*> cqs;
  uint64_t pinned_bytes = 0;
  uint32_t next_mr_index = 1;
  int64_t messages_sent = 0;   // for TF_RDMA_SOFTNIC_DROP_AFTER
  int64_t writes_posted = 0;   // for TF_RDMA_SOFTNIC_CORRUPT_RKEY

  // Joins the fabric (directory, socket, progress thread) once; false with
  // errno set when it cannot.
  bool Start();
  // A host-wide unique QP number, entered in the directory.
  bool AllocateQpn(uint32_t* qpn);
  void ReleaseQpn(uint32_t qpn);

  // ---- called with mu held ----
  void PushCompletion(Cq* cq, const Completion& c, bool solicited);
  void CompleteSend(Qp* qp, const SendEntry& e, ibv_wc_status status);
  void CompleteRecv(Qp* qp, const RecvEntry& r, ibv_wc wc, bool solicited);
  // Completes acknowledged requests at the head of the send queue.
  void RetireAcked(Qp* qp);
  // IBA 10.3.1 Error state: every outstanding and posted WR completes with
  // IBV_WC_WR_FLUSH_ERR (an entry marked failed with its own status), the
  // connection is dropped.
  void MoveToError(Qp* qp);
  void ResetQp(Qp* qp);
  void RaiseQpEvent(Qp* qp, ibv_event_type type);
  void RaiseCqEvent(Cq* cq, ibv_event_type type);
  void MarkLost(Qp* qp);  // messages are not getting through: retry timer
  bool RouteMatches(uint16_t dlid, bool is_global, const uint8_t* dgid) const;
  bool HasLink(const Qp* qp) const;

  // Queues a request for the QP's send engine (starting it).
  void Enqueue(Qp* qp, Transmission t);
  // Drops what the send engine has not sent yet (the QP left RTS).
  void DropUnsent(Qp* qp);
  // Stops the send engine: with mu held by `lock`, which it releases.
  void StopEngine(Qp* qp, std::unique_lock<std::mutex>* lock);

  void Wake();  // the progress thread recomputes its timers
  class Fabric* fabric();

 private:
  Nic() = default;
  bool StartLocked();
  void Sweep();
  void ProgressLoop();

  // The send engine of one QP (mu not held by the caller).
  void RunEngine(Qp* qp);
  // Sends one request (and the hello first on a new connection); false
  // when it could not be delivered to the responder's process. Engine
  // thread only, without mu.
  bool Transmit(Qp* qp, const Transmission& t);

  friend class Fabric;
  class Fabric* fabric_ = nullptr;
  int pid_ = 0;
};

// Helpers shared by the entry points and the fabric.
inline Context* ToContext(ibv_context* c) {
  return reinterpret_cast<Context*>(reinterpret_cast<uint8_t*>(c) -
                                    offsetof(verbs_context, context));
}
inline Qp* ToQp(ibv_qp* q) { return reinterpret_cast<Qp*>(q); }
inline Cq* ToCq(ibv_cq* c) { return reinterpret_cast<Cq*>(c); }
inline Pd* ToPd(ibv_pd* p) { return reinterpret_cast<Pd*>(p); }
inline Mr* ToMr(ibv_mr* m) { return reinterpret_cast<Mr*>(m); }

int MtuBytes(ibv_mtu mtu);
int64_t NowNs();
// IBA 9.7.5.2.8 / ibv_modify_qp(3): the local ACK timeout, 4.096 us *
// 2^timeout; 0 means infinite (returns 0).
int64_t AckTimeoutNs(uint8_t timeout);
// IBA 9.7.5.2.8 table 45 / ibv_modify_qp(3) min_rnr_timer encoding.
int64_t RnrTimerNs(uint8_t encoded);
// Packets a message of `length` bytes takes at `mtu_bytes` (at least one):
// each consumes a PSN (IBA 9.7.1).
uint32_t Packets(uint64_t length, uint32_t mtu_bytes);

}  // namespace softnic

#endif  // TF_RDMA_TESTS_SOFTNIC_SOFTNIC_H_
