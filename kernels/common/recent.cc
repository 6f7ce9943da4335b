#include "kernels/common/recent.h"

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>

#include "kernels/common/text.h"

namespace tf_rdma {
namespace recent {

namespace {

struct Kept {
  const char* name;  // one of trace.h's names: static storage
  std::string peer;
  uint64_t step;
  uint64_t bytes;
  int64_t start_ns;
  int64_t end_ns;
};

std::mutex g_mu;
// Never destroyed: traced events may end on threads that outlive main.
std::map<std::string, std::deque<Kept>>* g_rings =
    new std::map<std::string, std::deque<Kept>>;

}  // namespace

void Note(const trace::Event& event) {
  if (event.key == nullptr || event.name == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mu);
  std::deque<Kept>& ring = (*g_rings)[*event.key];
  if (ring.size() == kEventsPerKey) ring.pop_front();
  ring.push_back(Kept{event.name,
                      event.peer != nullptr ? *event.peer : std::string(),
                      event.step, event.bytes, event.start_ns, event.end_ns});
}

std::string Json() {
  const int64_t now = trace::NowNs();
  std::lock_guard<std::mutex> lock(g_mu);
  std::string out = "{\"now_ns\": " + std::to_string(now) + ", \"keys\": {";
  bool first_key = true;
  for (const auto& kv : *g_rings) {
    out += std::string(first_key ? "" : ", ") + JsonString(kv.first) + ": [";
    bool first = true;
    for (const Kept& k : kv.second) {
      out += std::string(first ? "" : ", ") + "{\"name\": " +
             JsonString(k.name) + ", \"peer\": " + JsonString(k.peer) +
             ", \"step\": " + std::to_string(k.step) +
             ", \"bytes\": " + std::to_string(k.bytes) +
             ", \"start_ns\": " + std::to_string(k.start_ns) +
             ", \"end_ns\": " + std::to_string(k.end_ns) + "}";
      first = false;
    }
    out += "]";
    first_key = false;
  }
  return out + "}}";
}

void Clear() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_rings->clear();
}

}  // namespace recent
}  // namespace tf_rdma
