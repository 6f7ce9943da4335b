// The last traced events of each transfer, kept for explain().
//
// What. Every traced event (trace.h: an op or one of its phases) is also
// noted here, in a ring per tensor key (a collective: its instance) that
// keeps the newest kEventsPerKey. `fn.explain(measured=True)` reads the
// rings of the tasks a rewritten function runs on (the TfRdmaReport op)
// and shows, next to each planned transfer, what its last calls measured:
// the op's time and its phases' (credit wait, write, data wait, release).
//
// Why here. The trace layer already has every number, once per event, on
// the transfer's own thread; keeping the newest few costs one lock and a
// copy per traced event, and nothing at all for an untraced transfer (the
// ring is fed from trace::Record, which only traced transfers reach). So
// measurements exist exactly while events are traced: inside a profiler
// session, or for a whole run with a timeline (docs/observability.md).
//
// Cost. A mutex (uncontended: events of one key come from one op at a
// time, mostly), a map lookup by key and the copy of two short strings:
// a small part of the sub-microsecond budget of a traced event. Memory:
// kEventsPerKey events per key, for the keys of the plans that ran.
#ifndef TF_RDMA_COMMON_RECENT_H_
#define TF_RDMA_COMMON_RECENT_H_

#include <string>

#include "kernels/common/trace.h"

namespace tf_rdma {
namespace recent {

// Events kept per key: a few dozen calls of a transfer (an op and up to
// four phases each), or a collective's blocks of its last call or two.
constexpr size_t kEventsPerKey = 256;

// Keeps a copy of `event` (trace::Record calls it for every traced event).
void Note(const trace::Event& event);

// The rings as JSON: {"now_ns": <the trace clock now>, "keys": {key:
// [{"name", "peer", "step", "bytes", "start_ns", "end_ns"}, ...]}}, each
// key's events oldest first.
std::string Json();

// Forgets every event (tests).
void Clear();

}  // namespace recent
}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_RECENT_H_
