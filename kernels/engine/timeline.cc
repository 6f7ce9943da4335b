// The engine's side of the timeline (kernels/common/timeline.h): starting
// it with the endpoint, and measuring its peers' clocks for it.
//
// The timeline's writer thread asks for the offsets of the peers this
// process is connected to (either direction) soon after each connects and
// every few seconds after; Engine::ClockOffset answers with the sample of
// smallest round trip among kTimelineSamples queries over the control
// connection (query.cc). Cost: kTimelineSamples small frames each way per
// peer and measurement, on the writer thread; nothing on the data path.

#include <string>
#include <vector>

#include "kernels/common/timeline.h"
#include "kernels/common/trace.h"
#include "kernels/engine/engine.h"
#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

namespace {
// Queries per measurement: the one with the smallest round trip is kept
// (its error bound, rtt / 2, is the smallest).
constexpr int kTimelineSamples = 8;
}  // namespace

void Engine::StartTimeline() {
  // Phases are left out only while a timeline of ops runs (a later
  // endpoint of this process without one records them again).
  trace::SetPhases(config_.timeline.empty() || config_.timeline_phases);
  if (config_.timeline.empty()) return;
  timeline::Clocks clocks;
  clocks.peers = [this] { return ConnectedPeers(); };
  clocks.measure = [this](const std::string& peer, int64_t deadline_ms,
                          timeline::ClockOffset* out) {
    ClockSample sample;
    if (!ClockOffset(peer, kTimelineSamples, Deadline(deadline_ms), &sample)
             .ok()) {
      return false;
    }
    out->peer = peer;
    out->offset_ns = sample.offset_ns;
    out->rtt_ns = sample.rtt_ns;
    return true;
  };
  std::string path;
  Status s = timeline::Start(config_.timeline, config_.task, clocks, &path);
  if (s.ok()) {
    Log(std::string("timeline: writing every transfer's trace events") +
        (config_.timeline_phases ? "" : " (the ops', without phases)") +
        " to " + path);
  } else {
    Log("timeline: not written: " + s.message());
  }
}

}  // namespace tf_rdma
