// Questions one task asks another over the control connection.
//
// What. A QUERY frame carries "key=value" fields, `what` naming the
// question; the peer's reader thread answers it at once with a QUERY_REPLY
// (wire.h). Questions:
//
//   what=clock   the peer's clock (trace::NowNs, the clock of its trace
//                events): `received_ns` when the query was handled and
//                `sent_ns` just before the reply left. ClockOffset turns
//                four such timestamps into the offset of the peer's clock,
//                as NTP does.
//   what=position  the peer's position on a slot or collective that the
//                asker waits on (`slot`, `side`, `collective`): the last
//                step it wrote or took there, whether it waits on it, and
//                the waits it is sleeping in itself (stall.cc).
//
// Why on the control connection. Every pair of tasks that exchanges data
// has one already, authenticated and with a reader thread per end that
// never blocks on a transfer; a question is answered even while every
// transfer between the two is stuck, as long as the peer's process runs.
//
// Cost. One small frame each way; nothing on the data path.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "kernels/common/text.h"
#include "kernels/common/trace.h"
#include "kernels/common/wire.h"
#include "kernels/engine/engine.h"
#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

Status Engine::Query(const std::string& peer,
                     const std::map<std::string, std::string>& fields,
                     const Deadline& deadline,
                     std::map<std::string, std::string>* reply) {
  std::shared_ptr<Connection> conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Either direction serves: both ends of a connection read its frames.
    auto dialed = dialed_.find(peer);
    if (dialed != dialed_.end() && !dialed->second->gone.load()) {
      conn = dialed->second;
    }
    for (auto it = connections_.begin(); !conn && it != connections_.end();
         ++it) {
      if ((*it)->peer == peer && !(*it)->gone.load()) conn = *it;
    }
  }
  if (!conn) {
    return Unavailable("no connection to " + peer + " to ask");
  }
  return Request(conn, kQuery, fields, deadline, reply);
}

void Engine::HandleQuery(const std::shared_ptr<Connection>& conn,
                         uint64_t request_id, const std::string& body) {
  // A peer asking in a loop gets its answers at kMaxQueriesPerSecond: this
  // connection's reader thread waits out the second, not a core.
  Clock::time_point now = Clock::now();
  if (now - conn->query_second >= std::chrono::seconds(1)) {
    conn->query_second = now;
    conn->queries_this_second = 0;
  }
  if (++conn->queries_this_second > kMaxQueriesPerSecond) {
    std::this_thread::sleep_until(conn->query_second + std::chrono::seconds(1));
    conn->query_second = Clock::now();
    conn->queries_this_second = 1;
  }
  const int64_t received_ns = trace::NowNs();
  std::map<std::string, std::string> fields = DecodeFields(body);
  std::map<std::string, std::string> reply;
  Status s;
  const std::string& what = fields["what"];
  if (what == "clock") {
    reply["received_ns"] = std::to_string(received_ns);
  } else if (what == "position") {
    AnswerPosition(fields, &reply);
  } else {
    // A peer running a newer tf_rdma may ask what this one cannot answer:
    // an error reply, and the connection goes on.
    s = InvalidArgument("unknown query '" + Printable(what, 100) + "'");
  }
  if (what == "clock" && s.ok()) {
    reply["sent_ns"] = std::to_string(trace::NowNs());
  }
  SendReply(conn, kQueryReply, request_id, s, reply);
}

Status Engine::ClockOffset(const std::string& peer, int samples,
                           const Deadline& deadline, ClockSample* out) {
  ClockSample best;
  best.rtt_ns = std::numeric_limits<int64_t>::max();
  for (int i = 0; i < std::max(1, samples); ++i) {
    std::map<std::string, std::string> reply;
    const int64_t t1 = trace::NowNs();
    TF_RDMA_RETURN_IF_ERROR(Query(peer, {{"what", "clock"}}, deadline, &reply));
    const int64_t t4 = trace::NowNs();
    uint64_t t2 = 0, t3 = 0;
    if (!ParseUint(reply["received_ns"], &t2) ||
        !ParseUint(reply["sent_ns"], &t3) || t3 < t2) {
      return InvalidArgument("malformed clock reply from " + peer);
    }
    // The peer's clock read t2..t3 while ours read t1..t4: the reply's
    // time on the wire is the round trip less the peer's handling, and the
    // offset is exact if both legs took equally long (error <= rtt / 2).
    const int64_t rtt = (t4 - t1) - static_cast<int64_t>(t3 - t2);
    const int64_t offset = ((static_cast<int64_t>(t2) - t1) +
                            (static_cast<int64_t>(t3) - t4)) / 2;
    if (rtt < best.rtt_ns) {
      best.rtt_ns = std::max<int64_t>(0, rtt);
      best.offset_ns = offset;
    }
  }
  *out = best;
  return Status::Ok();
}

std::vector<std::string> Engine::ConnectedPeers() {
  // Every connection, dialed or accepted, is in connections_ while its
  // reader runs (AddToProgress).
  std::set<std::string> peers;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& conn : connections_) {
    if (!conn->gone.load()) peers.insert(conn->peer);
  }
  return std::vector<std::string>(peers.begin(), peers.end());
}

std::string Engine::ClockOffsets(int samples, int64_t timeout_ms) {
  std::string out = "{\"task\": " + JsonString(config_.task) +
                    ", \"peers\": {";
  bool first = true;
  for (const std::string& peer : ConnectedPeers()) {
    ClockSample sample;
    Status s = ClockOffset(peer, samples, Deadline(timeout_ms), &sample);
    out += std::string(first ? "" : ", ") + JsonString(peer) + ": ";
    if (s.ok()) {
      out += "{\"offset_ns\": " + std::to_string(sample.offset_ns) +
             ", \"rtt_ns\": " + std::to_string(sample.rtt_ns) + "}";
    } else {
      out += "{\"error\": " + JsonString(s.message()) + "}";
    }
    first = false;
  }
  return out + "}}";
}

}  // namespace tf_rdma
