// The engine's trace events into TensorFlow's profiler (TraceMe).
//
// The engine records through a TF-free Sink (kernels/common/trace.h); this
// file, compiled only into the op library, installs TensorFlow's as the
// library loads. Its level word is TraceMe's own (tsl::profiler::internal::
// g_trace_level, which the profiler raises to host_tracer_level while a
// session runs), so the engine's check of an untraced transfer is exactly
// what TraceMe::Active costs a TensorFlow kernel. Its events go to the
// TraceMe recorder as complete events, named with TraceMeEncode metadata
// ("tf_rdma.write#key=x,bytes=4096,peer=/job:worker/task:1,step=7#"), which
// the profiler turns into the event's stats in the XPlane it writes: the
// trace viewer shows them when an event is selected.
//
// The installed pip package exports all that this needs from
// libtensorflow_framework.so.2 (TraceMeRecorder::Record, g_trace_level,
// g_trace_filter_bitmap, GetCurrentTimeNanos; the headers are in
// tf.sysconfig.get_include()), so it links with tf.sysconfig's flags alone.
#include <algorithm>
#include <string>
#include <utility>

#include "kernels/common/trace.h"
#include "tsl/profiler/lib/traceme.h"
#include "tsl/profiler/lib/traceme_encode.h"

namespace tf_rdma {
namespace {

using tsl::profiler::TraceMeEncode;
using tsl::profiler::TraceMeRecorder;

int64_t NowNs() { return tsl::profiler::GetCurrentTimeNanos(); }

// TraceMe metadata is "name#k=v,k=v#": a value must not hold '#' or ','
// (an instance "x#rows", say). They are percent-encoded (%23, %2C, and '%'
// itself as %25), so that a reader gets the value back with one unquote.
std::string Clean(const std::string* value) {
  if (value == nullptr) return std::string();
  if (value->find_first_of("#,%") == std::string::npos) return *value;
  std::string out;
  for (char c : *value) {
    if (c == '#') {
      out += "%23";
    } else if (c == ',') {
      out += "%2C";
    } else if (c == '%') {
      out += "%25";
    } else {
      out += c;
    }
  }
  return out;
}

void Record(const trace::Event& e) {
  // As TraceMe::Stop: the session may have ended since the transfer began.
  if (!TraceMeRecorder::Active(trace::kLevel) ||
      !TraceMeRecorder::CheckFilter(tsl::profiler::kTraceMeDefaultFilterMask)) {
    return;
  }
  std::string name;
  if (e.kind != nullptr) {
    name = TraceMeEncode(e.name, {{"key", Clean(e.key)},
                                  {"bytes", e.bytes},
                                  {"peer", Clean(e.peer)},
                                  {"step", e.step},
                                  {"kind", e.kind},
                                  {"algorithm", e.algorithm}});
  } else {
    name = TraceMeEncode(e.name, {{"key", Clean(e.key)},
                                  {"bytes", e.bytes},
                                  {"peer", Clean(e.peer)},
                                  {"step", e.step}});
  }
  TraceMeRecorder::Record(
      {std::move(name), e.start_ns, std::max(e.start_ns, e.end_ns)});
}

void InstallTraceMe() {
  trace::Install(trace::Sink{&tsl::profiler::internal::g_trace_level, &NowNs,
                             &Record});
}

// Installed when the op library is loaded (tf.load_op_library), before any
// op or endpoint of this process can run.
struct InstallTraceMeSink {
  InstallTraceMeSink() { InstallTraceMe(); }
} install_trace_me_sink;

}  // namespace
}  // namespace tf_rdma

extern "C" {
// 0: tf_rdma records no events, even while a profiler session runs (the
// engine's built-in sink); 1: TraceMe again (the default). For measuring
// what tf_rdma's events cost a profiled run (tests/test_profiler.py).
void tfrdma_trace_events(int on) {
  if (on) {
    tf_rdma::InstallTraceMe();
  } else {
    tf_rdma::trace::Uninstall();
  }
}
}  // extern "C"
