// The libibverbs entry points of softnic (softnic.h says what it is).
//
// Exported with rdma-core's symbol versions (libibverbs.map). ibv_post_send,
// ibv_post_recv, ibv_poll_cq and ibv_req_notify_cq are static inlines in
// verbs.h that call through context->ops; ibv_query_port and
// ibv_query_device_ex call through the extended `struct verbs_context`
// (verbs_get_ctx_op), which precedes struct ibv_context in memory: both
// tables are filled in ibv_open_device. Every function returns what the man
// page says it returns: an errno value (ibv_modify_qp, ibv_post_*), -1
// (ibv_query_gid, ibv_get_cq_event), or NULL with errno set.
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <sstream>

#include "tests/softnic/softnic.h"
#include "tests/softnic/wire.h"

using namespace softnic;  // NOLINT: the entry points are C functions


namespace {

ibv_device g_device;
pthread_once_t g_device_once = PTHREAD_ONCE_INIT;

void InitDevice() {
  memset(&g_device, 0, sizeof(g_device));
  g_device.node_type = IBV_NODE_CA;
  g_device.transport_type = IBV_TRANSPORT_IB;
  snprintf(g_device.name, sizeof(g_device.name), "%s", kDeviceName);
  snprintf(g_device.dev_name, sizeof(g_device.dev_name), "uverbs-%s",
           kDeviceName);
  snprintf(g_device.dev_path, sizeof(g_device.dev_path),
           "/sys/class/infiniband_verbs/uverbs-%s", kDeviceName);
  snprintf(g_device.ibdev_path, sizeof(g_device.ibdev_path),
           "/sys/class/infiniband/%s", kDeviceName);
}

Nic* NicOf(ibv_context* c) { return ToContext(c)->nic; }

uint64_t PageRound(uint64_t start, uint64_t length) {
  uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t lo = start & ~(page - 1);
  uint64_t hi = (start + length + page - 1) & ~(page - 1);
  return hi - lo;
}

// True when [start, start + length) is mapped (readable, and writable when
// `write`): what the kernel's get_user_pages needs to pin it for
// ibv_reg_mr (else EFAULT).
bool RangeMapped(uint64_t start, uint64_t length, bool write) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  uint64_t cur = start, end = start + length;
  while (std::getline(maps, line)) {
    unsigned long long lo = 0, hi = 0;
    char perms[8] = {0};
    if (sscanf(line.c_str(), "%llx-%llx %7s", &lo, &hi, perms) != 3) continue;
    if (hi <= cur) continue;
    if (lo > cur) return false;
    if (perms[0] != 'r' || (write && perms[1] != 'w')) return false;
    cur = hi;
    if (cur >= end) return true;
  }
  return false;
}

bool HasIpcLock() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    unsigned long long caps = strtoull(line.c_str() + 7, nullptr, 16);
    return (caps >> 14) & 1;
  }
  return false;
}

void FillPortAttr(Nic* nic, ibv_port_attr* a) {
  memset(a, 0, sizeof(*a));
  const Settings& s = nic->settings;
  a->state = s.port_active ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
  a->max_mtu = IBV_MTU_4096;
  a->active_mtu = s.mtu;
  a->gid_tbl_len = kGidTableLen;
  a->port_cap_flags = 0;
  a->max_msg_sz = kMaxMsgSize;
  a->pkey_tbl_len = kPkeyTableLen;
  a->lid = s.roce ? 0 : s.lid;
  a->sm_lid = s.roce ? 0 : 1;
  a->lmc = 0;
  a->max_vl_num = 1;
  a->subnet_timeout = 18;
  a->active_width = 2;   // 4X
  a->active_speed = 32;  // EDR (the numbers mean nothing for an emulation)
  a->phys_state = s.port_active ? 5 : 3;  // LinkUp : Disabled
  a->link_layer = s.roce ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
}

int QueryPortEx(ibv_context* context, uint8_t port, ibv_port_attr* attr,
                size_t attr_len) {
  if (port != 1) return EINVAL;
  ibv_port_attr full;
  FillPortAttr(NicOf(context), &full);
  memset(attr, 0, attr_len);
  memcpy(attr, &full, std::min(attr_len, sizeof(full)));
  return 0;
}

void FillDeviceAttr(ibv_device_attr* a) {
  memset(a, 0, sizeof(*a));
  snprintf(a->fw_ver, sizeof(a->fw_ver), "%s", kFirmware);
  a->node_guid = htobe64(kNodeGuid);
  a->sys_image_guid = htobe64(kNodeGuid);
  a->max_mr_size = ~0ull;
  a->page_size_cap = 0xfffff000;
  a->vendor_id = 0;
  a->vendor_part_id = 0;
  a->max_qp = kMaxQp;
  a->max_qp_wr = kMaxQpWr;
  a->device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_PORT_ACTIVE_EVENT |
                        IBV_DEVICE_SYS_IMAGE_GUID;
  a->max_sge = kMaxSge;
  a->max_sge_rd = kMaxSge;
  a->max_cq = kMaxCq;
  a->max_cqe = kMaxCqe;
  a->max_mr = kMaxMr;
  a->max_pd = kMaxPd;
  a->max_qp_rd_atom = kMaxRdAtom;
  a->max_res_rd_atom = kMaxRdAtom * kMaxQp;
  a->max_qp_init_rd_atom = kMaxRdAtom;
  a->atomic_cap = IBV_ATOMIC_NONE;
  a->max_pkeys = kPkeyTableLen;
  a->local_ca_ack_delay = 15;
  a->phys_port_cnt = 1;
}

int QueryDeviceEx(ibv_context* context, const ibv_query_device_ex_input* input,
                  ibv_device_attr_ex* attr, size_t attr_size) {
  if (input != nullptr && input->comp_mask != 0) return EINVAL;
  if (attr_size < sizeof(attr->orig_attr)) return EINVAL;
  memset(attr, 0, attr_size);
  FillDeviceAttr(&attr->orig_attr);
  // On-demand paging (TF_RDMA_SOFTNIC_ODP, on by default as on mlx5): the
  // send engine reads a requester's local buffer when it transmits, which
  // is what an ODP NIC does after faulting the pages in; RC SEND and RDMA
  // WRITE may read ODP memory, and the implicit (whole address space) MR
  // exists. The responder side (ODP targets) is not offered.
  if (NicOf(context)->settings.odp &&
      attr_size >= offsetof(ibv_device_attr_ex, odp_caps) +
                       sizeof(attr->odp_caps)) {
    attr->odp_caps.general_caps =
        IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT;
    attr->odp_caps.per_transport_caps.rc_odp_caps =
        IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_WRITE;
  }
  return 0;
}

// ---------------------------------------------------------------------------
// Posting and polling (context->ops).

bool LocalRangeOk(Nic* nic, Qp* qp, const ibv_sge& sge) {
  // IBA 10.6.3.1: a local key must name an MR of the QP's PD that holds the
  // buffer; reading from it needs no access flag.
  if (sge.length == 0) return true;
  auto it = nic->mrs.find(sge.lkey);
  if (it == nic->mrs.end()) return false;
  Mr* mr = it->second;
  if (mr->implicit) return mr->pd == qp->pd;
  uint64_t lo = reinterpret_cast<uintptr_t>(mr->mr.addr);
  return mr->pd == qp->pd && sge.addr >= lo &&
         sge.addr + sge.length <= lo + mr->mr.length;
}

int PostSend(ibv_qp* ibqp, ibv_send_wr* wr, ibv_send_wr** bad) {
  Qp* qp = ToQp(ibqp);
  Nic* nic = NicOf(ibqp->context);
  if (bad != nullptr) *bad = nullptr;
  std::lock_guard<std::mutex> lock(nic->mu);
  for (; wr != nullptr; wr = wr->next) {
    // Immediate errors (ibv_post_send(3); IBA 10.3.1: posting to the send
    // queue in Reset, Init or RTR is an immediate error).
    ibv_qp_state state = qp->qp.state;
    int err = 0;
    bool write = wr->opcode == IBV_WR_RDMA_WRITE ||
                 wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
    bool send = wr->opcode == IBV_WR_SEND || wr->opcode == IBV_WR_SEND_WITH_IMM;
    uint64_t length = 0;
    for (int i = 0; i < wr->num_sge && i < static_cast<int>(qp->cap.max_send_sge); ++i) {
      length += wr->sg_list[i].length;
    }
    bool inline_data = (wr->send_flags & IBV_SEND_INLINE) != 0;
    if (state == IBV_QPS_RESET || state == IBV_QPS_INIT || state == IBV_QPS_RTR) {
      err = EINVAL;
    } else if (!write && !send) {
      err = EINVAL;  // RDMA READ, atomics, ...: not emulated
    } else if (wr->num_sge < 0 ||
               static_cast<uint32_t>(wr->num_sge) > qp->cap.max_send_sge) {
      err = EINVAL;
    } else if (inline_data && length > qp->cap.max_inline_data) {
      err = EINVAL;
    } else if (qp->sq_posted - qp->sq_retired >= qp->cap.max_send_wr) {
      err = ENOMEM;  // the send queue is full
    }
    if (err != 0) {
      if (bad != nullptr) *bad = wr;
      return err;
    }
    SendEntry e;
    e.wr_id = wr->wr_id;
    e.opcode = write ? IBV_WC_RDMA_WRITE : IBV_WC_SEND;
    e.length = static_cast<uint32_t>(length);
    e.signaled = qp->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
    e.seq = qp->sq_posted++;
    if (state != IBV_QPS_RTS) {
      // Error (or SQE): IBA 10.3.1, WRs posted now complete with a flush.
      nic->CompleteSend(qp, e, IBV_WC_WR_FLUSH_ERR);
      continue;
    }
    ibv_wc_status local = IBV_WC_SUCCESS;
    if (length > kMaxMsgSize) local = IBV_WC_LOC_LEN_ERR;
    for (int i = 0; !inline_data && local == IBV_WC_SUCCESS && i < wr->num_sge; ++i) {
      if (!LocalRangeOk(nic, qp, wr->sg_list[i])) local = IBV_WC_LOC_PROT_ERR;
    }
    if (local != IBV_WC_SUCCESS) {
      // Detected when the NIC executes the WR: an error completion, and the
      // QP moves to Error (IBA 10.8.3.1).
      e.failed = local;
      qp->outstanding.push_back(e);
      nic->MoveToError(qp);
      continue;
    }
    WireRequest req;
    memset(&req, 0, sizeof(req));
    req.psn = qp->next_psn;
    req.length = static_cast<uint32_t>(length);
    req.solicited = (wr->send_flags & IBV_SEND_SOLICITED) ? 1 : 0;
    switch (wr->opcode) {
      case IBV_WR_RDMA_WRITE: req.op = kOpWrite; break;
      case IBV_WR_RDMA_WRITE_WITH_IMM: req.op = kOpWriteImm; break;
      case IBV_WR_SEND: req.op = kOpSend; break;
      default: req.op = kOpSendImm; break;
    }
    if (write) {
      req.remote_addr = wr->wr.rdma.remote_addr;
      req.rkey = wr->wr.rdma.rkey;
      if (++nic->writes_posted == nic->settings.corrupt_rkey) {
        req.rkey ^= 0xff;  // knob: a key no MR has (the index stays)
      }
    }
    if (wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM ||
        wr->opcode == IBV_WR_SEND_WITH_IMM) {
      req.imm = wr->imm_data;
    }
    e.psn = qp->next_psn;
    qp->next_psn = (qp->next_psn +
                    Packets(length, static_cast<uint32_t>(MtuBytes(qp->attr.path_mtu)))) &
                   0xffffff;
    bool dropped = nic->settings.drop_after >= 0 &&
                   nic->messages_sent >= nic->settings.drop_after;
    if (!dropped) ++nic->messages_sent;
    if (qp->outstanding.empty() && qp->lost_since_ns != 0) {
      qp->lost_since_ns = NowNs();  // the retry timer starts with this WR
    }
    qp->outstanding.push_back(e);
    if (dropped) nic->MarkLost(qp);
    if (qp->lost_since_ns != 0) continue;
    // Inline data is copied now (the caller may reuse it at once,
    // ibv_post_send(3)); any other payload is read by the send engine.
    Transmission t;
    t.request = req;
    if (inline_data) {
      t.inline_copy.resize(length);
      uint64_t at = 0;
      for (int i = 0; i < wr->num_sge; ++i) {
        memcpy(t.inline_copy.data() + at,
               reinterpret_cast<const void*>(wr->sg_list[i].addr),
               wr->sg_list[i].length);
        at += wr->sg_list[i].length;
      }
      t.payload.push_back({t.inline_copy.data(), t.inline_copy.size()});
    } else {
      for (int i = 0; i < wr->num_sge; ++i) {
        const ibv_sge& s = wr->sg_list[i];
        if (s.length == 0) continue;
        t.busy.push_back(nic->mrs[s.lkey]);
        t.payload.push_back({reinterpret_cast<void*>(s.addr), s.length});
      }
    }
    if (nic->settings.send_delay_us > 0) {
      t.not_before_ns = NowNs() + nic->settings.send_delay_us * 1000;
    }
    nic->Enqueue(qp, std::move(t));
  }
  return 0;
}

int PostRecv(ibv_qp* ibqp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  Qp* qp = ToQp(ibqp);
  Nic* nic = NicOf(ibqp->context);
  if (bad != nullptr) *bad = nullptr;
  std::lock_guard<std::mutex> lock(nic->mu);
  for (; wr != nullptr; wr = wr->next) {
    int err = 0;
    // IBA 10.3.1: receives may be posted from Init on; in Reset it is an
    // immediate error.
    if (qp->qp.state == IBV_QPS_RESET) {
      err = EINVAL;
    } else if (wr->num_sge < 0 ||
               static_cast<uint32_t>(wr->num_sge) > qp->cap.max_recv_sge) {
      err = EINVAL;
    } else if (qp->rq_posted - qp->rq_retired >= qp->cap.max_recv_wr) {
      err = ENOMEM;
    }
    if (err != 0) {
      if (bad != nullptr) *bad = wr;
      return err;
    }
    RecvEntry r;
    r.wr_id = wr->wr_id;
    r.seq = qp->rq_posted++;
    if (qp->qp.state == IBV_QPS_ERR) {
      ibv_wc wc;
      memset(&wc, 0, sizeof(wc));
      wc.status = IBV_WC_WR_FLUSH_ERR;
      wc.opcode = IBV_WC_RECV;
      nic->CompleteRecv(qp, r, wc, false);
      continue;
    }
    r.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
    qp->receives.push_back(r);
  }
  return 0;
}

int PostSrqRecv(ibv_srq*, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  if (bad != nullptr) *bad = wr;
  return EOPNOTSUPP;
}

int PollCq(ibv_cq* ibcq, int n, ibv_wc* wc) {
  Cq* cq = ToCq(ibcq);
  Nic* nic = NicOf(ibcq->context);
  std::lock_guard<std::mutex> lock(nic->mu);
  int got = 0;
  while (got < n && !cq->entries.empty()) {
    const Completion& c = cq->entries.front();
    wc[got++] = c.wc;
    auto it = nic->qps.find(c.qpn);
    if (it != nic->qps.end() && it->second->epoch == c.epoch) {
      Qp* qp = it->second;
      uint64_t& retired = c.send ? qp->sq_retired : qp->rq_retired;
      retired = std::max(retired, c.seq + 1);
    }
    cq->entries.pop_front();
  }
  return got;
}

int ReqNotifyCq(ibv_cq* ibcq, int solicited_only) {
  Cq* cq = ToCq(ibcq);
  Nic* nic = NicOf(ibcq->context);
  std::lock_guard<std::mutex> lock(nic->mu);
  // Only completions added after arming raise the event
  // (ibv_req_notify_cq(3)).
  cq->armed = true;
  cq->solicited_only = solicited_only != 0;
  return 0;
}

// ---------------------------------------------------------------------------
// modify_qp: the kernel's ib_modify_qp_is_ok table for RC (IBA 10.3.1,
// table 91 "QP state transition properties").

struct Rule {
  bool valid;
  int required;
  int optional;
};

Rule Transition(ibv_qp_state cur, ibv_qp_state next) {
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) return {true, 0, 0};
  switch (cur) {
    case IBV_QPS_RESET:
      if (next == IBV_QPS_INIT) {
        return {true, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0};
      }
      break;
    case IBV_QPS_INIT:
      if (next == IBV_QPS_INIT) {
        return {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS};
      }
      if (next == IBV_QPS_RTR) {
        return {true,
                IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX};
      }
      break;
    case IBV_QPS_RTR:
      if (next == IBV_QPS_RTS) {
        return {true,
                IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                    IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
                IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS |
                    IBV_QP_MIN_RNR_TIMER | IBV_QP_PATH_MIG_STATE};
      }
      break;
    case IBV_QPS_RTS:
      if (next == IBV_QPS_RTS) {
        return {true, 0,
                IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH |
                    IBV_QP_PATH_MIG_STATE | IBV_QP_MIN_RNR_TIMER};
      }
      break;
    default:
      break;
  }
  return {false, 0, 0};  // includes SQD and SQE, which are not emulated
}

int CheckValues(Nic* nic, const ibv_qp_attr* a, int mask) {
  if ((mask & IBV_QP_PKEY_INDEX) && a->pkey_index >= kPkeyTableLen) return EINVAL;
  if ((mask & IBV_QP_PORT) && a->port_num != 1) return EINVAL;
  if ((mask & IBV_QP_PATH_MTU) && MtuBytes(a->path_mtu) == 0) return EINVAL;
  if ((mask & IBV_QP_TIMEOUT) && a->timeout > 31) return EINVAL;
  if ((mask & IBV_QP_RETRY_CNT) && a->retry_cnt > 7) return EINVAL;
  if ((mask & IBV_QP_RNR_RETRY) && a->rnr_retry > 7) return EINVAL;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && a->min_rnr_timer > 31) return EINVAL;
  if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && a->max_rd_atomic > kMaxRdAtom) return EINVAL;
  if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && a->max_dest_rd_atomic > kMaxRdAtom) {
    return EINVAL;
  }
  if ((mask & IBV_QP_DEST_QPN) && a->dest_qp_num > 0xffffff) return EINVAL;
  if (mask & IBV_QP_AV) {
    const ibv_ah_attr& ah = a->ah_attr;
    if (ah.port_num != 1) return EINVAL;
    // RoCE has no LIDs: an address vector without a GRH is invalid
    // (the kernel's rdma_check_ah_attr).
    if (nic->settings.roce && !ah.is_global) return EINVAL;
    if (ah.is_global && (ah.grh.sgid_index >= kGidTableLen ||
                         nic->gids[ah.grh.sgid_index].empty())) {
      return EINVAL;
    }
  }
  return 0;
}

}  // namespace

// ---------------------------------------------------------------------------
// Exported entry points.

extern "C" {

// The mark that tells this library from rdma-core's (libibverbs.map).
extern const char softnic_emulated[] = "softnic: emulated RDMA NIC (tests/softnic), not hardware";

// Devices.

ibv_device** ibv_get_device_list(int* num_devices) {
  Nic* nic = Nic::Get();
  if (nic == nullptr) return nullptr;
  pthread_once(&g_device_once, InitDevice);
  auto** list = static_cast<ibv_device**>(calloc(2, sizeof(ibv_device*)));
  if (list == nullptr) {
    errno = ENOMEM;
    return nullptr;
  }
  int n = nic->settings.devices ? 1 : 0;
  if (n == 1) list[0] = &g_device;
  if (num_devices != nullptr) *num_devices = n;
  return list;
}

void ibv_free_device_list(ibv_device** list) { free(list); }

const char* ibv_get_device_name(ibv_device* device) { return device->name; }

__be64 ibv_get_device_guid(ibv_device*) { return htobe64(kNodeGuid); }

int ibv_get_device_index(ibv_device*) { return 0; }

ibv_context* ibv_open_device(ibv_device* device) {
  Nic* nic = Nic::Get();
  if (nic == nullptr) return nullptr;
  auto* c = new Context();
  memset(&c->vctx, 0, sizeof(c->vctx));
  c->nic = nic;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    delete c;
    return nullptr;
  }
  fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK);
  c->async_write_fd = fds[1];
  c->null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  verbs_context& v = c->vctx;
  v.sz = sizeof(verbs_context);
  v.query_port = QueryPortEx;
  v.query_device_ex = QueryDeviceEx;
  ibv_context& ctx = v.context;
  ctx.device = device;
  ctx.ops.poll_cq = PollCq;
  ctx.ops.req_notify_cq = ReqNotifyCq;
  ctx.ops.post_send = PostSend;
  ctx.ops.post_recv = PostRecv;
  ctx.ops.post_srq_recv = PostSrqRecv;
  ctx.cmd_fd = c->null_fd;
  ctx.async_fd = fds[0];
  ctx.num_comp_vectors = 1;
  pthread_mutex_init(&ctx.mutex, nullptr);
  ctx.abi_compat = __VERBS_ABI_IS_EXTENDED;
  return &ctx;
}

int ibv_close_device(ibv_context* context) {
  Context* c = ToContext(context);
  close(context->async_fd);
  close(c->async_write_fd);
  if (c->null_fd >= 0) close(c->null_fd);
  pthread_mutex_destroy(&context->mutex);
  delete c;
  return 0;
}

int ibv_query_device(ibv_context*, ibv_device_attr* attr) {
  FillDeviceAttr(attr);
  return 0;
}

int(ibv_query_port)(ibv_context* context, uint8_t port,
                    struct _compat_ibv_port_attr* attr) {
  // The old entry point fills the struct up to (not including)
  // port_cap_flags2.
  return QueryPortEx(context, port, reinterpret_cast<ibv_port_attr*>(attr),
                     offsetof(ibv_port_attr, port_cap_flags2));
}

int _ibv_query_gid_ex(ibv_context* context, uint32_t port, uint32_t index,
                      ibv_gid_entry* entry, uint32_t flags, size_t entry_size) {
  Nic* nic = NicOf(context);
  if (port != 1 || flags != 0 || entry_size < sizeof(ibv_gid_entry) ||
      index >= static_cast<uint32_t>(kGidTableLen)) {
    return EINVAL;
  }
  const GidEntry& e = nic->gids[index];
  if (e.empty()) return ENODATA;  // rdma-core: an empty GID entry
  memset(entry, 0, entry_size);
  entry->gid = e.gid;
  entry->gid_index = index;
  entry->port_num = port;
  entry->gid_type = e.type;
  entry->ndev_ifindex = e.ifindex;
  return 0;
}

ssize_t _ibv_query_gid_table(ibv_context* context, ibv_gid_entry* entries,
                             size_t max_entries, uint32_t flags,
                             size_t entry_size) {
  if (flags != 0 || entry_size < sizeof(ibv_gid_entry)) return -EINVAL;
  size_t n = 0;
  for (int i = 0; i < kGidTableLen; ++i) {
    auto* out = reinterpret_cast<ibv_gid_entry*>(
        reinterpret_cast<uint8_t*>(entries) + n * entry_size);
    if (n >= max_entries) {
      if (!NicOf(context)->gids[i].empty()) return -EINVAL;
      continue;
    }
    if (_ibv_query_gid_ex(context, 1, static_cast<uint32_t>(i), out, 0,
                          entry_size) == 0) {
      ++n;
    }
  }
  return static_cast<ssize_t>(n);
}

int ibv_query_gid(ibv_context* context, uint8_t port, int index, ibv_gid* gid) {
  // rdma-core: an empty entry reads as zeros (0), a bad index fails (-1).
  ibv_gid_entry entry;
  if (index < 0) return -1;
  int rc = _ibv_query_gid_ex(context, port, static_cast<uint32_t>(index), &entry,
                             0, sizeof(entry));
  if (rc == ENODATA) {
    memset(gid, 0, sizeof(*gid));
    return 0;
  }
  if (rc != 0) return -1;
  *gid = entry.gid;
  return 0;
}

int ibv_query_gid_type(ibv_context* context, uint8_t port, unsigned int index,
                       int* type) {
  ibv_gid_entry entry;
  if (_ibv_query_gid_ex(context, port, index, &entry, 0, sizeof(entry)) != 0) {
    return -1;
  }
  *type = entry.gid_type == IBV_GID_TYPE_ROCE_V2 ? 1 : 0;  // sysfs's names
  return 0;
}

int ibv_query_pkey(ibv_context*, uint8_t port, int index, __be16* pkey) {
  if (port != 1 || index < 0 || index >= kPkeyTableLen) return -1;
  *pkey = htobe16(0xffff);  // the default full-member partition
  return 0;
}

int ibv_get_pkey_index(ibv_context*, uint8_t port, __be16 pkey) {
  if (port != 1 || (be16toh(pkey) & 0x7fff) != 0x7fff) return -1;
  return 0;
}

// Protection domains and memory.

ibv_pd* ibv_alloc_pd(ibv_context* context) {
  static std::atomic<uint32_t> handles{1};
  auto* pd = new Pd();
  pd->pd.context = context;
  pd->pd.handle = handles++;
  return &pd->pd;
}

int ibv_dealloc_pd(ibv_pd* ibpd) {
  Pd* pd = ToPd(ibpd);
  Nic* nic = NicOf(ibpd->context);
  {
    std::lock_guard<std::mutex> lock(nic->mu);
    if (pd->users > 0) return EBUSY;
  }
  delete pd;
  return 0;
}

ibv_mr* ibv_reg_mr_iova2(ibv_pd* ibpd, void* addr, size_t length, uint64_t iova,
                         unsigned int access) {
  Nic* nic = NicOf(ibpd->context);
  // ibv_reg_mr(3): optional access flags the device lacks are dropped.
  access &= ~static_cast<unsigned int>(IBV_ACCESS_OPTIONAL_RANGE);
  const unsigned int known =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
      IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_MW_BIND | IBV_ACCESS_ZERO_BASED |
      IBV_ACCESS_ON_DEMAND | IBV_ACCESS_HUGETLB;
  uint64_t start = reinterpret_cast<uintptr_t>(addr);
  // ibv_reg_mr(3), implicit ODP: addr NULL, length SIZE_MAX, ON_DEMAND.
  bool on_demand = (access & IBV_ACCESS_ON_DEMAND) != 0;
  bool implicit = on_demand && addr == nullptr && length == SIZE_MAX;
  if ((access & ~known) != 0 || length == 0 ||
      (!implicit && start + length < start)) {
    errno = EINVAL;
    return nullptr;
  }
  // ibv_reg_mr(3): remote write or atomic access needs local write.
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(access & IBV_ACCESS_LOCAL_WRITE)) {
    errno = EINVAL;
    return nullptr;
  }
  // ODP only where the knob offers it, and only for local access: the
  // device advertises no responder-side ODP (QueryDeviceEx).
  if ((on_demand && (!nic->settings.odp ||
                     (access & (IBV_ACCESS_REMOTE_WRITE |
                                IBV_ACCESS_REMOTE_READ |
                                IBV_ACCESS_REMOTE_ATOMIC)))) ||
      (access & IBV_ACCESS_ZERO_BASED) || (!implicit && iova != start)) {
    errno = EOPNOTSUPP;  // no zero-based or other IOVAs
    return nullptr;
  }
  bool write = access & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                         IBV_ACCESS_REMOTE_ATOMIC);
  if (!on_demand && !RangeMapped(start, length, write)) {
    errno = EFAULT;  // get_user_pages would fail
    return nullptr;
  }
  // ODP pins nothing: pages are faulted in as the NIC touches them.
  uint64_t pages = on_demand ? 0 : PageRound(start, length);
  std::lock_guard<std::mutex> lock(nic->mu);
  // The kernel pins the pages and charges them to RLIMIT_MEMLOCK unless the
  // process has CAP_IPC_LOCK (ib_umem_get): ENOMEM above the limit.
  struct rlimit limit;
  if (!on_demand && getrlimit(RLIMIT_MEMLOCK, &limit) == 0 &&
      limit.rlim_cur != RLIM_INFINITY &&
      nic->pinned_bytes + pages > limit.rlim_cur && !HasIpcLock()) {
    errno = ENOMEM;
    return nullptr;
  }
  if (nic->mrs.size() >= static_cast<size_t>(kMaxMr)) {
    errno = ENOMEM;
    return nullptr;
  }
  // Keys: a 24-bit index and an 8-bit tag, lkey == rkey (as mlx5 does); a
  // key whose tag differs names no MR.
  uint32_t key = 0;
  do {
    uint32_t index = nic->next_mr_index++ & 0xffffff;
    if (index == 0) continue;
    uint8_t tag = static_cast<uint8_t>(1 + (static_cast<uint32_t>(NowNs()) ^ index) % 255);
    key = (index << 8) | tag;
  } while (key == 0 || nic->mrs.count(key) != 0);
  auto* mr = new Mr();
  mr->mr.context = ibpd->context;
  mr->mr.pd = ibpd;
  mr->mr.addr = addr;
  mr->mr.length = length;
  mr->mr.handle = key >> 8;
  mr->mr.lkey = key;
  mr->mr.rkey = key;
  mr->pd = ToPd(ibpd);
  mr->access = static_cast<int>(access);
  mr->pinned = pages;
  mr->implicit = implicit;
  nic->pinned_bytes += pages;
  nic->mrs[key] = mr;
  ++mr->pd->users;
  return &mr->mr;
}

ibv_mr*(ibv_reg_mr)(ibv_pd* pd, void* addr, size_t length, int access) {
  return ibv_reg_mr_iova2(pd, addr, length, reinterpret_cast<uintptr_t>(addr),
                          static_cast<unsigned int>(access));
}

ibv_mr*(ibv_reg_mr_iova)(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                         int access) {
  return ibv_reg_mr_iova2(pd, addr, length, iova,
                          static_cast<unsigned int>(access));
}

int ibv_dereg_mr(ibv_mr* ibmr) {
  Mr* mr = ToMr(ibmr);
  Nic* nic = NicOf(ibmr->context);
  std::unique_lock<std::mutex> lock(nic->mu);
  // A placement or transmission in progress finishes first.
  nic->idle.wait(lock, [mr] { return mr->busy == 0; });
  nic->mrs.erase(ibmr->lkey);
  nic->pinned_bytes -= mr->pinned;
  --mr->pd->users;
  delete mr;
  return 0;
}

// Completion channels and queues.

ibv_comp_channel* ibv_create_comp_channel(ibv_context* context) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return nullptr;
  fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK);
  auto* ch = new Channel();
  ch->channel.context = context;
  ch->channel.fd = fds[0];
  ch->channel.refcnt = 0;
  ch->write_fd = fds[1];
  return &ch->channel;
}

int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  auto* ch = reinterpret_cast<Channel*>(channel);
  Nic* nic = NicOf(channel->context);
  {
    std::lock_guard<std::mutex> lock(nic->mu);
    if (channel->refcnt > 0) return EBUSY;
  }
  close(ch->channel.fd);
  close(ch->write_fd);
  delete ch;
  return 0;
}

ibv_cq* ibv_create_cq(ibv_context* context, int cqe, void* cq_context,
                      ibv_comp_channel* channel, int comp_vector) {
  Nic* nic = NicOf(context);
  if (cqe < 1 || cqe > kMaxCqe || comp_vector < 0 ||
      comp_vector >= context->num_comp_vectors) {
    errno = EINVAL;
    return nullptr;
  }
  static std::atomic<uint32_t> handles{1};
  auto* cq = new Cq();
  cq->cq.context = context;
  cq->cq.channel = channel;
  cq->cq.cq_context = cq_context;
  cq->cq.handle = handles++;
  cq->cq.cqe = cqe;
  pthread_mutex_init(&cq->cq.mutex, nullptr);
  pthread_cond_init(&cq->cq.cond, nullptr);
  cq->capacity = cqe;
  cq->channel = reinterpret_cast<Channel*>(channel);
  std::lock_guard<std::mutex> lock(nic->mu);
  if (channel != nullptr) ++channel->refcnt;
  nic->cqs.insert(cq);
  return &cq->cq;
}

int ibv_destroy_cq(ibv_cq* ibcq) {
  Cq* cq = ToCq(ibcq);
  Nic* nic = NicOf(ibcq->context);
  {
    std::lock_guard<std::mutex> lock(nic->mu);
    if (cq->users > 0) return EBUSY;
  }
  // ibv_get_cq_event(3): destroying a CQ waits until every event read from
  // its channel has been acknowledged (ibv_ack_cq_events).
  pthread_mutex_lock(&ibcq->mutex);
  while (ibcq->comp_events_completed != cq->events_reported) {
    pthread_cond_wait(&ibcq->cond, &ibcq->mutex);
  }
  pthread_mutex_unlock(&ibcq->mutex);
  {
    std::lock_guard<std::mutex> lock(nic->mu);
    nic->cqs.erase(cq);
    if (ibcq->channel != nullptr) --ibcq->channel->refcnt;
  }
  pthread_mutex_destroy(&ibcq->mutex);
  pthread_cond_destroy(&ibcq->cond);
  delete cq;
  return 0;
}

int ibv_resize_cq(ibv_cq* ibcq, int cqe) {
  Cq* cq = ToCq(ibcq);
  Nic* nic = NicOf(ibcq->context);
  std::lock_guard<std::mutex> lock(nic->mu);
  if (cqe < 1 || cqe > kMaxCqe || cqe < static_cast<int>(cq->entries.size())) {
    return EINVAL;
  }
  cq->capacity = cqe;
  ibcq->cqe = cqe;
  return 0;
}

int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** out, void** cq_context) {
  Nic* nic = NicOf(channel->context);
  while (true) {
    uint64_t handle = 0;
    if (read(channel->fd, &handle, sizeof(handle)) != sizeof(handle)) return -1;
    Cq* cq = reinterpret_cast<Cq*>(static_cast<uintptr_t>(handle));
    {
      std::lock_guard<std::mutex> lock(nic->mu);
      // An event of a CQ destroyed since is not delivered (the kernel
      // removes them with the CQ).
      if (nic->cqs.count(cq) == 0 || cq->cq.channel != channel) continue;
    }
    pthread_mutex_lock(&cq->cq.mutex);
    ++cq->events_reported;
    pthread_mutex_unlock(&cq->cq.mutex);
    *out = &cq->cq;
    *cq_context = cq->cq.cq_context;
    return 0;
  }
}

void ibv_ack_cq_events(ibv_cq* cq, unsigned int nevents) {
  pthread_mutex_lock(&cq->mutex);
  cq->comp_events_completed += nevents;
  pthread_cond_signal(&cq->cond);
  pthread_mutex_unlock(&cq->mutex);
}

// Queue pairs.

ibv_qp* ibv_create_qp(ibv_pd* ibpd, ibv_qp_init_attr* init) {
  Nic* nic = NicOf(ibpd->context);
  if (init->qp_type != IBV_QPT_RC || init->srq != nullptr) {
    errno = EOPNOTSUPP;  // RC without SRQ is what softnic emulates
    return nullptr;
  }
  const ibv_qp_cap& cap = init->cap;
  if (init->send_cq == nullptr || init->recv_cq == nullptr ||
      cap.max_send_wr > static_cast<uint32_t>(kMaxQpWr) ||
      cap.max_recv_wr > static_cast<uint32_t>(kMaxQpWr) ||
      cap.max_send_sge > static_cast<uint32_t>(kMaxSge) ||
      cap.max_recv_sge > static_cast<uint32_t>(kMaxSge) ||
      cap.max_inline_data > kMaxInline) {
    errno = EINVAL;
    return nullptr;
  }
  if (!nic->Start()) return nullptr;
  uint32_t qpn = 0;
  if (!nic->AllocateQpn(&qpn)) return nullptr;
  auto* qp = new Qp();
  qp->qp.context = ibpd->context;
  qp->qp.qp_context = init->qp_context;
  qp->qp.pd = ibpd;
  qp->qp.send_cq = init->send_cq;
  qp->qp.recv_cq = init->recv_cq;
  qp->qp.handle = qpn;
  qp->qp.qp_num = qpn;
  qp->qp.state = IBV_QPS_RESET;
  qp->qp.qp_type = IBV_QPT_RC;
  pthread_mutex_init(&qp->qp.mutex, nullptr);
  pthread_cond_init(&qp->qp.cond, nullptr);
  qp->pd = ToPd(ibpd);
  qp->send_cq = ToCq(init->send_cq);
  qp->recv_cq = ToCq(init->recv_cq);
  qp->cap = cap;
  qp->sq_sig_all = init->sq_sig_all != 0;
  std::lock_guard<std::mutex> lock(nic->mu);
  ++qp->pd->users;
  ++qp->send_cq->users;
  ++qp->recv_cq->users;
  nic->qps[qpn] = qp;
  return &qp->qp;
}

int ibv_modify_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int mask) {
  Qp* qp = ToQp(ibqp);
  Nic* nic = NicOf(ibqp->context);
  std::lock_guard<std::mutex> lock(nic->mu);
  ibv_qp_state cur = qp->qp.state;
  if ((mask & IBV_QP_CUR_STATE) && attr->cur_qp_state != cur) return EINVAL;
  ibv_qp_state next = (mask & IBV_QP_STATE) ? attr->qp_state : cur;
  if (next < IBV_QPS_RESET || next > IBV_QPS_ERR) return EINVAL;
  Rule rule = Transition(cur, next);
  if (!rule.valid || (mask & rule.required) != rule.required ||
      (mask & ~(rule.required | rule.optional | IBV_QP_STATE)) != 0) {
    return EINVAL;
  }
  int err = CheckValues(nic, attr, mask);
  if (err != 0) return err;
  ibv_qp_attr& a = qp->attr;
  if (mask & IBV_QP_PKEY_INDEX) a.pkey_index = attr->pkey_index;
  if (mask & IBV_QP_PORT) a.port_num = attr->port_num;
  if (mask & IBV_QP_ACCESS_FLAGS) a.qp_access_flags = attr->qp_access_flags;
  if (mask & IBV_QP_AV) a.ah_attr = attr->ah_attr;
  if (mask & IBV_QP_PATH_MTU) a.path_mtu = attr->path_mtu;
  if (mask & IBV_QP_DEST_QPN) a.dest_qp_num = attr->dest_qp_num;
  if (mask & IBV_QP_RQ_PSN) a.rq_psn = attr->rq_psn & 0xffffff;
  if (mask & IBV_QP_SQ_PSN) a.sq_psn = attr->sq_psn & 0xffffff;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) a.max_dest_rd_atomic = attr->max_dest_rd_atomic;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) a.max_rd_atomic = attr->max_rd_atomic;
  if (mask & IBV_QP_MIN_RNR_TIMER) a.min_rnr_timer = attr->min_rnr_timer;
  if (mask & IBV_QP_TIMEOUT) a.timeout = attr->timeout;
  if (mask & IBV_QP_RETRY_CNT) a.retry_cnt = attr->retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) a.rnr_retry = attr->rnr_retry;
  if (!(mask & IBV_QP_STATE)) return 0;
  switch (next) {
    case IBV_QPS_RESET:
      nic->ResetQp(qp);
      break;
    case IBV_QPS_ERR:
      nic->MoveToError(qp);
      break;
    case IBV_QPS_RTR:
      if (cur == IBV_QPS_INIT) qp->expected_psn = a.rq_psn;
      break;
    case IBV_QPS_RTS:
      if (cur == IBV_QPS_RTR) qp->next_psn = a.sq_psn;
      break;
    default:
      break;
  }
  qp->qp.state = next;
  a.qp_state = next;
  return 0;
}

int ibv_query_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int, ibv_qp_init_attr* init) {
  Qp* qp = ToQp(ibqp);
  Nic* nic = NicOf(ibqp->context);
  std::lock_guard<std::mutex> lock(nic->mu);
  *attr = qp->attr;
  attr->qp_state = qp->qp.state;
  attr->cur_qp_state = qp->qp.state;
  attr->cap = qp->cap;
  attr->path_mig_state = IBV_MIG_MIGRATED;
  memset(init, 0, sizeof(*init));
  init->qp_context = ibqp->qp_context;
  init->send_cq = ibqp->send_cq;
  init->recv_cq = ibqp->recv_cq;
  init->cap = qp->cap;
  init->qp_type = IBV_QPT_RC;
  init->sq_sig_all = qp->sq_sig_all;
  return 0;
}

int ibv_destroy_qp(ibv_qp* ibqp) {
  Qp* qp = ToQp(ibqp);
  Nic* nic = NicOf(ibqp->context);
  {
    std::unique_lock<std::mutex> lock(nic->mu);
    nic->StopEngine(qp, &lock);  // releases the lock
  }
  {
    std::lock_guard<std::mutex> lock(nic->mu);
    nic->ResetQp(qp);
    nic->qps.erase(ibqp->qp_num);
    --qp->pd->users;
    --qp->send_cq->users;
    --qp->recv_cq->users;
  }
  nic->ReleaseQpn(ibqp->qp_num);
  pthread_mutex_destroy(&ibqp->mutex);
  pthread_cond_destroy(&ibqp->cond);
  delete qp;
  return 0;
}

int ibv_query_qp_data_in_order(ibv_qp*, ibv_wr_opcode, uint32_t) {
  return 0;  // the emulation places in order, but promises nothing more
}

// Asynchronous events.

int ibv_get_async_event(ibv_context* context, ibv_async_event* event) {
  struct {
    uint64_t element;
    uint32_t type;
    uint32_t reserved;
  } record;
  if (read(context->async_fd, &record, sizeof(record)) != sizeof(record)) {
    return -1;
  }
  event->event_type = static_cast<ibv_event_type>(record.type);
  if (event->event_type == IBV_EVENT_CQ_ERR) {
    event->element.cq = reinterpret_cast<ibv_cq*>(record.element);
  } else {
    event->element.qp = reinterpret_cast<ibv_qp*>(record.element);
  }
  return 0;
}

void ibv_ack_async_event(ibv_async_event* event) {
  if (event->event_type == IBV_EVENT_CQ_ERR) {
    ibv_cq* cq = event->element.cq;
    pthread_mutex_lock(&cq->mutex);
    ++cq->async_events_completed;
    pthread_cond_signal(&cq->cond);
    pthread_mutex_unlock(&cq->mutex);
    return;
  }
  ibv_qp* qp = event->element.qp;
  pthread_mutex_lock(&qp->mutex);
  ++qp->events_completed;
  pthread_cond_signal(&qp->cond);
  pthread_mutex_unlock(&qp->mutex);
}

// Fork: the emulation does no DMA, so there is nothing copy-on-write could
// break (rdma-core reports the same for kernels with MADV_DONTFORK-free
// pinning).

int ibv_fork_init(void) { return 0; }
enum ibv_fork_status ibv_is_fork_initialized(void) { return IBV_FORK_UNNEEDED; }
int ibv_dontfork_range(void*, size_t) { return 0; }
int ibv_dofork_range(void*, size_t) { return 0; }

// Strings (rdma-core's texts, so that messages read the same).

const char* ibv_wc_status_str(enum ibv_wc_status status) {
  static const char* const kText[] = {
      "success", "local length error", "local QP operation error",
      "local EE context operation error", "local protection error",
      "Work Request Flushed Error", "memory management operation error",
      "bad response error", "local access error", "remote invalid request error",
      "remote access error", "remote operation error",
      "transport retry counter exceeded", "RNR retry counter exceeded",
      "local RDD violation error", "remote invalid RD request", "aborted error",
      "invalid EE context number", "invalid EE context state", "fatal error",
      "response timeout error", "general error"};
  if (status < IBV_WC_SUCCESS || status > IBV_WC_GENERAL_ERR) return "unknown";
  return kText[status];
}

const char* ibv_port_state_str(enum ibv_port_state state) {
  static const char* const kText[] = {"no state change (NOP)", "down", "init",
                                      "armed", "active", "active defer"};
  if (state < IBV_PORT_NOP || state > IBV_PORT_ACTIVE_DEFER) return "unknown";
  return kText[state];
}

const char* ibv_node_type_str(enum ibv_node_type type) {
  static const char* const kText[] = {"InfiniBand channel adapter",
                                      "InfiniBand switch", "InfiniBand router",
                                      "iWARP NIC", "usNIC", "usNIC UDP"};
  if (type < IBV_NODE_CA || type > IBV_NODE_USNIC_UDP) return "unknown";
  return kText[type - IBV_NODE_CA];
}

const char* ibv_event_type_str(enum ibv_event_type event) {
  static const char* const kText[] = {
      "CQ error", "local work queue catastrophic error",
      "invalid request local work queue error",
      "local access violation work queue error", "communication established",
      "send queue drained", "path migrated", "path migration request error",
      "local catastrophic error", "port active", "port error", "LID change",
      "P_Key change", "SM change", "SRQ catastrophic error", "SRQ limit reached",
      "last WQE reached", "client reregistration", "GID table change"};
  if (event < IBV_EVENT_CQ_ERR || event > IBV_EVENT_GID_CHANGE) return "unknown";
  return kText[event];
}

// Rates (IBA 9.1.4 static rate encodings).

namespace {
struct RateRow {
  ibv_rate rate;
  int mult;
  int mbps;
};
const RateRow kRates[] = {
    {IBV_RATE_2_5_GBPS, 1, 2500},     {IBV_RATE_5_GBPS, 2, 5000},
    {IBV_RATE_10_GBPS, 4, 10000},     {IBV_RATE_20_GBPS, 8, 20000},
    {IBV_RATE_30_GBPS, 12, 30000},    {IBV_RATE_40_GBPS, 16, 40000},
    {IBV_RATE_60_GBPS, 24, 60000},    {IBV_RATE_80_GBPS, 32, 80000},
    {IBV_RATE_120_GBPS, 48, 120000},  {IBV_RATE_14_GBPS, 0, 14062},
    {IBV_RATE_56_GBPS, 0, 56250},     {IBV_RATE_112_GBPS, 0, 112500},
    {IBV_RATE_168_GBPS, 0, 168750},   {IBV_RATE_25_GBPS, 0, 25781},
    {IBV_RATE_100_GBPS, 0, 103125},   {IBV_RATE_200_GBPS, 0, 206250},
    {IBV_RATE_300_GBPS, 0, 309375},   {IBV_RATE_28_GBPS, 0, 28125},
    {IBV_RATE_50_GBPS, 0, 53125},     {IBV_RATE_400_GBPS, 0, 425000},
    {IBV_RATE_600_GBPS, 0, 637500},
};
}  // namespace

int ibv_rate_to_mult(enum ibv_rate rate) {
  for (const RateRow& r : kRates) {
    if (r.rate == rate && r.mult != 0) return r.mult;
  }
  return -1;
}

enum ibv_rate mult_to_ibv_rate(int mult) {
  for (const RateRow& r : kRates) {
    if (r.mult == mult && mult != 0) return r.rate;
  }
  return IBV_RATE_MAX;
}

int ibv_rate_to_mbps(enum ibv_rate rate) {
  for (const RateRow& r : kRates) {
    if (r.rate == rate) return r.mbps;
  }
  return -1;
}

enum ibv_rate mbps_to_ibv_rate(int mbps) {
  for (const RateRow& r : kRates) {
    if (r.mbps == mbps) return r.rate;
  }
  return IBV_RATE_MAX;
}

// Not emulated: fail the way a device without the feature does.

ibv_srq* ibv_create_srq(ibv_pd*, ibv_srq_init_attr*) {
  errno = EOPNOTSUPP;
  return nullptr;
}
int ibv_modify_srq(ibv_srq*, ibv_srq_attr*, int) { return EOPNOTSUPP; }
int ibv_query_srq(ibv_srq*, ibv_srq_attr*) { return EOPNOTSUPP; }
int ibv_destroy_srq(ibv_srq*) { return EOPNOTSUPP; }
ibv_ah* ibv_create_ah(ibv_pd*, ibv_ah_attr*) {
  errno = EOPNOTSUPP;
  return nullptr;
}
int ibv_destroy_ah(ibv_ah*) { return EOPNOTSUPP; }
ibv_ah* ibv_create_ah_from_wc(ibv_pd*, ibv_wc*, ibv_grh*, uint8_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
int ibv_init_ah_from_wc(ibv_context*, uint8_t, ibv_wc*, ibv_grh*, ibv_ah_attr*) {
  return EOPNOTSUPP;
}
int ibv_attach_mcast(ibv_qp*, const ibv_gid*, uint16_t) { return EOPNOTSUPP; }
int ibv_detach_mcast(ibv_qp*, const ibv_gid*, uint16_t) { return EOPNOTSUPP; }
int ibv_rereg_mr(ibv_mr*, int, ibv_pd*, void*, size_t, int) {
  return IBV_REREG_MR_ERR_INPUT;
}
ibv_mr* ibv_reg_dmabuf_mr(ibv_pd*, uint64_t, size_t, uint64_t, int, int) {
  errno = EOPNOTSUPP;
  return nullptr;
}
int ibv_resolve_eth_l2_from_gid(ibv_context*, ibv_ah_attr*, uint8_t*, uint16_t*) {
  return EOPNOTSUPP;
}
ibv_qp_ex* ibv_qp_to_qp_ex(ibv_qp*) {
  errno = EOPNOTSUPP;
  return nullptr;
}
ibv_context* ibv_import_device(int) {
  errno = EOPNOTSUPP;
  return nullptr;
}
ibv_pd* ibv_import_pd(ibv_context*, uint32_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
void ibv_unimport_pd(ibv_pd*) {}
ibv_mr* ibv_import_mr(ibv_pd*, uint32_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
void ibv_unimport_mr(ibv_mr*) {}
ibv_dm* ibv_import_dm(ibv_context*, uint32_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
void ibv_unimport_dm(ibv_dm*) {}
int ibv_query_ece(ibv_qp*, ibv_ece*) { return EOPNOTSUPP; }
int ibv_set_ece(ibv_qp*, ibv_ece*) { return EOPNOTSUPP; }

// Historical symbols other rdma-core libraries (librdmacm) link to; the
// kernel structures they convert never reach softnic.
void ibv_copy_qp_attr_from_kern(void*, void*) {}
void ibv_copy_ah_attr_from_kern(void*, void*) {}
void ibv_copy_path_rec_from_kern(void*, void*) {}
void ibv_copy_path_rec_to_kern(void*, void*) {}
const char* ibv_get_sysfs_path(void) { return "/sys"; }
int ibv_read_sysfs_file(const char*, const char*, char*, size_t) { return -1; }

}  // extern "C"
