// The control connection's wire format and socket helpers.
//
// Each directed pair of tasks (writer -> reader) has one TCP connection,
// dialled by the writer to the reader's endpoint. It starts with a text
// handshake (engine/handshake.cc: challenge, HELLO with an HMAC proof of the
// job secret, WELCOME with the reader's proof and the chosen transport), then
// carries binary frames in both directions:
//
//   FrameHeader (48 bytes, little-endian) [+ body]
//   OPEN_REQUEST  writer -> reader: a=request id, b=body bytes; body is
//                 "key=value\n" lines: the region's plan name, size and plan
//                 hash, and the descriptor of the writer's credit region.
//   OPEN_REPLY    reader -> writer: a=request id, b=body bytes, c=status
//                 code; body is the reader's region descriptor, or an error.
//   WRITE         either way (tcp transport only): a=region id, b=offset,
//                 c=payload bytes, d=notice offset, e=seq; payload follows.
//   ERROR         reader -> writer: b=body bytes; the body says why the
//                 reader refuses this writer's data (a plan mismatch found
//                 after the region was opened). The connection then closes.
//   QUERY         either way: a=request id, b=body bytes; body is
//                 "key=value\n" lines, `what` naming the question (see
//                 engine/query.cc: the clock for a timeline's offsets, a
//                 peer's position for the stall inspector).
//   QUERY_REPLY   the answer: a=request id, b=body bytes, c=status code;
//                 body is the answer's fields, or an error.
//
// The format is plain on purpose: a test (or a curious engineer) can speak
// it from Python with the socket and hmac modules.
#ifndef TF_RDMA_COMMON_WIRE_H_
#define TF_RDMA_COMMON_WIRE_H_

#include <sys/uio.h>

#include <cstdint>
#include <map>
#include <string>

#include "kernels/common/status.h"
#include "kernels/common/wait.h"

namespace tf_rdma {

constexpr uint32_t kFrameMagic = 0x44524654;  // "TFRD"

enum FrameType : uint16_t {
  kOpenRequest = 1,
  kOpenReply = 2,
  kWrite = 3,
  kError = 4,
  kQuery = 5,
  kQueryReply = 6,
  // No body: the sender's endpoint stops on purpose (Engine::Stop, which a
  // normal exit runs too). Its peer closes the connection without logging
  // it as lost; waits on the sender then fail saying that it stopped.
  kGoodbye = 7,
};

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t type = 0;
  uint16_t flags = 0;
  uint64_t a = 0, b = 0, c = 0, d = 0, e = 0;
};
static_assert(sizeof(FrameHeader) == 48, "FrameHeader is 48 bytes on the wire");

// Largest body of an OPEN or QUERY frame; anything bigger is a protocol error.
constexpr uint64_t kMaxBodyBytes = 64 * 1024;

// Sends everything unless the deadline passes first (DeadlineExceeded: the
// peer stopped reading, e.g. SIGSTOPped or partitioned). The socket may be
// blocking; each send is non-blocking and waits in poll(). A send cut off
// by the deadline leaves a partial message in the stream: the caller must
// close the connection.
Status SendAll(int fd, const void* data, size_t nbytes,
               const Deadline& deadline);
// `sent` (may be null): bytes that went out, also on failure.
Status SendAllv(int fd, struct iovec* iov, int iovcnt,
                const Deadline& deadline, size_t* sent = nullptr);
// Unavailable("connection closed by peer") on EOF.
Status RecvAll(int fd, void* data, size_t nbytes);
// Reads one '\n'-terminated line (without the '\n'), at most max_bytes,
// by the deadline (one bound for the whole line, however the peer
// trickles it).
Status RecvLine(int fd, std::string* line, size_t max_bytes,
                const Deadline& deadline);

// Listens on host:port (port 0: any); returns the fd and the bound port.
// Host "*": every interface, IPv6 and IPv4 on one socket where the host has
// IPv6.
Status Listen(const std::string& host, int port, int* fd, int* bound_port);
// Connects to host:port, retrying refused connections until the deadline
// (the peer's endpoint may not be up yet).
Status Dial(const std::string& host, int port, const Deadline& deadline,
            int* fd);
// TCP_NODELAY, large buffers, and a receive timeout so that a peer that
// stalls mid-frame cannot block the progress thread forever.
void TuneSocket(int fd, int recv_timeout_ms);
std::string PeerAddress(int fd);

// A decimal number that fits 64 bits, in canonical form (as std::to_string
// writes it); anything else (signs, spaces, leading zeros, a value past
// 2^64 - 1) is refused rather than wrapped.
bool ParseUint(const std::string& s, uint64_t* out);

// The longest region name an OPEN may carry.
constexpr size_t kMaxRegionNameBytes = 1024;

// An OPEN_REQUEST's body, parsed and range-checked (every number fits its
// type; the name is 1..kMaxRegionNameBytes bytes). `fields` keeps all of
// the body's fields (the credit region's descriptor).
struct OpenRequest {
  std::string name, plan_hash;
  std::string refusal;  // the writer refuses to go on (a restarted reader)
  uint64_t size = 0, credit_size = 0;
  uint32_t credit_id = 0;
  std::map<std::string, std::string> fields;
};
Status ParseOpenRequest(const std::string& body, OpenRequest* out);

// Checks that a write of `nbytes` at `offset` with its 8-byte notice word at
// `notice_offset` (8-aligned) lies inside a region of `region_size` bytes,
// without any sum that could wrap.
Status CheckWriteBounds(uint64_t offset, uint64_t nbytes,
                        uint64_t notice_offset, uint64_t region_size,
                        const std::string& region_name);

// "key=value\n" bodies.
std::string EncodeFields(const std::map<std::string, std::string>& fields);
std::map<std::string, std::string> DecodeFields(const std::string& body);

// Splits "host:port" / "[v6]:port".
Status SplitHostPort(const std::string& address, std::string* host,
                     int* port);

}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_WIRE_H_
