// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), used by the authenticated
// bootstrap handshake: peers prove knowledge of a shared job secret by
// computing an HMAC over a nonce. Standard library only.

#ifndef TF_RDMA_COMMON_SHA256_H_
#define TF_RDMA_COMMON_SHA256_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace tf_rdma {

// A 256-bit digest (SHA-256 output or HMAC-SHA256 tag).
using Digest256 = std::array<uint8_t, 32>;

// Incremental SHA-256 hasher. Feed data with Update() any number of times,
// then call Finish() once to obtain the digest. After Finish() the object must
// be Reset() before it is used again.
class Sha256 {
 public:
  Sha256();

  // Appends `len` bytes at `data` to the message being hashed.
  void Update(const void* data, size_t len);

  // Pads the message, processes the final block(s) and returns the digest.
  Digest256 Finish();

  // Restores the initial state so a new message can be hashed.
  void Reset();

 private:
  // Processes one 64-byte block, updating state_.
  void Compress(const uint8_t* block);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_;  // Pending bytes of a partial block.
  size_t buffer_len_;               // Number of valid bytes in buffer_.
  uint64_t total_len_;              // Total message length in bytes.
};

// One-shot SHA-256 of a byte string.
Digest256 Sha256Of(const void* data, size_t len);

// HMAC-SHA256 of `msg` under `key` (RFC 2104). Keys longer than the 64-byte
// block size are first hashed, as the RFC specifies.
Digest256 HmacSha256(const void* key, size_t key_len, const void* msg,
                     size_t msg_len);

// Lower-case hexadecimal encoding of `len` bytes.
std::string ToHex(const uint8_t* data, size_t len);

// Constant-time comparison of two equal-length byte strings. Runtime depends
// only on `len`, not on where (or whether) the inputs differ.
bool ConstantTimeEqual(const uint8_t* a, const uint8_t* b, size_t len);

}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_SHA256_H_
