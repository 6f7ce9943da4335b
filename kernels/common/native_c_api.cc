// The C interface of kernels/common for Python (ctypes, tf_rdma/_native.py):
// the rules that tools running without TensorFlow share with the engine.
// setup.py builds kernels/common alone, without TensorFlow, into
// tf_rdma/_tf_rdma_native.so, which `tf-rdma doctor`, the launcher and
// explain() load; the op library contains these functions too.
//
// Answers are JSON, in a buffer this library allocates: the caller copies it
// and hands it back to tfrdma_free. (A caller-sized buffer would have to be
// asked for twice, and a collection of segments cannot be run twice.)
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/common/region.h"
#include "kernels/common/text.h"
#include "kernels/common/transport_choice.h"

namespace {

char* Answer(const std::string& json) {
  char* out = static_cast<char*>(std::malloc(json.size() + 1));
  if (out != nullptr) std::memcpy(out, json.c_str(), json.size() + 1);
  return out;
}

std::string JsonList(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) {
    out += (i ? ", " : "") + tf_rdma::JsonString(items[i]);
  }
  return out + "]";
}

std::string JsonOrNull(const std::string& text) {
  return text.empty() ? "null" : tf_rdma::JsonString(text);
}

std::string Text(const char* text) { return text == nullptr ? "" : text; }

}  // namespace

extern "C" {

// One end of a pair, as tf_rdma::PairEnd (transport_choice.h) has it.
// Strings may be NULL (= "").
struct tfrdma_pair_end {
  const char* task;
  // "auto" or a list such as "shm,tcp"; "" for the peer: as the chooser's.
  const char* allowed;
  int verbs;  // 1 usable, 0 not, -1 not known
  const char* verbs_detail;  // the device, or why there is none
  // The host identity; both "" when not known.
  const char* boot_id;
  const char* netns;
  const char* host;  // the endpoint's host as the cluster names it
  // "loopback", "local", "remote", or "" to judge `host` here (it is
  // resolved, against this machine's interfaces).
  const char* host_kind;
  // Its /dev/shm directory, "<device>:<inode>"; "" when not known.
  const char* shm_id;
};

// ChooseTransport (transport_choice.h) as JSON: {"transport", "fallback"
// (string or null), "same_host", "shared_shm", "host_reason", "reason"}, or
// {"error"} for a bad setting or host kind.
char* tfrdma_choose_transport(const tfrdma_pair_end* chooser,
                              const tfrdma_pair_end* peer) {
  tf_rdma::PairEnd ends[2];
  std::set<std::string> local;
  bool local_known = false;
  const tfrdma_pair_end* given[2] = {chooser, peer};
  for (int i = 0; i < 2; ++i) {
    const tfrdma_pair_end& in = *given[i];
    tf_rdma::PairEnd& end = ends[i];
    end.task = Text(in.task);
    std::string allowed = Text(in.allowed);
    if (i == 0 || !allowed.empty()) {
      tf_rdma::Status s = tf_rdma::ParseTransportSetting(allowed, &end.allowed);
      if (!s.ok()) {
        return Answer("{\"error\": " + tf_rdma::JsonString(s.message()) + "}");
      }
    }
    end.verbs = in.verbs > 0    ? tf_rdma::Verbs::kUsable
                : in.verbs == 0 ? tf_rdma::Verbs::kUnusable
                                : tf_rdma::Verbs::kUnknown;
    end.verbs_detail = Text(in.verbs_detail);
    end.boot_id = Text(in.boot_id);
    end.netns = Text(in.netns);
    end.shm_id = Text(in.shm_id);
    end.identified = !end.boot_id.empty() || !end.netns.empty();
    end.host = Text(in.host);
    std::string kind = Text(in.host_kind);
    if (kind.empty()) {
      if (!local_known) local = tf_rdma::LocalAddresses();
      local_known = true;
      end.host_kind = tf_rdma::ClassifyHost(end.host, local);
    } else if (!tf_rdma::ParseHostKind(kind, &end.host_kind)) {
      return Answer("{\"error\": " +
                    tf_rdma::JsonString("host kind '" + kind +
                                        "' is not loopback, local or "
                                        "remote") +
                    "}");
    }
  }
  tf_rdma::TransportChoice c = tf_rdma::ChooseTransport(ends[0], ends[1]);
  return Answer("{\"transport\": " + JsonOrNull(c.transport) +
                ", \"fallback\": " + JsonOrNull(c.fallback) +
                ", \"same_host\": " + (c.same_host ? "true" : "false") +
                ", \"shared_shm\": " + (c.shared_shm ? "true" : "false") +
                ", \"host_reason\": " + tf_rdma::JsonString(c.host_reason) +
                ", \"reason\": " + tf_rdma::JsonString(c.reason) + "}");
}

// CollectStaleSegments (region.h) as JSON: {"removed": [names], "bytes",
// "errors": ["<name>: <why>"]}. `owner_pids`: comma-separated pids whose
// segments only are collected; NULL or "": every owner's.
char* tfrdma_remove_stale_segments(const char* owner_pids) {
  std::vector<int64_t> pids;
  for (const std::string& pid : tf_rdma::Split(Text(owner_pids), ',')) {
    pids.push_back(std::strtoll(pid.c_str(), nullptr, 10));
  }
  tf_rdma::StaleSegments stale = tf_rdma::CollectStaleSegments(pids);
  return Answer("{\"removed\": " + JsonList(stale.removed) +
                ", \"bytes\": " + std::to_string(stale.bytes) +
                ", \"errors\": " + JsonList(stale.errors) + "}");
}

// Frees an answer of the functions above.
void tfrdma_free(char* answer) { std::free(answer); }

}  // extern "C"
