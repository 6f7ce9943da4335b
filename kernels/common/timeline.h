// The timeline: every trace event of this process in a Chrome-trace file
// (TF_RDMA_TIMELINE=<dir>), for runs without TensorFlow's profiler.
//
// What. While started, the timeline is the trace tap (trace.h SetTap), so
// tracing is on for every transfer and each event (tf_rdma.send, its
// credit_wait and write, ...) becomes one complete event ("ph": "X") of
// <dir>/<task>.<pid>.json (FileName): ts and dur in µs from the file's
// origin, pid this process, tid the recording thread, name the event's and
// args its key, bytes, peer, step (and kind and algorithm for a
// collective). The file is the Chrome "JSON Array Format": "[", one event
// per line, each followed by a comma, and "]" when the timeline stops; a
// process killed before that leaves a file without its "]", which
// chrome://tracing, Perfetto and `tf-rdma timeline merge` read as well.
//
// Metadata events ("ph": "M") say what the events need to be merged with
// other tasks' files (tf_rdma/timeline.py): process_name (the task),
// tf_rdma_timeline (task, pid, origin_ns: the clock reading that ts counts
// from) and tf_rdma_clock_offset (peer, offset_ns: the peer's clock minus
// ours, rtt_ns, measured_at_ns), written whenever the offsets are measured:
// a peer is measured by the writer thread soon after its connection appears
// (the first check after it, every kFlushInterval), every peer again every
// kMeasureInterval and once more when the timeline stops. The measuring
// itself is the engine's (Engine::ClockOffset: NTP's four timestamps over
// the control connection, the sample with the smallest round trip of a few):
// the timeline gets it through Clocks, so that this file needs no engine.
//
// Cost. A traced event formats its line on the recording thread (one
// snprintf and the key's and peer's JSON escaping) and appends it to one
// buffer under a mutex; a writer thread swaps the buffer out and writes it
// every kFlushInterval, or as soon as it holds kFlushBytes. The buffer never
// holds more than kMaxPendingBytes: beyond that (a disk slower than the
// events) events are dropped and counted (tf_rdma_timeline_end's
// dropped_events). docs/observability.md has the measured cost per event.
#ifndef TF_RDMA_COMMON_TIMELINE_H_
#define TF_RDMA_COMMON_TIMELINE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/common/status.h"

namespace tf_rdma {
namespace timeline {

// One measured clock offset: the peer's clock minus this process's, within
// rtt_ns / 2 if the two legs of the exchange took equally long.
struct ClockOffset {
  std::string peer;
  int64_t offset_ns = 0;
  int64_t rtt_ns = 0;
};

// How the timeline measures clock offsets (the engine's side).
struct Clocks {
  // The peers this process has a live connection with now.
  std::function<std::vector<std::string>()> peers;
  // Measures one peer's offset by `deadline_ms` from now; false if it could
  // not (the peer is gone, or its tf_rdma cannot answer).
  std::function<bool(const std::string& peer, int64_t deadline_ms,
                     ClockOffset* out)>
      measure;
};

// The file's name for `task` in process `pid`: "/job:worker/task:1" ->
// "worker-1.<pid>.json" (characters other than letters, digits, '.', '_'
// and '-' become '_').
std::string FileName(const std::string& task, int pid);

// Starts writing this process's events to `dir` (which must exist) as
// `task`; *path gets the file's path. If the file exists (a second start in
// this process), "<task>.<pid>.<n>.json" with the first n free.
// FailedPrecondition while a timeline runs (Stop it first).
Status Start(const std::string& dir, const std::string& task, Clocks clocks,
             std::string* path);

// Measures the offsets once more (the peers still connected, within a
// short deadline), writes out what is buffered, ends the file with "]" and
// stops recording. Nothing if not started.
void Stop();

// Whether a timeline is being written.
bool Running();

}  // namespace timeline
}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_TIMELINE_H_
