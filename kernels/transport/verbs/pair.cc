#include "kernels/transport/verbs/pair.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "kernels/common/wait.h"

namespace tf_rdma {
namespace verbs {
namespace {

// A notice from the peer occupies one posted receive until the progress
// thread has read it and posted the receive again. The peer's write
// completes when our NIC has acknowledged it, not when the progress thread
// has run, so a fast peer can have many notices waiting here; once all
// receives are taken, its NIC retries after min_rnr_timer (0.64 ms), which
// is correct but slow. 256 receives (16 KiB) make that rare.
constexpr int kReceives = 256;
constexpr uint64_t kReceiveBytes = 64;
static_assert(sizeof(Notice) <= kReceiveBytes, "a notice fits a receive");
// Staging for unregistered sources: chunks of this size, this many in
// flight (the copy of one overlaps the transfer of the others).
constexpr uint64_t kStagingChunkBytes = 1 << 20;
constexpr int kStagingChunks = 4;
// A waiting writer reaps completions itself this long before it sleeps.
constexpr auto kSpin = std::chrono::microseconds(50);
// The longest a sleeping writer goes without looking at the queue itself,
// should the progress thread be busy or gone.
constexpr auto kNap = std::chrono::milliseconds(1);

std::string Strerror(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

uint8_t* AllocatePages(uint64_t nbytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, nbytes) != 0) return nullptr;
  std::memset(p, 0, nbytes);
  return static_cast<uint8_t*>(p);
}

std::string GidHex(const ibv_gid& gid) {
  char out[33];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(out + 2 * i, 3, "%02x", gid.raw[i]);
  }
  return std::string(out, 32);
}

bool ParseGid(const std::string& hex, ibv_gid* gid) {
  if (hex.size() != 32) return false;
  for (int i = 0; i < 16; ++i) {
    char byte[3] = {hex[2 * i], hex[2 * i + 1], 0};
    char* end = nullptr;
    unsigned long v = std::strtoul(byte, &end, 16);
    if (end != byte + 2) return false;
    gid->raw[i] = static_cast<uint8_t>(v);
  }
  return true;
}

int MtuBytes(ibv_mtu mtu) { return 128 << static_cast<int>(mtu); }

// A failed send completion, with what usually causes it.
Status CompletionError(const ibv_wc& wc) {
  char vendor[16];
  std::snprintf(vendor, sizeof(vendor), "0x%x", wc.vendor_err);
  std::string hint;
  switch (wc.status) {
    case IBV_WC_RETRY_EXC_ERR:
      hint = ": the peer's NIC never acknowledged (peer gone, or no route: "
             "check TF_RDMA_VERBS_GID_INDEX, RoCE v1 against v2, VLANs)";
      break;
    case IBV_WC_RNR_RETRY_EXC_ERR:
      hint = ": the peer posted no receive in time";
      break;
    case IBV_WC_REM_ACCESS_ERR:
      hint = ": the peer refused the write (region key or bounds)";
      break;
    case IBV_WC_WR_FLUSH_ERR:
      hint = ": the connection was closed";
      break;
    default:
      break;
  }
  return Unavailable(std::string("RDMA transfer failed: ") +
                     ibv_wc_status_str(wc.status) + " (vendor error " +
                     vendor + ")" + hint);
}

}  // namespace

Status Pair::Create(Context* context, std::unique_ptr<Pair>* out) {
  std::unique_ptr<Pair> pair(new Pair(context));
  TF_RDMA_RETURN_IF_ERROR(pair->Init());
  *out = std::move(pair);
  return Status::Ok();
}

Status Pair::Init() {
  const VerbsSettings& s = context_->settings();
  channel_ = ibv_create_comp_channel(context_->context());
  if (channel_ == nullptr) {
    return Internal(Strerror("ibv_create_comp_channel", errno));
  }
  int flags = fcntl(channel_->fd, F_GETFL);
  if (flags < 0 || fcntl(channel_->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return Internal(Strerror("making the completion channel non-blocking",
                             errno));
  }
  queue_depth_ = static_cast<uint64_t>(s.queue_depth);
  // Both queues report to the channel: the progress thread reaps send
  // completions for writers that went to sleep (pair.h).
  send_cq_ = ibv_create_cq(context_->context(), s.queue_depth, nullptr,
                           channel_, 0);
  recv_cq_ = ibv_create_cq(context_->context(), kReceives, nullptr, channel_,
                           0);
  if (send_cq_ == nullptr || recv_cq_ == nullptr) {
    return Internal(Strerror("ibv_create_cq", errno));
  }
  for (ibv_cq* cq : {send_cq_, recv_cq_}) {
    int armed = ibv_req_notify_cq(cq, 0);
    if (armed != 0) return Internal(Strerror("ibv_req_notify_cq", armed));
  }
  ibv_qp_init_attr init;
  std::memset(&init, 0, sizeof(init));
  init.send_cq = send_cq_;
  init.recv_cq = recv_cq_;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signalling (pair.h)
  init.cap.max_send_wr = s.queue_depth;
  init.cap.max_recv_wr = kReceives;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  // The notice is sent inline when the device allows it; payloads up to
  // inline_bytes too. A device that cannot inline that much gets the
  // notice's size, and one without inline sends at all (some iWARP and EFA
  // devices) sends from registered memory.
  for (uint32_t want : {std::max<uint32_t>(s.inline_bytes, sizeof(Notice)),
                        static_cast<uint32_t>(sizeof(Notice)), 0u}) {
    init.cap.max_inline_data = want;
    qp_ = ibv_create_qp(context_->pd(), &init);
    if (qp_ != nullptr) break;
  }
  if (qp_ == nullptr) return Internal(Strerror("ibv_create_qp", errno));
  // The device may round the inline size up; payloads stay within the
  // setting.
  notice_inline_ = init.cap.max_inline_data >= sizeof(Notice);
  payload_inline_ = std::min<uint32_t>(init.cap.max_inline_data,
                                       static_cast<uint32_t>(s.inline_bytes));
  max_message_ = std::min<uint32_t>(context_->max_message(), 1u << 30);

  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = context_->port();
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  int rc = ibv_modify_qp(qp_, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
                                         IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc != 0) return Internal(Strerror("moving the queue pair to INIT", rc));

  uint64_t notice_bytes = queue_depth_ * sizeof(Notice);
  receives_ = AllocatePages(kReceives * kReceiveBytes);
  notices_ = reinterpret_cast<Notice*>(AllocatePages(notice_bytes));
  if (receives_ == nullptr || notices_ == nullptr) {
    return Internal("out of memory for the verbs pair's buffers");
  }
  receives_mr_ = ibv_reg_mr(context_->pd(), receives_, kReceives * kReceiveBytes,
                            IBV_ACCESS_LOCAL_WRITE);
  notices_mr_ = ibv_reg_mr(context_->pd(), notices_, notice_bytes, 0);
  if (receives_mr_ == nullptr || notices_mr_ == nullptr) {
    return Internal(Strerror("registering the verbs pair's buffers", errno));
  }
  for (int i = 0; i < kReceives; ++i) {
    TF_RDMA_RETURN_IF_ERROR(PostReceive(i));
  }
  if (getrandom(&psn_, sizeof(psn_), 0) != sizeof(psn_)) {
    psn_ = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(this) >> 4) ^
           static_cast<uint32_t>(getpid());
  }
  psn_ &= 0xffffff;
  return Status::Ok();
}

Pair::~Pair() {
  if (qp_ != nullptr) ibv_destroy_qp(qp_);
  if (send_cq_ != nullptr) ibv_destroy_cq(send_cq_);
  if (recv_cq_ != nullptr) ibv_destroy_cq(recv_cq_);
  if (channel_ != nullptr) ibv_destroy_comp_channel(channel_);
  for (ibv_mr* mr : {receives_mr_, notices_mr_, staging_mr_}) {
    if (mr != nullptr) ibv_dereg_mr(mr);
  }
  std::free(receives_);
  std::free(notices_);
  std::free(staging_);
}

Status Pair::PostReceive(uint64_t index) {
  ibv_sge sge;
  sge.addr = reinterpret_cast<uintptr_t>(receives_ + index * kReceiveBytes);
  sge.length = kReceiveBytes;
  sge.lkey = receives_mr_->lkey;
  ibv_recv_wr wr;
  std::memset(&wr, 0, sizeof(wr));
  wr.wr_id = index;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  int rc = ibv_post_recv(qp_, &wr, &bad);
  return rc == 0 ? Status::Ok() : Unavailable(Strerror("ibv_post_recv", rc));
}

// ---------------------------------------------------------------------------
// Connecting: "lid=<n> gid=<32 hex> qpn=<n> psn=<n> mtu=<bytes>".

std::string Pair::address() const {
  char line[160];
  std::snprintf(line, sizeof(line), "lid=%u gid=%s qpn=%u psn=%u mtu=%d",
                context_->lid(), GidHex(context_->gid()).c_str(), qp_->qp_num,
                psn_, MtuBytes(context_->mtu()));
  return line;
}

Status Pair::Connect(const std::string& peer_address) {
  unsigned lid = 0, qpn = 0, psn = 0;
  int mtu_bytes = 0;
  char gid_hex[64] = {0};
  ibv_gid gid;
  if (std::sscanf(peer_address.c_str(), "lid=%u gid=%63s qpn=%u psn=%u mtu=%d",
                  &lid, gid_hex, &qpn, &psn, &mtu_bytes) != 5 ||
      !ParseGid(gid_hex, &gid) || lid > 0xffff || qpn > 0xffffff ||
      psn > 0xffffff) {
    return InvalidArgument("malformed verbs address '" +
                           peer_address.substr(0, 160) + "'");
  }
  ibv_mtu mtu = context_->mtu();
  while (MtuBytes(mtu) > mtu_bytes && mtu > IBV_MTU_256) {
    mtu = static_cast<ibv_mtu>(static_cast<int>(mtu) - 1);
  }
  const VerbsSettings& s = context_->settings();
  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = mtu;
  attr.dest_qp_num = qpn;
  attr.rq_psn = psn;
  attr.max_dest_rd_atomic = 1;
  attr.min_rnr_timer = 12;  // 0.64 ms before the peer retries a full queue
  attr.ah_attr.dlid = static_cast<uint16_t>(lid);
  attr.ah_attr.sl = static_cast<uint8_t>(s.service_level);
  attr.ah_attr.port_num = context_->port();
  // RoCE always routes by GID; InfiniBand by LID, with a global route header
  // only when a GID index was asked for (another subnet).
  if (context_->ethernet() || s.gid_index >= 0) {
    attr.ah_attr.is_global = 1;
    attr.ah_attr.grh.dgid = gid;
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(context_->gid_index());
    attr.ah_attr.grh.hop_limit = 64;
    attr.ah_attr.grh.traffic_class = static_cast<uint8_t>(s.traffic_class);
  }
  int rc = ibv_modify_qp(qp_, &attr,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                             IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc != 0) {
    return Unavailable(Strerror("moving the queue pair to RTR (peer " +
                                    peer_address + ")",
                                rc));
  }
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = static_cast<uint8_t>(s.timeout);
  attr.retry_cnt = static_cast<uint8_t>(s.retry_count);
  attr.rnr_retry = 7;  // a full receive queue is waited out, never an error
  attr.sq_psn = psn_;
  attr.max_rd_atomic = 1;
  rc = ibv_modify_qp(qp_, &attr,
                     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                         IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                         IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc != 0) return Unavailable(Strerror("moving the queue pair to RTS", rc));
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Regions.

Status Pair::Expose(uint32_t id, const Region& region, RegionDescriptor* out) {
  TF_RDMA_RETURN_IF_ERROR(::tf_rdma::Pair::Expose(id, region, out));
  out->remote_addr = reinterpret_cast<uintptr_t>(region.data());
  return context_->Register(region.data(), region.size(), &out->rkey);
}

Status Pair::AddRemoteRegion(const RegionDescriptor& region, int* handle) {
  if (region.remote_addr == 0) {
    return InvalidArgument("the peer's region " + std::to_string(region.id) +
                           " came without an RDMA address and key");
  }
  *handle = remote_.Add(region);
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Writing (pair.h has the essay: many writes in flight, selective
// signalling, who reaps).

Status Pair::Fail(const Status& why) {
  // Caller holds mu_.
  if (error_.ok()) error_ = why;
  closed_ = true;
  return error_;
}

bool Pair::Reap() {
  // Caller holds mu_. RC completes requests in post order, so a completion
  // retires its request and every one before it.
  ibv_wc wc[16];
  int n = ibv_poll_cq(send_cq_, 16, wc);
  if (n < 0) {
    Fail(Internal("polling the send completion queue"));
    return false;
  }
  for (int i = 0; i < n; ++i) {
    uint64_t number = wc[i].wr_id;
    if (wc[i].status != IBV_WC_SUCCESS && failed_ == 0) {
      failed_ = number;
      Fail(CompletionError(wc[i]));
    }
    completed_ = std::max(completed_, number);
  }
  if (n > 0) reaped_.notify_all();
  return n > 0;
}

template <typename Ready>
Status Pair::AwaitSend(const Ready& ready, const Deadline& deadline,
                       std::unique_lock<std::mutex>* lock) {
  // Caller holds mu_. Completions usually arrive within microseconds: spin
  // on the queue first; a long transfer (256 MiB is ~20 ms at 100 Gb/s)
  // then sleeps until the progress thread reaps, instead of burning a core.
  auto spin_until = Clock::now() + kSpin;
  while (!ready()) {
    if (Reap()) continue;
    if (failed_ != 0 || (closed_ && posted_ == completed_)) {
      // Nothing more will complete; the caller's check says for whom.
      return ready() ? Status::Ok() : error_;
    }
    if (deadline.Expired()) {
      Fail(DeadlineExceeded("the peer's NIC did not acknowledge an RDMA "
                            "transfer within " +
                            std::to_string(deadline.timeout_ms()) + " ms"));
      ibv_qp_attr attr;
      std::memset(&attr, 0, sizeof(attr));
      attr.qp_state = IBV_QPS_ERR;
      ibv_modify_qp(qp_, &attr, IBV_QP_STATE);
      return error_;
    }
    if (Clock::now() < spin_until) {
      lock->unlock();
      std::this_thread::yield();
      lock->lock();
      continue;
    }
    reaped_.wait_until(*lock, std::min(Clock::now() + kNap, deadline.at()));
  }
  return Status::Ok();
}

bool Pair::Outcome(uint64_t first, uint64_t last, Status* out) const {
  // Caller holds mu_.
  if (failed_ != 0 && last >= failed_) {
    *out = first <= failed_
               ? error_
               : Unavailable("an earlier RDMA write on this connection "
                             "failed, so this one was not delivered: " +
                             error_.message());
    return true;
  }
  if (completed_ >= last) {
    *out = Status::Ok();
    return true;
  }
  if (closed_ && !error_.ok() && completed_ == posted_) {
    *out = error_;  // failed before its requests could complete
    return true;
  }
  return false;
}

Status Pair::Post(ibv_send_wr* wr, bool signal, const Deadline& deadline,
                  std::unique_lock<std::mutex>* lock, uint64_t* number) {
  // Caller holds mu_. Keeps the send queue within its depth; at most half
  // of it runs unsignalled, so a full queue always holds a request whose
  // completion makes room.
  TF_RDMA_RETURN_IF_ERROR(AwaitSend(
      [&] { return posted_ - completed_ < queue_depth_ || !error_.ok(); },
      deadline, lock));
  if (!error_.ok()) return error_;
  if (unsignaled_ + 1 >= queue_depth_ / 2) signal = true;
  *number = posted_ + 1;
  wr->wr_id = *number;
  wr->send_flags = (wr->send_flags & ~IBV_SEND_SIGNALED) |
                   (signal ? IBV_SEND_SIGNALED : 0);
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(qp_, wr, &bad);
  if (rc != 0) return Fail(Unavailable(Strerror("ibv_post_send", rc)));
  posted_ = *number;
  unsignaled_ = signal ? 0 : unsignaled_ + 1;
  ++counters_.requests;
  if (signal) ++counters_.signaled;
  return Status::Ok();
}

Status Pair::StagingBuffer(uint64_t* chunk, const Deadline& deadline,
                           std::unique_lock<std::mutex>* lock) {
  // Caller holds mu_. Any chunk whose last reader completed will do.
  if (staging_ == nullptr) {
    staging_ = AllocatePages(kStagingChunkBytes * kStagingChunks);
    if (staging_ == nullptr) return Internal("out of memory for staging");
    staging_mr_ = ibv_reg_mr(context_->pd(), staging_,
                             kStagingChunkBytes * kStagingChunks, 0);
    if (staging_mr_ == nullptr) {
      std::free(staging_);
      staging_ = nullptr;
      return Internal(Strerror("registering the staging area", errno));
    }
    staging_users_.assign(kStagingChunks, 0);
  }
  auto free_chunk = [&] {
    for (uint64_t i = 0; i < staging_users_.size(); ++i) {
      if (staging_users_[i] <= completed_) {
        *chunk = i;
        return true;
      }
    }
    return !error_.ok();
  };
  TF_RDMA_RETURN_IF_ERROR(AwaitSend(free_chunk, deadline, lock));
  return error_;
}

Status Pair::Write(int handle, uint64_t offset, const void* src,
                   uint64_t nbytes, uint64_t notice_offset, uint64_t seq,
                   const Deadline& deadline) {
  RegionDescriptor region;
  TF_RDMA_RETURN_IF_ERROR(
      remote_.Find(handle, offset, nbytes, notice_offset, &region));
  std::unique_lock<std::mutex> posting(post_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) {
    ReleaseStaging();
    return error_.ok() ? Unavailable("the verbs connection was closed")
                       : error_;
  }
  ibv_sge sge;
  ibv_send_wr wr;
  auto prepare = [&](ibv_wr_opcode opcode, const void* from, uint64_t length,
                     uint32_t lkey, bool inline_it) {
    std::memset(&wr, 0, sizeof(wr));
    sge.addr = reinterpret_cast<uintptr_t>(from);
    sge.length = static_cast<uint32_t>(length);
    sge.lkey = lkey;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = inline_it ? IBV_SEND_INLINE : 0;
  };
  auto target = [&](uint64_t done) {
    wr.wr.rdma.remote_addr = region.remote_addr + offset + done;
    wr.wr.rdma.rkey = region.rkey;
  };
  const uint8_t* from = static_cast<const uint8_t*>(src);
  uint64_t first = posted_ + 1;
  uint64_t number = 0;
  uint32_t lkey = 0;
  Status s;
  if (nbytes > 0 && nbytes <= payload_inline_) {
    prepare(IBV_WR_RDMA_WRITE, from, nbytes, 0, true);
    target(0);
    s = Post(&wr, false, deadline, &lock, &number);
    if (s.ok()) counters_.bytes_inline += nbytes;
  } else if (nbytes > 0 && context_->FindLocal(src, nbytes, &lkey)) {
    for (uint64_t done = 0; s.ok() && done < nbytes; done += max_message_) {
      uint64_t length = std::min<uint64_t>(max_message_, nbytes - done);
      prepare(IBV_WR_RDMA_WRITE, from + done, length, lkey, false);
      target(done);
      s = Post(&wr, false, deadline, &lock, &number);
    }
    if (s.ok()) counters_.bytes_in_place += nbytes;
  } else if (nbytes > 0) {
    for (uint64_t done = 0; s.ok() && done < nbytes;
         done += kStagingChunkBytes) {
      uint64_t length = std::min<uint64_t>(kStagingChunkBytes, nbytes - done);
      uint64_t chunk = 0;
      s = StagingBuffer(&chunk, deadline, &lock);
      if (!s.ok()) break;
      uint8_t* buffer = staging_ + chunk * kStagingChunkBytes;
      std::memcpy(buffer, from + done, length);
      prepare(IBV_WR_RDMA_WRITE, buffer, length, staging_mr_->lkey, false);
      target(done);
      s = Post(&wr, true, deadline, &lock, &number);
      if (s.ok()) staging_users_[chunk] = number;
    }
    if (s.ok()) counters_.bytes_staged += nbytes;
  }
  if (s.ok()) {
    // The notice's buffer is the one of its request number: room in the
    // queue first, so that its previous user has completed.
    s = AwaitSend(
        [&] { return posted_ - completed_ < queue_depth_ || !error_.ok(); },
        deadline, &lock);
    if (s.ok()) s = error_;
  }
  if (s.ok()) {
    Notice* notice = &notices_[(posted_ + 1) % queue_depth_];
    notice->region_id = region.id;
    notice->offset = notice_offset;
    notice->seq = seq;
    prepare(IBV_WR_SEND, notice, sizeof(Notice), notices_mr_->lkey,
            notice_inline_);
    s = Post(&wr, true, deadline, &lock, &number);
  }
  posting.unlock();  // the next write may post while this one waits
  if (s.ok()) {
    ++counters_.writes;
    ++writes_in_flight_;
    counters_.max_writes_in_flight =
        std::max<uint64_t>(counters_.max_writes_in_flight, writes_in_flight_);
    uint64_t last = number;
    Status outcome;
    s = AwaitSend([&] { return Outcome(first, last, &outcome); }, deadline,
                  &lock);
    if (s.ok() || Outcome(first, last, &outcome)) s = outcome;
    --writes_in_flight_;
  }
  if (closed_) ReleaseStaging();
  return s;
}

PairCounters Pair::counters() {
  std::lock_guard<std::mutex> lock(mu_);
  PairCounters out = counters_;
  out.reported = true;
  return out;
}

void Pair::ReleaseStaging() {
  // Caller holds mu_. A closed pair's staging area (4 MiB of pinned
  // memory) goes as soon as no request can still read it; the small queues
  // stay until the process ends, like the connection that owns them.
  if (staging_ == nullptr || completed_ != posted_) return;
  ibv_dereg_mr(staging_mr_);
  std::free(staging_);
  staging_ = nullptr;
  staging_mr_ = nullptr;
  staging_users_.clear();
}

// ---------------------------------------------------------------------------
// Receiving notices (the progress thread).

int Pair::notice_fd() const { return channel_->fd; }

Status Pair::TakeNotices(std::vector<Notice>* out) {
  // Acknowledge every event, re-arm both queues, then drain them: a
  // completion that arrives after the re-arm raises a new event, so none is
  // missed.
  ibv_cq* cq = nullptr;
  void* unused = nullptr;
  while (ibv_get_cq_event(channel_, &cq, &unused) == 0) {
    ibv_ack_cq_events(cq, 1);
  }
  for (ibv_cq* armed_cq : {send_cq_, recv_cq_}) {
    int armed = ibv_req_notify_cq(armed_cq, 0);
    if (armed != 0) return Unavailable(Strerror("ibv_req_notify_cq", armed));
  }
  {
    // Send completions, for writers asleep in AwaitSend. A writer holding
    // the lock is posting and reaps for itself: never wait for it here,
    // this thread serves every connection.
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (lock.owns_lock()) {
      while (Reap()) {
      }
    }
  }
  while (true) {
    ibv_wc wc[16];
    int n = ibv_poll_cq(recv_cq_, 16, wc);
    if (n < 0) return Unavailable("polling the receive completion queue");
    if (n == 0) return Status::Ok();
    for (int i = 0; i < n; ++i) {
      if (wc[i].status == IBV_WC_WR_FLUSH_ERR) {
        // A flushed receive is a consequence: the queue pair is in the
        // error state. The cause is the first failed send completion (a
        // write the peer refused, a peer that stopped acknowledging), which
        // no writer may have reaped yet: report it when there is one.
        {
          std::lock_guard<std::mutex> lock(mu_);
          while (Reap()) {
          }
          if (!error_.ok()) return error_;
        }
        // Or the device failed it as a responder (asynchronous event).
        std::string why = context_->AsyncCause(qp_->qp_num);
        if (!why.empty()) return Unavailable("RDMA connection failed: " + why);
      }
      if (wc[i].status != IBV_WC_SUCCESS) {
        return Unavailable(std::string("RDMA receive failed: ") +
                           ibv_wc_status_str(wc[i].status));
      }
      if (wc[i].opcode != IBV_WC_RECV || wc[i].byte_len != sizeof(Notice) ||
          wc[i].wr_id >= kReceives) {
        return InvalidArgument("malformed notice of " +
                               std::to_string(wc[i].byte_len) + " bytes");
      }
      Notice notice;
      std::memcpy(&notice, receives_ + wc[i].wr_id * kReceiveBytes,
                  sizeof(notice));
      out->push_back(notice);
      TF_RDMA_RETURN_IF_ERROR(PostReceive(wc[i].wr_id));
    }
  }
}

void Pair::Close() {
  // The error state flushes every posted request, so a write waiting in
  // AwaitSend returns at once (and frees the staging area on its way out).
  closed_ = true;
  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(qp_, &attr, IBV_QP_STATE);
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (lock.owns_lock()) {
    ReleaseStaging();
    reaped_.notify_all();  // sleeping writers look at the queue now
  }
}

}  // namespace verbs
}  // namespace tf_rdma
