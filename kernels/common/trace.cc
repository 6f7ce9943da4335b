#include "kernels/common/trace.h"

#include <time.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "kernels/common/recent.h"

namespace tf_rdma {
namespace trace {

namespace {

// The built-in sink: its level never reaches kLevel, so nothing is ever
// recorded through it.
const std::atomic<int> g_never{-1};
// The word On() reads while a tap is set: always on.
const std::atomic<int> g_always{kLevel};

int64_t RealtimeNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

void Drop(const Event&) {}

// now_ns and record, read only by traced transfers (after a load of
// g_level that saw the sink's word on).
std::atomic<int64_t (*)()> g_now{&RealtimeNs};
std::atomic<void (*)(const Event&)> g_record{&Drop};
// The tap (SetTap), or nullptr.
std::atomic<void (*)(const Event&)> g_tap{nullptr};
// SetPhases: false records the op events only.
std::atomic<bool> g_phases{true};

// By content: each library that includes trace.h has its own copy of the
// names.
bool IsOpEvent(const char* name) {
  return name != nullptr &&
         (std::strcmp(name, kSend) == 0 || std::strcmp(name, kRecv) == 0 ||
          std::strcmp(name, kCollective) == 0);
}

// Install and SetTap: the sink's own word, and which word On() reads.
// (Never destroyed: the engine's exit handler stops the timeline, and
// with it the tap, during static destruction.)
std::mutex& InstallMu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
const std::atomic<int>* g_sink_level = &g_never;

// Publishes the word On() reads, with release: whoever sees it on sees the
// clock, record function and tap stored before. Holds InstallMu().
void PublishLevel() {
  internal::g_level.store(
      g_tap.load(std::memory_order_relaxed) != nullptr ? &g_always
                                                        : g_sink_level,
      std::memory_order_release);
}

}  // namespace

namespace internal {
std::atomic<const std::atomic<int>*> g_level{&g_never};
}  // namespace internal

void Install(const Sink& sink) {
  std::lock_guard<std::mutex> lock(InstallMu());
  g_now.store(sink.now_ns != nullptr ? sink.now_ns : &RealtimeNs,
              std::memory_order_relaxed);
  g_record.store(sink.record != nullptr ? sink.record : &Drop,
                 std::memory_order_relaxed);
  g_sink_level = sink.level != nullptr ? sink.level : &g_never;
  // Last, with release: whoever sees the new word sees its clock and sink.
  PublishLevel();
}

void SetTap(void (*tap)(const Event& event)) {
  std::lock_guard<std::mutex> lock(InstallMu());
  g_tap.store(tap, std::memory_order_relaxed);
  PublishLevel();
}

void Uninstall() { Install(Sink{nullptr, nullptr, nullptr}); }

int64_t NowNs() {
  // Pairs with Install's release store: the clock of the word seen on.
  internal::g_level.load(std::memory_order_acquire);
  return std::max<int64_t>(1, g_now.load(std::memory_order_relaxed)());
}

void SetPhases(bool on) { g_phases.store(on, std::memory_order_relaxed); }

void Record(const Event& event) {
  if (event.start_ns == 0) return;
  if (!g_phases.load(std::memory_order_relaxed) && !IsOpEvent(event.name)) {
    return;
  }
  internal::g_level.load(std::memory_order_acquire);
  g_record.load(std::memory_order_relaxed)(event);
  if (auto tap = g_tap.load(std::memory_order_relaxed)) tap(event);
  recent::Note(event);  // for explain(measured=True): recent.h
}

int64_t Span::EndTraced(const char* name, const std::string& key,
                        uint64_t bytes, const std::string& peer,
                        uint64_t step) const {
  Event e;
  e.name = name;
  e.key = &key;
  e.bytes = bytes;
  e.peer = &peer;
  e.step = step;
  e.start_ns = start_ns_;
  e.end_ns = std::max(start_ns_, NowNs());
  Record(e);
  return e.end_ns;
}

}  // namespace trace
}  // namespace tf_rdma
