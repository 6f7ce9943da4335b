#include "kernels/common/timeline.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "kernels/common/text.h"
#include "kernels/common/thread_name.h"
#include "kernels/common/trace.h"

namespace tf_rdma {
namespace timeline {

namespace {

// The writer wakes this often to write what the buffer holds (and to see
// whether a new peer's clock is to be measured) ...
constexpr auto kFlushInterval = std::chrono::milliseconds(500);
// ... or as soon as the buffer holds this much.
constexpr size_t kFlushBytes = size_t{1} << 20;
// Beyond this the buffer takes no more events (they are counted as dropped).
constexpr size_t kMaxPendingBytes = size_t{64} << 20;
// Every peer's clock again this often (a clock drifts: a few ppm).
constexpr int64_t kMeasureIntervalNs = int64_t{5} * 1000 * 1000 * 1000;
// A measurement's bound on the writer thread, and at Stop (each peer, and
// all of them together): a peer that is gone or stopped must not hold up an
// exiting process.
constexpr int64_t kMeasureDeadlineMs = 1000;
constexpr int64_t kFinalDeadlineMs = 300;
constexpr int64_t kFinalTotalNs = int64_t{1000} * 1000 * 1000;

struct Timeline {
  std::mutex mu;
  std::condition_variable cv;
  // Under mu: the lines not yet written, events dropped, whether lines are
  // taken (open) and whether the writer is to return (stop).
  std::string pending;
  uint64_t dropped = 0;
  bool open = false;
  bool stop = false;

  // Set by Start before the timeline runs, read by recording threads
  // (relaxed: g_running's release and acquire order them).
  std::atomic<int> pid{0};
  std::atomic<int64_t> origin_ns{0};

  // The writer thread's (and Stop's, after joining it).
  FILE* file = nullptr;
  std::string path;
  bool write_failed = false;
  Clocks clocks;
  std::set<std::string> measured;
  int64_t last_all_ns = 0;
  std::thread writer;
};

// Never destroyed: a recording thread may still be in Tap at exit.
Timeline& T() {
  static Timeline* timeline = new Timeline();
  return *timeline;
}

// Start and Stop (never destroyed, as the timeline: Stop runs in the
// engine's exit handler, during static destruction).
std::mutex& StartMu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
std::atomic<bool> g_running{false};

int ThreadId() {
  thread_local int tid = static_cast<int>(syscall(SYS_gettid));
  return tid;
}

// Formatting without printf (the recording thread pays for it): integers
// with to_chars, µs with three decimals from the integer ns, and a string
// without bytes to escape (the usual key or task) as it is.
void AppendInt(std::string* out, int64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  out->append(buf, r.ptr);
}

void AppendMicros(std::string* out, int64_t ns) {
  if (ns < 0) {
    out->push_back('-');
    ns = -ns;
  }
  AppendInt(out, ns / 1000);
  const int frac = static_cast<int>(ns % 1000);
  const char digits[4] = {'.', static_cast<char>('0' + frac / 100),
                          static_cast<char>('0' + frac / 10 % 10),
                          static_cast<char>('0' + frac % 10)};
  out->append(digits, 4);
}

void AppendString(std::string* out, const char* s, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\' || c < 0x20) {
      *out += JsonString(std::string(s, n));
      return;
    }
  }
  out->push_back('"');
  out->append(s, n);
  out->push_back('"');
}

void AppendString(std::string* out, const std::string* s) {
  if (s == nullptr) {
    out->append("\"\"");
  } else {
    AppendString(out, s->data(), s->size());
  }
}

// Appends one line to the buffer (under its mutex), or counts it dropped.
void Append(Timeline& t, const std::string& line) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    if (!t.open) return;
    if (t.pending.size() + line.size() > kMaxPendingBytes) {
      ++t.dropped;
      return;
    }
    t.pending += line;
    wake = t.pending.size() >= kFlushBytes;
  }
  if (wake) t.cv.notify_one();
}

// The trace tap: one event, one line, built in a per-thread string.
void Tap(const trace::Event& e) {
  if (!g_running.load(std::memory_order_acquire)) return;
  Timeline& t = T();
  thread_local std::string line;
  line.clear();
  line.append("{\"ph\":\"X\",\"name\":");
  const char* name = e.name != nullptr ? e.name : "?";
  AppendString(&line, name, std::strlen(name));
  line.append(",\"pid\":");
  AppendInt(&line, t.pid.load(std::memory_order_relaxed));
  line.append(",\"tid\":");
  AppendInt(&line, ThreadId());
  line.append(",\"ts\":");
  AppendMicros(&line,
               e.start_ns - t.origin_ns.load(std::memory_order_relaxed));
  line.append(",\"dur\":");
  AppendMicros(&line, std::max<int64_t>(0, e.end_ns - e.start_ns));
  line.append(",\"args\":{\"key\":");
  AppendString(&line, e.key);
  line.append(",\"bytes\":");
  AppendInt(&line, static_cast<int64_t>(e.bytes));
  line.append(",\"peer\":");
  AppendString(&line, e.peer);
  line.append(",\"step\":");
  AppendInt(&line, static_cast<int64_t>(e.step));
  if (e.kind != nullptr) {
    line.append(",\"kind\":");
    AppendString(&line, e.kind, std::strlen(e.kind));
  }
  if (e.algorithm != nullptr) {
    line.append(",\"algorithm\":");
    AppendString(&line, e.algorithm, std::strlen(e.algorithm));
  }
  line.append("}},\n");
  Append(t, line);
}

std::string Metadata(const Timeline& t, const char* name,
                     const std::string& args) {
  return "{\"ph\":\"M\",\"name\":\"" + std::string(name) +
         "\",\"pid\":" + std::to_string(t.pid.load()) +
         ",\"tid\":0,\"args\":{" + args + "}}";
}

// Writes `text` to the file (the writer thread, or Stop after it).
void Write(Timeline& t, const std::string& text) {
  if (text.empty() || t.write_failed) return;
  if (std::fwrite(text.data(), 1, text.size(), t.file) != text.size() ||
      std::fflush(t.file) != 0) {
    t.write_failed = true;
    std::fprintf(stderr, "tf_rdma: writing the timeline %s failed (%s); "
                 "no more events are written to it\n", t.path.c_str(),
                 std::strerror(errno));
  }
}

// Measures the clocks of the peers not measured yet, or of all of them
// (`all`), and buffers one tf_rdma_clock_offset line per answer.
void Measure(Timeline& t, bool all, int64_t deadline_ms, int64_t total_ns) {
  if (!t.clocks.peers || !t.clocks.measure) return;
  const int64_t begin = trace::NowNs();
  for (const std::string& peer : t.clocks.peers()) {
    if (!all && t.measured.count(peer)) continue;
    if (trace::NowNs() - begin > total_ns) break;
    ClockOffset o;
    if (!t.clocks.measure(peer, deadline_ms, &o)) continue;
    t.measured.insert(peer);
    Append(t, Metadata(t, "tf_rdma_clock_offset",
                       "\"peer\":" + JsonString(peer) +
                           ",\"offset_ns\":" + std::to_string(o.offset_ns) +
                           ",\"rtt_ns\":" + std::to_string(o.rtt_ns) +
                           ",\"measured_at_ns\":" +
                           std::to_string(trace::NowNs())) +
                  ",\n");
  }
}

void WriterLoop() {
  Timeline& t = T();
  std::unique_lock<std::mutex> lock(t.mu);
  while (true) {
    t.cv.wait_for(lock, kFlushInterval, [&t] {
      return t.stop || t.pending.size() >= kFlushBytes;
    });
    std::string out;
    out.swap(t.pending);
    const bool stop = t.stop;
    lock.unlock();
    Write(t, out);
    if (stop) return;  // Stop measures once more and ends the file
    const int64_t now = trace::NowNs();
    const bool all = now - t.last_all_ns >= kMeasureIntervalNs;
    Measure(t, all, kMeasureDeadlineMs, kMeasureDeadlineMs * 1000 * 1000);
    if (all) t.last_all_ns = now;
    lock.lock();
  }
}

void StopLocked() {
  if (!g_running.load()) return;
  Timeline& t = T();
  trace::SetTap(nullptr);
  {
    std::lock_guard<std::mutex> lock(t.mu);
    t.stop = true;
  }
  t.cv.notify_all();
  if (t.writer.joinable()) t.writer.join();
  Measure(t, true, kFinalDeadlineMs, kFinalTotalNs);
  std::string out;
  uint64_t dropped;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    out.swap(t.pending);
    dropped = t.dropped;
    t.open = false;
  }
  g_running.store(false);
  out += Metadata(t, "tf_rdma_timeline_end",
                  "\"dropped_events\":" + std::to_string(dropped)) +
         "\n]\n";
  Write(t, out);
  std::fclose(t.file);
  t.file = nullptr;
}

}  // namespace

std::string FileName(const std::string& task, int pid) {
  std::string name = task;
  if (name.rfind("/job:", 0) == 0) name = name.substr(5);
  const size_t at = name.find("/task:");
  if (at != std::string::npos) name.replace(at, 6, "-");
  for (char& c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) c = '_';
  }
  if (name.empty()) name = "task";
  return name + "." + std::to_string(pid) + ".json";
}

Status Start(const std::string& dir, const std::string& task, Clocks clocks,
             std::string* path) {
  std::lock_guard<std::mutex> start_lock(StartMu());
  // Not stopped here: its writer may be measuring, holding up whoever calls
  // Start (the engine, under its lock) on what the measuring needs.
  if (g_running.load()) {
    return FailedPrecondition("a timeline is already being written to " +
                              T().path);
  }
  Timeline& t = T();
  const int pid = static_cast<int>(getpid());
  const std::string base = FileName(task, pid);
  const std::string stem = base.substr(0, base.size() - 5);  // no ".json"
  int fd = -1;
  std::string file;
  for (int n = 1; fd < 0 && n <= 1000; ++n) {
    file = dir + "/" + (n == 1 ? base : stem + "." + std::to_string(n) +
                                            ".json");
    fd = open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) {
      return ErrnoStatus("creating the timeline file " + file +
                         " (TF_RDMA_TIMELINE)", errno);
    }
  }
  if (fd < 0) {
    return FailedPrecondition("no free timeline file name like " + dir + "/" +
                              base);
  }
  t.file = fdopen(fd, "w");
  if (t.file == nullptr) {
    const int err = errno;
    close(fd);
    return ErrnoStatus("opening the timeline file " + file, err);
  }
  t.path = file;
  t.write_failed = false;
  t.pid = pid;
  t.origin_ns = trace::NowNs();
  t.clocks = std::move(clocks);
  t.measured.clear();
  t.last_all_ns = t.origin_ns.load();
  {
    std::lock_guard<std::mutex> lock(t.mu);
    t.pending = "[\n" +
                Metadata(t, "process_name", "\"name\":" + JsonString(task)) +
                ",\n" +
                Metadata(t, "tf_rdma_timeline",
                         "\"task\":" + JsonString(task) +
                             ",\"pid\":" + std::to_string(pid) +
                             ",\"origin_ns\":" +
                             std::to_string(t.origin_ns.load()) +
                             ",\"version\":1") +
                ",\n";
    t.dropped = 0;
    t.open = true;
    t.stop = false;
  }
  g_running.store(true, std::memory_order_release);
  t.writer = std::thread([] {
    NameThisThread("tfrdma-timeline");
    WriterLoop();
  });
  trace::SetTap(&Tap);
  *path = file;
  return Status::Ok();
}

void Stop() {
  std::lock_guard<std::mutex> start_lock(StartMu());
  StopLocked();
}

bool Running() { return g_running.load(); }

}  // namespace timeline
}  // namespace tf_rdma
