// The engine's control interface for Python (ctypes), next to the ops in the
// same shared object: tf_rdma.Server starts the endpoint through it. Plain C
// types only; errors come back as a message in a caller-owned buffer.

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/reduce.h"
#include "kernels/common/sha256.h"
#include "kernels/common/text.h"
#include "kernels/common/trace.h"
#include "kernels/common/wait.h"
#include "kernels/engine/collective.h"
#include "kernels/engine/engine.h"
#include "kernels/engine/engine_internal.h"
#include "kernels/transport/factory.h"

namespace {

// Copies the status's message into err; returns its code (0 when ok).
int Fail(const tf_rdma::Status& s, char* err, int errlen) {
  if (err != nullptr && errlen > 0) {
    std::strncpy(err, s.message().c_str(), errlen - 1);
    err[errlen - 1] = '\0';
  }
  return static_cast<int>(s.code());
}

}  // namespace

extern "C" {

// Starts this process's endpoint. `config` is "key=value" lines (see
// EngineConfig::Parse). Returns 0, or a tf_rdma::Code with the message in err.
int tfrdma_start(const char* config, char* err, int errlen) {
  tf_rdma::EngineConfig c;
  tf_rdma::Status s = tf_rdma::EngineConfig::Parse(config, &c);
  if (s.ok()) s = tf_rdma::Engine::Get()->Start(c);
  return s.ok() ? 0 : Fail(s, err, errlen);
}

void tfrdma_stop() { tf_rdma::Engine::Get()->Stop(); }

int tfrdma_started() { return tf_rdma::Engine::Get()->started() ? 1 : 0; }

// Copies Info() (JSON, Engine::Info) into out; returns the length it needs
// (call again if larger).
int tfrdma_info(char* out, int outlen) {
  std::string info = tf_rdma::Engine::Get()->Info();
  if (out != nullptr && outlen > 0) {
    std::strncpy(out, info.c_str(), outlen - 1);
    out[outlen - 1] = '\0';
  }
  return static_cast<int>(info.size()) + 1;
}

// Copies Stats() (JSON, Engine::Stats: the transfer counters) into out;
// returns the length it needs (call again if larger).
int tfrdma_stats(char* out, int outlen) {
  std::string stats = tf_rdma::Engine::Get()->Stats();
  if (out != nullptr && outlen > 0) {
    std::strncpy(out, stats.c_str(), outlen - 1);
    out[outlen - 1] = '\0';
  }
  return static_cast<int>(stats.size()) + 1;
}

// Measures the offset of every connected peer's trace clock (Engine::
// ClockOffsets, `samples` queries each, each bounded by timeout_ms) and
// copies the JSON into out; returns the length it needs (measure again
// into a larger buffer if it did not fit).
int tfrdma_clock_offsets(int samples, int64_t timeout_ms, char* out,
                         int outlen) {
  std::string offsets =
      tf_rdma::Engine::Get()->ClockOffsets(samples, timeout_ms);
  if (out != nullptr && outlen > 0) {
    std::strncpy(out, offsets.c_str(), outlen - 1);
    out[outlen - 1] = '\0';
  }
  return static_cast<int>(offsets.size()) + 1;
}

// Whether the verbs transport is usable in this process, as the engine would
// decide at start: opens (and closes) the RDMA device with the verbs_* lines
// of `config` (EngineConfig keys; a listen= line gives the host whose
// address picks the device and GID; other keys are ignored). Returns 0 with
// the device's description in out, or a tf_rdma::Code with the reason.
int tfrdma_verbs_probe(const char* config, char* out, int outlen) {
  std::string verbs_lines, line, listen = ":0";
  for (const char* p = config; *p != '\0'; ++p) {
    if (*p != '\n') {
      line += *p;
      continue;
    }
    if (line.rfind("verbs_", 0) == 0) verbs_lines += line + "\n";
    if (line.rfind("listen=", 0) == 0) listen = line.substr(7);
    line.clear();
  }
  if (line.rfind("verbs_", 0) == 0) verbs_lines += line + "\n";
  if (line.rfind("listen=", 0) == 0) listen = line.substr(7);
  tf_rdma::EngineConfig c;
  tf_rdma::Status s = tf_rdma::EngineConfig::Parse(
      verbs_lines + "task=probe\nlisten=" + listen +
          "\nsecret=probe-needs-no-secret\n",
      &c);
  tf_rdma::TransportOptions options;
  int port = 0;
  if (s.ok()) s = tf_rdma::SplitHostPort(listen, &options.local_host, &port);
  options.verbs = c.verbs;
  std::unique_ptr<tf_rdma::Transport> verbs;
  if (s.ok()) s = tf_rdma::OpenTransport("verbs", options, &verbs);
  if (!s.ok()) return Fail(s, out, outlen);
  return Fail(tf_rdma::Status(tf_rdma::Code::kOk, verbs->Describe()), out,
              outlen);
}

// Times `n` trace events as a transfer takes them (the claim's check, then
// for a traced one a span from the claim to now with a slot's key, bytes,
// peer and step) and returns the nanoseconds of this thread's CPU time they
// took in all (CPU time: a busy machine that preempts the thread does not
// count). With tracing off that is the cost of the check an untraced
// transfer pays; with a profiler session running, of recording one event
// (docs/observability.md).
int64_t tfrdma_trace_bench(int64_t n) {
  const std::string key = "bench/tensor:0", peer = "/job:worker/task:1";
  int64_t start = tf_rdma::ThreadCpuNs();
  for (int64_t i = 0; i < n; ++i) {
    tf_rdma::trace::Span::At(tf_rdma::trace::Claim())
        .End(tf_rdma::trace::kWrite, key, 4096, peer,
             static_cast<uint64_t>(i + 1));
  }
  return tf_rdma::ThreadCpuNs() - start;
}

// The engine's allreduce without TensorFlow around it, for
// bench/allreduce.py: `calls` sums of `count` floats by `algorithm` (a
// tf_rdma.collectives name) among `group` (its tasks, one a line; this
// process is group[rank]), called back to back from this thread, as a
// C program calls MPI_Allreduce. Before every call it touches `cool_bytes`
// of memory, a write to every 64-byte line (0: nothing), so that the call
// finds its data as cold as after TensorFlow's dispatch of an op, which
// reads and writes more than the L2 holds (the dispatch evicts code too,
// which this does not: docs/benchmarks.md). Writes call i's start and end
// (NanosSinceEpoch: the clock of Python's time.perf_counter and of the
// engine's last_collective, so the ranks' calls line up) into times[2 i]
// and times[2 i + 1]. Every rank's input is 1: the last call's result must
// be the group's size everywhere. Returns 0, or a tf_rdma::Code with the
// message in err.
int tfrdma_allreduce_loop(const char* group, int rank, const char* algorithm,
                          int64_t count, int64_t block_bytes, int64_t calls,
                          int64_t cool_bytes, int64_t* times, char* err,
                          int errlen) {
  using tf_rdma::Code;
  using tf_rdma::Status;
  tf_rdma::CollectiveSpec spec;
  spec.kind = tf_rdma::CollectiveKind::kAllReduce;
  if (!tf_rdma::ParseAlgorithm(algorithm, &spec.algorithm)) {
    return Fail(Status(Code::kInvalidArgument,
                       std::string("unknown algorithm '") + algorithm +
                           "' (expected lp, ring, tree, rhd or oneshot)"),
                err, errlen);
  }
  spec.group = tf_rdma::Split(group, '\n');
  if (count < 1 || calls < 1 || cool_bytes < 0) {
    return Fail(Status(Code::kInvalidArgument,
                       "count and calls must be at least 1 and cool_bytes "
                       "at least 0; got " + std::to_string(count) + ", " +
                           std::to_string(calls) + " and " +
                           std::to_string(cool_bytes)),
                err, errlen);
  }
  spec.instance = "bench/allreduce_loop/" + std::string(algorithm) + "/" +
                  std::to_string(count);
  spec.dtype = "float";
  spec.rank = rank;
  spec.count = static_cast<uint64_t>(count);
  spec.element_bytes = sizeof(float);
  if (block_bytes > 0) spec.block_bytes = static_cast<uint64_t>(block_bytes);
  std::vector<float> in, out;
  std::vector<uint8_t> cool;
  try {
    in.assign(count, 1.0f);
    out.assign(count, 0.0f);
    cool.assign(static_cast<size_t>(cool_bytes), 0);
  } catch (const std::exception& e) {  // bad_alloc, length_error
    return Fail(Status(Code::kResourceExhausted,
                       "cannot allocate " + std::to_string(count) +
                           " floats twice and " + std::to_string(cool_bytes) +
                           " bytes to cool the caches with (" + e.what() +
                           ")"),
                err, errlen);
  }
  const tf_rdma::ReduceFn sum =
      tf_rdma::ReduceInto<float, tf_rdma::SumOp>;
  for (int64_t i = 0; i < calls; ++i) {
    for (size_t k = 0; k < cool.size(); k += 64) cool[k] += 1;
    std::atomic<bool> done{false};
    Status status;
    times[2 * i] = tf_rdma::NanosSinceEpoch(tf_rdma::Clock::now());
    tf_rdma::StartCollective(spec, reinterpret_cast<const uint8_t*>(in.data()),
                             reinterpret_cast<uint8_t*>(out.data()), sum,
                             [&](const Status& s) {
                               status = s;
                               done.store(true, std::memory_order_release);
                             });
    // Bounded: every wait of the collective is (its timeout ends it).
    while (!done.load(std::memory_order_acquire)) std::this_thread::yield();
    times[2 * i + 1] = tf_rdma::NanosSinceEpoch(tf_rdma::Clock::now());
    if (!status.ok()) return Fail(status, err, errlen);
  }
  const float expected = static_cast<float>(spec.group.size());
  for (int64_t k = 0; k < count; ++k) {
    if (out[k] != expected) {
      return Fail(Status(Code::kInternal,
                         "wrong sum at element " + std::to_string(k) + ": " +
                             std::to_string(out[k]) + ", expected " +
                             std::to_string(expected)),
                  err, errlen);
    }
  }
  return 0;
}

// The stall inspector's registration of a wait and its end, n times:
// thread CPU nanoseconds (Engine::StallBench).
int64_t tfrdma_stall_bench(int64_t n) {
  return tf_rdma::Engine::Get()->StallBench(n);
}

// HMAC-SHA256, exposed so that tests can check the handshake's primitive
// against Python's hmac module.
void tfrdma_hmac_sha256(const void* key, int key_len, const void* msg,
                        int msg_len, unsigned char* out32) {
  tf_rdma::Digest256 d = tf_rdma::HmacSha256(key, key_len, msg, msg_len);
  std::memcpy(out32, d.data(), d.size());
}

}  // extern "C"

extern "C" {
// The TensorFlow version this library was compiled against (setup.py).
const char* tfrdma_built_tf_version() {
#ifdef TF_RDMA_BUILT_TF_VERSION
  return TF_RDMA_BUILT_TF_VERSION;
#else
  return "unknown";
#endif
}
}  // extern "C"
