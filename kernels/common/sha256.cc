// Implementation of SHA-256 (FIPS 180-4, section 6.2) and HMAC-SHA256
// (RFC 2104). See sha256.h.

#include "kernels/common/sha256.h"

#include <algorithm>
#include <cstring>

namespace tf_rdma {
namespace {

constexpr size_t kBlockSize = 64;

// Round constants K0..K63 (FIPS 180-4, section 4.2.2): the first 32 bits of
// the fractional parts of the cube roots of the first 64 primes.
constexpr uint32_t kRoundConstants[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1,
    0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3,
    0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
    0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
    0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// Initial hash value H(0) (FIPS 180-4, section 5.3.3): the first 32 bits of
// the fractional parts of the square roots of the first 8 primes.
constexpr uint32_t kInitialState[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372,
                                       0xa54ff53a, 0x510e527f, 0x9b05688c,
                                       0x1f83d9ab, 0x5be0cd19};

// Rotate right by n bits (0 < n < 32).
inline uint32_t RotR(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

// The six logical functions of FIPS 180-4, section 4.1.2.
inline uint32_t Ch(uint32_t x, uint32_t y, uint32_t z) {
  return (x & y) ^ (~x & z);
}
inline uint32_t Maj(uint32_t x, uint32_t y, uint32_t z) {
  return (x & y) ^ (x & z) ^ (y & z);
}
inline uint32_t BigSigma0(uint32_t x) {
  return RotR(x, 2) ^ RotR(x, 13) ^ RotR(x, 22);
}
inline uint32_t BigSigma1(uint32_t x) {
  return RotR(x, 6) ^ RotR(x, 11) ^ RotR(x, 25);
}
inline uint32_t SmallSigma0(uint32_t x) {
  return RotR(x, 7) ^ RotR(x, 18) ^ (x >> 3);
}
inline uint32_t SmallSigma1(uint32_t x) {
  return RotR(x, 17) ^ RotR(x, 19) ^ (x >> 10);
}

// Big-endian load/store of 32-bit words, independent of host byte order.
inline uint32_t LoadBigEndian32(const uint8_t* p) {
  return (static_cast<uint32_t>(p[0]) << 24) |
         (static_cast<uint32_t>(p[1]) << 16) |
         (static_cast<uint32_t>(p[2]) << 8) | static_cast<uint32_t>(p[3]);
}
inline void StoreBigEndian32(uint32_t v, uint8_t* p) {
  p[0] = static_cast<uint8_t>(v >> 24);
  p[1] = static_cast<uint8_t>(v >> 16);
  p[2] = static_cast<uint8_t>(v >> 8);
  p[3] = static_cast<uint8_t>(v);
}

}  // namespace

Sha256::Sha256() { Reset(); }

// Restores H(0) and discards any buffered input.
void Sha256::Reset() {
  std::memcpy(state_.data(), kInitialState, sizeof(kInitialState));
  buffer_.fill(0);
  buffer_len_ = 0;
  total_len_ = 0;
}

// SHA-256 compression function (FIPS 180-4, section 6.2.2, steps 1-4):
// expands the block into the 64-word message schedule and runs 64 rounds.
void Sha256::Compress(const uint8_t* block) {
  uint32_t w[64];
  for (int t = 0; t < 16; ++t) w[t] = LoadBigEndian32(block + 4 * t);
  for (int t = 16; t < 64; ++t) {
    w[t] = SmallSigma1(w[t - 2]) + w[t - 7] + SmallSigma0(w[t - 15]) +
           w[t - 16];
  }

  uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
  uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
  for (int t = 0; t < 64; ++t) {
    const uint32_t t1 =
        h + BigSigma1(e) + Ch(e, f, g) + kRoundConstants[t] + w[t];
    const uint32_t t2 = BigSigma0(a) + Maj(a, b, c);
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state_[0] += a;
  state_[1] += b;
  state_[2] += c;
  state_[3] += d;
  state_[4] += e;
  state_[5] += f;
  state_[6] += g;
  state_[7] += h;
}

// Buffers input until a full block is available; whole blocks straight from
// the caller's data are compressed without copying.
void Sha256::Update(const void* data, size_t len) {
  if (len == 0) return;  // Also makes a null `data` with len 0 harmless.
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_len_ += len;

  if (buffer_len_ > 0) {
    const size_t take = std::min(len, kBlockSize - buffer_len_);
    std::memcpy(buffer_.data() + buffer_len_, p, take);
    buffer_len_ += take;
    p += take;
    len -= take;
    if (buffer_len_ < kBlockSize) return;
    Compress(buffer_.data());
    buffer_len_ = 0;
  }
  while (len >= kBlockSize) {
    Compress(p);
    p += kBlockSize;
    len -= kBlockSize;
  }
  if (len > 0) {
    std::memcpy(buffer_.data(), p, len);
    buffer_len_ = len;
  }
}

// Padding (FIPS 180-4, section 5.1.1): append a 1 bit, zeros up to 56 mod 64
// bytes, then the message length in bits as a 64-bit big-endian integer.
Digest256 Sha256::Finish() {
  const uint64_t bit_len = total_len_ * 8;

  buffer_[buffer_len_++] = 0x80;
  if (buffer_len_ > kBlockSize - 8) {
    std::memset(buffer_.data() + buffer_len_, 0, kBlockSize - buffer_len_);
    Compress(buffer_.data());
    buffer_len_ = 0;
  }
  std::memset(buffer_.data() + buffer_len_, 0, kBlockSize - 8 - buffer_len_);
  StoreBigEndian32(static_cast<uint32_t>(bit_len >> 32), buffer_.data() + 56);
  StoreBigEndian32(static_cast<uint32_t>(bit_len), buffer_.data() + 60);
  Compress(buffer_.data());
  buffer_len_ = 0;

  Digest256 digest;
  for (int i = 0; i < 8; ++i) {
    StoreBigEndian32(state_[i], digest.data() + 4 * i);
  }
  return digest;
}

Digest256 Sha256Of(const void* data, size_t len) {
  Sha256 hasher;
  hasher.Update(data, len);
  return hasher.Finish();
}

// HMAC(K, m) = H((K0 ^ opad) || H((K0 ^ ipad) || m)), where K0 is the key
// (hashed first if longer than the block size) zero-padded to 64 bytes,
// ipad = 0x36 repeated and opad = 0x5c repeated (RFC 2104, section 2).
Digest256 HmacSha256(const void* key, size_t key_len, const void* msg,
                     size_t msg_len) {
  uint8_t k0[kBlockSize] = {};
  if (key_len > kBlockSize) {
    const Digest256 hashed_key = Sha256Of(key, key_len);
    std::memcpy(k0, hashed_key.data(), hashed_key.size());
  } else if (key_len > 0) {
    std::memcpy(k0, key, key_len);
  }

  uint8_t ipad[kBlockSize];
  uint8_t opad[kBlockSize];
  for (size_t i = 0; i < kBlockSize; ++i) {
    ipad[i] = k0[i] ^ 0x36;
    opad[i] = k0[i] ^ 0x5c;
  }

  Sha256 inner;
  inner.Update(ipad, sizeof(ipad));
  inner.Update(msg, msg_len);
  const Digest256 inner_digest = inner.Finish();

  Sha256 outer;
  outer.Update(opad, sizeof(opad));
  outer.Update(inner_digest.data(), inner_digest.size());
  return outer.Finish();
}

std::string ToHex(const uint8_t* data, size_t len) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * len, '\0');
  for (size_t i = 0; i < len; ++i) {
    out[2 * i] = kDigits[data[i] >> 4];
    out[2 * i + 1] = kDigits[data[i] & 0x0f];
  }
  return out;
}

// Accumulates the OR of all byte differences so that every byte is always
// examined; the volatile accumulator discourages the compiler from
// introducing an early exit.
bool ConstantTimeEqual(const uint8_t* a, const uint8_t* b, size_t len) {
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < len; ++i) {
    diff = static_cast<uint8_t>(diff | (a[i] ^ b[i]));
  }
  return diff == 0;
}

}  // namespace tf_rdma
