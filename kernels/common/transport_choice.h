// Which transport a pair of tasks uses, and why: the one rule.
//
// The accepting end of a connection (the reader) chooses, in the handshake:
// the first transport of its own list (TF_RDMA_TRANSPORT; "auto" is verbs,
// shm, tcp) that the dialling end also offers and that fits the pair:
//   verbs  when both ends opened an RDMA device;
//   shm    when both run on one host;
//   tcp    always.
// Three places need the rule. The handshake decides with both ends'
// identities in hand. The engine's start-up log predicts, one line per
// peer, from the peer's address. `tf-rdma doctor`, the launcher and
// explain() predict for any pair of a cluster, without TensorFlow (they call
// this through tf_rdma/_native.py). ChooseTransport is the rule for all
// three; only what is known about the two ends differs.
//
// "One host" means the same boot of the same kernel and the same network
// namespace (network namespaces count as hosts, so that veth "hosts" on one
// machine use tcp). Where both ends' boot id and namespace are known (the
// handshake), they decide. One host is not enough for shm: containers with
// the host's network (Kubernetes hostNetwork pods, `docker run --network
// host`) share both and still have a /dev/shm each, whose segments the other
// cannot open. So the handshake also compares the two ends' /dev/shm
// directories by device and inode number (ThisShm): within one boot of one
// kernel, equal numbers are the very same directory, a bind mount of it
// included, and different ones are not; shm needs them equal. Where the
// identities are not known (a prediction from a cluster's addresses), the
// addresses decide: two ends are on one host when both are on loopback or
// on addresses of this machine, or when they have the same host string. That misses two names of one remote machine, and
// cannot see namespaces; the handshake, which decides, can.
#ifndef TF_RDMA_COMMON_TRANSPORT_CHOICE_H_
#define TF_RDMA_COMMON_TRANSPORT_CHOICE_H_

#include <set>
#include <string>
#include <vector>

#include "kernels/common/status.h"

namespace tf_rdma {

// The transports of a TF_RDMA_TRANSPORT setting, in order of preference:
// "auto" is {verbs, shm, tcp}; otherwise a comma-separated list of those
// names without repeats. InvalidArgument names the setting otherwise.
Status ParseTransportSetting(const std::string& setting,
                             std::vector<std::string>* out);

// What a host is to this machine, judged from its address.
enum class HostKind {
  kUnknown,   // not judged (counts as another machine)
  kLoopback,  // a loopback address (127.0.0.0/8, ::1, "localhost")
  kLocal,     // an address of one of this network namespace's interfaces
  kRemote,    // anything else, or a name that does not resolve
};
const char* HostKindName(HostKind kind);  // "loopback", ...
bool ParseHostKind(const std::string& name, HostKind* out);

// The numeric addresses of this network namespace's interfaces.
std::set<std::string> LocalAddresses();
// Judges `host` (a name, an IPv4 address, an IPv6 address with or without
// brackets) against `local` (LocalAddresses()); resolves names.
HostKind ClassifyHost(const std::string& host,
                      const std::set<std::string>& local);

// This process's host identity: the kernel's boot id and the network
// namespace ("net:[4026531840]"); "" where /proc does not say.
void ThisHost(std::string* boot_id, std::string* netns);
// This process's /dev/shm directory as "<device>:<inode>" (decimal); ""
// where it cannot be read.
std::string ThisShm();

// Whether an end can use verbs.
enum class Verbs {
  kUnknown,   // not known (a peer before its hello)
  kUsable,    // it opened an RDMA device
  kUnusable,  // it has none, or its setting does not ask for one
};

// What is known about one end of a pair.
struct PairEnd {
  std::string task;  // for the reasons ("/job:worker/task:0"); may be ""
  // Its TF_RDMA_TRANSPORT, parsed (ParseTransportSetting). Empty for the
  // peer: the same as the chooser's.
  std::vector<std::string> allowed;
  Verbs verbs = Verbs::kUnknown;
  std::string verbs_detail;  // the device (kUsable) or why none (kUnusable)
  // Its host identity (ThisHost, or the HELLO's host id field). Used only
  // when both ends have one: `identified` says so.
  bool identified = false;
  std::string boot_id;
  std::string netns;
  std::string shm_id;  // ThisShm(), when identified; "" if not known
  // Its endpoint's host as the cluster names it, and what that is to this
  // machine (ClassifyHost): the prediction's evidence.
  std::string host;
  HostKind host_kind = HostKind::kUnknown;
};

struct TransportChoice {
  std::string transport;  // "verbs", "shm", "tcp"; "" when none fits
  // When `transport` is verbs but an end's verbs is not known: the transport
  // the pair uses if it has no device after all; when it is shm but an end's
  // /dev/shm is not known (a prediction): the transport the pair uses if the
  // two ends have a /dev/shm each. "" if none would fit.
  std::string fallback;
  bool same_host = false;
  // Whether the two ends see one /dev/shm: when both are identified, their
  // /dev/shm ids are known and equal; otherwise as same_host.
  bool shared_shm = false;
  std::string host_reason;  // why the two ends are, or are not, on one host
  std::string reason;       // why this transport, or why none
};

// The transport `chooser` (the accepting end, or for a prediction the end
// that predicts) picks for the pair with `peer`. Pure: what is known about
// the ends is all it looks at.
TransportChoice ChooseTransport(const PairEnd& chooser, const PairEnd& peer);

}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_TRANSPORT_CHOICE_H_
