// The engine's control interface for Python (ctypes), next to the ops in the
// same shared object: tf_rdma.Server starts the endpoint through it. Plain C
// types only; errors come back as a message in a caller-owned buffer.

#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/common/sha256.h"
#include "kernels/common/trace.h"
#include "kernels/common/wait.h"
#include "kernels/engine/engine.h"
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
