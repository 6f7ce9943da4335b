// Connections after the handshake: a reader thread each.
//
// Each connection has its own thread that reads its frames: WRITE frames
// (tcp payloads and credits, read straight into the region), OPEN requests
// (answered on the same thread) and replies. A peer that stalls mid-frame,
// or stops reading the replies it asked for, holds only its own connection's
// thread, up to the timeout, and then loses the connection; every other
// peer's transfers go on. (A single progress thread reading every socket
// used to stall every transfer into the endpoint behind one such peer.) The
// number of these threads is bounded by the cluster: one connection per
// directed pair of tasks. Verbs notices, which arrive on completion
// channels, are still drained by the one progress thread (ProgressLoop):
// draining never blocks.

#include "kernels/engine/engine.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "kernels/common/text.h"
#include "kernels/common/trace.h"
#include "kernels/common/wire.h"
#include "kernels/engine/engine_internal.h"
#include "kernels/transport/factory.h"

namespace tf_rdma {

namespace {

Code CodeFromInt(uint64_t c) {
  constexpr auto kLast = static_cast<uint64_t>(Code::kCancelled);
  if (c > kLast) return Code::kInternal;
  return static_cast<Code>(c);
}

}  // namespace

Status Engine::AddToProgress(const std::shared_ptr<Connection>& conn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    connections_.insert(conn);
  }
  try {
    std::thread([this, conn] {
      NameThisThread("tfrdma-reader");
      ReadLoop(conn);
    }).detach();
  } catch (const std::system_error& e) {
    Status s = Unavailable(std::string("cannot start the connection's reader "
                                       "thread: ") + e.what() +
                           " (a pids limit?)");
    CloseConnection(conn, s);
    std::lock_guard<std::mutex> lock(mu_);
    connections_.erase(conn);
    return s;
  }
  int notice_fd = conn->pair->notice_fd();
  if (notice_fd >= 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      by_notice_fd_[notice_fd] = conn;
    }
    struct epoll_event ev;
    std::memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.fd = notice_fd;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, notice_fd, &ev);
  }
  return Status::Ok();
}

void Engine::ReadLoop(std::shared_ptr<Connection> conn) {
  while (!stopping_) {
    {
      std::lock_guard<std::mutex> lock(conn->mu);
      if (conn->dead) break;
    }
    struct pollfd p;
    p.fd = conn->fd;
    p.events = POLLIN | POLLRDHUP;
    p.revents = 0;
    int rc = poll(&p, 1, 100);
    if (rc < 0 && errno != EINTR) {
      CloseConnection(conn, ErrnoStatus("poll", errno));
      break;
    }
    if (rc > 0) HandleFrame(conn);
  }
  std::lock_guard<std::mutex> lock(mu_);
  connections_.erase(conn);
  if (conn->pair && conn->pair->notice_fd() >= 0) {
    by_notice_fd_.erase(conn->pair->notice_fd());
  }
}

void Engine::ProgressLoop() {
  struct epoll_event events[32];
  Clock::time_point next_sweep = Clock::now();
  while (!stopping_) {
    int n = epoll_wait(epoll_fd_, events, 32, 100);
    for (int i = 0; i < n && !stopping_; ++i) {
      if (events[i].data.fd == wake_fd_) continue;
      std::shared_ptr<Connection> conn;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto nt = by_notice_fd_.find(events[i].data.fd);
        if (nt == by_notice_fd_.end()) continue;
        conn = nt->second;
      }
      HandleNotices(conn);
    }
    FlushLimitedLog();
    // A released region is unmapped (its fd closed, its /dev/shm pages
    // given back) once nothing can touch it any more (peers.cc): looked
    // for here every second, not only when another region is released.
    if (Clock::now() >= next_sweep) {
      std::lock_guard<std::mutex> lock(mu_);
      SweepRetiredLocked();
      next_sweep = Clock::now() + std::chrono::seconds(1);
    }
  }
}

void Engine::HandleFrame(const std::shared_ptr<Connection>& conn) {
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    if (conn->dead) return;
  }
  FrameHeader h;
  Status s = RecvAll(conn->fd, &h, sizeof(h));
  if (s.ok() && h.magic != kFrameMagic) {
    s = InvalidArgument("bad frame magic from " + conn->peer);
  }
  if (s.ok() && h.type == kWrite) {
    // This thread is awake and the data is in place: it completes the recv
    // waiting for it itself, before waking the word's sleepers (the poller
    // would be one more thread wake-up per transfer; see poller.cc).
    s = ApplyWriteFrame(
        conn->fd, h,
        [this, &conn](uint32_t id) { return RegionForPeer(*conn, id); },
        [this] { CompleteLandedRecvs(); });
    if (!s.ok()) {
      LogLimited("rejected write from " + conn->peer + ": " + s.message());
    }
  } else if (s.ok() && (h.type == kOpenRequest || h.type == kOpenReply ||
                         h.type == kError || h.type == kQuery ||
                         h.type == kQueryReply)) {
    if (h.b > kMaxBodyBytes) {
      s = InvalidArgument("frame body of " + std::to_string(h.b) +
                          " bytes (at most " + std::to_string(kMaxBodyBytes) +
                          ")");
    } else {
      std::string body(h.b, '\0');
      s = RecvAll(conn->fd, &body[0], body.size());
      if (s.ok() && h.type == kOpenRequest) {
        HandleOpen(conn, h.a, body);
      } else if (s.ok() && h.type == kQuery) {
        HandleQuery(conn, h.a, body);
      } else if (s.ok() && h.type == kError) {
        s = FailedPrecondition(Printable(body, 2000));
      } else if (s.ok()) {
        std::lock_guard<std::mutex> lock(conn->mu);
        // Only a reply to a request still waiting for one is kept.
        if (conn->outstanding.count(h.a)) {
          conn->replies[h.a] = {h, body};
          conn->cv.notify_all();
        } else if (conn->abandoned.erase(h.a)) {
          // Late: its asker gave up (a stopped or slow peer answers when
          // it runs again). Dropped.
        } else {
          s = InvalidArgument(
              std::string(h.type == kOpenReply ? "OPEN" : "QUERY") +
              " reply " + std::to_string(h.a) +
              " answers no outstanding request");
        }
      }
    }
  } else if (s.ok() && h.type == kGoodbye) {
    {
      std::lock_guard<std::mutex> lock(conn->mu);
      conn->said_goodbye = true;
    }
    s = Unavailable(conn->peer + " stopped its endpoint (its process ended "
                    "or stopped it)");
  } else if (s.ok()) {
    s = InvalidArgument("unknown frame type " + std::to_string(h.type));
  }
  if (!s.ok()) {
    // A peer that wrote its last tensor and exited closes the socket right
    // after its NIC had our acknowledgement: the notices of those writes
    // may still wait in our completion queue, behind this EOF. Publish them
    // before the pair goes, or the last steps it sent would be lost.
    if (conn->pair && conn->pair->notice_fd() >= 0) HandleNotices(conn);
    CloseConnection(conn, s);
  }
}

void Engine::HandleNotices(const std::shared_ptr<Connection>& conn) {
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    if (conn->dead) return;
  }
  std::lock_guard<std::mutex> taking(conn->notice_mu);
  std::vector<Notice> notices;
  Status received = conn->pair->TakeNotices(&notices);
  Status s;
  for (const Notice& n : notices) {
    Region* region = RegionForPeer(*conn, n.region_id);
    if (region == nullptr) {
      s = PermissionDenied("notice for region id " +
                           std::to_string(n.region_id) +
                           ", which this peer was never given");
      break;
    }
    if (!region->Contains(n.offset, 8) || n.offset % 8 != 0) {
      s = InvalidArgument("notice at offset " + std::to_string(n.offset) +
                          " is outside region " + region->shm_name() +
                          " of " + std::to_string(region->size()) + " bytes");
      break;
    }
    PublishWord(region->Word(n.offset), n.seq, region->Sleepers(n.offset));
  }
  if (!s.ok()) {
    LogLimited("rejected notice from " + conn->peer + ": " + s.message());
    CloseConnection(conn, s);
  } else if (!received.ok()) {
    CloseConnection(conn, received);
  }
}

void Engine::CloseConnection(const std::shared_ptr<Connection>& conn,
                             const Status& why) {
  bool said_goodbye;
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    if (conn->dead) return;
    said_goodbye = conn->said_goodbye;
    conn->dead = true;
    conn->gone.store(true, std::memory_order_release);
    // A refusal by the peer (plan mismatch) keeps its code; anything else
    // means the peer is gone.
    conn->dead_code = why.code() == Code::kFailedPrecondition
                          ? Code::kFailedPrecondition
                          : Code::kUnavailable;
    conn->dead_reason = why.message();
    conn->replies.clear();
    conn->peer_writable.clear();
    conn->cv.notify_all();
  }
  // A peer that said goodbye ended on purpose: nothing was lost (a wait on
  // it still fails, saying that it stopped).
  if (!stopping_ && !said_goodbye) {
    // The reason may quote a peer's error frame (up to 2,000 bytes): the
    // log line keeps its start.
    constexpr size_t kMaxReason = 300;
    std::string reason = why.message();
    if (reason.size() > kMaxReason) {
      reason = reason.substr(0, kMaxReason) + "... (cut)";
    }
    LogLost(conn->peer, "lost connection " +
        (conn->dialed ? config_.task + " -> " + conn->peer
                      : conn->peer + " -> " + config_.task) +
        ": " + reason);
  }
  if (conn->pair) {
    if (conn->pair->notice_fd() >= 0) {
      epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn->pair->notice_fd(), nullptr);
    }
    conn->pair->Close();
  }
  // The fd itself is closed by the last holder of the connection
  // (~Connection), so that its number is not reused under a thread still
  // using it.
  shutdown(conn->fd, SHUT_RDWR);
  // A matched-call region lives as long as its writer's connection
  // (peers.cc, "Releasing a peer's regions").
  if (!stopping_) {
    std::lock_guard<std::mutex> lock(mu_);
    ReleaseRegionsOfLocked(conn, "the connection " +
                                     (conn->dialed
                                          ? config_.task + " -> " + conn->peer
                                          : conn->peer + " -> " + config_.task) +
                                     " ended (" + why.message() + ")");
  }
  // Waits on this peer fail now, not at their next periodic check.
  poller_recheck_.store(true);
  RingPoller();
  if (!stopping_) SweepSegmentsOfTheDead();
}

// A peer on this host that died leaves its segments in /dev/shm (nothing
// runs at SIGKILL), whatever the transport between us; once its process is
// gone their locks are free and they can go (region.h). So each connection
// that ends starts a sweep that tries for a few seconds (the process may
// still be exiting). One sweep at a time, on an engine thread: connections
// that end while it runs extend it, so a peer cycling connections costs
// one thread, not one per connection. (A peer on another host, or with a
// /dev/shm of its own, leaves nothing here: the sweep finds none.)
void Engine::SweepSegmentsOfTheDead() {
  constexpr int64_t kSweepMs = 3000;
  sweep_until_ns_.store(trace::NowNs() + kSweepMs * 1000000);
  if (sweeping_.exchange(true)) return;
  Schedule([this] {
    while (true) {
      while (!stopping_ && trace::NowNs() < sweep_until_ns_.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        uint64_t bytes = 0;
        if (int n = RemoveStaleSegments(&bytes)) {
          Log("removed " + std::to_string(n) + " shared-memory segment" +
              (n == 1 ? "" : "s") + " (" + std::to_string(bytes) +
              " bytes) of a peer that died");
        }
      }
      sweeping_.store(false);
      // A connection that ended as this one stopped extended nothing.
      if (stopping_ || trace::NowNs() >= sweep_until_ns_.load() ||
          sweeping_.exchange(true)) {
        return;
      }
    }
  });
}

Status Engine::CheckPeerAlive(const std::shared_ptr<Connection>& conn,
                              const std::string& what) {
  if (!conn) return Status::Ok();
  std::lock_guard<std::mutex> lock(conn->mu);
  if (!conn->dead) return Status::Ok();
  if (conn->dead_code == Code::kFailedPrecondition) {
    return FailedPrecondition(what + ": " + conn->peer + " refused: " +
                              conn->dead_reason);
  }
  return Unavailable(what + ": the connection to " + conn->peer +
                     " was lost (" + conn->dead_reason + ")");
}

Status Engine::SendFrame(const std::shared_ptr<Connection>& conn,
                         const FrameHeader& h, const std::string& body,
                         const Deadline& deadline) {
  struct iovec iov[2];
  iov[0].iov_base = const_cast<FrameHeader*>(&h);
  iov[0].iov_len = sizeof(h);
  iov[1].iov_base = const_cast<char*>(body.data());
  iov[1].iov_len = body.size();
  std::lock_guard<std::mutex> lock(conn->send_mu);
  size_t sent = 0;
  Status s = SendAllv(conn->fd, iov, body.empty() ? 1 : 2, deadline, &sent);
  // Half a frame on the wire: the stream cannot carry another one.
  if (!s.ok() && sent > 0) CloseConnection(conn, s);
  return s;
}

void Engine::SayGoodbye(const std::shared_ptr<Connection>& conn) {
  // Short: a peer that does not read (stopped, partitioned) must not hold
  // up a stopping process; 48 bytes fit any socket buffer that has room.
  constexpr int64_t kGoodbyeMs = 100;
  // A send may hold the socket for a while (a write to a full buffer):
  // wait for it only as long.
  Deadline deadline(kGoodbyeMs);
  std::unique_lock<std::mutex> lock(conn->send_mu, std::defer_lock);
  while (!lock.try_lock()) {
    if (deadline.Expired()) return;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  // After a frame cut short the peer would read the goodbye as the rest of
  // that frame: such a connection is only closed.
  if (conn->pair && conn->pair->broken()) return;
  FrameHeader h;
  h.type = kGoodbye;
  struct iovec iov;
  iov.iov_base = &h;
  iov.iov_len = sizeof(h);
  size_t sent = 0;
  SendAllv(conn->fd, &iov, 1, deadline, &sent);
}

void Engine::SendReply(const std::shared_ptr<Connection>& conn,
                       FrameType type, uint64_t request_id, const Status& s,
                       const std::map<std::string, std::string>& fields) {
  FrameHeader h;
  h.type = type;
  h.a = request_id;
  std::string body = s.ok() ? EncodeFields(fields) : s.message();
  h.b = body.size();
  h.c = static_cast<uint64_t>(s.code());
  Status sent = SendFrame(conn, h, body, Deadline(config_.timeout_ms));
  if (!sent.ok()) CloseConnection(conn, sent);
}

Status Engine::Request(const std::shared_ptr<Connection>& conn,
                       FrameType type,
                       const std::map<std::string, std::string>& fields,
                       const Deadline& deadline,
                       std::map<std::string, std::string>* reply) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    if (conn->dead) {
      return Unavailable("connection to " + conn->peer + " lost (" +
                         conn->dead_reason + ")");
    }
    id = conn->next_request++;
    conn->outstanding.insert(id);
  }
  struct Forget {  // the reply, if it comes late, is not kept
    Connection* conn;
    uint64_t id;
    ~Forget() {
      std::lock_guard<std::mutex> lock(conn->mu);
      conn->outstanding.erase(id);
      conn->replies.erase(id);
    }
  } forget{conn.get(), id};
  std::string body = EncodeFields(fields);
  FrameHeader h;
  h.type = type;
  h.a = id;
  h.b = body.size();
  TF_RDMA_RETURN_IF_ERROR(SendFrame(conn, h, body, deadline));
  std::unique_lock<std::mutex> lock(conn->mu);
  while (true) {
    auto it = conn->replies.find(id);
    if (it != conn->replies.end()) {
      FrameHeader rh = it->second.first;
      std::string rbody = it->second.second;
      conn->replies.erase(it);
      const uint16_t expected = type == kQuery ? kQueryReply : kOpenReply;
      if (rh.type != expected) {
        // CloseConnection takes conn->mu itself.
        lock.unlock();
        CloseConnection(conn, InvalidArgument(
                                  "reply of frame type " +
                                  std::to_string(rh.type) + " to request " +
                                  std::to_string(id) + " (expected " +
                                  std::to_string(expected) + ")"));
        return Unavailable("connection to " + conn->peer + " lost (a reply "
                           "of the wrong type)");
      }
      if (rh.c != 0) return Status(CodeFromInt(rh.c), Printable(rbody, 2000));
      *reply = DecodeFields(rbody);
      return Status::Ok();
    }
    if (conn->dead) {
      return Unavailable("connection to " + conn->peer + " lost (" +
                         conn->dead_reason + ")");
    }
    if (deadline.Expired()) {
      // The reply may still come (a stopped or slow peer answers when it
      // runs again): the reader drops it then.
      conn->abandoned.insert(id);
      if (conn->abandoned.size() > kMaxAbandonedRequests) {
        conn->abandoned.erase(conn->abandoned.begin());
      }
      return DeadlineExceeded("no answer from " + conn->peer + " after " +
                              std::to_string(deadline.timeout_ms()) + " ms");
    }
    conn->cv.wait_for(lock, std::chrono::milliseconds(50));
  }
}

}  // namespace tf_rdma
