// Fuzz target over what the engine parses from peers and graphs: OPEN
// request bodies (ParseOpenRequest, DecodeFields, ParseUint), the bounds of
// a WRITE frame (CheckWriteBounds) and a slot's attributes
// (SlotSpec::Validate).
//
// Each check has an oracle computed in 128-bit arithmetic, which cannot
// wrap: the parser or the check must agree with it on every input. That is
// the bug class a fault review found here (a 20-digit number wrapping to a
// small one, depth x stride wrapping past 2^64 to pass the bounds check), so
// the fuzzer looks for exactly that, and the sanitizers for anything else.
//
// Built with libFuzzer where clang is installed (`make fuzz`), and otherwise
// with g++ and standalone_main.cc, which feeds the target seeds and random
// mutations (tests/test_fuzz_targets.py runs it in `make test`).
//
// Input: the first byte picks the check, the rest is its input.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/engine/engine.h"
#include "kernels/common/wire.h"

namespace {

using u128 = unsigned __int128;

[[noreturn]] void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "ORACLE MISMATCH in %s: %s\n", what, detail.c_str());
  std::abort();
}

uint64_t Take64(const uint8_t*& data, size_t& size) {
  uint64_t v = 0;
  size_t n = size < 8 ? size : 8;
  std::memcpy(&v, data, n);
  data += n;
  size -= n;
  return v;
}

// The value of a canonical decimal string (no sign, no leading zero) in
// 128 bits; false if it is not one or does not fit.
bool Decimal128(const std::string& s, u128* out) {
  if (s.empty() || s.size() > 38 || (s.size() > 1 && s[0] == '0')) {
    return false;
  }
  u128 v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<unsigned>(c - '0');
  }
  *out = v;
  return true;
}

void CheckParseUint(const std::string& s) {
  uint64_t got = 0;
  bool ok = tf_rdma::ParseUint(s, &got);
  u128 want = 0;
  bool fits = Decimal128(s, &want) && want <= UINT64_MAX;
  if (ok != fits || (ok && got != static_cast<uint64_t>(want))) {
    Fail("ParseUint", "'" + s + "'");
  }
}

void CheckOpenRequest(const std::string& body) {
  tf_rdma::OpenRequest request;
  bool ok = tf_rdma::ParseOpenRequest(body, &request).ok();
  auto fields = tf_rdma::DecodeFields(body);
  for (const char* key : {"size", "credit_size", "credit_id"}) {
    CheckParseUint(fields[key]);
  }
  if (!ok) return;
  u128 size = 0, credit_id = 0;
  if (!Decimal128(fields["size"], &size) || size != request.size ||
      !Decimal128(fields["credit_id"], &credit_id) || credit_id > UINT32_MAX ||
      credit_id != request.credit_id || request.name.empty() ||
      request.name.size() > tf_rdma::kMaxRegionNameBytes) {
    Fail("ParseOpenRequest", body.substr(0, 200));
  }
}

void CheckWrite(const uint8_t* data, size_t size) {
  uint64_t offset = Take64(data, size), nbytes = Take64(data, size);
  uint64_t notice = Take64(data, size), region = Take64(data, size);
  bool ok = tf_rdma::CheckWriteBounds(offset, nbytes, notice, region, "r").ok();
  bool want = u128(offset) + nbytes <= region && u128(notice) + 8 <= region &&
              notice % 8 == 0;
  if (ok != want) {
    Fail("CheckWriteBounds", std::to_string(offset) + " " +
                                 std::to_string(nbytes) + " " +
                                 std::to_string(notice) + " " +
                                 std::to_string(region));
  }
}

void CheckSlot(const uint8_t* data, size_t size) {
  tf_rdma::SlotSpec spec;
  spec.tensor_name = "t";
  spec.region = "r";
  spec.region_bytes = Take64(data, size);
  spec.credit_bytes = Take64(data, size);
  spec.offset = Take64(data, size);
  spec.stride = Take64(data, size);
  spec.nbytes = Take64(data, size);
  spec.depth = static_cast<int64_t>(Take64(data, size));
  spec.credit_index = static_cast<int64_t>(Take64(data, size));
  if (!spec.Validate().ok()) return;
  // Accepted: every copy and every credit line must lie inside its region.
  u128 end = u128(spec.offset) + u128(spec.depth) * spec.stride;
  u128 credit_end = (u128(spec.credit_index) + 1) * u128(spec.depth) * 64;
  if (spec.depth < 1 || spec.depth > tf_rdma::kMaxSlotDepth ||
      spec.credit_index < 0 || end > spec.region_bytes ||
      u128(spec.nbytes) + tf_rdma::kSlotHeaderBytes > spec.stride ||
      credit_end > spec.credit_bytes) {
    Fail("SlotSpec::Validate",
         "offset " + std::to_string(spec.offset) + " stride " +
             std::to_string(spec.stride) + " depth " +
             std::to_string(spec.depth) + " region " +
             std::to_string(spec.region_bytes));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  uint8_t which = data[0] % 4;
  ++data;
  --size;
  std::string text(reinterpret_cast<const char*>(data), size);
  switch (which) {
    case 0: CheckOpenRequest(text); break;
    case 1: CheckWrite(data, size); break;
    case 2: CheckSlot(data, size); break;
    case 3: CheckParseUint(text.substr(0, 40)); break;
  }
  return 0;
}
