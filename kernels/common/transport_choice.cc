#include "kernels/common/transport_choice.h"

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <fstream>

#include "kernels/common/text.h"

namespace tf_rdma {
namespace {

bool Contains(const std::vector<std::string>& list, const std::string& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// A host string as compared: lower case, without an IPv6 address's
// brackets.
std::string Bare(const std::string& host) {
  std::string out = host;
  if (out.size() >= 2 && out.front() == '[' && out.back() == ']') {
    out = out.substr(1, out.size() - 2);
  }
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) {
    return static_cast<char>(std::tolower(c));
  });
  return out;
}

bool IsLoopbackAddress(const std::string& numeric) {
  return numeric.rfind("127.", 0) == 0 || numeric == "::1" ||
         numeric.rfind("::ffff:127.", 0) == 0;
}

bool OnThisMachine(const PairEnd& end) {
  return end.host_kind == HostKind::kLoopback ||
         end.host_kind == HostKind::kLocal;
}

std::string NameOf(const PairEnd& end, const char* otherwise) {
  return end.task.empty() ? otherwise : end.task;
}

// Whether the two ends share a host (transport_choice.h says what that
// means), and why.
bool SameHost(const PairEnd& a, const PairEnd& b, std::string* why) {
  if (a.identified && b.identified) {
    if (a.boot_id != b.boot_id) {
      *why = "different hosts (their boot ids differ)";
      return false;
    }
    if (a.netns != b.netns) {
      *why = "different network namespaces of one machine (each counts as "
             "a host)";
      return false;
    }
    *why = "one host (same boot id and network namespace)";
    return true;
  }
  if (a.host_kind == HostKind::kLoopback &&
      b.host_kind == HostKind::kLoopback) {
    *why = "both tasks are on loopback addresses of this host";
    return true;
  }
  if (OnThisMachine(a) && OnThisMachine(b)) {
    *why = "both tasks are on addresses of this host";
    return true;
  }
  if (!a.host.empty() && Bare(a.host) == Bare(b.host)) {
    *why = "both tasks are on host " + Printable(a.host);
    return true;
  }
  std::vector<std::string> elsewhere;
  for (const PairEnd* end : {&a, &b}) {
    if (OnThisMachine(*end)) continue;
    elsewhere.push_back(NameOf(*end, "one end") + " is on " +
                        (end->host.empty() ? std::string("a host not known")
                                           : Printable(end->host)));
  }
  *why = "different hosts: " + Join(elsewhere, ", ") +
         (elsewhere.size() == 1 ? " (not this machine)" : "");
  return false;
}

// The transports of `allowed` an end can use: verbs only with a device.
std::vector<std::string> Usable(const std::vector<std::string>& allowed,
                                Verbs verbs) {
  std::vector<std::string> out;
  for (const std::string& t : allowed) {
    if (t != "verbs" || verbs != Verbs::kUnusable) out.push_back(t);
  }
  return out;
}

}  // namespace

Status ParseTransportSetting(const std::string& setting,
                             std::vector<std::string>* out) {
  if (setting == "auto") {
    *out = {"verbs", "shm", "tcp"};
    return Status::Ok();
  }
  std::vector<std::string> names = Split(setting, ',');
  std::vector<std::string> seen;
  // Split drops empty pieces; "shm,,tcp" or ",shm" is refused, as
  // tf_rdma.settings refuses it.
  bool ok = !names.empty() &&
            names.size() == static_cast<size_t>(std::count(
                                 setting.begin(), setting.end(), ',')) + 1;
  for (const std::string& t : names) {
    ok = ok && (t == "verbs" || t == "shm" || t == "tcp") && !Contains(seen, t);
    seen.push_back(t);
  }
  if (!ok) {
    return InvalidArgument("transport '" + setting +
                           "' is not auto or a list of verbs, shm, tcp "
                           "without repeats");
  }
  *out = names;
  return Status::Ok();
}

const char* HostKindName(HostKind kind) {
  switch (kind) {
    case HostKind::kLoopback: return "loopback";
    case HostKind::kLocal: return "local";
    case HostKind::kRemote: return "remote";
    case HostKind::kUnknown: break;
  }
  return "unknown";
}

bool ParseHostKind(const std::string& name, HostKind* out) {
  for (HostKind k : {HostKind::kUnknown, HostKind::kLoopback, HostKind::kLocal,
                     HostKind::kRemote}) {
    if (name == HostKindName(k)) {
      *out = k;
      return true;
    }
  }
  return false;
}

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

HostKind ClassifyHost(const std::string& host,
                      const std::set<std::string>& local) {
  std::string bare = Bare(host);
  if (bare.empty()) return HostKind::kUnknown;
  if (bare == "localhost") return HostKind::kLoopback;
  struct addrinfo hints, *res = nullptr;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(bare.c_str(), nullptr, &hints, &res) != 0) {
    return HostKind::kRemote;
  }
  bool any = false, all_loopback = true, here = false;
  for (auto* a = res; a != nullptr; a = a->ai_next) {
    char text[NI_MAXHOST];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, text, sizeof(text), nullptr, 0,
                    NI_NUMERICHOST) != 0) {
      continue;
    }
    any = true;
    bool loopback = IsLoopbackAddress(text);
    all_loopback = all_loopback && loopback;
    here = here || loopback || local.count(text) > 0;
  }
  freeaddrinfo(res);
  if (any && all_loopback) return HostKind::kLoopback;
  return here ? HostKind::kLocal : HostKind::kRemote;
}

void ThisHost(std::string* boot_id, std::string* netns) {
  *boot_id = ReadFirstLine("/proc/sys/kernel/random/boot_id");
  char link[128] = {0};
  ssize_t n = readlink("/proc/self/ns/net", link, sizeof(link) - 1);
  if (n < 0) n = 0;
  link[n] = 0;
  *netns = link;
}

std::string ThisShm() {
  struct stat st;
  if (stat("/dev/shm", &st) != 0) return "";
  return std::to_string(static_cast<uint64_t>(st.st_dev)) + ":" +
         std::to_string(static_cast<uint64_t>(st.st_ino));
}

TransportChoice ChooseTransport(const PairEnd& chooser, const PairEnd& peer) {
  TransportChoice c;
  c.same_host = SameHost(chooser, peer, &c.host_reason);
  c.shared_shm = chooser.identified && peer.identified
                     ? c.same_host && !chooser.shm_id.empty() &&
                           chooser.shm_id == peer.shm_id
                     : c.same_host;
  const std::vector<std::string>& mine = chooser.allowed;
  const std::vector<std::string>& theirs =
      peer.allowed.empty() ? chooser.allowed : peer.allowed;
  // A setting with verbs and without tcp does not start an endpoint where
  // verbs is not usable (Engine::StartTransports).
  if (Contains(mine, "verbs") && !Contains(mine, "tcp") &&
      chooser.verbs == Verbs::kUnusable) {
    c.reason = "TF_RDMA_TRANSPORT=" + Join(mine, ",") +
               " asks for verbs, which is not usable here" +
               (chooser.verbs_detail.empty()
                    ? ""
                    : " (" + chooser.verbs_detail + ")") +
               ": the endpoint does not start";
    return c;
  }
  // Verbs needs a device at both ends; where an end's is not known, verbs is
  // the guess and `fallback` what the pair uses without it.
  bool verbs_possible =
      chooser.verbs != Verbs::kUnusable && peer.verbs != Verbs::kUnusable;
  bool verbs_sure =
      chooser.verbs == Verbs::kUsable && peer.verbs == Verbs::kUsable;
  auto pick = [&](bool with_verbs) -> std::string {
    for (const std::string& t : mine) {
      if (!Contains(theirs, t)) continue;
      if (t == "verbs" && !with_verbs) continue;
      if (t == "shm" && !c.shared_shm) continue;
      return t;
    }
    return "";
  };
  c.transport = pick(verbs_possible);
  if (c.transport == "verbs" && !verbs_sure) c.fallback = pick(false);
  const bool identified = chooser.identified && peer.identified;
  if (c.transport == "shm" && !identified) {
    // One host by the addresses, but containers with the host's network
    // have a /dev/shm each: the handshake compares them.
    c.shared_shm = false;
    c.fallback = pick(verbs_possible);
    c.shared_shm = true;
  }

  if (c.transport.empty()) {
    c.reason = "no common transport: " + NameOf(peer, "the peer") +
               " allows " + Printable(Join(Usable(theirs, peer.verbs), ",")) +
               ", " + NameOf(chooser, "this end") + " allows " +
               Printable(Join(Usable(mine, chooser.verbs), ",")) +
               (!c.same_host    ? " (different hosts)"
                : !c.shared_shm ? " (one host, but not one /dev/shm)"
                                : "");
  } else if (c.transport == "verbs") {
    const std::string& device = chooser.verbs == Verbs::kUsable
                                    ? chooser.verbs_detail
                                    : peer.verbs_detail;
    std::string otherwise = c.fallback.empty() ? "no transport" : c.fallback;
    if (verbs_sure) {
      c.reason = "both ends have a usable RDMA device" +
                 (device.empty() ? "" : " (" + device + ")");
    } else if (chooser.verbs == Verbs::kUsable) {
      c.reason = "RDMA device " + device +
                 " (when the other end has a usable device too; else " +
                 otherwise + ")";
    } else {
      c.reason = "verbs when both ends have a usable RDMA device; else " +
                 otherwise;
    }
  } else if (c.transport == "tcp" && c.same_host) {
    bool both_shm = Contains(mine, "shm") && Contains(theirs, "shm");
    c.reason = c.host_reason +
               (both_shm && !c.shared_shm
                    ? ", but each end has a /dev/shm of its own (a container "
                      "with the host's network, or a private mount), where "
                      "the other cannot open its segments"
                : both_shm
                    ? ", but tcp comes before shm in the transports allowed"
                    : ", but shm is not among the transports both ends "
                      "allow");
  } else if (c.transport == "shm" && identified) {
    c.reason = c.host_reason + ", and one /dev/shm";
  } else if (c.transport == "shm") {
    c.reason = c.host_reason + "; shm if both ends see one /dev/shm, which "
               "the handshake checks (containers with the host's network "
               "have one each), else " +
               (c.fallback.empty() ? "no transport" : c.fallback);
  } else {
    c.reason = c.host_reason;
  }
  return c;
}

}  // namespace tf_rdma
