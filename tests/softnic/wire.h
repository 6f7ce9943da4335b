// softnic's wire format between a requester QP and the responder's process
// (fabric.cc describes the protocol). Host byte order: both ends are on
// this host.
#ifndef TF_RDMA_TESTS_SOFTNIC_WIRE_H_
#define TF_RDMA_TESTS_SOFTNIC_WIRE_H_

#include <stdint.h>

namespace softnic {

constexpr uint32_t kHelloMagic = 0x534e4943;  // "SNIC"

// First on a new connection: who talks to whom, and the requester's route
// and retry settings (the responder checks the route and times retries).
struct WireHello {
  uint32_t magic;
  uint32_t src_qpn;
  uint32_t dst_qpn;
  uint32_t mtu_bytes;  // the requester's path MTU
  uint16_t dlid;
  uint8_t is_global;
  uint8_t rnr_retry;
  uint8_t retry_cnt;
  uint8_t timeout;
  uint16_t slid;
  uint8_t dgid[16];
};

enum WireOp : uint8_t { kOpWrite = 1, kOpWriteImm, kOpSend, kOpSendImm };

// One per work request, followed by `length` payload bytes.
struct WireRequest {
  uint32_t psn;
  uint8_t op;
  uint8_t solicited;
  uint16_t reserved;
  uint32_t length;
  uint32_t rkey;
  uint64_t remote_addr;
  uint32_t imm;  // network byte order, as posted
  uint32_t reserved2;
};

// One per request, in order.
enum Syndrome : uint8_t {
  kAck = 0,
  kNakRnr,        // RNR retries ran out: IBV_WC_RNR_RETRY_EXC_ERR
  kNakAccess,     // remote access error: IBV_WC_REM_ACCESS_ERR
  kNakInvalid,    // remote invalid request: IBV_WC_REM_INV_REQ_ERR
  kNakOperation,  // remote operation error: IBV_WC_REM_OP_ERR
  kNakRetry,      // transport retries ran out: IBV_WC_RETRY_EXC_ERR
};

struct WireResponse {
  uint32_t psn;
  uint8_t syndrome;
  uint8_t reserved[3];
};

}  // namespace softnic

#endif  // TF_RDMA_TESTS_SOFTNIC_WIRE_H_
