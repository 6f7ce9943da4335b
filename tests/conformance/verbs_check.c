/* verbs_check: the driver of the verbs conformance suite
 * (tests/test_verbs_conformance.py). Each check is one semantic of the
 * InfiniBand verbs that tf_rdma's verbs plugin relies on, exercised with
 * plain libibverbs calls, so that the same binary runs against softnic (the
 * emulated NIC, tests/softnic/) and against a real RDMA device: where the
 * two disagree, the suite says which semantic.
 *
 *   verbs_check CHECK [ROLE] [key=value ...]
 *
 * Single-process checks use two QPs of one process connected to each
 * other (loopback through the port). Two-process checks (ROLE target or
 * initiator) exchange their addresses out of band through the test: each
 * prints "ADDR ..." (and the target "MR ...") on stdout and reads the
 * peer's lines from stdin; "GO" lines on stdin pace the steps. Facts are
 * printed as "FACT key=value"; a failed expectation prints "FAIL: ..." on
 * stderr and exits 1.
 *
 * Options: device=NAME (default: the first with an active port), port=N,
 * gid_index=N (RoCE; default: an IPv4-mapped RoCE v2 GID), plus per check
 * (variant=, rnr_retry=, timeout=, retry_cnt=, rounds=, bytes=).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* Plumbing. */

static int g_argc;
static char** g_argv;

static const char* opt(const char* key, const char* fallback) {
  size_t n = strlen(key);
  for (int i = 1; i < g_argc; ++i) {
    if (strncmp(g_argv[i], key, n) == 0 && g_argv[i][n] == '=') {
      return g_argv[i] + n + 1;
    }
  }
  return fallback;
}

static long opt_int(const char* key, long fallback) {
  const char* v = opt(key, NULL);
  return v ? strtol(v, NULL, 0) : fallback;
}

static void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "FAIL: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  exit(1);
}

#define EXPECT(cond, ...)      \
  do {                         \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

static void fact(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("FACT ");
  vprintf(fmt, ap);
  printf("\n");
  fflush(stdout);
  va_end(ap);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Reads the next stdin line that starts with `prefix` (others are errors). */
static void read_line(const char* prefix, char* out, size_t size) {
  if (!fgets(out, (int)size, stdin)) fail("stdin closed while waiting for %s", prefix);
  if (strncmp(out, prefix, strlen(prefix)) != 0) fail("expected %s, got %s", prefix, out);
}

/* ------------------------------------------------------------------------ */
/* The device, its port and the queue pairs. */

struct dev {
  struct ibv_context* ctx;
  struct ibv_pd* pd;
  struct ibv_device_attr attr;
  struct ibv_port_attr port_attr;
  char name[64];
  uint8_t port;
  int roce;
  int gid_index;
  union ibv_gid gid;
};

static int is_ipv4_mapped(const union ibv_gid* g) {
  for (int i = 0; i < 10; ++i) {
    if (g->raw[i]) return 0;
  }
  return g->raw[10] == 0xff && g->raw[11] == 0xff;
}

static void open_dev(struct dev* d) {
  memset(d, 0, sizeof(*d));
  int n = 0;
  struct ibv_device** list = ibv_get_device_list(&n);
  EXPECT(list != NULL, "ibv_get_device_list: %s", strerror(errno));
  EXPECT(n > 0, "no RDMA device");
  const char* want = opt("device", NULL);
  d->port = (uint8_t)opt_int("port", 1);
  for (int i = 0; i < n && d->ctx == NULL; ++i) {
    if (want && strcmp(want, ibv_get_device_name(list[i])) != 0) continue;
    struct ibv_context* c = ibv_open_device(list[i]);
    if (!c) continue;
    struct ibv_port_attr pa;
    if (ibv_query_port(c, d->port, &pa) == 0 && (pa.state == IBV_PORT_ACTIVE || want)) {
      d->ctx = c;
      d->port_attr = pa;
      snprintf(d->name, sizeof(d->name), "%s", ibv_get_device_name(list[i]));
    } else {
      ibv_close_device(c);
    }
  }
  ibv_free_device_list(list);
  EXPECT(d->ctx != NULL, "no device with an active port %d", d->port);
  EXPECT(ibv_query_device(d->ctx, &d->attr) == 0, "ibv_query_device");
  d->pd = ibv_alloc_pd(d->ctx);
  EXPECT(d->pd != NULL, "ibv_alloc_pd: %s", strerror(errno));
  d->roce = d->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
  d->gid_index = (int)opt_int("gid_index", -1);
  if (d->gid_index < 0 && d->roce) {
    for (int i = 0; i < d->port_attr.gid_tbl_len; ++i) {
      struct ibv_gid_entry e;
      if (ibv_query_gid_ex(d->ctx, d->port, i, &e, 0) != 0) continue;
      if (e.gid_type == IBV_GID_TYPE_ROCE_V2 && is_ipv4_mapped(&e.gid)) {
        d->gid_index = i;
        break;
      }
    }
  }
  if (d->gid_index < 0) d->gid_index = 0;
  EXPECT(ibv_query_gid(d->ctx, d->port, d->gid_index, &d->gid) == 0, "ibv_query_gid");
}

struct addr {
  unsigned lid, qpn, psn;
  union ibv_gid gid;
};

static void print_addr(const struct dev* d, struct ibv_qp* qp, unsigned psn) {
  printf("ADDR lid=%u qpn=%u psn=%u gid=", d->port_attr.lid, qp->qp_num, psn);
  for (int i = 0; i < 16; ++i) printf("%02x", d->gid.raw[i]);
  printf("\n");
  fflush(stdout);
}

static void parse_addr(const char* line, struct addr* a) {
  char hex[40] = {0};
  EXPECT(sscanf(line, "ADDR lid=%u qpn=%u psn=%u gid=%32s", &a->lid, &a->qpn, &a->psn, hex) == 4,
         "bad address line %s", line);
  for (int i = 0; i < 16; ++i) {
    unsigned b;
    sscanf(hex + 2 * i, "%2x", &b);
    a->gid.raw[i] = (uint8_t)b;
  }
}

static struct ibv_qp* make_qp(struct dev* d, struct ibv_cq* scq, struct ibv_cq* rcq,
                              uint32_t send_wr, uint32_t recv_wr, uint32_t inline_bytes,
                              int sig_all) {
  struct ibv_qp_init_attr init;
  memset(&init, 0, sizeof(init));
  init.send_cq = scq;
  init.recv_cq = rcq;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = sig_all;
  init.cap.max_send_wr = send_wr;
  init.cap.max_recv_wr = recv_wr;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = inline_bytes;
  struct ibv_qp* qp = ibv_create_qp(d->pd, &init);
  EXPECT(qp != NULL, "ibv_create_qp: %s", strerror(errno));
  return qp;
}

static int to_init(struct dev* d, struct ibv_qp* qp, int access) {
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_INIT;
  a.port_num = d->port;
  a.qp_access_flags = access;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

static int to_rtr(struct dev* d, struct ibv_qp* qp, const struct addr* peer, int min_rnr_timer) {
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = d->port_attr.active_mtu;
  a.dest_qp_num = peer->qpn;
  a.rq_psn = peer->psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = (uint8_t)min_rnr_timer;
  a.ah_attr.port_num = d->port;
  a.ah_attr.dlid = (uint16_t)peer->lid;
  if (d->roce) {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = peer->gid;
    a.ah_attr.grh.sgid_index = (uint8_t)d->gid_index;
    a.ah_attr.grh.hop_limit = 64;
  }
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                   IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

static int to_rts(struct ibv_qp* qp, unsigned psn, int timeout, int retry_cnt, int rnr_retry) {
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = psn;
  a.timeout = (uint8_t)timeout;
  a.retry_cnt = (uint8_t)retry_cnt;
  a.rnr_retry = (uint8_t)rnr_retry;
  a.max_rd_atomic = 1;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                   IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

/* Brings a QP up against `peer` with the check's retry settings. */
static void connect_qp(struct dev* d, struct ibv_qp* qp, const struct addr* peer, unsigned my_psn) {
  EXPECT(to_rtr(d, qp, peer, (int)opt_int("min_rnr_timer", 1)) == 0, "modify to RTR");
  EXPECT(to_rts(qp, my_psn, (int)opt_int("timeout", 14), (int)opt_int("retry_cnt", 7),
                (int)opt_int("rnr_retry", 7)) == 0,
         "modify to RTS");
}

static struct addr self_addr(struct dev* d, struct ibv_qp* qp, unsigned psn) {
  struct addr a;
  memset(&a, 0, sizeof(a));
  a.lid = d->port_attr.lid;
  a.qpn = qp->qp_num;
  a.psn = psn;
  a.gid = d->gid;
  return a;
}

/* Two QPs of this process connected to each other. */
struct pair {
  struct ibv_cq *scq, *rcq;
  struct ibv_qp *a, *b;
};

static void loopback(struct dev* d, struct pair* p, uint32_t send_wr, int sig_all, int access) {
  p->scq = ibv_create_cq(d->ctx, 256, NULL, NULL, 0);
  p->rcq = ibv_create_cq(d->ctx, 256, NULL, NULL, 0);
  EXPECT(p->scq && p->rcq, "ibv_create_cq: %s", strerror(errno));
  p->a = make_qp(d, p->scq, p->rcq, send_wr, 16, 64, sig_all);
  p->b = make_qp(d, p->scq, p->rcq, send_wr, 16, 64, sig_all);
  EXPECT(to_init(d, p->a, access) == 0 && to_init(d, p->b, access) == 0, "modify to INIT");
  struct addr aa = self_addr(d, p->a, 100), bb = self_addr(d, p->b, 200);
  connect_qp(d, p->a, &bb, 100);
  connect_qp(d, p->b, &aa, 200);
}

/* Polls until one completion arrives; fails after `seconds`. */
static struct ibv_wc wait_wc(struct ibv_cq* cq, double seconds, const char* what) {
  struct ibv_wc wc;
  double end = now_s() + seconds;
  while (1) {
    int n = ibv_poll_cq(cq, 1, &wc);
    EXPECT(n >= 0, "ibv_poll_cq failed (%s)", what);
    if (n == 1) return wc;
    if (now_s() > end) fail("no completion within %.1f s (%s)", seconds, what);
    usleep(100);
  }
}

static int poll_none(struct ibv_cq* cq, double seconds) {
  struct ibv_wc wc;
  double end = now_s() + seconds;
  while (now_s() < end) {
    if (ibv_poll_cq(cq, 1, &wc) != 0) return 0;
    usleep(200);
  }
  return 1;
}

static void* pages(size_t bytes) {
  void* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT(p != MAP_FAILED, "mmap");
  return p;
}

static int post_write(struct ibv_qp* qp, uint64_t wr_id, void* src, uint32_t len, uint32_t lkey,
                      uint64_t raddr, uint32_t rkey, int flags) {
  struct ibv_sge sge = {(uintptr_t)src, len, lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = flags;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  return ibv_post_send(qp, &wr, &bad);
}

static int post_send(struct ibv_qp* qp, uint64_t wr_id, void* src, uint32_t len, uint32_t lkey,
                     int flags) {
  struct ibv_sge sge = {(uintptr_t)src, len, lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = flags;
  return ibv_post_send(qp, &wr, &bad);
}

static int post_recv(struct ibv_qp* qp, uint64_t wr_id, void* buf, uint32_t len, uint32_t lkey) {
  struct ibv_sge sge = {(uintptr_t)buf, len, lkey};
  struct ibv_recv_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  return ibv_post_recv(qp, &wr, &bad);
}

static enum ibv_qp_state qp_state(struct ibv_qp* qp) {
  struct ibv_qp_attr a;
  struct ibv_qp_init_attr i;
  EXPECT(ibv_query_qp(qp, &a, IBV_QP_STATE, &i) == 0, "ibv_query_qp");
  return a.qp_state;
}

/* ------------------------------------------------------------------------ */
/* Single-process checks. */

/* Devices, ports, GIDs and the limits the plugin checks. */
static void check_device(void) {
  struct dev d;
  open_dev(&d);
  fact("name=%s", d.name);
  fact("fw_ver=%s", d.attr.fw_ver);
  fact("node_guid=%016llx", (unsigned long long)be64toh(d.attr.node_guid));
  EXPECT(d.attr.phys_port_cnt >= 1, "phys_port_cnt %d", d.attr.phys_port_cnt);
  EXPECT(d.attr.max_qp_wr >= 128 && d.attr.max_cqe >= 128 && d.attr.max_sge >= 1,
         "limits: max_qp_wr %d max_cqe %d max_sge %d", d.attr.max_qp_wr, d.attr.max_cqe,
         d.attr.max_sge);
  fact("max_qp_wr=%d", d.attr.max_qp_wr);
  fact("max_cqe=%d", d.attr.max_cqe);
  fact("max_sge=%d", d.attr.max_sge);
  EXPECT(d.port_attr.state == IBV_PORT_ACTIVE, "port %d is %s", d.port,
         ibv_port_state_str(d.port_attr.state));
  int mtu = 128 << d.port_attr.active_mtu;
  EXPECT(mtu >= 256 && mtu <= 4096, "active MTU enum %d", d.port_attr.active_mtu);
  fact("active_mtu=%d", mtu);
  fact("max_msg_sz=%u", d.port_attr.max_msg_sz);
  fact("link=%s", d.roce ? "roce" : "ib");
  if (d.roce) {
    int v2_ipv4 = -1;
    for (int i = 0; i < d.port_attr.gid_tbl_len; ++i) {
      struct ibv_gid_entry e;
      int rc = ibv_query_gid_ex(d.ctx, d.port, i, &e, 0);
      if (rc == ENODATA) continue; /* an empty entry */
      EXPECT(rc == 0, "ibv_query_gid_ex(%d): %d", i, rc);
      EXPECT(e.gid_index == (uint32_t)i && e.port_num == d.port, "gid entry %d echoes", i);
      if (e.gid_type == IBV_GID_TYPE_ROCE_V2 && is_ipv4_mapped(&e.gid) && v2_ipv4 < 0) v2_ipv4 = i;
    }
    EXPECT(v2_ipv4 >= 0, "no IPv4-mapped RoCE v2 GID on port %d", d.port);
    union ibv_gid g;
    EXPECT(ibv_query_gid(d.ctx, d.port, v2_ipv4, &g) == 0, "ibv_query_gid");
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, g.raw + 12, text, sizeof(text));
    fact("roce_v2_ipv4_gid=%d:%s", v2_ipv4, text);
  } else {
    EXPECT(d.port_attr.lid != 0, "InfiniBand port without a LID");
    fact("lid=%u", d.port_attr.lid);
  }
  /* The largest inline size a QP gets, probing as the plugin does. */
  struct ibv_cq* cq = ibv_create_cq(d.ctx, 16, NULL, NULL, 0);
  EXPECT(cq != NULL, "ibv_create_cq");
  uint32_t best = 0;
  for (uint32_t want = 16; want <= 4096; want *= 2) {
    struct ibv_qp_init_attr init;
    memset(&init, 0, sizeof(init));
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = 4;
    init.cap.max_recv_wr = 4;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    init.cap.max_inline_data = want;
    struct ibv_qp* qp = ibv_create_qp(d.pd, &init);
    if (!qp) break;
    best = init.cap.max_inline_data;
    ibv_destroy_qp(qp);
  }
  fact("max_inline_data=%u", best);
  EXPECT(ibv_create_cq(d.ctx, d.attr.max_cqe + 1, NULL, NULL, 0) == NULL,
         "a CQ above max_cqe was created");
  ibv_destroy_cq(cq);
}

/* Memory registration: access flags, bad ranges, keys, busy PDs. */
static void check_mr(void) {
  struct dev d;
  open_dev(&d);
  size_t len = 1 << 20;
  char* buf = pages(len);
  errno = 0;
  EXPECT(ibv_reg_mr(d.pd, buf, len, IBV_ACCESS_REMOTE_WRITE) == NULL && errno == EINVAL,
         "REMOTE_WRITE without LOCAL_WRITE: errno %d", errno);
  void* hole = mmap(NULL, 1 << 16, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  munmap(hole, 1 << 16);
  errno = 0;
  EXPECT(ibv_reg_mr(d.pd, hole, 1 << 16, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EFAULT,
         "unmapped memory: errno %d", errno);
  void* ro = mmap(NULL, 1 << 16, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  errno = 0;
  EXPECT(ibv_reg_mr(d.pd, ro, 1 << 16, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EFAULT,
         "read-only memory for writing: errno %d", errno);
  struct ibv_mr* rmr = ibv_reg_mr(d.pd, ro, 1 << 16, 0);
  EXPECT(rmr != NULL, "read-only memory for reading: %s", strerror(errno));
  ibv_dereg_mr(rmr);
  struct ibv_mr* mr = ibv_reg_mr(d.pd, buf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  EXPECT(mr != NULL, "ibv_reg_mr: %s", strerror(errno));
  EXPECT(mr->addr == buf && mr->length == len && mr->pd == d.pd, "MR echoes its range");
  struct ibv_mr* mr2 = ibv_reg_mr(d.pd, buf + 4096, 4096, IBV_ACCESS_LOCAL_WRITE);
  EXPECT(mr2 != NULL && mr2->lkey != mr->lkey && mr2->rkey != mr->rkey, "keys differ per MR");
  EXPECT(ibv_dealloc_pd(d.pd) == EBUSY, "a PD with MRs was deallocated");
  EXPECT(ibv_dereg_mr(mr2) == 0 && ibv_dereg_mr(mr) == 0, "ibv_dereg_mr");
  EXPECT(ibv_dealloc_pd(d.pd) == 0, "ibv_dealloc_pd");
  fact("mr=ok");
}

/* The RC state machine: masks, posting per state, flush in Error. */
static void check_qp_state(void) {
  struct dev d;
  open_dev(&d);
  struct ibv_cq* scq = ibv_create_cq(d.ctx, 64, NULL, NULL, 0);
  struct ibv_cq* rcq = ibv_create_cq(d.ctx, 64, NULL, NULL, 0);
  struct ibv_qp* qp = make_qp(&d, scq, rcq, 8, 8, 0, 1);
  struct ibv_qp* peer = make_qp(&d, scq, rcq, 8, 8, 0, 1);
  char* buf = pages(4096);
  struct ibv_mr* mr = ibv_reg_mr(d.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
  EXPECT(mr != NULL, "ibv_reg_mr");
  EXPECT(qp->state == IBV_QPS_RESET && qp_state(qp) == IBV_QPS_RESET, "a new QP is in RESET");
  EXPECT(post_send(qp, 1, buf, 8, mr->lkey, IBV_SEND_SIGNALED) == EINVAL, "post_send in RESET");
  EXPECT(post_recv(qp, 1, buf, 64, mr->lkey) == EINVAL, "post_recv in RESET");
  struct addr pa = self_addr(&d, peer, 7);
  EXPECT(to_rtr(&d, qp, &pa, 1) == EINVAL, "RESET -> RTR");
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_INIT;
  a.port_num = d.port;
  EXPECT(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT) == EINVAL,
         "RESET -> INIT without ACCESS_FLAGS");
  EXPECT(ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS |
                           IBV_QP_SQ_PSN) == EINVAL,
         "RESET -> INIT with SQ_PSN");
  EXPECT(to_init(&d, qp, IBV_ACCESS_LOCAL_WRITE) == 0 && qp->state == IBV_QPS_INIT, "-> INIT");
  EXPECT(post_recv(qp, 11, buf, 64, mr->lkey) == 0, "post_recv in INIT");
  EXPECT(post_send(qp, 1, buf, 8, mr->lkey, IBV_SEND_SIGNALED) == EINVAL, "post_send in INIT");
  EXPECT(to_rts(qp, 5, 14, 7, 7) == EINVAL, "INIT -> RTS");
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = d.port_attr.active_mtu;
  a.dest_qp_num = peer->qp_num;
  a.ah_attr.port_num = d.port;
  a.ah_attr.is_global = d.roce;
  a.ah_attr.grh.dgid = d.gid;
  a.ah_attr.grh.sgid_index = (uint8_t)d.gid_index;
  a.ah_attr.dlid = d.port_attr.lid;
  EXPECT(ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC) == EINVAL,
         "INIT -> RTR without MIN_RNR_TIMER");
  EXPECT(to_rtr(&d, qp, &pa, 1) == 0 && qp->state == IBV_QPS_RTR, "-> RTR");
  EXPECT(post_send(qp, 1, buf, 8, mr->lkey, IBV_SEND_SIGNALED) == EINVAL, "post_send in RTR");
  EXPECT(to_rts(qp, 5, 14, 7, 7) == 0 && qp->state == IBV_QPS_RTS && qp_state(qp) == IBV_QPS_RTS,
         "-> RTS");
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_ERR;
  EXPECT(ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0 && qp_state(qp) == IBV_QPS_ERR, "-> ERR");
  struct ibv_wc wc = wait_wc(rcq, 5, "flushed receive");
  EXPECT(wc.wr_id == 11 && wc.status == IBV_WC_WR_FLUSH_ERR, "posted receive flushes: %s",
         ibv_wc_status_str(wc.status));
  EXPECT(post_send(qp, 21, buf, 8, mr->lkey, IBV_SEND_SIGNALED) == 0, "post_send in ERR");
  wc = wait_wc(scq, 5, "flushed send");
  EXPECT(wc.wr_id == 21 && wc.status == IBV_WC_WR_FLUSH_ERR, "a send posted in ERR flushes: %s",
         ibv_wc_status_str(wc.status));
  EXPECT(post_recv(qp, 22, buf, 64, mr->lkey) == 0, "post_recv in ERR");
  wc = wait_wc(rcq, 5, "flushed receive");
  EXPECT(wc.wr_id == 22 && wc.status == IBV_WC_WR_FLUSH_ERR, "a receive posted in ERR flushes");
  a.qp_state = IBV_QPS_RESET;
  EXPECT(ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0 && qp_state(qp) == IBV_QPS_RESET, "-> RESET");
  EXPECT(ibv_destroy_cq(scq) == EBUSY, "a CQ in use was destroyed");
  EXPECT(ibv_destroy_qp(qp) == 0 && ibv_destroy_qp(peer) == 0, "ibv_destroy_qp");
  EXPECT(ibv_destroy_cq(scq) == 0 && ibv_destroy_cq(rcq) == 0, "ibv_destroy_cq");
  fact("qp_state=ok");
}

/* Inline data: the caller's buffer is free at once; too long is EINVAL. */
static void check_inline(void) {
  struct dev d;
  open_dev(&d);
  struct pair p;
  loopback(&d, &p, 16, 1, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  struct ibv_qp_attr qa;
  struct ibv_qp_init_attr qi;
  EXPECT(ibv_query_qp(p.a, &qa, IBV_QP_CAP, &qi) == 0, "ibv_query_qp");
  uint32_t max_inline = qi.cap.max_inline_data;
  EXPECT(max_inline >= 16, "inline size %u", max_inline);
  char* dst = pages(4096);
  struct ibv_mr* mr = ibv_reg_mr(d.pd, dst, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  EXPECT(mr != NULL, "ibv_reg_mr");
  char src[4096];
  memset(src, 'a', sizeof(src));
  /* lkey 0: inline data is not read through a key. */
  EXPECT(post_write(p.a, 1, src, 16, 0, (uintptr_t)dst, mr->rkey, IBV_SEND_SIGNALED | IBV_SEND_INLINE) == 0,
         "inline write");
  memset(src, 'b', sizeof(src)); /* reused before the completion */
  struct ibv_wc wc = wait_wc(p.scq, 5, "inline write");
  EXPECT(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_WRITE, "inline write: %s",
         ibv_wc_status_str(wc.status));
  EXPECT(memcmp(dst, "aaaaaaaaaaaaaaaa", 16) == 0 && dst[16] == 0, "inline data placed as posted");
  EXPECT(post_write(p.a, 2, src, max_inline + 1, 0, (uintptr_t)dst, mr->rkey,
                    IBV_SEND_SIGNALED | IBV_SEND_INLINE) == EINVAL,
         "inline beyond max_inline_data");
  fact("max_inline_data=%u", max_inline);
}

/* Unsignaled WRs complete silently; the send queue is full at its size
 * until completions are polled. */
static void check_unsignaled(void) {
  struct dev d;
  open_dev(&d);
  struct pair p;
  loopback(&d, &p, 8, 0, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  char* buf = pages(1 << 16);
  struct ibv_mr* mr = ibv_reg_mr(d.pd, buf, 1 << 16, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  EXPECT(mr != NULL, "ibv_reg_mr");
  for (int i = 0; i < 3; ++i) {
    EXPECT(post_write(p.a, 10 + i, buf, 64, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, 0) == 0,
           "unsignaled write");
  }
  EXPECT(post_write(p.a, 13, buf, 64, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, IBV_SEND_SIGNALED) == 0,
         "signaled write");
  struct ibv_wc wc = wait_wc(p.scq, 5, "signaled write");
  EXPECT(wc.wr_id == 13 && wc.status == IBV_WC_SUCCESS, "only the signaled WR completes (got %llu)",
         (unsigned long long)wc.wr_id);
  EXPECT(poll_none(p.scq, 0.2), "an unsignaled WR completed");
  struct ibv_qp_attr qa;
  struct ibv_qp_init_attr qi;
  ibv_query_qp(p.a, &qa, IBV_QP_CAP, &qi);
  uint32_t depth = qi.cap.max_send_wr;
  int rc = 0;
  uint32_t posted = 0;
  for (; posted < depth + 1; ++posted) {
    rc = post_write(p.a, 100 + posted, buf, 64, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, IBV_SEND_SIGNALED);
    if (rc) break;
  }
  EXPECT(rc == ENOMEM && posted == depth, "a full send queue (%u WRs) refuses with ENOMEM (rc %d after %u)",
         depth, rc, posted);
  wc = wait_wc(p.scq, 5, "queued write");
  EXPECT(wc.status == IBV_WC_SUCCESS, "queued write: %s", ibv_wc_status_str(wc.status));
  EXPECT(post_write(p.a, 999, buf, 64, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, IBV_SEND_SIGNALED) == 0,
         "a polled completion frees a slot");
  fact("send_queue_depth=%u", depth);
}

/* Which bytes a WRITE carries when its source changes after the post and
 * before the completion: the NIC reads the payload some time after the
 * doorbell, so ibv_post_send(3) forbids touching it until the completion.
 * On hardware the answer is a race; softnic's TF_RDMA_SOFTNIC_SEND_DELAY_US
 * makes it deterministic ("late"), which is how it catches senders that
 * reuse buffers early. */
static void check_late_read(void) {
  struct dev d;
  open_dev(&d);
  struct pair p;
  loopback(&d, &p, 16, 1, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  char* buf = pages(1 << 16);
  struct ibv_mr* mr = ibv_reg_mr(d.pd, buf, 1 << 16, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  EXPECT(mr != NULL, "ibv_reg_mr");
  memset(buf, 'a', 4096);
  EXPECT(post_write(p.a, 1, buf, 4096, mr->lkey, (uintptr_t)buf + 8192, mr->rkey, IBV_SEND_SIGNALED) == 0,
         "post");
  memset(buf, 'b', 4096); /* what ibv_post_send(3) forbids */
  struct ibv_wc wc = wait_wc(p.scq, 5, "write");
  EXPECT(wc.status == IBV_WC_SUCCESS, "write: %s", ibv_wc_status_str(wc.status));
  fact("placed=%s", buf[8192] == 'b' ? "late" : "early");
}

/* Implicit on-demand paging (ibv_reg_mr(3)): where the device reports
 * IBV_ODP_SUPPORT_IMPLICIT with RC SEND and WRITE, one MR over the whole
 * address space (addr NULL, length SIZE_MAX, IBV_ACCESS_ON_DEMAND) lets a
 * WRITE read a buffer that was never registered, including one mapped after
 * the MR was made; the plugin's zero-copy sends rely on exactly this. Where
 * the device does not report it, registering one must fail. */
static void check_odp(void) {
  struct dev d;
  open_dev(&d);
  struct ibv_device_attr_ex attr;
  memset(&attr, 0, sizeof(attr));
  EXPECT(ibv_query_device_ex(d.ctx, NULL, &attr) == 0, "ibv_query_device_ex: %s", strerror(errno));
  uint32_t rc_needed = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_WRITE;
  int implicit = (attr.odp_caps.general_caps & IBV_ODP_SUPPORT_IMPLICIT) &&
                 (attr.odp_caps.per_transport_caps.rc_odp_caps & rc_needed) == rc_needed;
  struct ibv_mr* odp = ibv_reg_mr(d.pd, NULL, SIZE_MAX, IBV_ACCESS_ON_DEMAND | IBV_ACCESS_LOCAL_WRITE);
  if (!implicit) {
    EXPECT(odp == NULL, "an implicit ODP MR registered on a device that does not report it");
    fact("implicit_odp=no");
    return;
  }
  EXPECT(odp != NULL, "implicit ODP MR: %s", strerror(errno));
  struct pair p;
  loopback(&d, &p, 16, 1, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  char* dst = pages(1 << 20);
  struct ibv_mr* mr = ibv_reg_mr(d.pd, dst, 1 << 20, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  EXPECT(mr != NULL, "ibv_reg_mr");
  char* src = pages(1 << 20); /* mapped after the ODP MR was made */
  for (int i = 0; i < (1 << 20); ++i) src[i] = (char)(i * 7 + 3);
  EXPECT(post_write(p.a, 1, src, 1 << 20, odp->lkey, (uintptr_t)dst, mr->rkey, IBV_SEND_SIGNALED) == 0,
         "write from an unregistered buffer through the implicit MR");
  struct ibv_wc wc = wait_wc(p.scq, 5, "odp write");
  EXPECT(wc.status == IBV_WC_SUCCESS, "odp write: %s", ibv_wc_status_str(wc.status));
  EXPECT(memcmp(dst, src, 1 << 20) == 0, "odp write placed the buffer's bytes");
  /* The same address, remapped with other pages: the NIC reads the new
   * ones (a registration made before the remap would read the old). */
  munmap(src, 1 << 20);
  char* again = mmap(src, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  EXPECT(again == src, "remap");
  memset(again, 'z', 1 << 20);
  EXPECT(post_write(p.a, 2, again, 1 << 20, odp->lkey, (uintptr_t)dst, mr->rkey, IBV_SEND_SIGNALED) == 0,
         "write after the remap");
  wc = wait_wc(p.scq, 5, "odp write after remap");
  EXPECT(wc.status == IBV_WC_SUCCESS, "odp write after remap: %s", ibv_wc_status_str(wc.status));
  EXPECT(dst[0] == 'z' && dst[(1 << 20) - 1] == 'z', "the remapped pages' bytes were sent");
  fact("implicit_odp=yes");
}

/* Completion channel: the fd works with epoll, one event per arming. */
static void check_channel(void) {
  struct dev d;
  open_dev(&d);
  struct ibv_comp_channel* ch = ibv_create_comp_channel(d.ctx);
  EXPECT(ch != NULL, "ibv_create_comp_channel");
  int flags = fcntl(ch->fd, F_GETFL);
  EXPECT(fcntl(ch->fd, F_SETFL, flags | O_NONBLOCK) == 0, "O_NONBLOCK on the channel fd");
  int cookie = 42;
  struct ibv_cq* scq = ibv_create_cq(d.ctx, 64, NULL, NULL, 0);
  struct ibv_cq* rcq = ibv_create_cq(d.ctx, 64, &cookie, ch, 0);
  EXPECT(scq && rcq, "ibv_create_cq");
  EXPECT(ibv_destroy_comp_channel(ch) == EBUSY, "a channel in use was destroyed");
  struct ibv_qp* a = make_qp(&d, scq, rcq, 16, 16, 64, 1);
  struct ibv_qp* b = make_qp(&d, scq, rcq, 16, 16, 64, 1);
  EXPECT(to_init(&d, a, IBV_ACCESS_LOCAL_WRITE) == 0 && to_init(&d, b, IBV_ACCESS_LOCAL_WRITE) == 0, "INIT");
  struct addr aa = self_addr(&d, a, 1), bb = self_addr(&d, b, 2);
  connect_qp(&d, a, &bb, 1);
  connect_qp(&d, b, &aa, 2);
  char* buf = pages(4096);
  struct ibv_mr* mr = ibv_reg_mr(d.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
  EXPECT(post_recv(b, 7, buf, 256, mr->lkey) == 0 && post_recv(b, 8, buf + 256, 256, mr->lkey) == 0,
         "post_recv");
  int ep = epoll_create1(0);
  struct epoll_event ev = {.events = EPOLLIN};
  EXPECT(epoll_ctl(ep, EPOLL_CTL_ADD, ch->fd, &ev) == 0, "epoll_ctl on the channel fd");
  struct epoll_event out;
  struct ibv_cq* got;
  void* ctx;
  EXPECT(ibv_get_cq_event(ch, &got, &ctx) == -1 && errno == EAGAIN, "no event before arming");
  EXPECT(ibv_req_notify_cq(rcq, 0) == 0, "ibv_req_notify_cq");
  EXPECT(epoll_wait(ep, &out, 1, 100) == 0, "an event without a completion");
  strcpy(buf + 1024, "hello");
  EXPECT(post_send(a, 1, buf + 1024, 6, mr->lkey, IBV_SEND_SIGNALED | IBV_SEND_INLINE) == 0, "send");
  EXPECT(epoll_wait(ep, &out, 1, 5000) == 1, "epoll saw no completion event");
  EXPECT(ibv_get_cq_event(ch, &got, &ctx) == 0 && got == rcq && ctx == &cookie,
         "ibv_get_cq_event names the CQ and its context");
  struct ibv_wc wc = wait_wc(rcq, 5, "receive");
  EXPECT(wc.wr_id == 7 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.byte_len == 6 &&
             wc.qp_num == b->qp_num && strcmp(buf, "hello") == 0,
         "the receive completion");
  /* Not re-armed: a second completion raises no event. */
  EXPECT(post_send(a, 2, buf + 1024, 6, mr->lkey, IBV_SEND_SIGNALED | IBV_SEND_INLINE) == 0, "send");
  wait_wc(rcq, 5, "second receive");
  EXPECT(epoll_wait(ep, &out, 1, 100) == 0, "an event without arming");
  ibv_ack_cq_events(rcq, 1);
  wait_wc(scq, 5, "send 1");
  wait_wc(scq, 5, "send 2");
  EXPECT(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy QPs");
  EXPECT(ibv_destroy_cq(rcq) == 0 && ibv_destroy_cq(scq) == 0, "destroy CQs (every event acked)");
  EXPECT(ibv_destroy_comp_channel(ch) == 0, "ibv_destroy_comp_channel");
  fact("channel=ok");
}

/* ------------------------------------------------------------------------ */
/* Two-process checks. */

struct side {
  struct dev d;
  struct ibv_comp_channel* ch;
  struct ibv_cq *scq, *rcq;
  struct ibv_qp* qp;
  struct addr peer;
  unsigned psn;
};

/* Creates the QP, prints ADDR, reads the peer's and connects. */
static void side_up(struct side* s, unsigned psn, int access, int with_channel) {
  open_dev(&s->d);
  s->ch = with_channel ? ibv_create_comp_channel(s->d.ctx) : NULL;
  s->scq = ibv_create_cq(s->d.ctx, 1024, NULL, NULL, 0);
  s->rcq = ibv_create_cq(s->d.ctx, 1024, NULL, s->ch, 0);
  EXPECT(s->scq && s->rcq, "ibv_create_cq");
  s->qp = make_qp(&s->d, s->scq, s->rcq, 512, 512, 64, 0);
  s->psn = psn;
  EXPECT(to_init(&s->d, s->qp, access) == 0, "INIT");
  print_addr(&s->d, s->qp, psn);
  char line[256];
  read_line("ADDR", line, sizeof(line));
  parse_addr(line, &s->peer);
}

static void go(void) {
  char line[64];
  read_line("GO", line, sizeof(line));
}

/* RDMA WRITE + SEND, many rounds: every receive completion finds the data
 * of the WRITE posted before it placed (IBA 9.5 ordering on one RC QP).
 * The target answers each round with a SEND (a credit) once it has checked
 * the region, so the next WRITE never overwrites data under inspection. */
static void check_write_send(const char* role) {
  uint32_t bytes = (uint32_t)opt_int("bytes", 1 << 20);
  int rounds = (int)opt_int("rounds", 50);
  struct side s;
  int target = strcmp(role, "target") == 0;
  side_up(&s, target ? 1000 : 2000,
          target ? IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_LOCAL_WRITE, target);
  if (target) {
    uint8_t* region = pages(bytes);
    struct ibv_mr* mr = ibv_reg_mr(s.d.pd, region, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    EXPECT(mr != NULL, "ibv_reg_mr");
    uint8_t* notes = pages(4096);
    struct ibv_mr* nmr = ibv_reg_mr(s.d.pd, notes, 4096, IBV_ACCESS_LOCAL_WRITE);
    for (int i = 0; i < 32; ++i) EXPECT(post_recv(s.qp, i, notes + 64 * i, 64, nmr->lkey) == 0, "post_recv");
    connect_qp(&s.d, s.qp, &s.peer, s.psn);
    printf("MR addr=%llx rkey=%u len=%u\n", (unsigned long long)(uintptr_t)region, mr->rkey, bytes);
    fflush(stdout);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN};
    fcntl(s.ch->fd, F_SETFL, fcntl(s.ch->fd, F_GETFL) | O_NONBLOCK);
    epoll_ctl(ep, EPOLL_CTL_ADD, s.ch->fd, &ev);
    /* Arm, then poll: a completion that arrived before the arming raises
     * no event (ibv_req_notify_cq(3)), so the queue is drained first. */
    EXPECT(ibv_req_notify_cq(s.rcq, 0) == 0, "arm");
    int seen = 0, events = 0;
    while (seen < rounds) {
      struct ibv_wc wc;
      int got = 0;
      while (ibv_poll_cq(s.rcq, 1, &wc) == 1) {
        ++got;
        EXPECT(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.byte_len == 4,
               "receive %d: %s", seen, ibv_wc_status_str(wc.status));
        uint32_t round;
        memcpy(&round, notes + 64 * wc.wr_id, 4);
        EXPECT(round == (uint32_t)seen, "notice %u out of order (expected %d)", round, seen);
        uint8_t want = (uint8_t)(round * 7 + 1);
        for (uint32_t i = 0; i < bytes; i += 4093) {
          EXPECT(region[i] == want, "round %u: byte %u is %u, not %u: the WRITE was not placed before the "
                 "SEND's receive completion", round, i, region[i], want);
        }
        EXPECT(region[bytes - 1] == want, "round %u: last byte not placed", round);
        EXPECT(post_recv(s.qp, wc.wr_id, notes + 64 * wc.wr_id, 64, nmr->lkey) == 0, "repost");
        EXPECT(post_send(s.qp, round, &round, 4, 0, IBV_SEND_SIGNALED | IBV_SEND_INLINE) == 0, "credit");
        struct ibv_wc sent = wait_wc(s.scq, 10, "credit");
        EXPECT(sent.status == IBV_WC_SUCCESS, "credit: %s", ibv_wc_status_str(sent.status));
        ++seen;
      }
      if (got > 0 || seen == rounds) continue;
      struct epoll_event out;
      EXPECT(epoll_wait(ep, &out, 1, 10000) == 1, "no completion event after %d rounds", seen);
      struct ibv_cq* cq;
      void* ctx;
      while (ibv_get_cq_event(s.ch, &cq, &ctx) == 0) {
        ibv_ack_cq_events(cq, 1);
        ++events;
      }
      EXPECT(ibv_req_notify_cq(s.rcq, 0) == 0, "re-arm");
    }
    fact("rounds=%d", seen);
    fact("events=%d", events);
    go(); /* the initiator is done: leave */
    return;
  }
  connect_qp(&s.d, s.qp, &s.peer, s.psn);
  char line[256];
  read_line("MR", line, sizeof(line));
  unsigned long long raddr;
  unsigned rkey, rlen;
  EXPECT(sscanf(line, "MR addr=%llx rkey=%u len=%u", &raddr, &rkey, &rlen) == 3, "bad MR line");
  uint8_t* src = pages(bytes);
  struct ibv_mr* mr = ibv_reg_mr(s.d.pd, src, bytes, IBV_ACCESS_LOCAL_WRITE);
  EXPECT(mr != NULL, "ibv_reg_mr");
  uint8_t* credits = pages(4096);
  struct ibv_mr* cmr = ibv_reg_mr(s.d.pd, credits, 4096, IBV_ACCESS_LOCAL_WRITE);
  EXPECT(cmr != NULL && post_recv(s.qp, 0, credits, 64, cmr->lkey) == 0, "post_recv");
  double start = now_s();
  for (int r = 0; r < rounds; ++r) {
    if (r > 0) {
      struct ibv_wc credit = wait_wc(s.rcq, 10, "credit");
      uint32_t round;
      memcpy(&round, credits, 4);
      EXPECT(credit.status == IBV_WC_SUCCESS && round == (uint32_t)(r - 1), "credit %d: %s", r - 1,
             ibv_wc_status_str(credit.status));
      EXPECT(post_recv(s.qp, 0, credits, 64, cmr->lkey) == 0, "post_recv");
    }
    memset(src, (uint8_t)(r * 7 + 1), bytes);
    /* The WRITE unsignaled, the SEND signaled: its completion covers both. */
    EXPECT(post_write(s.qp, 2 * r, src, bytes, mr->lkey, raddr, rkey, 0) == 0, "post WRITE");
    uint32_t round = (uint32_t)r;
    EXPECT(post_send(s.qp, 2 * r + 1, &round, 4, 0, IBV_SEND_SIGNALED | IBV_SEND_INLINE) == 0, "post SEND");
    struct ibv_wc wc = wait_wc(s.scq, 10, "SEND");
    EXPECT(wc.status == IBV_WC_SUCCESS && wc.wr_id == (uint64_t)(2 * r + 1) && wc.opcode == IBV_WC_SEND,
           "round %d: %s (wr %llu)", r, ibv_wc_status_str(wc.status), (unsigned long long)wc.wr_id);
  }
  fact("seconds=%.3f", now_s() - start);
  EXPECT(poll_none(s.scq, 0.05), "an unsignaled WRITE completed");
}

/* An RDMA WRITE the responder must refuse: REM_ACCESS_ERR, both QPs to
 * Error, later WRs flushed. variant: rkey | range | access. */
static void check_remote_access(const char* role) {
  const char* variant = opt("variant", "rkey");
  struct side s;
  int target = strcmp(role, "target") == 0;
  side_up(&s, target ? 10 : 20, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, 0);
  if (target) {
    uint8_t* region = pages(1 << 16);
    int access = strcmp(variant, "access") == 0 ? IBV_ACCESS_LOCAL_WRITE
                                                : IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    struct ibv_mr* mr = ibv_reg_mr(s.d.pd, region, 1 << 16, access);
    EXPECT(mr != NULL, "ibv_reg_mr");
    uint8_t* notes = pages(4096);
    struct ibv_mr* nmr = ibv_reg_mr(s.d.pd, notes, 4096, IBV_ACCESS_LOCAL_WRITE);
    EXPECT(post_recv(s.qp, 77, notes, 64, nmr->lkey) == 0, "post_recv");
    connect_qp(&s.d, s.qp, &s.peer, s.psn);
    printf("MR addr=%llx rkey=%u len=%u\n", (unsigned long long)(uintptr_t)region, mr->rkey, 1 << 16);
    fflush(stdout);
    go(); /* the initiator saw its error */
    /* The responder's QP moved to Error too: its receive is flushed. */
    struct ibv_wc wc = wait_wc(s.rcq, 5, "flushed receive at the responder");
    EXPECT(wc.wr_id == 77 && wc.status == IBV_WC_WR_FLUSH_ERR, "responder receive: %s",
           ibv_wc_status_str(wc.status));
    fact("responder_state=%d", qp_state(s.qp));
    EXPECT(qp_state(s.qp) == IBV_QPS_ERR, "the responder's QP is not in ERR");
    EXPECT(region[0] == 0, "a refused write was placed");
    return;
  }
  connect_qp(&s.d, s.qp, &s.peer, s.psn);
  char line[256];
  read_line("MR", line, sizeof(line));
  unsigned long long raddr;
  unsigned rkey, rlen;
  EXPECT(sscanf(line, "MR addr=%llx rkey=%u len=%u", &raddr, &rkey, &rlen) == 3, "bad MR line");
  uint8_t* src = pages(1 << 16);
  memset(src, 0xab, 1 << 16);
  struct ibv_mr* mr = ibv_reg_mr(s.d.pd, src, 1 << 16, IBV_ACCESS_LOCAL_WRITE);
  uint64_t addr = raddr;
  uint32_t len = 4096;
  if (strcmp(variant, "rkey") == 0) rkey ^= 0x5a5a00;
  if (strcmp(variant, "range") == 0) addr = raddr + rlen - 100; /* runs 3996 bytes past the end */
  /* variant none: a valid write (refused only through a fault knob). */
  EXPECT(post_write(s.qp, 1, src, len, mr->lkey, addr, rkey, IBV_SEND_SIGNALED) == 0, "post");
  EXPECT(post_write(s.qp, 2, src, len, mr->lkey, raddr, rkey, IBV_SEND_SIGNALED) == 0, "post");
  struct ibv_wc wc = wait_wc(s.scq, 10, "refused write");
  EXPECT(wc.wr_id == 1 && wc.status == IBV_WC_REM_ACCESS_ERR, "%s: got %s", variant,
         ibv_wc_status_str(wc.status));
  wc = wait_wc(s.scq, 10, "flushed write");
  EXPECT(wc.wr_id == 2 && wc.status == IBV_WC_WR_FLUSH_ERR, "the next WR: %s", ibv_wc_status_str(wc.status));
  EXPECT(qp_state(s.qp) == IBV_QPS_ERR, "the requester's QP is not in ERR");
  fact("status=%s", ibv_wc_status_str(IBV_WC_REM_ACCESS_ERR));
}

/* A SEND to an empty receive queue: RNR NAKs, retried rnr_retry times
 * after the responder's min_rnr_timer. variant: exceeded (the target posts
 * nothing) | late (it posts after delay_ms). */
static void check_rnr(const char* role) {
  const char* variant = opt("variant", "exceeded");
  struct side s;
  int target = strcmp(role, "target") == 0;
  side_up(&s, target ? 30 : 40, IBV_ACCESS_LOCAL_WRITE, 0);
  connect_qp(&s.d, s.qp, &s.peer, s.psn);
  uint8_t* buf = pages(4096);
  struct ibv_mr* mr = ibv_reg_mr(s.d.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
  if (target) {
    printf("READY\n");
    fflush(stdout);
    if (strcmp(variant, "late") == 0) {
      usleep((useconds_t)opt_int("delay_ms", 200) * 1000);
      EXPECT(post_recv(s.qp, 5, buf, 64, mr->lkey) == 0, "post_recv");
      struct ibv_wc wc = wait_wc(s.rcq, 10, "late receive");
      EXPECT(wc.status == IBV_WC_SUCCESS && wc.byte_len == 8, "late receive: %s", ibv_wc_status_str(wc.status));
      EXPECT(qp_state(s.qp) == IBV_QPS_RTS, "responder state");
    }
    go();
    return;
  }
  char line[64];
  read_line("READY", line, sizeof(line));
  memcpy(buf, "rnr-test", 8);
  double start = now_s();
  EXPECT(post_send(s.qp, 9, buf, 8, mr->lkey, IBV_SEND_SIGNALED) == 0, "post");
  struct ibv_wc wc = wait_wc(s.scq, 30, "SEND");
  double took = now_s() - start;
  fact("status=%s", ibv_wc_status_str(wc.status));
  fact("seconds=%.4f", took);
  if (strcmp(variant, "late") == 0) {
    EXPECT(wc.status == IBV_WC_SUCCESS, "late receive: %s", ibv_wc_status_str(wc.status));
  } else {
    EXPECT(wc.status == IBV_WC_RNR_RETRY_EXC_ERR, "empty receive queue: %s", ibv_wc_status_str(wc.status));
    EXPECT(qp_state(s.qp) == IBV_QPS_ERR, "the requester's QP is not in ERR");
  }
}

/* The peer process dies: outstanding WRs complete RETRY_EXC_ERR after the
 * QP's timeout and retry count, the rest flush. */
static void check_dead_peer(const char* role) {
  struct side s;
  int target = strcmp(role, "target") == 0;
  side_up(&s, target ? 50 : 60, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, 0);
  connect_qp(&s.d, s.qp, &s.peer, s.psn);
  uint8_t* buf = pages(1 << 16);
  struct ibv_mr* mr = ibv_reg_mr(s.d.pd, buf, 1 << 16, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (target) {
    printf("MR addr=%llx rkey=%u len=%u\n", (unsigned long long)(uintptr_t)buf, mr->rkey, 1 << 16);
    fflush(stdout);
    go(); /* killed by the test, or told to leave */
    return;
  }
  char line[256];
  read_line("MR", line, sizeof(line));
  unsigned long long raddr;
  unsigned rkey, rlen;
  EXPECT(sscanf(line, "MR addr=%llx rkey=%u len=%u", &raddr, &rkey, &rlen) == 3, "bad MR line");
  /* One write while the peer lives: the connection works. */
  EXPECT(post_write(s.qp, 1, buf, 4096, mr->lkey, raddr, rkey, IBV_SEND_SIGNALED) == 0, "post");
  struct ibv_wc wc = wait_wc(s.scq, 10, "first write");
  EXPECT(wc.status == IBV_WC_SUCCESS, "first write: %s", ibv_wc_status_str(wc.status));
  printf("KILL\n");
  fflush(stdout);
  go(); /* the target is dead */
  double start = now_s();
  EXPECT(post_write(s.qp, 2, buf, 4096, mr->lkey, raddr, rkey, IBV_SEND_SIGNALED) == 0, "post");
  EXPECT(post_write(s.qp, 3, buf, 4096, mr->lkey, raddr, rkey, IBV_SEND_SIGNALED) == 0, "post");
  wc = wait_wc(s.scq, 60, "write to a dead peer");
  double took = now_s() - start;
  fact("status=%s", ibv_wc_status_str(wc.status));
  fact("seconds=%.4f", took);
  EXPECT(wc.wr_id == 2 && wc.status == IBV_WC_RETRY_EXC_ERR, "dead peer: %s", ibv_wc_status_str(wc.status));
  wc = wait_wc(s.scq, 10, "flushed write");
  EXPECT(wc.wr_id == 3 && wc.status == IBV_WC_WR_FLUSH_ERR, "the next WR: %s", ibv_wc_status_str(wc.status));
  EXPECT(qp_state(s.qp) == IBV_QPS_ERR, "the requester's QP is not in ERR");
}

int main(int argc, char** argv) {
  g_argc = argc;
  g_argv = argv;
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2) {
    fprintf(stderr,
            "usage: verbs_check device|mr|qp_state|inline|unsignaled|channel|late_read|odp\n"
            "       verbs_check write_send|remote_access|rnr|dead_peer target|initiator [key=value ...]\n");
    return 2;
  }
  const char* check = argv[1];
  const char* role = argc > 2 ? argv[2] : "";
  if (!strcmp(check, "device")) check_device();
  else if (!strcmp(check, "mr")) check_mr();
  else if (!strcmp(check, "qp_state")) check_qp_state();
  else if (!strcmp(check, "inline")) check_inline();
  else if (!strcmp(check, "unsignaled")) check_unsignaled();
  else if (!strcmp(check, "channel")) check_channel();
  else if (!strcmp(check, "late_read")) check_late_read();
  else if (!strcmp(check, "odp")) check_odp();
  else if (!strcmp(check, "write_send")) check_write_send(role);
  else if (!strcmp(check, "remote_access")) check_remote_access(role);
  else if (!strcmp(check, "rnr")) check_rnr(role);
  else if (!strcmp(check, "dead_peer")) check_dead_peer(role);
  else fail("unknown check %s", check);
  printf("OK\n");
  return 0;
}
