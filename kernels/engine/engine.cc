// Start and stop: the endpoint's listener, threads and backends, the
// transports it expects each pair to use, and what it reports (Info).

#include "kernels/engine/engine.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/region.h"
#include "kernels/common/text.h"
#include "kernels/common/timeline.h"
#include "kernels/common/transport_choice.h"
#include "kernels/engine/collective.h"
#include "kernels/engine/engine_internal.h"
#include "kernels/transport/factory.h"

namespace tf_rdma {

std::vector<std::string> TransportPreference(const std::string& setting) {
  std::vector<std::string> out;
  if (!ParseTransportSetting(setting, &out).ok()) out.clear();
  return out;
}

bool Contains(const std::vector<std::string>& list, const std::string& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

Engine* Engine::Get() {
  static Engine* engine = new Engine();
  return engine;
}

namespace {
// Removes this process's segments from /dev/shm at a normal exit.
struct UnlinkAtExit {
  ~UnlinkAtExit() { Engine::Get()->Stop(); }
} unlink_at_exit;
}  // namespace

void Engine::Schedule(std::function<void()> fn) {
  pool_.Schedule(std::move(fn));
}

void Engine::Log(const std::string& line) {
  std::fprintf(stderr, "tf_rdma[%s]: %s\n",
               config_.task.empty() ? "?" : config_.task.c_str(),
               line.c_str());
  std::fflush(stderr);
}

Status Engine::Start(const EngineConfig& config) {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_) {
    return FailedPrecondition("the tf_rdma endpoint of this process is "
                              "already running as " + config_.task);
  }
  std::string host;
  int port = 0;
  TF_RDMA_RETURN_IF_ERROR(SplitHostPort(config.listen, &host, &port));
  config_ = config;
  uint64_t stale_bytes = 0;
  if (int stale = RemoveStaleSegments(&stale_bytes)) {
    Log("removed " + std::to_string(stale) + " shared-memory segment" +
        (stale == 1 ? "" : "s") + " (" + std::to_string(stale_bytes) +
        " bytes) that processes which died had left in /dev/shm");
  }
  TF_RDMA_RETURN_IF_ERROR(StartTransports(config, host));
  TF_RDMA_RETURN_IF_ERROR(
      Listen(config.bind.empty() ? host : config.bind, port, &listen_fd_,
             &listen_port_)
          .Prefixed("starting the tf_rdma endpoint"));
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  struct epoll_event ev;
  std::memset(&ev, 0, sizeof(ev));
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  config_ = config;
  incarnation_ = RandomHex(16);
  struct rlimit files;
  max_regions_per_peer_ = kMaxRegionsPerPeer;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY) {
    max_regions_per_peer_ = static_cast<int>(std::max<rlim_t>(
        64, std::min<rlim_t>(kMaxRegionsPerPeer, files.rlim_cur / 4)));
  }
  region_budget_ = config_.region_budget;
  if (region_budget_ == 0) region_budget_ = ShmBytes() / 4 * 3;
  // Before started_: collectives read config_.collective_spin_us and
  // shares_cores_.
  ResolveCollectiveSpin(1 + PredictTransports());
  stopping_ = false;
  started_ = true;
  accept_thread_ = std::thread([this] {
    NameThisThread("tfrdma-accept");
    AcceptLoop();
  });
  progress_thread_ = std::thread([this] {
    NameThisThread("tfrdma-progress");
    ProgressLoop();
  });
  StartTimeline();
  return Status::Ok();
}

Status Engine::StartTransports(const EngineConfig& config,
                               const std::string& host) {
  // Caller holds mu_.
  std::vector<std::string> wanted = TransportPreference(config.transport);
  TransportOptions options;
  options.local_host = host;
  options.timeout_ms = config.timeout_ms;
  options.verbs = config.verbs;
  for (const std::string& name : TransportPreference("auto")) {
    if (!Contains(wanted, name)) {
      unusable_[name] = "not asked for (TF_RDMA_TRANSPORT=" +
                        config.transport + ")";
      continue;
    }
    if (transports_.count(name)) continue;  // opened by an earlier Start
    std::unique_ptr<Transport> transport;
    Status s = OpenTransport(name, options, &transport);
    if (s.ok()) {
      unusable_.erase(name);
      std::string device = transport->Describe();
      if (!device.empty()) Log(name + ": " + device);
      transports_[name] = std::move(transport);
      continue;
    }
    unusable_[name] = s.message();
    // A list without tcp leaves some pairs (other hosts) nothing but this
    // one: better a clear error now than a refused connection later.
    if (!Contains(wanted, "tcp")) {
      return FailedPrecondition("TF_RDMA_TRANSPORT=" + config.transport +
                                " asks for " + name + ", but " + name +
                                " cannot be used here: " + s.message());
    }
    std::vector<std::string> others;
    for (const std::string& t : wanted) {
      if (t != name) others.push_back(t);
    }
    // Once per process and transport, however many starts.
    static std::mutex logged_mu;
    static std::set<std::string>* logged = new std::set<std::string>();
    std::lock_guard<std::mutex> lock(logged_mu);
    if (logged->insert(name).second) {
      Log(name + " is not usable, so pairs use " + Join(others, " or ") +
          ": " + s.message());
    }
  }
  return Status::Ok();
}

int Engine::PredictTransports() {
  // A prediction from the peers' addresses (transport_choice.h): this end
  // is on this machine by definition, and no peer's identity is known yet.
  int same_host = 0;
  PairEnd me = ThisEnd();
  me.identified = false;
  std::set<std::string> local = LocalAddresses();
  for (const auto& kv : config_.peers) {
    PairEnd peer;
    peer.task = kv.first;
    int port = 0;
    peer.host_kind = SplitHostPort(kv.second, &peer.host, &port).ok()
                         ? ClassifyHost(peer.host, local)
                         : HostKind::kRemote;
    TransportChoice expected = ChooseTransport(me, peer);
    if (expected.same_host) ++same_host;
    const std::string& t = expected.transport;
    std::string line = "pair " + config_.task + " <-> " + kv.first + " (" +
                       kv.second + "): ";
    if (t.empty()) {
      line += "no transport: " + expected.reason;
    } else if (!transports_.at(t)->Describe().empty()) {
      // A device (verbs): the peer may not have one.
      line += t + " (" + transports_.at(t)->Describe() + ")" +
              (expected.fallback.empty()
                   ? ""
                   : ", or " + expected.fallback +
                         " if the peer cannot use " + t);
    } else {
      line += t + (t == "shm"               ? " (same host)"
                   : expected.same_host ? ""
                                        : " (another host)");
      if (t == "shm" && !expected.fallback.empty()) {
        line += ", or " + expected.fallback + " if the peer has a /dev/shm "
                "of its own";
      }
    }
    Log(line);
  }
  return same_host;
}

void Engine::ResolveCollectiveSpin(int tasks_here) {
  cpu_set_t cpus;
  int ncpus = sched_getaffinity(0, sizeof(cpus), &cpus) == 0
                  ? CPU_COUNT(&cpus)
                  : static_cast<int>(std::thread::hardware_concurrency());
  // Bound to its own CPUs (tf-rdma launch): the tasks share the host's.
  const bool bound = config_.host_cpus > 0;
  if (bound) ncpus = static_cast<int>(config_.host_cpus);
  const std::string host = std::to_string(tasks_here) + " task" +
                           (tasks_here == 1 ? "" : "s") +
                           " of the cluster on this host, " +
                           std::to_string(ncpus) + " CPU" +
                           (ncpus == 1 ? "" : "s") +
                           (bound ? ", each task bound to its own" : "");
  shares_cores_ = tasks_here > ncpus;
  const bool automatic = config_.collective_spin_us == kAutoSpin;
  if (automatic) config_.collective_spin_us = shares_cores_ ? 0 : kAutoSpinUs;
  std::string limit = std::to_string(kLatencyBoundBytes >> 20) + " MiB";
  spin_choice_ =
      config_.collective_spin_us > 0
          ? "collectives of up to " + limit + " spin up to " +
                std::to_string(config_.collective_spin_us) +
                " us for each block before sleeping"
          : "collectives sleep after a few us without their block";
  if (!automatic) spin_choice_ += " (TF_RDMA_COLLECTIVE_SPIN_US)";
  if (shares_cores_) {
    spin_choice_ += "; their inline poll yields the core between its looks";
  }
  if (automatic || shares_cores_) spin_choice_ += " (" + host + ")";
  // A process bound to part of the host by something other than tf-rdma
  // launch (taskset, numactl, a batch system's CPU binding) cannot tell
  // whether its peers on the host are bound to the same CPUs or to their
  // own: it assumes the same (a pause-spin where the peer needs the core
  // would cost the whole spin), and says how to tell it otherwise.
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  if (shares_cores_ && !bound && online > ncpus) {
    spin_choice_ += "; this process may use " + std::to_string(ncpus) +
                    " of the host's " + std::to_string(online) +
                    " CPUs: where each task is bound to CPUs of its own, "
                    "set TF_RDMA_HOST_CPUS to the number they share";
  }
}

void Engine::LogCollectiveSpin() {
  std::call_once(spin_logged_, [this] { Log(spin_choice_); });
}

void Engine::Stop() {
  if (!started_.exchange(false)) return;
  // First, while the connections still answer: the last clock offsets.
  timeline::Stop();
  // The connections as they are now: a reader thread leaves its
  // connection's set entry once stopping_ is seen (at its next frame, or
  // within 100 ms), and each must still get its goodbye and be closed.
  std::vector<std::shared_ptr<Connection>> open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    open.assign(connections_.begin(), connections_.end());
  }
  stopping_ = true;
  shutdown(listen_fd_, SHUT_RDWR);
  uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    // The progress thread also wakes up every 100 ms.
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  if (progress_thread_.joinable()) progress_thread_.join();
  {
    // And any accepted since (the accept thread has ended).
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& conn : connections_) {
      if (std::find(open.begin(), open.end(), conn) == open.end()) {
        open.push_back(conn);
      }
    }
  }
  // (without mu_: a peer that reads nothing holds each goodbye 100 ms)
  for (const auto& conn : open) {
    if (!conn->gone.load()) SayGoodbye(conn);
    std::lock_guard<std::mutex> cl(conn->mu);
    conn->dead = true;
    conn->gone.store(true);
    conn->dead_reason = "the local endpoint was stopped";
    conn->cv.notify_all();
    conn->pair->Close();
    shutdown(conn->fd, SHUT_RDWR);
  }
  poller_recheck_.store(true);
  RingPoller();
  std::lock_guard<std::mutex> lock(mu_);
  // Mappings stay valid (tensors may still alias them); the names go.
  for (auto& region : regions_) {
    if (region->memory) region->memory->Unlink();
  }
  close(listen_fd_);
}

std::string Engine::Info() {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = "{\"task\": " + JsonString(config_.task);
  out += ", \"listen_port\": " + std::to_string(listen_port_);
  out += ", \"transport\": " + JsonString(config_.transport);
  // Connections closed before or during their handshake (limits, denials).
  out += ", \"refused_connections\": " +
         std::to_string(refused_connections_.load());
  out += ", \"collective_spin_us\": " +
         std::to_string(config_.collective_spin_us);
  out += std::string(", \"shares_cores\": ") +
         (shares_cores_ ? "true" : "false");
  auto verbs = transports_.find("verbs");
  out += ", \"verbs\": " +
         JsonString(verbs != transports_.end()
                        ? verbs->second->Describe()
                        : "unusable: " + unusable_["verbs"]);
  out += ", \"pairs\": [";
  bool first = true;
  for (const auto& conn : connections_) {
    const Connection& c = *conn;
    if (c.gone.load()) continue;
    out += std::string(first ? "" : ", ") + "{\"writer\": " +
           JsonString(c.dialed ? config_.task : c.peer) + ", \"reader\": " +
           JsonString(c.dialed ? c.peer : config_.task) +
           ", \"transport\": " + JsonString(c.pair->transport());
    PairCounters n = c.pair->counters();
    if (n.reported) {
      out += ", \"counters\": {\"writes\": " + std::to_string(n.writes) +
             ", \"bytes_in_place\": " + std::to_string(n.bytes_in_place) +
             ", \"bytes_inline\": " + std::to_string(n.bytes_inline) +
             ", \"bytes_staged\": " + std::to_string(n.bytes_staged) +
             ", \"requests\": " + std::to_string(n.requests) +
             ", \"signaled\": " + std::to_string(n.signaled) +
             ", \"max_writes_in_flight\": " +
             std::to_string(n.max_writes_in_flight) + "}";
    }
    out += "}";
    first = false;
  }
  out += "], \"regions\": [";
  // Released regions (peers.cc) are not listed.
  SweepRetiredLocked();
  first = true;
  for (size_t id = 0; id < regions_.size(); ++id) {
    const LocalRegion& r = *regions_[id];
    if (r.retired.load(std::memory_order_relaxed)) continue;
    out += std::string(first ? "" : ", ") + "{\"id\": " + std::to_string(id) +
           ", \"name\": " + JsonString(r.name) + ", \"segment\": " +
           JsonString(r.memory->shm_name()) + ", \"bytes\": " +
           std::to_string(r.memory->size()) + "}";
    first = false;
  }
  return out + "]}";
}

std::string Engine::Stats() {
  std::string task;
  {
    std::lock_guard<std::mutex> lock(mu_);
    task = config_.task;
  }
  std::string last = "null";
  {
    std::lock_guard<std::mutex> lock(stall_mu_);
    if (last_collective_ != nullptr) {
      auto ns = [](Clock::time_point t) {
        return std::to_string(NanosSinceEpoch(t));
      };
      last = "{\"instance\": " + JsonString(*last_collective_) +
             ", \"call\": " + std::to_string(last_collective_call_) +
             ", \"began_ns\": " + ns(last_collective_began_) +
             ", \"ended_ns\": " + ns(last_collective_ended_) +
             ", \"waited_ns\": " +
             std::to_string(last_collective_waited_ns_) + "}";
    }
  }
  std::string counters = stats_.Json();  // "{...}"
  return "{\"task\": " + JsonString(task) + ", \"last_collective\": " +
         last + ", " + counters.substr(1);
}

std::string Engine::HostId() const {
  // "<boot id>/<network namespace>/<dev>:<ino> of /dev/shm": one host is the
  // same boot and namespace; shm also needs the same /dev/shm
  // (transport_choice.h).
  std::string boot, netns;
  ThisHost(&boot, &netns);
  return boot + "/" + netns + "/" + ThisShm();
}

PairEnd Engine::ThisEnd() const {
  PairEnd me;
  me.task = config_.task;
  me.allowed = TransportPreference(config_.transport);
  auto verbs = transports_.find("verbs");
  me.verbs = verbs != transports_.end() ? Verbs::kUsable : Verbs::kUnusable;
  if (verbs != transports_.end()) {
    me.verbs_detail = verbs->second->Describe();
  } else if (unusable_.count("verbs")) {
    me.verbs_detail = unusable_.at("verbs");
  }
  me.identified = true;
  ThisHost(&me.boot_id, &me.netns);
  me.shm_id = ThisShm();
  me.host_kind = HostKind::kLocal;
  return me;
}

std::vector<std::string> Engine::AllowedTransports() const {
  std::vector<std::string> out;
  for (const std::string& t : TransportPreference(config_.transport)) {
    if (transports_.count(t)) out.push_back(t);
  }
  return out;
}

std::string Engine::PeerHost(const std::string& peer) const {
  auto it = config_.peers.find(peer);
  std::string host;
  int port = 0;
  if (it == config_.peers.end() ||
      !SplitHostPort(it->second, &host, &port).ok()) {
    return "";
  }
  return host;
}

int64_t Engine::TimeoutFor(const SlotSpec& spec) const {
  return spec.timeout_ms > 0 ? spec.timeout_ms : config_.timeout_ms;
}

}  // namespace tf_rdma
