#include "kernels/common/wire.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>

namespace tf_rdma {

Status SendAll(int fd, const void* data, size_t nbytes,
               const Deadline& deadline) {
  struct iovec iov;
  iov.iov_base = const_cast<void*>(data);
  iov.iov_len = nbytes;
  return SendAllv(fd, &iov, 1, deadline);
}

namespace {

// Waits until `fd` is ready for `events` or the deadline passes; false on
// timeout. EINTR restarts with the time that is left.
bool PollUntil(int fd, short events, const Deadline& deadline) {
  while (true) {
    struct pollfd p;
    p.fd = fd;
    p.events = events;
    p.revents = 0;
    int64_t left = deadline.RemainingMs();
    int rc = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
    if (rc > 0) return true;  // ready, or an error the next call reports
    if (rc == 0) return false;
    if (errno != EINTR) return true;
  }
}

}  // namespace

Status SendAllv(int fd, struct iovec* iov, int iovcnt,
                const Deadline& deadline, size_t* sent_out) {
  size_t total = 0, sent = 0;
  struct Report {
    size_t* out;
    const size_t& sent;
    ~Report() {
      if (out != nullptr) *out = sent;
    }
  } report{sent_out, sent};
  for (int i = 0; i < iovcnt; ++i) total += iov[i].iov_len;
  while (iovcnt > 0) {
    struct msghdr msg;
    std::memset(&msg, 0, sizeof(msg));
    msg.msg_iov = iov;
    msg.msg_iovlen = iovcnt;
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!PollUntil(fd, POLLOUT, deadline)) {
          return DeadlineExceeded(
              "the peer stopped reading: " + std::to_string(sent) + " of " +
              std::to_string(total) + " bytes sent after " +
              std::to_string(deadline.timeout_ms()) + " ms");
        }
        continue;
      }
      if (errno == EPIPE || errno == ECONNRESET) {
        return Unavailable("connection closed by peer");
      }
      return ErrnoStatus("send", errno);
    }
    size_t left = static_cast<size_t>(n);
    sent += left;
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return Status::Ok();
}

Status RecvAll(int fd, void* data, size_t nbytes) {
  char* p = static_cast<char*>(data);
  while (nbytes > 0) {
    ssize_t n = recv(fd, p, nbytes, 0);
    if (n == 0) return Unavailable("connection closed by peer");
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return DeadlineExceeded("peer stopped sending mid-message");
      }
      if (errno == ECONNRESET) return Unavailable("connection reset by peer");
      return ErrnoStatus("recv", errno);
    }
    p += n;
    nbytes -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status RecvLine(int fd, std::string* line, size_t max_bytes,
                const Deadline& deadline) {
  // Peeks at what has arrived and consumes up to the newline only: the
  // handshake is lock-step, so bytes after the line belong to the next
  // message (a verbs address, the first frame) and must stay in the socket.
  line->clear();
  char buf[1024];
  while (true) {
    if (!PollUntil(fd, POLLIN, deadline)) {
      return DeadlineExceeded("no complete line within " +
                              std::to_string(deadline.timeout_ms()) + " ms");
    }
    size_t want = std::min(sizeof(buf), max_bytes + 1 - line->size());
    ssize_t n = recv(fd, buf, want, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return Unavailable("connection closed by peer");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      if (errno == ECONNRESET) return Unavailable("connection reset by peer");
      return ErrnoStatus("recv", errno);
    }
    const char* end = static_cast<const char*>(
        std::memchr(buf, '\n', static_cast<size_t>(n)));
    size_t take = end ? static_cast<size_t>(end - buf) + 1
                      : static_cast<size_t>(n);
    TF_RDMA_RETURN_IF_ERROR(RecvAll(fd, buf, take));
    line->append(buf, end ? take - 1 : take);
    if (line->size() > max_bytes) {
      return InvalidArgument("handshake line longer than " +
                             std::to_string(max_bytes) + " bytes");
    }
    if (end) return Status::Ok();
  }
}

Status SplitHostPort(const std::string& address, std::string* host,
                     int* port) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return InvalidArgument("address '" + address +
                           "' is not of the form host:port");
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  try {
    size_t used = 0;
    *port = std::stoi(address.substr(colon + 1), &used);
    if (used != address.size() - colon - 1 || *port < 0 || *port > 65535) {
      throw std::out_of_range("port");
    }
  } catch (const std::exception&) {
    return InvalidArgument("address '" + address +
                           "' has no valid port (0..65535)");
  }
  return Status::Ok();
}

namespace {

Status Resolve(const std::string& host, int port, bool passive,
               struct addrinfo** result) {
  struct addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  std::string port_str = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_str.c_str(),
                       &hints, result);
  if (rc != 0) {
    return Unavailable("cannot resolve '" + host + "': " + gai_strerror(rc));
  }
  return Status::Ok();
}

}  // namespace

namespace {

// A listening socket bound to `addr`; an IPv6 one with `dual_stack` takes
// IPv4 peers too (as ::ffff:a.b.c.d, which PeerAddress writes as a.b.c.d).
// `*err` gets the errno of a failure.
Status BindAndListen(const sockaddr* addr, socklen_t len, bool dual_stack,
                     const std::string& where, int* fd, int* bound_port,
                     int* err) {
  int s = socket(addr->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) {
    *err = errno;
    return ErrnoStatus("socket", *err);
  }
  int one = 1, zero = 0;
  setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (dual_stack) setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  if (bind(s, addr, len) != 0 || listen(s, 128) != 0) {
    *err = errno;
    close(s);
    return ErrnoStatus("listening on " + where, *err);
  }
  struct sockaddr_storage bound;
  socklen_t bound_len = sizeof(bound);
  getsockname(s, reinterpret_cast<struct sockaddr*>(&bound), &bound_len);
  *bound_port =
      bound.ss_family == AF_INET6
          ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
          : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  *fd = s;
  return Status::Ok();
}

// Every interface, IPv4 and IPv6 alike: one dual-stack IPv6 socket, or,
// where the host has no IPv6, an IPv4 one.
Status ListenEverywhere(int port, int* fd, int* bound_port) {
  const std::string where = "*:" + std::to_string(port);
  struct sockaddr_in6 any6;
  std::memset(&any6, 0, sizeof(any6));
  any6.sin6_family = AF_INET6;
  any6.sin6_addr = in6addr_any;
  any6.sin6_port = htons(static_cast<uint16_t>(port));
  int err = 0;
  Status s = BindAndListen(reinterpret_cast<sockaddr*>(&any6), sizeof(any6),
                           /*dual_stack=*/true, where, fd, bound_port, &err);
  if (s.ok() || (err != EAFNOSUPPORT && err != EADDRNOTAVAIL)) return s;
  struct sockaddr_in any4;
  std::memset(&any4, 0, sizeof(any4));
  any4.sin_family = AF_INET;
  any4.sin_addr.s_addr = htonl(INADDR_ANY);
  any4.sin_port = htons(static_cast<uint16_t>(port));
  return BindAndListen(reinterpret_cast<sockaddr*>(&any4), sizeof(any4),
                       /*dual_stack=*/false, where, fd, bound_port, &err);
}

}  // namespace

Status Listen(const std::string& host, int port, int* fd, int* bound_port) {
  if (host == "*") return ListenEverywhere(port, fd, bound_port);
  struct addrinfo* ai = nullptr;
  TF_RDMA_RETURN_IF_ERROR(Resolve(host, port, /*passive=*/true, &ai));
  Status last = Internal("no address to listen on for '" + host + "'");
  int err = 0;
  for (struct addrinfo* p = ai; p != nullptr; p = p->ai_next) {
    last = BindAndListen(p->ai_addr, p->ai_addrlen, /*dual_stack=*/false,
                         host + ":" + std::to_string(port), fd, bound_port,
                         &err);
    if (last.ok()) break;
  }
  freeaddrinfo(ai);
  return last;
}

Status Dial(const std::string& host, int port, const Deadline& deadline,
            int* fd) {
  std::string where = host + ":" + std::to_string(port);
  int backoff_ms = 5;
  while (true) {
    struct addrinfo* ai = nullptr;
    Status s = Resolve(host, port, /*passive=*/false, &ai);
    if (s.ok()) {
      for (struct addrinfo* p = ai; p != nullptr; p = p->ai_next) {
        int sock = socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC,
                          p->ai_protocol);
        if (sock < 0) {
          s = ErrnoStatus("socket", errno);
          continue;
        }
        if (connect(sock, p->ai_addr, p->ai_addrlen) == 0) {
          *fd = sock;
          freeaddrinfo(ai);
          return Status::Ok();
        }
        s = Unavailable("cannot connect to " + where + ": " +
                        std::strerror(errno));
        close(sock);
      }
      freeaddrinfo(ai);
    }
    if (deadline.Expired()) {
      return DeadlineExceeded(s.message() + " (gave up after " +
                              std::to_string(deadline.timeout_ms()) + " ms)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(
        std::min<int64_t>(backoff_ms, deadline.RemainingMs() + 1)));
    backoff_ms = std::min(backoff_ms * 2, 200);
  }
}

void TuneSocket(int fd, int recv_timeout_ms) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  if (recv_timeout_ms > 0) {
    struct timeval tv;
    tv.tv_sec = recv_timeout_ms / 1000;
    tv.tv_usec = (recv_timeout_ms % 1000) * 1000;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
}

std::string PeerAddress(int fd) {
  struct sockaddr_storage addr;
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<struct sockaddr*>(&addr), &len) != 0) {
    return "?";
  }
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    port = ntohs(a->sin6_port);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {  // an IPv4 peer (ListenEverywhere)
      inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], host, sizeof(host));
      return std::string(host) + ":" + std::to_string(port);
    }
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(port);
  }
  auto* a = reinterpret_cast<sockaddr_in*>(&addr);
  inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
  port = ntohs(a->sin_port);
  return std::string(host) + ":" + std::to_string(port);
}

// A decimal number that fits 64 bits, written as std::to_string writes
// it; anything else (signs, spaces, leading zeros, a value past 2^64 - 1)
// is rejected rather than wrapped.
bool ParseUint(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 20 || (s.size() > 1 && s[0] == '0')) {
    return false;
  }
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    if (__builtin_mul_overflow(v, 10, &v) ||
        __builtin_add_overflow(v, static_cast<uint64_t>(c - '0'), &v)) {
      return false;
    }
  }
  *out = v;
  return true;
}

Status ParseOpenRequest(const std::string& body, OpenRequest* out) {
  out->fields = DecodeFields(body);
  std::map<std::string, std::string>& f = out->fields;
  uint64_t credit_id = 0;
  if (!ParseUint(f["size"], &out->size)) {
    return InvalidArgument("size '" + f["size"].substr(0, 40) +
                           "' is not a number below 2^64");
  }
  if (!ParseUint(f["credit_size"], &out->credit_size)) {
    return InvalidArgument("credit_size '" + f["credit_size"].substr(0, 40) +
                           "' is not a number below 2^64");
  }
  if (!ParseUint(f["credit_id"], &credit_id) || credit_id > UINT32_MAX) {
    return InvalidArgument("credit_id '" + f["credit_id"].substr(0, 40) +
                           "' is not a region id (below 2^32)");
  }
  out->credit_id = static_cast<uint32_t>(credit_id);
  out->name = f["name"];
  if (out->name.empty() || out->name.size() > kMaxRegionNameBytes) {
    return InvalidArgument("the region name has " +
                           std::to_string(out->name.size()) +
                           " bytes (1 to " +
                           std::to_string(kMaxRegionNameBytes) + " allowed)");
  }
  out->plan_hash = f["plan_hash"];
  out->refusal = f["refusal"];
  return Status::Ok();
}

Status CheckWriteBounds(uint64_t offset, uint64_t nbytes,
                        uint64_t notice_offset, uint64_t region_size,
                        const std::string& region_name) {
  if (offset > region_size || nbytes > region_size - offset ||
      region_size < 8 || notice_offset > region_size - 8 ||
      notice_offset % 8 != 0) {
    return InvalidArgument(
        "write of " + std::to_string(nbytes) + " bytes at offset " +
        std::to_string(offset) + " (notice at " +
        std::to_string(notice_offset) + ") is outside region " + region_name +
        " of " + std::to_string(region_size) + " bytes; rejected");
  }
  return Status::Ok();
}

std::string EncodeFields(const std::map<std::string, std::string>& fields) {
  std::string out;
  for (const auto& kv : fields) out += kv.first + "=" + kv.second + "\n";
  return out;
}

std::map<std::string, std::string> DecodeFields(const std::string& body) {
  std::map<std::string, std::string> fields;
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line)) {
    size_t eq = line.find('=');
    if (eq != std::string::npos) fields[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return fields;
}

}  // namespace tf_rdma
