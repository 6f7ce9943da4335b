// Tracing: tf_rdma's transfers and their phases in a profiler's timeline,
// without the engine knowing which profiler.
//
// What is traced. Every op that moves data is one event (tf_rdma.send,
// tf_rdma.recv, tf_rdma.collective) and the time inside it is cut into
// phases, each its own event nested in the op's: a send waits for its
// credit (tf_rdma.credit_wait: the reader has not yet released the copy
// this step reuses) and then writes (tf_rdma.write: the one-sided write and
// its notice); a recv waits for the data (tf_rdma.data_wait, from the claim
// until the notice lands) and, when the last reference to its tensor is
// dropped, gives the copy back (tf_rdma.release: the credit write); a
// collective's blocks add the reduction of a block where it landed
// (tf_rdma.reduce) or its copy out of the channel (tf_rdma.copy). Each event
// carries the tensor's key (a collective's instance), the bytes, the peer
// task (a collective's event: its group) and the step (with match_calls,
// the call's id; inside a collective, the block's number on its channel).
//
// How. The engine is built without TensorFlow too (the C++ unit tests, the
// fuzz target), so it records through a Sink: a level word, a clock and a
// record function. The op library installs TensorFlow's (kernels/ops/
// trace_sink.cc: the word is TraceMe's own level, the events go to the
// TraceMe recorder, so tf.profiler and TensorBoard show them); without one
// the level word stays below kLevel forever and nothing is recorded.
//
// A second destination, the tap (SetTap), takes every event too: the
// per-process timeline file of TF_RDMA_TIMELINE (kernels/common/timeline.h).
// While a tap is set tracing is on whatever the sink's word says (On()
// reads a word that always says on), and each event goes to the sink's
// record function (which checks its own level, as TraceMe's does) and then
// to the tap.
//
// Cost. Whether a transfer is traced is decided once, when it is claimed
// (ClaimSend / ClaimRecv, or a collective's start): On() is a load of the
// word's address, fixed after start-up, and one relaxed load of the word —
// what TensorFlow's own TraceMe::Active compiles to in a custom op. The
// answer travels in the ticket as its claim time (0: untraced), so the
// phases of an untraced transfer test a field they already hold and never
// touch the clock. A traced event costs two clock reads, building the name
// with its metadata and one append to the recorder's per-thread queue
// (docs/observability.md has the measured numbers).
#ifndef TF_RDMA_COMMON_TRACE_H_
#define TF_RDMA_COMMON_TRACE_H_

#include <atomic>
#include <cstdint>
#include <string>

namespace tf_rdma {
namespace trace {

// The level of tf_rdma's events on TensorFlow's TraceMe scale: 2 (kInfo) is
// recorded at the profiler's default host_tracer_level (2), and left out
// at host_tracer_level=1.
constexpr int kLevel = 2;

// Event names: the ops, then the phases inside them.
constexpr const char kSend[] = "tf_rdma.send";
constexpr const char kRecv[] = "tf_rdma.recv";
constexpr const char kCollective[] = "tf_rdma.collective";
constexpr const char kCreditWait[] = "tf_rdma.credit_wait";
constexpr const char kWrite[] = "tf_rdma.write";
constexpr const char kDataWait[] = "tf_rdma.data_wait";
constexpr const char kReduce[] = "tf_rdma.reduce";
constexpr const char kCopy[] = "tf_rdma.copy";
constexpr const char kRelease[] = "tf_rdma.release";

// One finished event, [start_ns, end_ns] on the sink's clock.
struct Event {
  const char* name = nullptr;         // one of the names above
  const std::string* key = nullptr;   // tensor key or collective instance
  uint64_t bytes = 0;
  const std::string* peer = nullptr;  // the other task, or a group
  uint64_t step = 0;
  const char* kind = nullptr;         // collectives: "allreduce", ...
  const char* algorithm = nullptr;    // collectives: "ring", ...
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

// Where events go. `level` must stay valid for the life of the process.
struct Sink {
  const std::atomic<int>* level;  // tracing is on while *level >= kLevel
  int64_t (*now_ns)();            // the recorder's clock
  void (*record)(const Event& event);
};

namespace internal {
extern std::atomic<const std::atomic<int>*> g_level;
}  // namespace internal

// Sends events to `sink` from now on (the op library, as it loads).
void Install(const Sink& sink);
// Back to the built-in sink that never records (tests).
void Uninstall();
// Sends every event to `tap` as well, and turns tracing on for good while
// it is set (the timeline); nullptr: the sink's word decides again. The
// tap must stay callable for the life of the process (an event that read
// the old tap may still be calling it).
void SetTap(void (*tap)(const Event& event));

// Whether tracing is on now: the one check of an untraced transfer.
inline bool On() {
  return internal::g_level.load(std::memory_order_relaxed)
             ->load(std::memory_order_relaxed) >= kLevel;
}

// Whether the phases of a traced op are recorded (default) or only the op
// events themselves (tf_rdma.send, tf_rdma.recv, tf_rdma.collective): the
// timeline's TF_RDMA_TIMELINE_EVENTS=ops. Without phases a traced op costs
// its own event plus two clock reads per phase, instead of up to six
// events.
void SetPhases(bool on);

// The sink's clock, in ns (never 0); call it only for traced transfers.
int64_t NowNs();

// The claim time of a transfer: now if tracing is on, else 0 (untraced).
inline int64_t Claim() { return On() ? NowNs() : 0; }

// Hands a finished event to the sink (out of line: only traced events).
void Record(const Event& event);

// One phase of a traced transfer: starts when constructed with a nonzero
// claim time (or at `start_ns` itself), ends at End(). For an untraced
// transfer (claim time 0) both are a test of that 0.
class Span {
 public:
  // Starts now if `traced_since` is nonzero.
  explicit Span(int64_t traced_since)
      : start_ns_(traced_since != 0 ? NowNs() : 0) {}
  // Starts at `start_ns` (0: untraced).
  static Span At(int64_t start_ns) { return Span(start_ns, 0); }

  // Records the phase [start, now]; returns now (0 if untraced), where the
  // next phase may start.
  int64_t End(const char* name, const std::string& key, uint64_t bytes,
              const std::string& peer, uint64_t step) const {
    if (start_ns_ == 0) return 0;
    return EndTraced(name, key, bytes, peer, step);
  }

 private:
  Span(int64_t start_ns, int) : start_ns_(start_ns) {}
  int64_t EndTraced(const char* name, const std::string& key, uint64_t bytes,
                    const std::string& peer, uint64_t step) const;

  int64_t start_ns_;
};

}  // namespace trace
}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_TRACE_H_
