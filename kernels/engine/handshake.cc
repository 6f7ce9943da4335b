// Bootstrap handshake.
//
//   reader (accepts)                          writer (dials)
//   "TFRDMA/3 CHALLENGE <nonce_r>"      ->
//                                       <-  "HELLO <writer> <reader> <host id>
//                                             <transports> <incarnation_w>
//                                             <nonce_w> <proof_w>"
//        proof_w = HMAC(secret, "hello|nonce_r|writer|reader|host id|
//                                transports|incarnation_w|nonce_w")
//   "WELCOME <transport> <incarnation_r> <proof_r>"  ->   (or "DENIED <why>")
//        proof_r = HMAC(secret, "welcome|nonce_w|nonce_r|writer|reader|
//                                transport|incarnation_r")
//
// Both sides prove knowledge of the job secret without sending it, over
// fresh nonces, so a recorded handshake cannot be replayed; every field
// either side acts on is inside a proof, so a party in the middle cannot
// steer the transport or fake a restart. Until the writer's proof checks
// out, the reader has created no state for it: a client with the wrong
// secret gets nothing written, and is logged.
//
// The incarnation is a random id each engine draws when it starts: a peer
// that comes back with another one is a new process in the old one's place
// (see "Restarted peers").
//
// Unauthenticated clients are bounded: at most kMaxHandshakes handshakes run
// at once (kMaxHandshakesPerSource from one address), each on its own thread
// and within one deadline for the whole exchange, however slowly the client
// trickles its bytes. Failing to start a thread (a pids limit) closes that
// connection, never the process. Rejections are logged with the peer's bytes
// escaped and cut, at most kLogBurst lines per kLogWindowMs and then one
// summary line.
//
// Admission. A full endpoint must not be held by whoever came first: clients
// that open connection after connection from a few addresses would hold
// every slot for good (each for its whole deadline, then again), and a real
// writer, which dials again until its own deadline, would never get in. So
// a connection that finds all kMaxHandshakes slots taken cuts short the
// oldest handshake whose peer has not yet proved the secret (its socket is
// shut down; a real writer cut short dials again) of the source that holds
// the most such slots, when
//   - it comes from a host of the cluster (an address the cluster spec's
//     hosts resolve to) and that source does not, or
//   - its own source would then still hold fewer than that one.
// Otherwise it is closed at once, as is a connection whose source is at its
// own cap. So a flood from outside the cluster never keeps a cluster peer
// out, and a flood from a few addresses leaves room for every other address
// (a fair share). The cost is one pass over at most kMaxHandshakes entries
// per connection that finds the endpoint full, and a handshake's fd is
// closed or handed over only after it left the set admission cuts from
// (SettleHandshake), so a shutdown never reaches a reused descriptor.

#include "kernels/engine/engine.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "kernels/common/sha256.h"
#include "kernels/common/text.h"
#include "kernels/common/transport_choice.h"
#include "kernels/common/wire.h"
#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

namespace {

constexpr size_t kMaxLine = 4096;

std::string Proof(const std::string& secret, const std::string& message) {
  Digest256 d = HmacSha256(secret.data(), secret.size(), message.data(),
                           message.size());
  return ToHex(d.data(), d.size());
}

bool SameProof(const std::string& a, const std::string& b) {
  return a.size() == b.size() &&
         ConstantTimeEqual(reinterpret_cast<const uint8_t*>(a.data()),
                           reinterpret_cast<const uint8_t*>(b.data()),
                           a.size());
}

}  // namespace

std::string RandomHex(size_t nbytes) {
  std::vector<uint8_t> buf(nbytes);
  size_t got = 0;
  while (got < nbytes) {
    ssize_t n = getrandom(buf.data() + got, nbytes - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return ToHex(buf.data(), buf.size());
}

namespace {

// 3: shm writers wake only sleepers counted beside the notice word (wait.h),
// which a reader of version 2 never counts: the two must not share memory.
const char kHandshakeVersion[] = "TFRDMA/3";
constexpr int kMaxHandshakes = 64;
constexpr int kMaxHandshakesPerSource = 16;
constexpr int kLogBurst = 20;
constexpr int64_t kLogWindowMs = 10000;

std::string HelloProof(const std::string& secret, const std::string& nonce_r,
                       const std::vector<std::string>& f) {
  // f: the HELLO line's fields, "HELLO" first, the proof last.
  return Proof(secret, "hello|" + nonce_r + "|" + f[1] + "|" + f[2] + "|" +
                           f[3] + "|" + f[4] + "|" + f[5] + "|" + f[6]);
}

std::string WelcomeProof(const std::string& secret, const std::string& nonce_w,
                         const std::string& nonce_r, const std::string& writer,
                         const std::string& reader,
                         const std::string& transport,
                         const std::string& incarnation) {
  return Proof(secret, "welcome|" + nonce_w + "|" + nonce_r + "|" + writer +
                           "|" + reader + "|" + transport + "|" + incarnation);
}

// "host" of "host:port" / "[v6]:port".
std::string HostOf(const std::string& address) {
  size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

// The addresses `peers` (task -> "host:port") resolve to, written as
// PeerAddress writes a source: "10.0.0.5", "[fe80::1]", and an IPv4 address
// also as an IPv4-mapped IPv6 one (a peer reaching a dual-stack socket).
// A host that does not resolve (yet) adds nothing.
std::set<std::string> SourcesOf(const std::map<std::string, std::string>& peers) {
  std::set<std::string> hosts, out;
  for (const auto& kv : peers) {
    std::string host;
    int port;
    if (SplitHostPort(kv.second, &host, &port).ok()) hosts.insert(host);
  }
  for (const std::string& host : hosts) {
    struct addrinfo hints;
    std::memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    struct addrinfo* ai = nullptr;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &ai) != 0) continue;
    for (struct addrinfo* p = ai; p != nullptr; p = p->ai_next) {
      char text[INET6_ADDRSTRLEN];
      if (p->ai_family == AF_INET) {
        auto* a = reinterpret_cast<sockaddr_in*>(p->ai_addr);
        inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
        out.insert(text);
        out.insert("[::ffff:" + std::string(text) + "]");
      } else if (p->ai_family == AF_INET6) {
        auto* a = reinterpret_cast<sockaddr_in6*>(p->ai_addr);
        inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
        out.insert("[" + std::string(text) + "]");
      }
    }
    freeaddrinfo(ai);
  }
  return out;
}

}  // namespace

void Engine::LogThrough(LogLimiter* limiter, const std::string& raw) {
  // Every caller escapes the peer's text it quotes; this is the backstop for
  // text that reaches here through a status message (a field ParseOpenRequest
  // quotes, say): no control or non-ASCII byte reaches the log, and no line
  // is longer than kMaxLoggedChars.
  constexpr size_t kMaxLoggedChars = 600;
  std::string line;
  size_t i = 0;
  for (; i < raw.size() && line.size() < kMaxLoggedChars; ++i) {
    unsigned char c = static_cast<unsigned char>(raw[i]);
    if (c >= 0x20 && c < 0x7f) {
      line.push_back(static_cast<char>(c));
    } else {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\x%02x", c);
      line += esc;
    }
  }
  if (i < raw.size()) line += "... (cut)";
  std::lock_guard<std::mutex> lock(limiter->mu);
  Clock::time_point now = Clock::now();
  if (now - limiter->window > std::chrono::milliseconds(kLogWindowMs)) {
    FlushLimitedLocked(limiter);
    limiter->window = now;
    limiter->count = 0;
  }
  if (limiter->count < kLogBurst) {
    ++limiter->count;
    Log(line);
  } else {
    if (limiter->suppressed++ == 0) limiters_owing_.fetch_add(1);
    limiter->last = line;
  }
}

void Engine::FlushLimitedLocked(LogLimiter* limiter) {
  if (limiter->suppressed == 0) return;
  Log(std::to_string(limiter->suppressed) + " more " + limiter->noun +
      (limiter->suppressed == 1 ? "" : "s") + " in the last " +
      std::to_string(kLogWindowMs / 1000) + " s (last: " + limiter->last +
      ")");
  limiter->suppressed = 0;
  limiters_owing_.fetch_sub(1);
}

void Engine::LogLost(const std::string& peer, const std::string& line) {
  // Peer names are authenticated cluster tasks, but a secret holder may
  // claim many: at most kMaxLossLimiters get a window of their own.
  constexpr size_t kMaxLossLimiters = 256;
  LogLimiter* limiter = &losses_;
  {
    std::lock_guard<std::mutex> lock(losses_mu_);
    auto it = losses_by_peer_.find(peer);
    if (it != losses_by_peer_.end()) {
      limiter = it->second.get();
    } else if (losses_by_peer_.size() < kMaxLossLimiters) {
      auto made = std::make_unique<LogLimiter>("lost connection");
      limiter = made.get();
      losses_by_peer_.emplace(peer, std::move(made));
    }
  }
  LogThrough(limiter, line);
}

void Engine::FlushLimitedLog() {
  if (limiters_owing_.load(std::memory_order_relaxed) == 0) return;
  std::vector<LogLimiter*> limiters = {&rejections_, &losses_};
  {
    std::lock_guard<std::mutex> lock(losses_mu_);
    for (auto& kv : losses_by_peer_) limiters.push_back(kv.second.get());
  }
  Clock::time_point now = Clock::now();
  for (LogLimiter* limiter : limiters) {
    std::lock_guard<std::mutex> lock(limiter->mu);
    if (now - limiter->window > std::chrono::milliseconds(kLogWindowMs)) {
      FlushLimitedLocked(limiter);
    }
  }
}

uint64_t Engine::refused_connections() const {
  return refused_connections_.load();
}

void Engine::AcceptLoop() {
  Clock::time_point fd_logged{};
  // Off this thread: a name that does not resolve may take seconds.
  Schedule([this] {
    std::set<std::string> sources = SourcesOf(config_.peers);
    std::lock_guard<std::mutex> lock(handshake_mu_);
    cluster_sources_ = std::move(sources);
  });
  while (!stopping_) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (stopping_) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: connections wait in the backlog meanwhile.
        Clock::time_point now = Clock::now();
        if (now - fd_logged > std::chrono::milliseconds(kLogWindowMs)) {
          fd_logged = now;
          struct rlimit lim;
          getrlimit(RLIMIT_NOFILE, &lim);
          Log(std::string("out of file descriptors (") +
              (errno == EMFILE ? "this process's limit " +
                                     std::to_string(lim.rlim_cur)
                               : "the system's limit") +
              "): new connections wait until some close; " +
              std::to_string(handshakes_.load()) + " handshakes in progress");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      return;
    }
    std::string from = PeerAddress(fd);
    std::string source = HostOf(from);
    std::string busy;
    uint64_t id = 0;
    {
      std::lock_guard<std::mutex> lock(handshake_mu_);
      AdmitHandshakeLocked(fd, source, &id, &busy);
    }
    if (!busy.empty()) {
      close(fd);
      ++refused_connections_;
      LogLimited("refused connection from " + from + ": " + busy +
                 " (limit reached)");
      continue;
    }
    try {
      std::thread([this, fd, id, source] {
        NameThisThread("tfrdma-auth");
        Handshake(fd, id);
        EndHandshake(source);
      }).detach();
    } catch (const std::system_error& e) {
      SettleHandshake(id);
      close(fd);
      EndHandshake(source);
      ++refused_connections_;
      LogLimited("refused connection from " + from +
                 ": cannot start a thread for it (" + e.what() +
                 "; a pids limit?)");
    }
  }
}

bool Engine::AdmitHandshakeLocked(int fd, const std::string& source,
                                  uint64_t* id, std::string* busy) {
  int& mine = handshakes_by_source_[source];
  if (mine >= kMaxHandshakesPerSource) {
    *busy = std::to_string(mine) + " handshakes in progress from " + source;
    return false;
  }
  if (handshakes_ >= kMaxHandshakes) {
    // Full: the pending handshakes of the source that holds the most (a
    // source outside the cluster first, for one inside it).
    const bool known = cluster_sources_.count(source) > 0;
    std::map<std::string, int> held;
    for (const auto& kv : pending_handshakes_) ++held[kv.second.source];
    std::string victim;
    int most = 0;
    bool victim_known = true;
    for (const auto& kv : held) {
      if (kv.first == source) continue;
      bool k = cluster_sources_.count(kv.first) > 0;
      bool better = known ? (victim_known && !k) || (k == victim_known &&
                                                     kv.second > most)
                          : kv.second > most;
      if (victim.empty() || better) {
        victim = kv.first;
        most = kv.second;
        victim_known = k;
      }
    }
    const bool cut = !victim.empty() &&
                     ((known && !victim_known) || mine + 1 < most);
    if (!cut) {
      *busy = std::to_string(kMaxHandshakes) + " handshakes in progress";
      if (mine == 0) handshakes_by_source_.erase(source);
      return false;
    }
    for (auto it = pending_handshakes_.begin(); it != pending_handshakes_.end();
         ++it) {
      if (it->second.source != victim) continue;
      // Its thread sees the connection end at once, counts and logs it;
      // the slot comes back when that thread has ended (EndHandshake).
      shutdown(it->second.fd, SHUT_RDWR);
      pending_handshakes_.erase(it);
      break;
    }
  }
  ++handshakes_;
  ++mine;
  *id = ++next_handshake_;
  pending_handshakes_[*id] = PendingHandshake{fd, source};
  return true;
}

bool Engine::SettleHandshake(uint64_t id) {
  std::lock_guard<std::mutex> lock(handshake_mu_);
  return pending_handshakes_.erase(id) > 0;
}

void Engine::EndHandshake(const std::string& source) {
  std::lock_guard<std::mutex> lock(handshake_mu_);
  --handshakes_;
  if (--handshakes_by_source_[source] <= 0) handshakes_by_source_.erase(source);
}

void Engine::Handshake(int fd, uint64_t id) {
  Deadline deadline(kHandshakeTimeoutMs);
  TuneSocket(fd, kHandshakeTimeoutMs);
  std::string from = PeerAddress(fd);
  bool settled = false;  // out of admission's reach (SettleHandshake)
  auto close_fd = [&] {
    if (!settled) SettleHandshake(id);
    settled = true;
    close(fd);
  };
  auto reject = [&](const std::string& log) {
    ++refused_connections_;
    // Out of the pending set before this thread settled it: admission cut
    // it short for a newer connection.
    const bool cut = !settled && !SettleHandshake(id);
    settled = true;
    LogLimited("rejected connection from " + from + ": " +
               (cut ? "cut short for a newer connection (" +
                          std::to_string(kMaxHandshakes) +
                          " handshakes in progress, the most of them from " +
                          HostOf(from) + ")"
                    : log));
    close_fd();
  };
  auto deny = [&](const std::string& reason, const std::string& log) {
    std::string line = "DENIED " + reason + "\n";
    SendAll(fd, line.data(), line.size(), deadline);
    reject(log);
  };
  std::string nonce_r = RandomHex(32);
  std::string challenge =
      std::string(kHandshakeVersion) + " CHALLENGE " + nonce_r + "\n";
  Status sent = SendAll(fd, challenge.data(), challenge.size(), deadline);
  if (!sent.ok()) {
    reject("no CHALLENGE sent (" + sent.message() + ")");
    return;
  }
  std::string line;
  Status s = RecvLine(fd, &line, kMaxLine, deadline);
  if (!s.ok()) {
    reject("no HELLO (" + s.message() + ")");
    return;
  }
  std::vector<std::string> f = Split(line, ' ');
  if (f.size() != 8 || f[0] != "HELLO") {
    deny("malformed HELLO (expected " + std::string(kHandshakeVersion) + ")",
         "malformed HELLO '" + Printable(line) + "'");
    return;
  }
  const std::string &writer = f[1], &reader = f[2], &host = f[3];
  const std::string &incarnation = f[5], &nonce_w = f[6], &proof_w = f[7];
  if (!SameProof(proof_w, HelloProof(config_.secret, nonce_r, f))) {
    deny("secret proof does not match",
         "peer claiming to be " + Printable(writer) +
             " failed the secret proof (is TF_RDMA_SECRET the same on every "
             "task?)");
    return;
  }
  // The peer holds the secret: admission no longer cuts it short (if it
  // did meanwhile, the socket is shut down and what follows fails).
  SettleHandshake(id);
  settled = true;
  if (config_.peers.find(writer) == config_.peers.end()) {
    deny(writer + " is not a task of this cluster",
         "peer proved the secret but claims to be " + Printable(writer) +
             ", which is not in this endpoint's cluster");
    return;
  }
  if (reader != config_.task) {
    deny("this endpoint is " + config_.task + ", not " + reader,
         writer + " dialled " + Printable(reader) + " but reached " +
             config_.task + " (check the endpoint addresses)");
    return;
  }
  int held = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& c : connections_) {
      held += c->peer == writer && !c->dialed && !c->gone.load() ? 1 : 0;
    }
  }
  if (held >= kMaxConnectionsPerPeer) {
    deny(writer + " already holds " + std::to_string(held) +
             " connections to " + config_.task + ", the most allowed",
         writer + " already holds " + std::to_string(held) +
             " connections, the most allowed (" +
             std::to_string(kMaxConnectionsPerPeer) + ")");
    return;
  }
  Status impostor = CheckNewIncarnation(writer, incarnation);
  if (!impostor.ok()) {
    deny(impostor.message(), impostor.message());
    return;
  }
  // The writer offers the transports it can use; its host id is
  // "<boot id>/<network namespace>/<its /dev/shm>" (HostId).
  PairEnd writer_end;
  writer_end.task = writer;
  writer_end.allowed = Split(f[4], ',');
  writer_end.verbs = Contains(writer_end.allowed, "verbs") ? Verbs::kUsable
                                                           : Verbs::kUnusable;
  writer_end.identified = true;
  std::vector<std::string> identity = Split(host, '/');
  identity.resize(3);
  writer_end.boot_id = identity[0];
  writer_end.netns = identity[1];
  writer_end.shm_id = identity[2];
  TransportChoice choice = ChooseTransport(ThisEnd(), writer_end);
  const std::string& chosen = choice.transport;
  if (chosen.empty()) {
    deny(choice.reason, choice.reason);
    return;
  }
  std::string welcome =
      "WELCOME " + chosen + " " + incarnation_ + " " +
      WelcomeProof(config_.secret, nonce_w, nonce_r, writer, config_.task,
                   chosen, incarnation_) +
      "\n";
  if (!SendAll(fd, welcome.data(), welcome.size(), deadline).ok()) {
    close_fd();
    return;
  }
  auto conn = std::make_shared<Connection>();
  conn->fd = fd;
  conn->peer = writer;
  conn->peer_address = from;
  conn->incarnation = incarnation;
  conn->dialed = false;
  Status made = MakePair(chosen, false, conn, deadline);
  if (!made.ok()) {
    conn->fd = -1;  // closed by deny
    deny(chosen + " set-up failed on " + config_.task + ": " + made.message(),
         chosen + " set-up for " + writer + " failed: " + made.message());
    return;
  }
  TuneSocket(fd, static_cast<int>(config_.timeout_ms));
  Log(writer + " -> " + config_.task + " uses " + chosen);
  if (choice.same_host && !choice.shared_shm) {
    // The start-up log predicted shm from the addresses; say why not.
    Log(writer + " -> " + config_.task + ": " + choice.reason);
  }
  NotePeerIncarnation(conn);
  AddToProgress(conn);
}

Status Engine::Dial(const std::string& peer, const Deadline& deadline,
                    std::shared_ptr<Connection>* out) {
  auto it = config_.peers.find(peer);
  if (it == config_.peers.end()) {
    std::vector<std::string> known;
    for (auto& kv : config_.peers) known.push_back(kv.first);
    return InvalidArgument("unknown peer task '" + peer + "'; the cluster has " +
                           (known.empty() ? "no other tasks"
                                          : Join(known, ", ")));
  }
  std::string host;
  int port;
  TF_RDMA_RETURN_IF_ERROR(SplitHostPort(it->second, &host, &port));
  int fd = -1;
  std::string line;
  auto fail = [&](Status s) {
    close(fd);
    return s.Prefixed("handshake with " + peer + " at " + it->second);
  };
  // An endpoint at its handshake limit closes new connections, before its
  // challenge or, cutting this one short (admission), after it: dial again
  // (bounded by the deadline).
  std::string nonce_r, nonce_w;
  for (int backoff_ms = 10;; backoff_ms = std::min(backoff_ms * 2, 500)) {
    TF_RDMA_RETURN_IF_ERROR(
        ::tf_rdma::Dial(host, port, deadline, &fd)
            .Prefixed("reaching the endpoint of " + peer + " at " +
                      it->second));
    TuneSocket(fd, kHandshakeTimeoutMs);
    Status s = RecvLine(fd, &line, kMaxLine, deadline);
    if (s.ok()) {
      std::vector<std::string> f = Split(line, ' ');
      if (f.size() != 3 || f[0] != kHandshakeVersion || f[1] != "CHALLENGE") {
        return fail(Unavailable("not a tf_rdma " +
                                std::string(kHandshakeVersion) +
                                " endpoint (got '" + Printable(line, 60) +
                                "')"));
      }
      nonce_r = f[2];
      nonce_w = RandomHex(32);
      std::vector<std::string> hello = {
          "HELLO", config_.task, peer, HostId(),
          Join(AllowedTransports(), ","), incarnation_, nonce_w};
      hello.push_back(HelloProof(config_.secret, nonce_r, hello));
      std::string hello_line = Join(hello, " ") + "\n";
      s = SendAll(fd, hello_line.data(), hello_line.size(), deadline);
      if (s.ok()) s = RecvLine(fd, &line, kMaxLine, deadline);
      if (s.ok()) break;
    }
    if (s.code() != Code::kUnavailable || deadline.Expired()) return fail(s);
    close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(
        std::min<int64_t>(backoff_ms, deadline.RemainingMs() + 1)));
  }
  if (line.rfind("DENIED ", 0) == 0) {
    Code code = line.find("secret") != std::string::npos
                    ? Code::kPermissionDenied
                    : Code::kFailedPrecondition;
    return fail(Status(code, "refused: " + Printable(line.substr(7), 400)));
  }
  std::vector<std::string> f = Split(line, ' ');
  if (f.size() != 4 || f[0] != "WELCOME" ||
      !SameProof(f[3], WelcomeProof(config_.secret, nonce_w, nonce_r,
                                    config_.task, peer, f[1], f[2]))) {
    return fail(PermissionDenied(
        "the peer did not prove knowledge of the job secret"));
  }
  auto conn = std::make_shared<Connection>();
  conn->peer = peer;
  conn->peer_address = it->second;
  conn->incarnation = f[2];
  conn->dialed = true;
  if (!Contains(AllowedTransports(), f[1])) {
    return fail(Unavailable("peer chose transport '" + Printable(f[1]) +
                            "', which was not offered"));
  }
  conn->fd = fd;
  Status s = MakePair(f[1], true, conn, deadline);
  if (!s.ok()) {
    conn->fd = -1;  // closed by fail
    return fail(s);
  }
  TuneSocket(fd, static_cast<int>(config_.timeout_ms));
  Log(config_.task + " -> " + peer + " uses " + f[1]);
  NotePeerIncarnation(conn);
  TF_RDMA_RETURN_IF_ERROR(AddToProgress(conn));
  *out = conn;
  return Status::Ok();
}

// The pair of the transport both ends chose, made by its backend (a set-up
// exchange on the connection, verbs's queue pair addresses, is the
// backend's: transport/verbs/factory.cc).
Status Engine::MakePair(const std::string& transport, bool dialed,
                        const std::shared_ptr<Connection>& conn,
                        const Deadline& deadline) {
  auto it = transports_.find(transport);
  if (it == transports_.end()) {
    return Unavailable("the " + transport + " transport is not open here");
  }
  PairSetup setup;
  setup.fd = conn->fd;
  setup.send_mu = &conn->send_mu;
  setup.dialed = dialed;
  setup.peer = conn->peer;
  return it->second->NewPair(setup, deadline, &conn->pair);
}

Status Engine::GetConnection(const std::string& peer, const Deadline& deadline,
                             std::shared_ptr<Connection>* out) {
  std::mutex* dial_mu;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& m = dial_mu_[peer];
    if (!m) m.reset(new std::mutex());
    dial_mu = m.get();
  }
  std::lock_guard<std::mutex> dial_lock(*dial_mu);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = dialed_.find(peer);
    if (it != dialed_.end()) {
      // A lost connection is forgotten: the next op dials again (the peer
      // may be back, or a new process in its place).
      if (CheckPeerAlive(it->second, "").ok()) {
        *out = it->second;
        return Status::Ok();
      }
      dialed_.erase(it);
    }
  }
  std::shared_ptr<Connection> conn;
  TF_RDMA_RETURN_IF_ERROR(Dial(peer, deadline, &conn));
  std::lock_guard<std::mutex> lock(mu_);
  dialed_[peer] = conn;
  *out = conn;
  return Status::Ok();
}

}  // namespace tf_rdma
