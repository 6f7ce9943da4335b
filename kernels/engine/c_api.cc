// The engine's control interface for Python (ctypes), next to the ops in the
// same shared object: tf_rdma.Server starts the endpoint through it. Plain C
// types only; errors come back as a message in a caller-owned buffer.
#include <cstring>
#include <string>

#include "kernels/engine/engine.h"
#include "kernels/engine/sha256.h"

namespace {

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

// Copies Info() into out; returns the length it needs (call again if larger).
int tfrdma_info(char* out, int outlen) {
  std::string info = tf_rdma::Engine::Get()->Info();
  if (out != nullptr && outlen > 0) {
    std::strncpy(out, info.c_str(), outlen - 1);
    out[outlen - 1] = '\0';
  }
  return static_cast<int>(info.size()) + 1;
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
