#include "kernels/engine/wire.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>

namespace tf_rdma {

Status SendAll(int fd, const void* data, size_t nbytes) {
  struct iovec iov;
  iov.iov_base = const_cast<void*>(data);
  iov.iov_len = nbytes;
  return SendAllv(fd, &iov, 1);
}

Status SendAllv(int fd, struct iovec* iov, int iovcnt) {
  while (iovcnt > 0) {
    struct msghdr msg;
    std::memset(&msg, 0, sizeof(msg));
    msg.msg_iov = iov;
    msg.msg_iovlen = iovcnt;
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EPIPE || errno == ECONNRESET) {
        return Unavailable("connection closed by peer");
      }
      return ErrnoStatus("send", errno);
    }
    size_t left = static_cast<size_t>(n);
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

Status RecvLine(int fd, std::string* line, size_t max_bytes) {
  line->clear();
  while (line->size() < max_bytes) {
    char c;
    TF_RDMA_RETURN_IF_ERROR(RecvAll(fd, &c, 1));
    if (c == '\n') return Status::Ok();
    line->push_back(c);
  }
  return InvalidArgument("handshake line longer than " +
                         std::to_string(max_bytes) + " bytes");
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

Status Listen(const std::string& host, int port, int* fd, int* bound_port) {
  struct addrinfo* ai = nullptr;
  TF_RDMA_RETURN_IF_ERROR(Resolve(host, port, /*passive=*/true, &ai));
  Status last = Internal("no address to listen on for '" + host + "'");
  for (struct addrinfo* p = ai; p != nullptr; p = p->ai_next) {
    int s = socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC,
                   p->ai_protocol);
    if (s < 0) {
      last = ErrnoStatus("socket", errno);
      continue;
    }
    int one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(s, p->ai_addr, p->ai_addrlen) != 0 || listen(s, 128) != 0) {
      last = ErrnoStatus("listening on " + host + ":" + std::to_string(port),
                         errno);
      close(s);
      continue;
    }
    struct sockaddr_storage addr;
    socklen_t len = sizeof(addr);
    getsockname(s, reinterpret_cast<struct sockaddr*>(&addr), &len);
    *bound_port = addr.ss_family == AF_INET6
                      ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                      : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    *fd = s;
    freeaddrinfo(ai);
    return Status::Ok();
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
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
  }
  auto* a = reinterpret_cast<sockaddr_in*>(&addr);
  inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
  port = ntohs(a->sin_port);
  return std::string(host) + ":" + std::to_string(port);
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
