#include "kernels/engine/engine.h"

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sched.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <system_error>

#include "kernels/common/sha256.h"
#include "kernels/common/text.h"
#include "kernels/transport/factory.h"

namespace tf_rdma {

// ---------------------------------------------------------------------------
// State shared by the threads of the engine.

struct Connection {
  int fd = -1;               // closed by the last holder (see CloseConnection)
  std::string peer;          // the peer's task
  std::string peer_address;  // where the socket goes, for messages
  std::string incarnation;   // the peer process's id (see "Restarted peers")
  bool dialed = false;       // true: we write data, the peer writes credits
  std::unique_ptr<Pair> pair;
  std::mutex send_mu;        // one frame at a time on fd

  std::mutex mu;  // guards the fields below
  std::condition_variable cv;
  bool dead = false;
  std::atomic<bool> gone{false};  // = dead, for lock-free checks
  Code dead_code = Code::kUnavailable;
  std::string dead_reason;
  uint64_t next_request = 1;
  std::set<uint64_t> outstanding;  // requests waiting for their reply
  std::map<uint64_t, std::pair<FrameHeader, std::string>> replies;
  std::set<uint32_t> peer_writable;  // our region ids this peer may write

  ~Connection() {
    pair.reset();
    if (fd >= 0) close(fd);
  }
};

struct LocalRegion {
  uint32_t id = 0;
  std::string name;       // plan region name (credit regions: name + "#credit")
  std::string plan_hash;
  std::string peer;       // data: the writer; credit: the reader
  std::unique_ptr<Region> memory;
  // Data regions: the writer's connection and its credit region there, set
  // when the writer opens the region. Guarded by Engine::mu_.
  std::shared_ptr<Connection> writer;
  int credit_handle = -1;
  // Why a writer's OPEN of this region was refused (plan mismatch, the
  // writer restarted), so that the reader's waiting ops fail with the
  // reason instead of a timeout; later OPENs are refused with it too.
  std::string refusal;
  bool opened = false;  // a writer opened it (Engine::mu_)
};

// A step that fails is given back (the next op on the slot retries the same
// step, so a late peer loses nothing) when it is the newest claim. If later
// steps were already claimed, the step order can no longer be kept: the slot
// is then poisoned and every later op on it fails with the first error.
struct StepCounter {
  uint64_t claimed = 0;  // last step handed out
  std::string poisoned;  // non-empty: why the slot can no longer be used
};

struct SendSlot {
  SlotSpec spec;
  std::mutex mu;
  StepCounter steps;
  // match_calls, under mu: per copy, the step last written into it and
  // whether a send is writing it now (AcquireCopy).
  std::vector<uint64_t> issued;
  std::vector<char> busy;
  // Set once by BindSendSlot (under mu), read lock-free after `bound`.
  std::atomic<bool> bound{false};
  std::shared_ptr<Connection> conn;
  int data_handle = -1;
  Region* credits = nullptr;
  uint32_t credits_id = 0;  // the credit region's id here, for OPEN requests
  // Dynamic slots: the current payload area (see kDynamicMetaBytes), under
  // dynamic_mu.
  std::mutex dynamic_mu;
  uint64_t generation = 0;
  uint64_t capacity = 0;
  int payload_handle = -1;
};

// A peer's data region that this process writes into, and the credit region
// here that the peer writes back into: opened with one OPEN request, shared by
// every slot in it.
struct SendRegion {
  std::mutex mu;  // held while opening
  std::string peer;  // the reader
  // The credit region, created with the first OPEN and kept for retries
  // and reconnections (one per region, however often OPEN is refused).
  LocalRegion* credit_region = nullptr;
  std::mutex state_mu;  // guards open, conn and refusal (also Engine::mu_)
  bool open = false;
  std::shared_ptr<Connection> conn;
  // Non-empty: the reader restarted after this region was opened.
  std::string refusal;
  bool refusal_told = false;  // sent to the new reader (BindSendSlot)
  int data_handle = -1;
  Region* credits = nullptr;
  uint32_t credits_id = 0;
};

struct RecvSlot {
  SlotSpec spec;
  std::mutex mu;
  StepCounter steps;
  // Inline polls in a row that missed their data, and polls (PollRecv).
  std::atomic<int> poll_misses{0};
  std::atomic<uint32_t> polls{0};
  // match_calls, under mu (MatchRecv): per copy, the step last taken, and
  // the step first seen untaken with when it was seen; the calls whose
  // recv failed, whose copies are dropped when they land.
  std::vector<uint64_t> taken;
  std::vector<uint64_t> seen_step;
  std::vector<Clock::time_point> seen_at;
  std::deque<uint64_t> abandoned;
  LocalRegion* region = nullptr;  // set at the first claim
};

namespace {

constexpr int64_t kCheckEveryMs = 50;  // as WaitForWord's sleep slices
constexpr size_t kMaxLine = 4096;
// How long a send whose connection was lost tries to dial the peer again.
constexpr int64_t kRedialMs = 1000;
// Regions one writer task's OPENs may create, over all its connections: each
// holds a file descriptor, so at most a quarter of the process's descriptors,
// and at most this many.
constexpr int kMaxRegionsPerPeer = 1024;
constexpr int kHandshakeTimeoutMs = 10000;

std::string RandomHex(size_t nbytes) {
  std::vector<uint8_t> buf(nbytes);
  size_t got = 0;
  while (got < nbytes) {
    ssize_t n = getrandom(buf.data() + got, nbytes - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return ToHex(buf.data(), buf.size());
}

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

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

Code CodeFromInt(uint64_t c) {
  constexpr auto kLast = static_cast<uint64_t>(Code::kResourceExhausted);
  if (c > kLast) return Code::kInternal;
  return static_cast<Code>(c);
}

std::string SlotKey(const SlotSpec& spec) {
  return spec.region + "@" + std::to_string(spec.offset);
}

bool SameLayout(const SlotSpec& a, const SlotSpec& b) {
  return a.peer == b.peer && a.plan_hash == b.plan_hash &&
         a.region_bytes == b.region_bytes && a.credit_bytes == b.credit_bytes &&
         a.stride == b.stride && a.nbytes == b.nbytes && a.depth == b.depth &&
         a.credit_index == b.credit_index && a.match_calls == b.match_calls;
}

Status NotStarted() {
  return FailedPrecondition(
      "the tf_rdma endpoint is not running in this process; start a "
      "tf_rdma.Server (or tf_rdma.start_endpoint) for this task first");
}

// Checks a new op's slot against the one already registered at its place:
// two ops may share a slot only if they agree on its whole layout.
Status CheckSameSlot(const SlotSpec& spec, const SlotSpec& existing) {
  if (SameLayout(spec, existing)) return Status::Ok();
  return InvalidArgument("tensor '" + spec.tensor_name +
                         "' uses the slot at offset " +
                         std::to_string(spec.offset) + " of region '" +
                         spec.region + "' with a different layout than tensor '" +
                         existing.tensor_name + "'");
}

// The copy an in-order slot uses at `step` (steps count from 1).
uint64_t CopyOf(const SlotSpec& spec, uint64_t step) {
  return (step - 1) % static_cast<uint64_t>(spec.depth);
}

// Where copy `copy` of the slot starts in its region (its header).
uint64_t CopyOffset(const SlotSpec& spec, uint64_t copy) {
  return spec.offset + copy * spec.stride;
}

Status ClaimStep(StepCounter* steps, const SlotSpec& spec, uint64_t* step) {
  if (!steps->poisoned.empty()) {
    return FailedPrecondition("tensor '" + spec.tensor_name +
                              "' cannot move any more: " + steps->poisoned);
  }
  *step = ++steps->claimed;
  return Status::Ok();
}

// Called with the slot's mutex held, after step `step` failed with `why`.
void GiveBackStep(StepCounter* steps, uint64_t step, const Status& why) {
  if (steps->claimed == step) {
    --steps->claimed;
  } else if (steps->poisoned.empty()) {
    steps->poisoned = "step " + std::to_string(step) +
                      " failed while later steps were in flight (" +
                      why.message() + ")";
  }
}

// A region descriptor as fields of an OPEN request ("credit_" prefix: the
// writer's credit region) or reply (no prefix: the data region).
void EncodeDescriptor(const RegionDescriptor& d, const std::string& prefix,
                      std::map<std::string, std::string>* fields) {
  (*fields)[prefix + "id"] = std::to_string(d.id);
  (*fields)[prefix + "size"] = std::to_string(d.size);
  (*fields)[prefix + "shm"] = d.shm_name;
  if (d.remote_addr != 0) {
    (*fields)[prefix + "addr"] = std::to_string(d.remote_addr);
    (*fields)[prefix + "rkey"] = std::to_string(d.rkey);
  }
}

RegionDescriptor DecodeDescriptor(std::map<std::string, std::string>& fields,
                                  const std::string& prefix) {
  RegionDescriptor d;
  uint64_t id = 0, rkey = 0;
  ParseUint(fields[prefix + "id"], &id);
  ParseUint(fields[prefix + "size"], &d.size);
  d.shm_name = fields[prefix + "shm"];
  ParseUint(fields[prefix + "addr"], &d.remote_addr);
  ParseUint(fields[prefix + "rkey"], &rkey);
  d.id = static_cast<uint32_t>(id);
  d.rkey = static_cast<uint32_t>(rkey);
  return d;
}

// The transports a setting allows, in order of preference ("auto": verbs,
// shm, tcp).
std::vector<std::string> TransportPreference(const std::string& setting) {
  if (setting == "auto") return {"verbs", "shm", "tcp"};
  return Split(setting, ',');
}

bool Contains(const std::vector<std::string>& list, const std::string& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

// One "verbs_<name>=<value>" config line (the plugin checks the ranges).
Status ParseVerbsSetting(const std::string& key, const std::string& value,
                         VerbsSettings* v) {
  if (key == "verbs_device") {
    v->device = value;
    return Status::Ok();
  }
  static const std::map<std::string, int VerbsSettings::*> kInts = {
      {"verbs_port", &VerbsSettings::port},
      {"verbs_gid_index", &VerbsSettings::gid_index},
      {"verbs_mtu", &VerbsSettings::mtu},
      {"verbs_sl", &VerbsSettings::service_level},
      {"verbs_traffic_class", &VerbsSettings::traffic_class},
      {"verbs_timeout", &VerbsSettings::timeout},
      {"verbs_retry_count", &VerbsSettings::retry_count},
      {"verbs_queue_depth", &VerbsSettings::queue_depth},
      {"verbs_inline", &VerbsSettings::inline_bytes}};
  uint64_t number = 0;
  bool negative = !value.empty() && value[0] == '-';
  bool parsed = ParseUint(negative ? value.substr(1) : value, &number) &&
                number <= (1u << 30);
  auto it = kInts.find(key);
  if (it == kInts.end()) {
    return InvalidArgument("unknown engine config key '" + key + "'");
  }
  if (!parsed) {
    return InvalidArgument(key + " '" + value + "' is not an integer");
  }
  v->*(it->second) = negative ? -static_cast<int>(number)
                              : static_cast<int>(number);
  return Status::Ok();
}

// The numeric addresses of this network namespace's interfaces.
std::set<std::string> LocalAddresses() {
  std::set<std::string> mine;
  struct ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) == 0) {
    for (auto* i = ifs; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr) continue;
      char text[NI_MAXHOST];
      socklen_t len = i->ifa_addr->sa_family == AF_INET
                          ? sizeof(sockaddr_in)
                          : sizeof(sockaddr_in6);
      if (getnameinfo(i->ifa_addr, len, text, sizeof(text), nullptr, 0,
                      NI_NUMERICHOST) == 0) {
        mine.insert(text);
      }
    }
    freeifaddrs(ifs);
  }
  return mine;
}

// True when `host` names this machine in this network namespace: loopback,
// or one of `mine` (LocalAddresses).
bool IsLocalHost(const std::string& host, const std::set<std::string>& mine) {
  struct addrinfo hints, *res = nullptr;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return false;
  bool local = false;
  for (auto* a = res; a != nullptr && !local; a = a->ai_next) {
    char text[NI_MAXHOST];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, text, sizeof(text), nullptr, 0,
                    NI_NUMERICHOST) != 0) {
      continue;
    }
    std::string t = text;
    local = mine.count(t) || t.rfind("127.", 0) == 0 || t == "::1";
  }
  freeaddrinfo(res);
  return local;
}

Status CheckNewSlot(const SlotSpec& spec, const std::string& own_task) {
  TF_RDMA_RETURN_IF_ERROR(spec.Validate());
  if (spec.peer == own_task) {
    return InvalidArgument("tensor '" + spec.tensor_name + "' has its own task " +
                           own_task + " as the peer; a transfer needs two tasks");
  }
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------------------
// Config and slot specs.

Status EngineConfig::Parse(const std::string& text, EngineConfig* out) {
  EngineConfig c;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == std::string::npos) {
      return InvalidArgument("engine config line '" + line +
                             "' is not key=value");
    }
    std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    if (key == "task") {
      c.task = value;
    } else if (key == "listen") {
      c.listen = value;
    } else if (key == "secret") {
      c.secret = value;
    } else if (key == "transport") {
      std::vector<std::string> names = Split(value, ',');
      std::set<std::string> seen;
      bool ok = !names.empty();
      for (const std::string& t : names) {
        ok = ok && (t == "verbs" || t == "shm" || t == "tcp") &&
             seen.insert(t).second;
      }
      ok = ok || value == "auto";
      if (!ok) {
        return InvalidArgument("transport '" + value +
                               "' is not auto or a list of verbs, shm, tcp "
                               "without repeats");
      }
      c.transport = value;
    } else if (key.rfind("verbs_", 0) == 0) {
      TF_RDMA_RETURN_IF_ERROR(ParseVerbsSetting(key, value, &c.verbs));
    } else if (key == "timeout_ms") {
      uint64_t v;
      if (!ParseUint(value, &v) || v == 0 ||
          v > static_cast<uint64_t>(kMaxDeadlineMs)) {
        return InvalidArgument("timeout_ms '" + value +
                               "' is not an integer in [1, " +
                               std::to_string(kMaxDeadlineMs) + "]");
      }
      c.timeout_ms = static_cast<int64_t>(v);
    } else if (key == "poll_us") {
      uint64_t v;
      if (!ParseUint(value, &v) || v > 10000) {
        return InvalidArgument("poll_us '" + value +
                               "' is not an integer in [0, 10000]");
      }
      c.poll_us = static_cast<int64_t>(v);
    } else if (key == "peer") {
      size_t sp = value.find(' ');
      if (sp == std::string::npos) {
        return InvalidArgument("peer line '" + value +
                               "' is not '<task> <host:port>'");
      }
      c.peers[value.substr(0, sp)] = value.substr(sp + 1);
    } else {
      return InvalidArgument("unknown engine config key '" + key + "'");
    }
  }
  if (c.task.empty()) return InvalidArgument("engine config has no task");
  if (c.listen.empty()) return InvalidArgument("engine config has no listen");
  if (c.secret.empty()) {
    return InvalidArgument(
        "no job secret: set TF_RDMA_SECRET to the same value on every task "
        "(tf-rdma launch does this for you)");
  }
  if (c.secret.size() < kMinSecretBytes) {
    return InvalidArgument(
        "the job secret (TF_RDMA_SECRET) has " +
        std::to_string(c.secret.size()) + " characters; it needs at least " +
        std::to_string(kMinSecretBytes) +
        ": anyone who records one handshake can try short secrets offline");
  }
  *out = c;
  return Status::Ok();
}

Status SlotSpec::Validate() const {
  // The attributes come from a graph (or the wire): every offset and size
  // computed from them is checked for overflow, so that no value can wrap
  // around into a slot that passes the bounds check and reads or writes
  // outside its region.
  std::string what = "tensor '" + tensor_name + "' in region '" + region + "'";
  if (depth < 1 || depth > kMaxSlotDepth) {
    return InvalidArgument(what + ": depth " + std::to_string(depth) +
                           " must be in [1, " + std::to_string(kMaxSlotDepth) +
                           "]");
  }
  uint64_t min_stride = 0;
  if (__builtin_add_overflow(kSlotHeaderBytes, nbytes, &min_stride) ||
      stride < min_stride || stride % 64 != 0 || offset % 64 != 0) {
    return InvalidArgument(what + ": stride " + std::to_string(stride) +
                           " / offset " + std::to_string(offset) +
                           " must be multiples of 64 and stride >= 64 + " +
                           std::to_string(nbytes) + " bytes");
  }
  if (region_bytes % kPageBytes != 0 || credit_bytes % kPageBytes != 0) {
    return InvalidArgument(what + ": region sizes must be multiples of 4096");
  }
  uint64_t span = 0, end = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(depth), stride, &span) ||
      __builtin_add_overflow(offset, span, &end) || end > region_bytes) {
    return InvalidArgument(
        what + ": " + std::to_string(depth) + " copies of " +
        std::to_string(stride) + " bytes from offset " +
        std::to_string(offset) + " do not fit the region's " +
        std::to_string(region_bytes) + " bytes (region too small for the plan)");
  }
  uint64_t lines = 0, credit_end = 0;
  if (credit_index < 0 ||
      __builtin_mul_overflow(static_cast<uint64_t>(credit_index) + 1,
                             static_cast<uint64_t>(depth), &lines) ||
      __builtin_mul_overflow(lines, kCreditLineBytes, &credit_end) ||
      credit_end > credit_bytes) {
    return InvalidArgument(what + ": credit index " +
                           std::to_string(credit_index) +
                           " does not fit a credit region of " +
                           std::to_string(credit_bytes) + " bytes");
  }
  return Status::Ok();
}

std::string SlotSpec::Describe(uint64_t step) const {
  return "tensor '" + tensor_name + "' (peer " + peer +
         (match_calls ? ", call " : ", step ") + std::to_string(step) + ")";
}

// ---------------------------------------------------------------------------
// Start and stop.

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
  TF_RDMA_RETURN_IF_ERROR(Listen(host, port, &listen_fd_, &listen_port_)
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
  stopping_ = false;
  started_ = true;
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  progress_thread_ = std::thread([this] { ProgressLoop(); });
  LogExpectedTransports();
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

void Engine::LogExpectedTransports() {
  std::vector<std::string> allowed = AllowedTransports();
  std::set<std::string> mine = LocalAddresses();
  for (const auto& kv : config_.peers) {
    std::string host;
    int port = 0;
    bool local = SplitHostPort(kv.second, &host, &port).ok() &&
                 IsLocalHost(host, mine);
    std::string expected, fallback;
    for (const std::string& t : allowed) {
      if (t == "shm" && !local) continue;
      if (expected.empty()) {
        expected = t;
      } else if (fallback.empty()) {
        fallback = t;
      }
    }
    std::string line = "pair " + config_.task + " <-> " + kv.first + " (" +
                       kv.second + "): ";
    if (expected.empty()) {
      line += "no transport (only shm is allowed and the peer is on another "
              "host)";
    } else if (!transports_.at(expected)->Describe().empty()) {
      // A device (verbs): the peer may not have one.
      line += expected + " (" + transports_.at(expected)->Describe() + ")" +
              (fallback.empty() ? "" : ", or " + fallback +
                                           " if the peer cannot use " +
                                           expected);
    } else {
      line += expected + (expected == "shm" ? " (same host)"
                          : local         ? ""
                                          : " (another host)");
    }
    Log(line);
  }
}

void Engine::Stop() {
  if (!started_.exchange(false)) return;
  stopping_ = true;
  shutdown(listen_fd_, SHUT_RDWR);
  uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    // The progress thread also wakes up every 100 ms.
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  if (progress_thread_.joinable()) progress_thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& conn : connections_) {
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
  // Mappings stay valid (tensors may still alias them); the names go.
  for (auto& region : regions_) region->memory->Unlink();
  close(listen_fd_);
}

std::string Engine::Info() {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = "task=" + config_.task + "\n";
  out += "listen_port=" + std::to_string(listen_port_) + "\n";
  out += "transport=" + config_.transport + "\n";
  // Connections closed before or during their handshake (limits, denials).
  out += "refused_connections=" + std::to_string(refused_connections_.load()) +
         "\n";
  auto verbs = transports_.find("verbs");
  out += "verbs=" + (verbs != transports_.end()
                         ? verbs->second->Describe()
                         : "unusable: " + unusable_["verbs"]) + "\n";
  for (const auto& conn : connections_) {
    const Connection& c = *conn;
    if (c.gone.load()) continue;
    out += "pair=" + (c.dialed ? config_.task + " -> " + c.peer
                               : c.peer + " -> " + config_.task) +
           " " + c.pair->transport() + "\n";
  }
  for (auto& r : regions_) {
    out += "region=" + r->name + " " + r->memory->shm_name() + " " +
           std::to_string(r->memory->size()) + "\n";
  }
  return out;
}

std::string Engine::HostId() const {
  // Same boot of the same kernel and the same network namespace: peers that
  // share both can map each other's /dev/shm segments. (Network namespaces
  // count as separate hosts so that veth "hosts" on one machine use tcp.)
  std::string boot = ReadFirstLine("/proc/sys/kernel/random/boot_id");
  char netns[128] = {0};
  ssize_t n = readlink("/proc/self/ns/net", netns, sizeof(netns) - 1);
  if (n < 0) n = 0;
  netns[n] = 0;
  return boot + "/" + std::string(netns);
}

std::vector<std::string> Engine::AllowedTransports() const {
  std::vector<std::string> out;
  for (const std::string& t : TransportPreference(config_.transport)) {
    if (transports_.count(t)) out.push_back(t);
  }
  return out;
}

int64_t Engine::TimeoutFor(const SlotSpec& spec) const {
  return spec.timeout_ms > 0 ? spec.timeout_ms : config_.timeout_ms;
}

// ---------------------------------------------------------------------------
// Blocking-work threads.

void Engine::Schedule(std::function<void()> fn) {
  // Every queued item may block until its deadline, so an item must never
  // wait behind another: unless there are at least as many idle threads as
  // queued items, start a thread. (An idle thread only leaves the idle count
  // when it takes an item, so a wake-up in flight is still counted.)
  std::unique_lock<std::mutex> lock(pool_mu_);
  pool_queue_.push_back(std::move(fn));
  if (pool_idle_ >= static_cast<int>(pool_queue_.size())) {
    pool_cv_.notify_one();
    return;
  }
  try {
    std::thread([this] { PoolThread(); }).detach();
    ++pool_threads_;
  } catch (const std::system_error& e) {
    // No thread to be had (a pids limit): the item waits for a pool thread
    // that finishes its own (every item is bounded), or, with none, runs
    // here (bounded too). Never a crash.
    bool inline_run = pool_threads_ == 0;
    std::function<void()> item;
    if (inline_run) {
      item = std::move(pool_queue_.back());
      pool_queue_.pop_back();
    }
    lock.unlock();
    LogLimited(std::string("cannot start an engine thread (") + e.what() +
               "); " + (inline_run ? "running the work on this thread"
                                   : "the work waits for a busy thread"));
    if (inline_run) item();
  }
}

void Engine::PoolThread() {
  {
    std::unique_lock<std::mutex> lock(pool_mu_);
    while (true) {
      while (pool_queue_.empty()) {
        ++pool_idle_;
        bool woke = pool_cv_.wait_for(lock, std::chrono::seconds(30), [this] {
          return !pool_queue_.empty();
        });
        --pool_idle_;
        if (!woke) {
          --pool_threads_;
          return;
        }
      }
      std::function<void()> item = std::move(pool_queue_.front());
      pool_queue_.pop_front();
      lock.unlock();
      item();
      lock.lock();
    }
  }
}

// ---------------------------------------------------------------------------
// Bootstrap handshake.
//
//   reader (accepts)                          writer (dials)
//   "TFRDMA/2 CHALLENGE <nonce_r>"      ->
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
// trickles its bytes; connections beyond that are closed at once (a real
// writer that meets a full endpoint dials again until its deadline). Failing
// to start a thread (a pids limit) closes that connection, never the
// process. Rejections are logged with the peer's bytes escaped and cut, at
// most kLogBurst lines per kLogWindowMs and then one summary line.

namespace {

const char kHandshakeVersion[] = "TFRDMA/2";
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

}  // namespace

void Engine::LogLimited(const std::string& raw) {
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
  std::lock_guard<std::mutex> lock(limited_mu_);
  Clock::time_point now = Clock::now();
  if (now - limited_window_ > std::chrono::milliseconds(kLogWindowMs)) {
    FlushLimitedLocked();
    limited_window_ = now;
    limited_count_ = 0;
  }
  if (limited_count_ < kLogBurst) {
    ++limited_count_;
    Log(line);
  } else {
    ++limited_suppressed_;
    limited_last_ = line;
  }
}

void Engine::FlushLimitedLocked() {
  if (limited_suppressed_ == 0) return;
  Log(std::to_string(limited_suppressed_) + " more rejected connection" +
      (limited_suppressed_ == 1 ? "" : "s") + " in the last " +
      std::to_string(kLogWindowMs / 1000) + " s (last: " + limited_last_ + ")");
  limited_suppressed_ = 0;
}

void Engine::FlushLimitedLog() {
  std::lock_guard<std::mutex> lock(limited_mu_);
  if (Clock::now() - limited_window_ > std::chrono::milliseconds(kLogWindowMs)) {
    FlushLimitedLocked();
  }
}

uint64_t Engine::refused_connections() const {
  return refused_connections_.load();
}

void Engine::AcceptLoop() {
  Clock::time_point fd_logged{};
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
    {
      std::lock_guard<std::mutex> lock(handshake_mu_);
      int& mine = handshakes_by_source_[source];
      if (handshakes_ >= kMaxHandshakes) {
        busy = std::to_string(kMaxHandshakes) + " handshakes in progress";
      } else if (mine >= kMaxHandshakesPerSource) {
        busy = std::to_string(mine) + " handshakes in progress from " + source;
      } else {
        ++handshakes_;
        ++mine;
      }
      if (!busy.empty() && mine == 0) handshakes_by_source_.erase(source);
    }
    if (!busy.empty()) {
      close(fd);
      ++refused_connections_;
      LogLimited("refused connection from " + from + ": " + busy +
                 " (limit reached)");
      continue;
    }
    try {
      std::thread([this, fd, source] {
        Handshake(fd);
        EndHandshake(source);
      }).detach();
    } catch (const std::system_error& e) {
      close(fd);
      EndHandshake(source);
      ++refused_connections_;
      LogLimited("refused connection from " + from +
                 ": cannot start a thread for it (" + e.what() +
                 "; a pids limit?)");
    }
  }
}

void Engine::EndHandshake(const std::string& source) {
  std::lock_guard<std::mutex> lock(handshake_mu_);
  --handshakes_;
  if (--handshakes_by_source_[source] <= 0) handshakes_by_source_.erase(source);
}

void Engine::Handshake(int fd) {
  Deadline deadline(kHandshakeTimeoutMs);
  TuneSocket(fd, kHandshakeTimeoutMs);
  std::string from = PeerAddress(fd);
  auto reject = [&](const std::string& log) {
    ++refused_connections_;
    LogLimited("rejected connection from " + from + ": " + log);
    close(fd);
  };
  auto deny = [&](const std::string& reason, const std::string& log) {
    std::string line = "DENIED " + reason + "\n";
    SendAll(fd, line.data(), line.size(), deadline);
    reject(log);
  };
  std::string nonce_r = RandomHex(32);
  std::string challenge =
      std::string(kHandshakeVersion) + " CHALLENGE " + nonce_r + "\n";
  if (!SendAll(fd, challenge.data(), challenge.size(), deadline).ok()) {
    close(fd);
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
  std::vector<std::string> theirs = Split(f[4], ',');
  std::string chosen;
  for (const std::string& t : AllowedTransports()) {
    if (std::find(theirs.begin(), theirs.end(), t) == theirs.end()) continue;
    if (t == "shm" && host != HostId()) continue;
    chosen = t;
    break;
  }
  if (chosen.empty()) {
    std::string why = "no common transport: " + writer + " allows " +
                      Printable(f[4]) + ", " + config_.task + " allows " +
                      Join(AllowedTransports(), ",") +
                      (host != HostId() ? " (different hosts)" : "");
    deny(why, why);
    return;
  }
  std::string welcome =
      "WELCOME " + chosen + " " + incarnation_ + " " +
      WelcomeProof(config_.secret, nonce_w, nonce_r, writer, config_.task,
                   chosen, incarnation_) +
      "\n";
  if (!SendAll(fd, welcome.data(), welcome.size(), deadline).ok()) {
    close(fd);
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
  // An endpoint at its handshake limit closes new connections before its
  // challenge: dial again (bounded by the deadline).
  for (int backoff_ms = 10;; backoff_ms = std::min(backoff_ms * 2, 500)) {
    TF_RDMA_RETURN_IF_ERROR(
        ::tf_rdma::Dial(host, port, deadline, &fd)
            .Prefixed("reaching the endpoint of " + peer + " at " +
                      it->second));
    TuneSocket(fd, kHandshakeTimeoutMs);
    Status s = RecvLine(fd, &line, kMaxLine, deadline);
    if (s.ok()) break;
    if (s.code() != Code::kUnavailable || deadline.Expired()) return fail(s);
    close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(
        std::min<int64_t>(backoff_ms, deadline.RemainingMs() + 1)));
  }
  std::vector<std::string> f = Split(line, ' ');
  if (f.size() != 3 || f[0] != kHandshakeVersion || f[1] != "CHALLENGE") {
    return fail(Unavailable("not a tf_rdma " + std::string(kHandshakeVersion) +
                            " endpoint (got '" + Printable(line, 60) + "')"));
  }
  const std::string nonce_r = f[2];
  std::string nonce_w = RandomHex(32);
  std::vector<std::string> hello = {
      "HELLO", config_.task, peer, HostId(), Join(AllowedTransports(), ","),
      incarnation_, nonce_w};
  hello.push_back(HelloProof(config_.secret, nonce_r, hello));
  std::string hello_line = Join(hello, " ") + "\n";
  Status s = SendAll(fd, hello_line.data(), hello_line.size(), deadline);
  if (!s.ok()) return fail(s);
  s = RecvLine(fd, &line, kMaxLine, deadline);
  if (!s.ok()) return fail(s);
  if (line.rfind("DENIED ", 0) == 0) {
    Code code = line.find("secret") != std::string::npos
                    ? Code::kPermissionDenied
                    : Code::kFailedPrecondition;
    return fail(Status(code, "refused: " + Printable(line.substr(7), 400)));
  }
  f = Split(line, ' ');
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
  s = MakePair(f[1], true, conn, deadline);
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

// ---------------------------------------------------------------------------
// Restarted peers.
//
// A task that dies and is started again (same task, same plan) is a new
// process: its step counters start at 1, its regions are new, and the
// regions it had opened on its peers hold the old process's steps. Each
// engine therefore draws a random incarnation id when it starts and sends it
// in the handshake; the first one seen for a task is remembered, and a later
// connection with another one means the task restarted.
//
// The two sides can continue only from a step they agree on. For a region
// the old process never opened there is nothing to disagree about: the new
// process opens it and starts at step 1, like any first writer. For a region
// it had opened, the survivor is at step N and the newcomer at step 1;
// rather than guess which steps the other side holds (tcp may have lost
// frames in flight, a shm writer may have left a half-written copy), tf_rdma
// refuses that region on both sides with an error that says the peer
// restarted and what to do: restart every task of the job, which then start
// together from step 1 (Keras BackupAndRestore, or the user's checkpoints,
// resume the training). Ops waiting on such a region fail at once, not at
// their timeout; the new process's ops get the same message from the OPEN
// that the survivor refuses. A connection that drops while both processes
// live (same incarnations) is dialled again and continues.

std::string Engine::RestartMessage(const std::string& peer, bool peer_writes) {
  return peer + " restarted (a new process connected in its place) after " +
         (peer_writes ? "it had started writing to " + config_.task
                      : config_.task + " had started writing to it") +
         "; tf_rdma does not resume transfers half-way through a job: "
         "restart every task of the job so that all start again from step 1 "
         "(Keras BackupAndRestore or your checkpoints resume the training)";
}

void Engine::NotePeerIncarnation(const std::shared_ptr<Connection>& conn) {
  std::vector<std::shared_ptr<Connection>> stale;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::string& known = peer_incarnation_[conn->peer];
    if (known.empty() || known == conn->incarnation) {
      known = conn->incarnation;
      return;
    }
    known = conn->incarnation;
    Log(conn->peer + " restarted: it connected as a new process");
    for (auto& region : regions_) {
      LocalRegion& r = *region;
      if (r.peer != conn->peer || r.name.find("#credit") != std::string::npos) {
        continue;
      }
      if (r.opened && r.refusal.empty()) r.refusal = RestartMessage(r.peer, true);
      r.writer.reset();
    }
    for (auto& kv : send_regions_) {
      SendRegion& r = *kv.second;
      if (r.peer != conn->peer) continue;
      std::lock_guard<std::mutex> rl(r.state_mu);
      if (r.open && r.refusal.empty()) {
        r.refusal = RestartMessage(r.peer, false);
      }
    }
    for (const auto& c : connections_) {
      if (c->peer == conn->peer && c->incarnation != conn->incarnation) {
        stale.push_back(c);
      }
    }
  }
  for (const auto& c : stale) {
    CloseConnection(c, Unavailable(conn->peer + " restarted"));
  }
  poller_recheck_.store(true);
  RingPoller();
}

// ---------------------------------------------------------------------------
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

Status Engine::AddToProgress(const std::shared_ptr<Connection>& conn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    connections_.insert(conn);
  }
  try {
    std::thread([this, conn] { ReadLoop(conn); }).detach();
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
    s = ApplyWriteFrame(conn->fd, h, [this, &conn](uint32_t id) {
      return RegionForPeer(*conn, id);
    });
    if (!s.ok()) {
      LogLimited("rejected write from " + conn->peer + ": " + s.message());
    }
  } else if (s.ok() && (h.type == kOpenRequest || h.type == kOpenReply ||
                         h.type == kError)) {
    if (h.b > kMaxBodyBytes) {
      s = InvalidArgument("frame body of " + std::to_string(h.b) +
                          " bytes (at most " + std::to_string(kMaxBodyBytes) +
                          ")");
    } else {
      std::string body(h.b, '\0');
      s = RecvAll(conn->fd, &body[0], body.size());
      if (s.ok() && h.type == kOpenRequest) {
        HandleOpen(conn, h.a, body);
      } else if (s.ok() && h.type == kError) {
        s = FailedPrecondition(Printable(body, 2000));
      } else if (s.ok()) {
        std::lock_guard<std::mutex> lock(conn->mu);
        // Only a reply to a request still waiting for one is kept.
        if (conn->outstanding.count(h.a)) {
          conn->replies[h.a] = {h, body};
          conn->cv.notify_all();
        } else {
          s = InvalidArgument("OPEN reply " + std::to_string(h.a) +
                              " answers no outstanding request");
        }
      }
    }
  } else if (s.ok()) {
    s = InvalidArgument("unknown frame type " + std::to_string(h.type));
  }
  if (!s.ok()) CloseConnection(conn, s);
}

void Engine::HandleNotices(const std::shared_ptr<Connection>& conn) {
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    if (conn->dead) return;
  }
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
    PublishWord(region->Word(n.offset), n.seq);
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
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    if (conn->dead) return;
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
  if (!stopping_) {
    Log("lost connection " +
        (conn->dialed ? config_.task + " -> " + conn->peer
                      : conn->peer + " -> " + config_.task) +
        ": " + why.message());
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
  // Waits on this peer fail now, not at their next periodic check.
  poller_recheck_.store(true);
  RingPoller();
  // A peer on this host that died leaves its segments in /dev/shm (nothing
  // runs at SIGKILL); once its process is gone their locks are free and
  // they can go (region.h). Try for a few seconds: the process may still be
  // exiting.
  if (!stopping_ && conn->pair && conn->pair->maps_peer_segments()) {
    Schedule([this] {
      for (int i = 0; i < 30 && !stopping_; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        uint64_t bytes = 0;
        if (int n = RemoveStaleSegments(&bytes)) {
          Log("removed " + std::to_string(n) + " shared-memory segment" +
              (n == 1 ? "" : "s") + " (" + std::to_string(bytes) +
              " bytes) of a peer that died");
          return;
        }
      }
    });
  }
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

Status Engine::Request(const std::shared_ptr<Connection>& conn,
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
  h.type = kOpenRequest;
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
      if (rh.c != 0) return Status(CodeFromInt(rh.c), Printable(rbody, 2000));
      *reply = DecodeFields(rbody);
      return Status::Ok();
    }
    if (conn->dead) {
      return Unavailable("connection to " + conn->peer + " lost (" +
                         conn->dead_reason + ")");
    }
    if (deadline.Expired()) {
      return DeadlineExceeded("no answer from " + conn->peer + " after " +
                              std::to_string(deadline.timeout_ms()) + " ms");
    }
    conn->cv.wait_for(lock, std::chrono::milliseconds(50));
  }
}
// ---------------------------------------------------------------------------
// Regions.

Status Engine::NewLocalRegion(const std::string& name, uint64_t size,
                              const std::string& plan_hash,
                              const std::string& peer, LocalRegion** out) {
  // Caller holds mu_.
  std::unique_ptr<Region> memory;
  TF_RDMA_RETURN_IF_ERROR(Region::Create(size, &memory).Prefixed(
      "region '" + Printable(name) + "' for " + peer));
  auto region = std::make_unique<LocalRegion>();
  region->id = static_cast<uint32_t>(regions_.size());
  region->name = name;
  region->plan_hash = plan_hash;
  region->peer = peer;
  region->memory = std::move(memory);
  *out = region.get();
  regions_.push_back(std::move(region));
  return Status::Ok();
}

Status Engine::FindOrCreateDataRegion(const std::string& name, uint64_t size,
                                      const std::string& plan_hash,
                                      const std::string& writer,
                                      LocalRegion** out) {
  // Caller holds mu_.
  auto it = data_regions_.find(name);
  if (it != data_regions_.end()) {
    LocalRegion* r = it->second;
    Status mismatch;
    if (r->plan_hash != plan_hash) {
      // The name and hash may come from a peer's OPEN: escaped and cut
      // (they end up in the log and in refusals).
      mismatch = FailedPrecondition(
          "plan hash mismatch for region '" + Printable(name) +
          "': one side has plan " + Printable(r->plan_hash, 64) +
          ", the other has plan " + Printable(plan_hash, 64) +
          " (both tasks must run the same plan)");
    } else if (r->memory->size() != size || r->peer != writer) {
      mismatch = FailedPrecondition(
          "region '" + Printable(name) + "' was set up with " +
          std::to_string(r->memory->size()) + " bytes written by " + r->peer +
          ", now asked for " + std::to_string(size) + " bytes written by " +
          writer);
    }
    if (!mismatch.ok()) {
      // The region's own writer and reader disagree for good: ops already
      // waiting on it fail with this reason instead of timing out. (Another
      // task asking for it is only refused; it cannot spoil the region.)
      if (r->peer == writer) r->refusal = mismatch.message();
      return mismatch;
    }
    *out = r;
    return Status::Ok();
  }
  TF_RDMA_RETURN_IF_ERROR(NewLocalRegion(name, size, plan_hash, writer, out));
  data_regions_[name] = *out;
  return Status::Ok();
}

Region* Engine::RegionForPeer(const Connection& conn, uint32_t id) {
  {
    std::lock_guard<std::mutex> lock(const_cast<Connection&>(conn).mu);
    if (!conn.peer_writable.count(id)) return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  return id < regions_.size() ? regions_[id]->memory.get() : nullptr;
}

namespace {

// Region names tf_rdma generates carry the writer and the reader: a plan's
// "<plan>/<writer>-><reader>", a collective's "coll:<instance>:<writer>>
// <reader>", and their dynamic payload areas "<region>#<tensor>#<n>". A
// writer may open only names of these forms that name itself and this
// reader (other names come from raw ops and belong to their first writer).
bool NameBelongsTo(const std::string& name, const std::string& writer,
                   const std::string& reader) {
  // The pair's part ends the name, or is followed by a payload area's '#'.
  auto names = [&](const std::string& pair) {
    size_t at = name.rfind(pair);
    while (at != std::string::npos) {
      size_t end = at + pair.size();
      if (end == name.size() || name[end] == '#') return true;
      at = at == 0 ? std::string::npos : name.rfind(pair, at - 1);
    }
    return false;
  };
  if (name.rfind("coll:", 0) == 0) return names(":" + writer + ">" + reader);
  if (name.find("->") != std::string::npos) {
    return names("/" + writer + "->" + reader);
  }
  return true;
}

}  // namespace

// OPEN: a writer asks for its region here. Bounded on purpose, since the
// writer chooses the name and the size: the name must be its own (above);
// each writer task may create at most kMaxRegionsPerPeer regions; the size
// is reserved in /dev/shm when the region is created (Region::Create), so
// asking for more than there is fails with an error instead of a SIGBUS
// later; and a region keeps the writer that first opened it (a second live
// writer is refused; a writer whose connection was lost is replaced).
void Engine::HandleOpen(const std::shared_ptr<Connection>& conn,
                        uint64_t request_id, const std::string& body) {
  OpenRequest request;
  Status s = ParseOpenRequest(body, &request).Prefixed(
      "malformed OPEN request from " + conn->peer);
  std::map<std::string, std::string>& f = request.fields;
  const std::string& name = request.name;
  uint64_t size = request.size;
  std::map<std::string, std::string> reply;
  if (s.ok() && conn->dialed) {
    s = FailedPrecondition("OPEN request on a connection we dialled");
  }
  if (s.ok() && !NameBelongsTo(name, conn->peer, config_.task)) {
    s = PermissionDenied("region '" + Printable(name) + "' belongs to another "
                         "pair of tasks than " + conn->peer + " -> " +
                         config_.task);
  }
  LocalRegion* region = nullptr;
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    bool exists = data_regions_.count(name) > 0;
    // Counted per writer task, not per connection: regions outlive their
    // connection, so a count that restarted with each connection let a
    // peer that reconnects create regions (fds, /dev/shm) without end.
    int& created = regions_opened_by_[conn->peer];
    if (!exists && created >= max_regions_per_peer_) {
      s = FailedPrecondition(
          conn->peer + " has already opened " + std::to_string(created) +
          " regions on this endpoint, the most allowed (a quarter of the "
          "process's file descriptor limit, at most " +
          std::to_string(kMaxRegionsPerPeer) + ")");
    }
    if (s.ok()) {
      s = FindOrCreateDataRegion(name, size, f["plan_hash"], conn->peer,
                                 &region);
    }
    if (s.ok() && !exists) ++created;
    // The writer refuses to go on with this region (it saw this process
    // restart; see "Restarted peers"): ops waiting on it fail with why.
    if (s.ok() && !request.refusal.empty() && region->refusal.empty()) {
      region->refusal = Printable(request.refusal, 1000);
    }
    if (s.ok() && !region->refusal.empty()) {
      s = FailedPrecondition(region->refusal);
    }
    if (s.ok() && region->writer && region->writer != conn &&
        !region->writer->gone.load()) {
      s = FailedPrecondition("region '" + Printable(name) +
                             "' already has a connected writer");
    }
    if (s.ok() && region->writer != conn) {
      RegionDescriptor credits = DecodeDescriptor(f, "credit_");
      credits.id = request.credit_id;
      credits.size = request.credit_size;
      int handle = -1;
      s = conn->pair->AddRemoteRegion(credits, &handle);
      if (s.ok()) {
        region->writer = conn;
        region->credit_handle = handle;
        region->opened = true;
      }
    }
  }
  // Outside mu_: verbs registers the region here (pins it, once), which
  // takes a while for a large one.
  RegionDescriptor exposed;
  if (s.ok()) s = conn->pair->Expose(region->id, *region->memory, &exposed);
  if (s.ok()) {
    std::lock_guard<std::mutex> cl(conn->mu);
    conn->peer_writable.insert(region->id);
    EncodeDescriptor(exposed, "", &reply);
  }
  FrameHeader h;
  h.type = kOpenReply;
  h.a = request_id;
  std::string rbody = s.ok() ? EncodeFields(reply) : s.message();
  h.b = rbody.size();
  h.c = static_cast<uint64_t>(s.code());
  if (!s.ok()) {
    LogLimited("refused region for " + conn->peer + ": " + s.message());
  }
  Status sent = SendFrame(conn, h, rbody, Deadline(config_.timeout_ms));
  if (!sent.ok()) CloseConnection(conn, sent);
}

void Engine::RefuseWriter(const std::string& region_name, const Status& why) {
  // Caller holds mu_. The writer already opened the region with another
  // plan: tell it why its data is refused, then drop it (on an engine
  // thread: the send may wait up to its deadline, not under mu_).
  auto it = data_regions_.find(region_name);
  if (it == data_regions_.end() || !it->second->writer) return;
  std::shared_ptr<Connection> writer = it->second->writer;
  Schedule([this, writer, why] {
    FrameHeader h;
    h.type = kError;
    h.b = why.message().size();
    SendFrame(writer, h, why.message(), Deadline(kHandshakeTimeoutMs));
    CloseConnection(writer, why);
  });
}

// ---------------------------------------------------------------------------
// Send.

Status Engine::ClaimSend(const SlotSpec& spec, SendTicket* ticket,
                         uint64_t call) {
  if (!started_) return NotStarted();
  SendSlot* slot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& entry = send_slots_[SlotKey(spec)];
    if (!entry) {
      TF_RDMA_RETURN_IF_ERROR(CheckNewSlot(spec, config_.task));
      entry.reset(new SendSlot());
      entry->spec = spec;
      if (spec.match_calls) {
        entry->issued.assign(spec.depth, 0);
        entry->busy.assign(spec.depth, 0);
      }
    } else {
      TF_RDMA_RETURN_IF_ERROR(CheckSameSlot(spec, entry->spec));
    }
    slot = entry.get();
  }
  ticket->slot = slot;
  ticket->call = call;
  ticket->timeout_ms = TimeoutFor(spec);
  if (spec.match_calls) return Status::Ok();  // the copy is chosen later
  std::lock_guard<std::mutex> lock(slot->mu);
  TF_RDMA_RETURN_IF_ERROR(ClaimStep(&slot->steps, spec, &ticket->step));
  ticket->copy = CopyOf(spec, ticket->step);
  return Status::Ok();
}

Status Engine::BindSendSlot(SendSlot* slot, const Deadline& deadline,
                            SendBinding* out) {
  std::lock_guard<std::mutex> lock(slot->mu);
  const SlotSpec& spec = slot->spec;
  Status lost;
  if (slot->bound) {
    if (!slot->conn->gone.load(std::memory_order_acquire)) {
      *out = SendBinding{slot->conn, slot->data_handle};
      return Status::Ok();
    }
    // The connection was lost. Dial again, briefly: the peer may be back
    // (or restarted, see "Restarted peers"); a peer that is gone fails the
    // op within kRedialMs with why, not at its timeout.
    lost = CheckPeerAlive(slot->conn, "");
    if (lost.ok()) lost = Unavailable("the connection to " + spec.peer +
                                      " was lost");
    slot->bound = false;
  }
  std::shared_ptr<Connection> conn;
  Status dialed = GetConnection(
      spec.peer,
      lost.ok() ? deadline
                : Deadline(std::min<int64_t>(kRedialMs, deadline.RemainingMs())),
      &conn);
  if (!dialed.ok()) {
    return lost.ok() ? dialed
                     : Status(lost.code(), lost.message() +
                                               "; dialling it again: " +
                                               dialed.message());
  }
  // Several slots share a region; whichever binds first opens it, the others
  // wait for it here and then share its connection, handle and credits.
  SendRegion* region;
  {
    std::lock_guard<std::mutex> elock(mu_);
    auto& entry = send_regions_[spec.region];
    if (entry == nullptr) {
      entry.reset(new SendRegion);
      entry->peer = spec.peer;
    }
    region = entry.get();
  }
  std::lock_guard<std::mutex> rlock(region->mu);
  bool open;
  std::string refusal;
  bool tell = false;
  {
    std::lock_guard<std::mutex> sl(region->state_mu);
    refusal = region->refusal;
    tell = !refusal.empty() && !region->refusal_told;
    if (tell) region->refusal_told = true;
    open = region->open && region->conn == conn;
  }
  if (!refusal.empty()) {
    // The reader restarted: tell the new process too, so that its recvs
    // fail now with the reason rather than wait for data that never comes.
    if (tell && region->credit_region != nullptr) {
      int ignored = -1;
      OpenRemoteRegion(conn, spec.region, spec.region_bytes, spec.plan_hash,
                       region->credit_region->id,
                       *region->credit_region->memory, deadline, &ignored,
                       refusal);
    }
    return FailedPrecondition(refusal);
  }
  if (!open) {
    TF_RDMA_RETURN_IF_ERROR(OpenSendRegion(spec, conn, deadline, region));
  }
  {
    std::lock_guard<std::mutex> dl(slot->dynamic_mu);
    // A dynamic slot's payload area was opened through the old connection:
    // the next tensor opens a new generation through this one.
    if (slot->conn != region->conn) slot->capacity = 0;
  }
  slot->conn = region->conn;
  slot->data_handle = region->data_handle;
  slot->credits = region->credits;
  slot->credits_id = region->credits_id;
  slot->bound = true;
  *out = SendBinding{slot->conn, slot->data_handle};
  return Status::Ok();
}

// Asks the peer to set up (or find) its region `name` of `size` bytes that
// this process will write, telling it where our credit region is; returns
// the transport handle of the peer's region.
Status Engine::OpenRemoteRegion(const std::shared_ptr<Connection>& conn,
                                const std::string& name, uint64_t size,
                                const std::string& plan_hash,
                                uint32_t credits_id, const Region& credits,
                                const Deadline& deadline, int* handle,
                                const std::string& refusal) {
  RegionDescriptor exposed;
  TF_RDMA_RETURN_IF_ERROR(conn->pair->Expose(credits_id, credits, &exposed));
  std::map<std::string, std::string> request = {
      {"name", name}, {"size", std::to_string(size)}, {"plan_hash", plan_hash}};
  if (!refusal.empty()) request["refusal"] = refusal;
  EncodeDescriptor(exposed, "credit_", &request);
  std::map<std::string, std::string> reply;
  TF_RDMA_RETURN_IF_ERROR(Request(conn, request, deadline, &reply));
  return conn->pair->AddRemoteRegion(DecodeDescriptor(reply, ""), handle);
}

Status Engine::OpenSendRegion(const SlotSpec& spec,
                              const std::shared_ptr<Connection>& conn,
                              const Deadline& deadline, SendRegion* region) {
  // Caller holds region->mu.
  if (region->credit_region == nullptr) {
    std::lock_guard<std::mutex> elock(mu_);
    TF_RDMA_RETURN_IF_ERROR(NewLocalRegion(spec.region + "#credit",
                                           spec.credit_bytes, spec.plan_hash,
                                           spec.peer,
                                           &region->credit_region));
  }
  LocalRegion* credits = region->credit_region;
  {
    std::lock_guard<std::mutex> cl(conn->mu);
    conn->peer_writable.insert(credits->id);
  }
  int data_handle = -1;
  TF_RDMA_RETURN_IF_ERROR(OpenRemoteRegion(
      conn, spec.region, spec.region_bytes, spec.plan_hash, credits->id,
      *credits->memory, deadline, &data_handle));
  std::lock_guard<std::mutex> elock(mu_);
  std::lock_guard<std::mutex> sl(region->state_mu);
  if (!region->refusal.empty()) return FailedPrecondition(region->refusal);
  region->conn = conn;
  region->data_handle = data_handle;
  region->credits = credits->memory.get();
  region->credits_id = credits->id;
  region->open = true;
  return Status::Ok();
}

namespace {

std::atomic<uint64_t>* CreditWord(Region* credits, const SlotSpec& spec,
                                  uint64_t copy) {
  uint64_t line = static_cast<uint64_t>(spec.credit_index) * spec.depth + copy;
  return credits->Word(line * kCreditLineBytes);
}

// The credit value that frees the copy for `step`.
uint64_t CreditNeeded(const SlotSpec& spec, uint64_t step) {
  return step > static_cast<uint64_t>(spec.depth) ? step - spec.depth : 0;
}

}  // namespace

bool Engine::SendProgress(const SlotSpec& spec, uint64_t* written,
                          uint64_t* released) {
  SendSlot* slot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = send_slots_.find(SlotKey(spec));
    if (it == send_slots_.end()) return false;
    slot = it->second.get();
  }
  std::lock_guard<std::mutex> lock(slot->mu);
  if (slot->credits == nullptr) return false;
  *written = slot->steps.claimed;
  *released = 0;
  for (int64_t c = 0; c < slot->spec.depth; ++c) {
    *released = std::max<uint64_t>(
        *released, CreditWord(slot->credits, slot->spec, c)
                       ->load(std::memory_order_acquire));
  }
  return true;
}

// True if the slot is connected and the copy for the ticket's step is free.
bool Engine::CreditReady(const SendTicket& ticket) const {
  SendSlot* slot = ticket.slot;
  if (!slot->bound.load(std::memory_order_acquire)) return false;
  const SlotSpec& spec = slot->spec;
  if (spec.match_calls) {
    std::lock_guard<std::mutex> lock(slot->mu);
    for (int64_t c = 0; c < spec.depth; ++c) {
      if (!slot->busy[c] &&
          CreditWord(slot->credits, spec, c)->load(std::memory_order_acquire) >=
              slot->issued[c]) {
        return true;
      }
    }
    return false;
  }
  return CreditWord(slot->credits, spec, ticket.copy)
             ->load(std::memory_order_acquire) >=
         CreditNeeded(spec, ticket.step);
}

bool Engine::TrySendNow(const SendTicket& ticket, const void* data,
                        Status* status) {
  if (!CreditReady(ticket)) return false;
  *status = FinishSend(ticket, data);
  return true;
}

bool Engine::TrySendDynamicNow(const SendTicket& ticket, const void* data,
                               const DynamicMeta& meta, Status* status) {
  if (!CreditReady(ticket)) return false;
  *status = FinishSendDynamic(ticket, data, meta);
  return true;
}

Status Engine::FinishSend(const SendTicket& ticket, const void* data) {
  Status s = SendStep(ticket, data, nullptr);
  if (!s.ok() && !ticket.slot->spec.match_calls) {
    std::lock_guard<std::mutex> lock(ticket.slot->mu);
    GiveBackStep(&ticket.slot->steps, ticket.step, s);
  }
  return s;
}

Status Engine::FinishSendDynamic(const SendTicket& ticket, const void* data,
                                 const DynamicMeta& meta) {
  Status s = SendStep(ticket, data, &meta);
  if (!s.ok() && !ticket.slot->spec.match_calls) {
    std::lock_guard<std::mutex> lock(ticket.slot->mu);
    GiveBackStep(&ticket.slot->steps, ticket.step, s);
  }
  return s;
}

// Writes a dynamic step's bytes into the current payload area, opening a
// larger one first if they do not fit, and records its generation in meta.
Status Engine::WriteDynamicPayload(const SendTicket& ticket,
                                   const SendBinding& binding,
                                   const void* data, DynamicMeta* meta,
                                   const Deadline& deadline) {
  SendSlot* slot = ticket.slot;
  const SlotSpec& spec = slot->spec;
  if (meta->nbytes == 0) {
    meta->generation = 0;
    return Status::Ok();
  }
  uint64_t generation, capacity;
  int handle;
  {
    std::lock_guard<std::mutex> lock(slot->dynamic_mu);
    if (meta->nbytes > slot->capacity) {
      uint64_t wanted = std::max<uint64_t>(kPageBytes, 2 * slot->capacity);
      while (wanted < meta->nbytes) wanted *= 2;
      uint64_t size = kDynamicHeaderBytes + wanted * spec.depth;
      std::string name = spec.region + "#" + spec.tensor_name + "#" +
                         std::to_string(slot->generation + 1);
      int new_handle = -1;
      TF_RDMA_RETURN_IF_ERROR(OpenRemoteRegion(
          binding.conn, name, size, spec.plan_hash, slot->credits_id,
          *slot->credits, deadline, &new_handle));
      slot->generation += 1;
      slot->capacity = wanted;
      slot->payload_handle = new_handle;
    }
    generation = slot->generation;
    capacity = slot->capacity;
    handle = slot->payload_handle;
  }
  uint64_t copy = ticket.copy;
  meta->generation = generation;
  return binding.conn->pair->Write(
      handle, kDynamicHeaderBytes + copy * capacity, data, meta->nbytes,
      copy * kCreditLineBytes, ticket.step, deadline);
}

Status Engine::SendStep(SendTicket ticket, const void* data,
                        const DynamicMeta* dynamic) {
  SendSlot* slot = ticket.slot;
  const SlotSpec& spec = slot->spec;
  std::string what = "tf_rdma send of " +
                     spec.Describe(spec.match_calls ? ticket.call : ticket.step);
  Deadline deadline(ticket.timeout_ms);
  SendBinding bound;
  Status s = BindSendSlot(slot, deadline, &bound);
  const std::shared_ptr<Connection>& conn = bound.conn;
  if (!s.ok()) {
    return s.code() == Code::kDeadlineExceeded
               ? DeadlineExceeded(what + ": " + s.message())
               : s.Prefixed(what);
  }
  if (spec.match_calls) {
    TF_RDMA_RETURN_IF_ERROR(AcquireCopy(&ticket, conn, deadline, what));
    // The call's id first, then the data and the step's notice: a reader
    // that sees the notice sees the id (writes on a pair apply in order).
    s = conn->pair->Write(bound.data_handle, 0, nullptr, 0,
                          CopyOffset(spec, ticket.copy) + kCallWordOffset,
                          ticket.call, deadline);
  } else {
    s = WaitForWord(CreditWord(slot->credits, spec, ticket.copy),
                    CreditNeeded(spec, ticket.step), deadline,
                    [&] { return CheckPeerAlive(conn, what); });
  }
  if (!s.ok() && !spec.match_calls) {
    if (s.code() == Code::kDeadlineExceeded) {
      return DeadlineExceeded(
          what + ": " + s.message() + " waiting for the receiver to release "
          "the slot it used at step " +
          std::to_string(CreditNeeded(spec, ticket.step)));
    }
    return s;
  }
  DynamicMeta meta;
  if (dynamic != nullptr) {
    // The payload first, then the meta with the step's notice: the reader
    // sees the notice only after the bytes it describes (same connection,
    // writes applied in order).
    meta = *dynamic;
    if (s.ok()) s = WriteDynamicPayload(ticket, bound, data, &meta, deadline);
    data = &meta;
  }
  uint64_t copy = CopyOffset(spec, ticket.copy);
  if (s.ok()) {
    uint64_t nbytes = spec.nbytes;
    if (dynamic == nullptr && ticket.nbytes != 0 && ticket.nbytes < nbytes) {
      nbytes = ticket.nbytes;
    }
    s = conn->pair->Write(bound.data_handle, copy + kSlotHeaderBytes, data,
                          nbytes, copy, ticket.step, deadline);
  }
  if (spec.match_calls) {
    std::lock_guard<std::mutex> lock(slot->mu);
    if (s.ok()) slot->issued[ticket.copy] = ticket.step;
    slot->busy[ticket.copy] = 0;
  }
  if (!s.ok()) {
    if (conn->pair->broken()) CloseConnection(conn, s);
    if (s.code() == Code::kDeadlineExceeded) {
      return DeadlineExceeded(what + ": " + s.message());
    }
    Status alive = CheckPeerAlive(conn, what);
    return alive.ok() ? s.Prefixed(what) : alive;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Matching calls (SlotSpec::match_calls).
//
// The in-order protocol pairs the writer's n-th send on a slot with the
// reader's n-th recv: each side counts its own ops. That is right while one
// call of a function runs at a time, and wrong as soon as calls overlap (two
// client threads calling one rewritten function, asynchronous training):
// the writer's step k and the reader's step k can then belong to different
// calls, and a call silently receives another call's tensor. A call that
// fails between its send and its recv leaves the two counts apart the same
// way.
//
// A rewritten function's ops therefore match by call instead. TensorFlow
// runs every component of one multi-device function call, on every task,
// with the same step id (it keys its own Send/Recv rendezvous by it), and
// each planned edge moves exactly once per call. So:
//   writer: take any copy that is free (not being written, and released by
//     the reader since its last write), give it the slot's next step, write
//     the call's id into the copy's header (kCallWordOffset), then the data
//     with the step as the notice.
//   reader: take the copy whose notice is newer than what it last took from
//     that copy and whose header names its own call; release it as before
//     (the copy's credit word := its step).
// Copies are chosen when the data is written, not when an op claims its
// step: with copies bound in claim order, two calls that reach two slots in
// opposite orders could each hold the copy the other waits for. With free
// choice, a call that waits for a copy waits only for calls that will finish
// without it, as long as no more than `depth` calls are in flight, which the
// Python side bounds (tf_rdma/decorator.py). More calls in flight than that
// (say, two client processes) are still correct, but may wait for each
// other until the timeout.
//
// A copy no recv will ever take — its call's recv failed (Abandon), or never
// ran because the call failed elsewhere — would keep its copy forever. The
// reader drops such copies when it sees them: at once for a call whose recv
// failed, and after the slot's timeout for any other call's copy that nobody
// took (a live call's recv starts with its call, long before that).
//
// Cost: one extra notice-only write per send (the call id: a store on shm, a
// frame header on tcp, a message on verbs) and a scan of `depth` header
// words per recv.

Status Engine::AcquireCopy(SendTicket* ticket,
                           const std::shared_ptr<Connection>& conn,
                           const Deadline& deadline, const std::string& what) {
  SendSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  std::vector<WordWatch> watch;
  Clock::time_point next_check = Clock::now();
  while (true) {
    bool writing = false;  // a copy is busy: it frees without a notice
    watch.clear();
    {
      std::lock_guard<std::mutex> lock(slot->mu);
      for (int64_t c = 0; c < spec.depth; ++c) {
        std::atomic<uint64_t>* credit = CreditWord(slot->credits, spec, c);
        uint64_t released = credit->load(std::memory_order_acquire);
        if (slot->busy[c]) {
          writing = true;
        } else if (released >= slot->issued[c]) {
          slot->busy[c] = 1;
          ticket->copy = static_cast<uint64_t>(c);
          ticket->step = ++slot->steps.claimed;
          return Status::Ok();
        }
        watch.push_back(
            WordWatch{credit, static_cast<uint32_t>(released), true});
      }
    }
    Clock::time_point now = Clock::now();
    if (now >= deadline.at()) {
      return DeadlineExceeded(
          what + ": timed out after " + std::to_string(deadline.timeout_ms()) +
          " ms waiting for the receiver to release one of the slot's " +
          std::to_string(spec.depth) + " copies (the calls in flight hold " +
          "them)");
    }
    if (now >= next_check) {
      TF_RDMA_RETURN_IF_ERROR(CheckPeerAlive(conn, what));
      next_check = now + std::chrono::milliseconds(kCheckEveryMs);
    }
    Clock::time_point until = std::min(deadline.at(), next_check);
    if (writing) {
      until = std::min(until, now + std::chrono::microseconds(20));
    }
    if (!WaitForAnyWord(watch.data(), static_cast<int>(watch.size()), until)) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

bool Engine::MatchRecv(RecvTicket* ticket, bool take) {
  RecvSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  Region* memory = slot->region->memory.get();
  std::vector<RecvTicket> dropped;
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    Clock::time_point now{};
    for (int64_t c = 0; c < spec.depth; ++c) {
      uint64_t at = CopyOffset(spec, c);
      uint64_t step = memory->Word(at)->load(std::memory_order_acquire);
      if (step <= slot->taken[c]) continue;
      uint64_t call =
          memory->Word(at + kCallWordOffset)->load(std::memory_order_relaxed);
      auto gone = std::find(slot->abandoned.begin(), slot->abandoned.end(),
                            call);
      bool drop = gone != slot->abandoned.end();
      if (drop) {
        slot->abandoned.erase(gone);
      } else if (call == ticket->call) {
        if (!found || step < ticket->step) {
          found = true;
          ticket->step = step;
          ticket->copy = static_cast<uint64_t>(c);
        }
        continue;
      } else {
        if (now == Clock::time_point{}) now = Clock::now();
        if (slot->seen_step[c] != step) {
          slot->seen_step[c] = step;
          slot->seen_at[c] = now;
        }
        drop = now - slot->seen_at[c] >
               std::chrono::milliseconds(TimeoutFor(spec));
      }
      if (drop) {
        slot->taken[c] = step;
        RecvTicket orphan = *ticket;
        orphan.step = step;
        orphan.copy = static_cast<uint64_t>(c);
        orphan.call = call;
        dropped.push_back(orphan);
      }
    }
    if (found && take) slot->taken[ticket->copy] = ticket->step;
  }
  for (const RecvTicket& orphan : dropped) {
    Log("dropped the " + spec.Describe(orphan.call) +
        ": no recv of that call took it (the call failed)");
    Release(orphan);
  }
  if (found) {
    ticket->payload =
        memory->data() + CopyOffset(spec, ticket->copy) + kSlotHeaderBytes;
  }
  return found;
}

Status Engine::WaitForMatch(RecvTicket* ticket, const Deadline& deadline) {
  RecvSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  Region* memory = slot->region->memory.get();
  std::string what = "tf_rdma recv of " + spec.Describe(ticket->call);
  std::vector<WordWatch> watch(spec.depth);
  Clock::time_point next_check =
      Clock::now() + std::chrono::milliseconds(kCheckEveryMs);
  while (true) {
    for (int64_t c = 0; c < spec.depth; ++c) {
      const std::atomic<uint64_t>* word = memory->Word(CopyOffset(spec, c));
      watch[c] = WordWatch{
          word,
          static_cast<uint32_t>(word->load(std::memory_order_acquire)), true};
    }
    if (MatchRecv(ticket, /*take=*/false)) return Status::Ok();
    Clock::time_point now = Clock::now();
    if (now >= deadline.at()) {
      return RecvTimedOut(slot, what,
                          DeadlineExceeded("timed out after " +
                                           std::to_string(deadline.timeout_ms()) +
                                           " ms"));
    }
    if (now >= next_check) {
      TF_RDMA_RETURN_IF_ERROR(RecvCheck(slot, what));
      next_check = now + std::chrono::milliseconds(kCheckEveryMs);
    }
    if (!WaitForAnyWord(watch.data(), static_cast<int>(watch.size()),
                        std::min(deadline.at(), next_check))) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void Engine::Abandon(const RecvTicket& ticket) {
  {
    std::lock_guard<std::mutex> lock(ticket.slot->mu);
    std::deque<uint64_t>& abandoned = ticket.slot->abandoned;
    abandoned.push_back(ticket.call);
    if (abandoned.size() > static_cast<size_t>(kMaxSlotDepth)) {
      abandoned.pop_front();
    }
  }
  RecvTicket scan = ticket;
  MatchRecv(&scan, /*take=*/false);  // drops the copy if it already landed
}

// ---------------------------------------------------------------------------
// Recv.

Status Engine::ClaimRecv(const SlotSpec& spec, RecvTicket* ticket,
                         uint64_t call) {
  if (!started_) return NotStarted();
  RecvSlot* slot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& entry = recv_slots_[SlotKey(spec)];
    if (!entry) {
      TF_RDMA_RETURN_IF_ERROR(CheckNewSlot(spec, config_.task));
      LocalRegion* region = nullptr;
      Status s = FindOrCreateDataRegion(spec.region, spec.region_bytes,
                                        spec.plan_hash, spec.peer, &region);
      if (!s.ok()) {
        RefuseWriter(spec.region, s);
        return s;
      }
      entry.reset(new RecvSlot());
      entry->spec = spec;
      entry->region = region;
      if (spec.match_calls) {
        entry->taken.assign(spec.depth, 0);
        entry->seen_step.assign(spec.depth, 0);
        entry->seen_at.assign(spec.depth, Clock::time_point{});
      }
    } else {
      TF_RDMA_RETURN_IF_ERROR(CheckSameSlot(spec, entry->spec));
    }
    slot = entry.get();
  }
  ticket->slot = slot;
  ticket->call = call;
  ticket->timeout_ms = TimeoutFor(spec);
  if (spec.match_calls) return Status::Ok();  // the copy is found later
  std::lock_guard<std::mutex> lock(slot->mu);
  TF_RDMA_RETURN_IF_ERROR(ClaimStep(&slot->steps, spec, &ticket->step));
  ticket->copy = CopyOf(spec, ticket->step);
  return Status::Ok();
}

bool Engine::TryRecvNow(RecvTicket* ticket) {
  RecvSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  if (spec.match_calls) return MatchRecv(ticket, /*take=*/true);
  uint64_t copy = CopyOffset(spec, ticket->copy);
  Region* memory = slot->region->memory.get();
  if (memory->Word(copy)->load(std::memory_order_acquire) < ticket->step) {
    return false;
  }
  ticket->payload = memory->data() + copy + kSlotHeaderBytes;
  return true;
}

bool Engine::PollRecv(RecvTicket* ticket) {
  if (TryRecvNow(ticket)) return true;
  // A slot whose data never lands within the poll (a recv that starts long
  // before its sender, as in a chain of hops started by one call) would
  // only hold TensorFlow's thread: after two misses in a row, poll only
  // every 8th step, to notice when the pattern changes.
  std::atomic<int>& misses = ticket->slot->poll_misses;
  uint32_t poll = ticket->slot->polls.fetch_add(1, std::memory_order_relaxed);
  if (misses.load(std::memory_order_relaxed) >= 2 && poll % 8 != 0) {
    return false;
  }
  if (PollRecvFor(ticket)) {
    misses.store(0, std::memory_order_relaxed);
    return true;
  }
  misses.fetch_add(1, std::memory_order_relaxed);
  return false;
}

bool Engine::PollRecvFor(RecvTicket* ticket) {
  Clock::time_point until =
      Clock::now() + std::chrono::microseconds(config_.poll_us);
  while (Clock::now() < until) {
    for (int i = 0; i < 32; ++i) {
      if (TryRecvNow(ticket)) return true;
      CpuRelax();
    }
  }
  return false;
}

Status Engine::FinishRecv(RecvTicket* ticket) {
  Deadline deadline(ticket->timeout_ms);
  while (!TryRecvNow(ticket)) {
    Status s = RecvStep(ticket, deadline);
    if (!s.ok()) {
      GiveBackRecv(ticket, s);
      return s;
    }
    if (!ticket->slot->spec.match_calls) return Status::Ok();
  }
  return Status::Ok();
}

void Engine::GiveBackRecv(RecvTicket* ticket, const Status& why) {
  if (ticket->slot->spec.match_calls) {
    Abandon(*ticket);
    return;
  }
  std::lock_guard<std::mutex> lock(ticket->slot->mu);
  GiveBackStep(&ticket->slot->steps, ticket->step, why);
}

Status Engine::RecvCheck(RecvSlot* slot, const std::string& what) {
  std::shared_ptr<Connection> writer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!slot->region->refusal.empty()) {
      return FailedPrecondition(what + ": " + slot->region->refusal);
    }
    writer = slot->region->writer;
  }
  return CheckPeerAlive(writer, what);
}

Status Engine::RecvTimedOut(RecvSlot* slot, const std::string& what,
                            const Status& timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  return DeadlineExceeded(
      what + ": " + timeout.message() + " waiting for the data" +
      (slot->region->writer ? "" : " (the peer never connected)"));
}

Status Engine::RecvStep(RecvTicket* ticket, const Deadline& deadline) {
  RecvSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  if (spec.match_calls) return WaitForMatch(ticket, deadline);
  std::string what = "tf_rdma recv of " + spec.Describe(ticket->step);
  uint64_t copy = CopyOffset(spec, ticket->copy);
  Region* memory = slot->region->memory.get();
  Status s = WaitForWord(memory->Word(copy), ticket->step, deadline,
                         [&] { return RecvCheck(slot, what); });
  if (!s.ok()) {
    if (s.code() == Code::kDeadlineExceeded) {
      return RecvTimedOut(slot, what, s);
    }
    return s;
  }
  ticket->payload = memory->data() + copy + kSlotHeaderBytes;
  return Status::Ok();
}

Status Engine::ResolveDynamic(RecvTicket* ticket, DynamicMeta* meta) {
  RecvSlot* slot = ticket->slot;
  const SlotSpec& spec = slot->spec;
  std::memcpy(meta, ticket->payload, sizeof(DynamicMeta));
  std::string what = "tf_rdma recv of " +
                     spec.Describe(spec.match_calls ? ticket->call
                                                    : ticket->step);
  if (meta->rank > static_cast<uint64_t>(kMaxDynamicRank)) {
    return InvalidArgument(what + ": the sender wrote rank " +
                           std::to_string(meta->rank) + ", more than " +
                           std::to_string(kMaxDynamicRank));
  }
  if (meta->nbytes == 0) return Status::Ok();  // payload stays the meta
  std::string name = spec.region + "#" + spec.tensor_name + "#" +
                     std::to_string(meta->generation);
  LocalRegion* area = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = data_regions_.find(name);
    if (it != data_regions_.end()) area = it->second;
  }
  if (area == nullptr || area->peer != spec.peer ||
      area->plan_hash != spec.plan_hash) {
    return Internal(what + ": payload area '" + name +
                    "' of the sender's generation " +
                    std::to_string(meta->generation) +
                    " was never opened by " + spec.peer);
  }
  uint64_t size = area->memory->size();
  uint64_t capacity =
      size > kDynamicHeaderBytes ? (size - kDynamicHeaderBytes) / spec.depth : 0;
  if (meta->nbytes > capacity) {
    return InvalidArgument(what + ": " + std::to_string(meta->nbytes) +
                           " bytes do not fit the payload area '" + name +
                           "' of " + std::to_string(capacity) +
                           " bytes per copy");
  }
  ticket->payload =
      area->memory->data() + kDynamicHeaderBytes + ticket->copy * capacity;
  return Status::Ok();
}

void Engine::Release(const RecvTicket& ticket) {
  RecvSlot* slot = ticket.slot;
  const SlotSpec& spec = slot->spec;
  std::shared_ptr<Connection> writer;
  int handle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writer = slot->region->writer;
    handle = slot->region->credit_handle;
  }
  if (!writer || stopping_) return;
  uint64_t line =
      static_cast<uint64_t>(spec.credit_index) * spec.depth + ticket.copy;
  Status s = writer->pair->Write(handle, 0, nullptr, 0,
                                 line * kCreditLineBytes, ticket.step,
                                 Deadline(config_.timeout_ms));
  if (!s.ok() && writer->pair->broken()) CloseConnection(writer, s);
  if (!s.ok() && CheckPeerAlive(writer, "").ok()) {
    Log("could not return the credit of " +
        spec.Describe(spec.match_calls ? ticket.call : ticket.step) + ": " +
        s.message());
  }
}

// ---------------------------------------------------------------------------
// Waiting for a recv's data without a thread per wait: the poller, and sends
// that help it.
//
// A recv whose data is not there after its inline poll (PollRecv) needs
// something to wait for it. That used to be one engine thread per wait,
// asleep on the futex of its sequence word, which then called the op's
// `done`; TensorFlow's executor queues the op's successors on its inter-op
// pool, which woke one of its threads for them. In a client-driven chain of
// 4 KiB hops between two tasks (bench/p2p.py, 2-vCPU VM) a hop took about
// 140 us on average, of which about 60 us was the futex wake-up of the
// engine thread (a sleeping vCPU has to be woken by the hypervisor) and
// about 50 us the wake-up of TensorFlow's thread for the next op; the memcpy
// itself is a microsecond. In such a chain every recv starts with the call
// and waits for many hops, so the inline poll cannot catch the data.
//
// Two changes remove both wake-ups from a hop:
//
// - *Sends help.* A send op that has written its data, on TensorFlow's
//   thread, polls the process's waiting recvs for up to kHelpPollFactor x
//   poll_us (200 us by default) and completes the first whose data lands,
//   right there (HelpRecvs). An answer often follows a send (a chain, a
//   ping-pong, a request and its reply); completing it on an inter-op
//   thread lets the executor queue the successors on that thread's own
//   queue, which it runs next: nothing is woken, and a hop of the chain
//   costs about what the ping-pong's does. Only the thread that just sent
//   spins, so on two vCPUs at most one thread per task burns a core (an
//   earlier variant with a spinning thread per process was slower: the
//   spinners took the cores the executor needed).
// - *One poller per process* owns every other wait: instead of a thread per
//   wait, one thread sleeps in a single futex_waitv (Linux >= 5.16) on the
//   sequence words of up to 127 waits plus its doorbell (new waits, lost
//   connections), completes whatever landed, and sleeps again. It never
//   spins: an idle wait costs no CPU. It wakes at least every kCheckEveryMs
//   to check peers and deadlines as WaitForWord does, so every wait stays
//   bounded by its timeout and a dead peer or a refused plan fails it with
//   the same messages. Waits beyond 127, or all of them on a kernel without
//   futex_waitv, are handed to engine threads (RecvStep) as before.
//
// A wait is completed exactly once: whoever sets `taken` first (a helping
// send, the poller, an engine thread) runs `done`; the others drop it.
// Cost: a send with recvs waiting in its process holds its inter-op thread
// for up to 200 us when no answer comes (never when poll_us is 0), and
// `done` runs on whichever thread completes the wait, so it must be short
// (TensorFlow's only queues the successors). Sends that wait for a credit
// still use engine threads: in practice their credit is already there.

struct Engine::PendingRecv {
  Engine* engine;
  RecvTicket ticket;
  RecvDone done;
  Deadline deadline{0};
  // The sequence words to watch: the copy's, or with match_calls every
  // copy's (the data may land in any).
  std::vector<const std::atomic<uint64_t>*> words;
  Clock::time_point next_check;       // poller thread only
  bool handed_off = false;            // poller thread only
  std::atomic<bool> taken{false};     // whoever sets it completes the wait

  bool Landed() {
    if (ticket.slot->spec.match_calls) {
      RecvTicket peek = ticket;
      return engine->MatchRecv(&peek, /*take=*/false);
    }
    return words[0]->load(std::memory_order_acquire) >= ticket.step;
  }
};

void Engine::WaitRecvAsync(const RecvTicket& ticket, RecvDone done) {
  const SlotSpec& spec = ticket.slot->spec;
  Region* memory = ticket.slot->region->memory.get();
  auto p = std::make_shared<PendingRecv>();
  p->engine = this;
  p->ticket = ticket;
  p->done = std::move(done);
  p->deadline = Deadline(ticket.timeout_ms);
  if (spec.match_calls) {
    for (int64_t c = 0; c < spec.depth; ++c) {
      p->words.push_back(memory->Word(CopyOffset(spec, c)));
    }
  } else {
    p->words.push_back(memory->Word(CopyOffset(spec, ticket.copy)));
  }
  p->next_check = Clock::now() + std::chrono::milliseconds(kCheckEveryMs);
  std::call_once(poller_once_, [this] {
    std::thread([this] { PollerLoop(); }).detach();
  });
  {
    std::lock_guard<std::mutex> lock(poller_mu_);
    waiting_.push_back(p);
    waiting_count_.store(waiting_.size(), std::memory_order_relaxed);
  }
  RingPoller();
}

void Engine::RingPoller() {
  // Pairs with the poller's store of poller_asleep_ then load of the bell:
  // either it sees the new bell value, or we see it asleep and wake it.
  poller_bell_.fetch_add(1, std::memory_order_seq_cst);
  if (poller_asleep_.load(std::memory_order_seq_cst)) {
    WakeLocalWord(&poller_bell_);
  }
}

bool Engine::TakePending(const std::shared_ptr<PendingRecv>& p,
                         const Status& s) {
  if (p->taken.exchange(true, std::memory_order_acq_rel)) return false;
  RecvTicket ticket = p->ticket;
  if (s.ok() && !TryRecvNow(&ticket)) {
    // match_calls: another recv of the same call took the copy first.
    p->taken.store(false, std::memory_order_release);
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(poller_mu_);
    auto it = std::find(waiting_.begin(), waiting_.end(), p);
    if (it != waiting_.end()) waiting_.erase(it);
    waiting_count_.store(waiting_.size(), std::memory_order_relaxed);
  }
  if (!s.ok()) GiveBackRecv(&ticket, s);
  p->done(s, ticket);
  return true;
}

bool Engine::HelpRecvs() {
  if (waiting_count_.load(std::memory_order_relaxed) == 0) return false;
  int64_t budget_us = config_.poll_us * kHelpPollFactor;
  if (budget_us <= 0) return false;
  // When helping keeps missing (answers come later than the budget, or the
  // cores are busy with other work, where spinning only delays the peer),
  // help only every 8th time, to notice when that changes.
  int misses = help_misses_.load(std::memory_order_relaxed);
  if (misses >= 2 && help_calls_.fetch_add(1, std::memory_order_relaxed) % 8) {
    return false;
  }
  bool helped = HelpRecvsFor(budget_us);
  if (helped) {
    help_misses_.store(0, std::memory_order_relaxed);
  } else {
    help_misses_.fetch_add(1, std::memory_order_relaxed);
  }
  return helped;
}

bool Engine::HelpRecvsFor(int64_t budget_us) {
  Clock::time_point until = Clock::now() + std::chrono::microseconds(budget_us);
  std::vector<std::shared_ptr<PendingRecv>> mine;
  uint32_t seen = ~0u;
  for (int round = 0;; ++round) {
    uint32_t bell = poller_bell_.load(std::memory_order_acquire);
    if (bell != seen) {  // new waits (or a lost peer): look again
      seen = bell;
      std::lock_guard<std::mutex> lock(poller_mu_);
      mine = waiting_;
      if (mine.empty()) return false;
    }
    for (const auto& p : mine) {
      if (!p->taken.load(std::memory_order_relaxed) && p->Landed() &&
          TakePending(p, Status::Ok())) {
        return true;
      }
    }
    for (int i = 0; i < 16; ++i) CpuRelax();
    if ((round & 15) == 15) {
      if (Clock::now() >= until) return false;
      // Every ~15 us: let a thread that is ready on this core run (on a
      // busy machine it may be the one that has to answer).
      if ((round & 31) == 31) sched_yield();
    }
  }
}

void Engine::PollerLoop() {
  std::vector<std::shared_ptr<PendingRecv>> pending;
  std::vector<WordWatch> watch;
  uint32_t bell_seen = 0;
  while (true) {
    bell_seen = poller_bell_.load(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lock(poller_mu_);
      pending = waiting_;
    }
    Clock::time_point now = Clock::now();
    if (poller_recheck_.exchange(false)) {
      for (auto& p : pending) p->next_check = now;
    }
    size_t kept = 0;
    for (size_t i = 0; i < pending.size(); ++i) {
      std::shared_ptr<PendingRecv>& p = pending[i];
      if (p->taken.load(std::memory_order_relaxed)) continue;
      if (p->Landed()) {
        TakePending(p, Status::Ok());
        continue;
      }
      bool expired = now >= p->deadline.at();
      if (now >= p->next_check || expired) {
        RecvSlot* slot = p->ticket.slot;
        std::string what =
            "tf_rdma recv of " + slot->spec.Describe(p->ticket.step);
        Status s = RecvCheck(slot, what);
        if (s.ok() && expired) {
          s = p->Landed() ? Status::Ok()
                          : RecvTimedOut(slot, what,
                                         DeadlineExceeded(
                                             "timed out after " +
                                             std::to_string(
                                                 p->deadline.timeout_ms()) +
                                             " ms"));
          TakePending(p, s);
          continue;
        }
        if (!s.ok()) {
          TakePending(p, s);
          continue;
        }
        p->next_check = now + std::chrono::milliseconds(kCheckEveryMs);
      }
      if (!p->handed_off) pending[kept++] = p;
    }
    pending.resize(kept);

    // Sleep until a watched word moves, news, or the next check is due.
    // Waits beyond what one futex_waitv takes go to engine threads.
    Clock::time_point until = now + std::chrono::seconds(10);
    watch.clear();
    watch.push_back(WordWatch{&poller_bell_, bell_seen, false});
    bool landed = false;
    for (auto& p : pending) {
      if (watch.size() + p->words.size() >
              static_cast<size_t>(kMaxWatchedWords) ||
          !have_waitv_) {
        p->handed_off = true;
        Schedule([this, p] {
          // Until this call completes it (a match_calls copy can be taken
          // by a sibling recv of the same call between the wait and here).
          do {
            RecvTicket ticket = p->ticket;
            Status s = RecvStep(&ticket, p->deadline);
            if (!s.ok() && p->Landed()) s = Status::Ok();
            if (TakePending(p, s)) break;
          } while (!p->taken.load(std::memory_order_acquire));
        });
        continue;
      }
      for (const std::atomic<uint64_t>* word : p->words) {
        uint64_t v = word->load(std::memory_order_acquire);
        watch.push_back(WordWatch{word, static_cast<uint32_t>(v), true});
      }
      if (p->Landed()) landed = true;
      until = std::min(until, std::min(p->next_check, p->deadline.at()));
    }
    if (landed) continue;
    pending.clear();  // drop references while asleep
    poller_asleep_.store(true, std::memory_order_seq_cst);
    if (poller_bell_.load(std::memory_order_seq_cst) == bell_seen) {
      if (!WaitForAnyWord(watch.data(), static_cast<int>(watch.size()),
                          until)) {
        have_waitv_ = false;  // old kernel: engine threads from now on
      }
    }
    poller_asleep_.store(false, std::memory_order_relaxed);
  }
}

}  // namespace tf_rdma
