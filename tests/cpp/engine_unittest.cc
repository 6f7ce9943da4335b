// C++ unit tests of the engine pieces that work without TensorFlow (issue 14):
// the wire format and socket helpers, regions and the collection of stale
// segments, the engine's config parser, SlotSpec::Validate and the
// slot/credit layout it guards, SHA-256/HMAC, the trace hooks, the
// notice-word waits, the shm/tcp transports' write paths, and which
// transport a pair uses.
//
// Built by `make cpp-test` with g++ from the same engine sources as the fuzz
// target (Makefile FUZZ_ENGINE), no TensorFlow, no gtest: a small CHECK/EXPECT
// set below counts failures and prints file:line and both values. Real
// sockets (socketpair, 127.0.0.1) and real /dev/shm segments, as design.md §5
// asks; every segment a test creates is removed before it ends, and main()
// checks that this process left none behind.
//
//   build/cpp/engine_unittest             run every test
//   build/cpp/engine_unittest --list      the test names
//   build/cpp/engine_unittest wire region run the tests whose name contains
//                                         any of the words
//   build/cpp/engine_unittest --known-bugs  also run the KNOWN_BUG tests:
//                                         checks of product bugs found here
//                                         and not fixed yet (they fail until
//                                         the fix lands; then make them TEST)
//
// The last line is "engine_unittest: ran N tests, F failed, C checks";
// tests/test_cpp_units.py checks N against the TEST( count of this file.
// Exit status: 0 only if every test that ran passed and at least one ran;
// a test that runs past 60 s ends the run (exit 3), naming the test.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/engine/engine.h"
#include "kernels/engine/stats.h"
#include "kernels/common/recent.h"
#include "kernels/common/region.h"
#include "kernels/common/sha256.h"
#include "kernels/common/status.h"
#include "kernels/common/text.h"
#include "kernels/common/timeline.h"
#include "kernels/common/trace.h"
#include "kernels/common/transport_choice.h"
#include "kernels/common/wait.h"
#include "kernels/common/wire.h"
#include "kernels/transport/shm/pair.h"
#include "kernels/transport/tcp/pair.h"
#include "kernels/transport/transport.h"

// ---------------------------------------------------------------------------
// The test harness.

namespace ut {

struct TestCase {
  const char* name;
  void (*fn)();
  bool known_bug;
};

std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}

struct Registrar {
  Registrar(const char* name, void (*fn)(), bool known_bug) {
    Registry().push_back({name, fn, known_bug});
  }
};

int g_test_failures = 0;  // in the running test
long g_checks = 0;
const char* g_current = "";  // the running test, for the watchdog

// A test that hangs (a check let a bad frame through and a read waits for
// data that never comes) ends the run after this long, naming the test.
constexpr unsigned kTestTimeoutS = 60;

void OnTestTimeout(int) {
  const char head[] = "[ FAIL ] ";
  const char tail[] = " timed out; engine_unittest: aborted\n";
  ssize_t n = write(1, head, sizeof(head) - 1);
  n = write(1, g_current, std::strlen(g_current));
  n = write(1, tail, sizeof(tail) - 1);
  (void)n;
  _exit(3);
}

std::string Escape(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < 160; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\x%02x", c);
      out += esc;
    }
  }
  if (s.size() > 160) out += "...(" + std::to_string(s.size()) + " bytes)";
  return out + "\"";
}

const char* CodeName(tf_rdma::Code c) {
  using tf_rdma::Code;
  switch (c) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "InvalidArgument";
    case Code::kDeadlineExceeded: return "DeadlineExceeded";
    case Code::kUnavailable: return "Unavailable";
    case Code::kFailedPrecondition: return "FailedPrecondition";
    case Code::kPermissionDenied: return "PermissionDenied";
    case Code::kInternal: return "Internal";
    case Code::kResourceExhausted: return "ResourceExhausted";
    case Code::kCancelled: return "Cancelled";
  }
  return "Code(?)";
}

template <typename T>
std::string Show(const T& v) {
  std::ostringstream o;
  o << v;
  return o.str();
}
std::string Show(const std::string& s) { return Escape(s); }
std::string Show(const char* s) { return s ? Escape(s) : "(null)"; }
std::string Show(bool b) { return b ? "true" : "false"; }
std::string Show(unsigned char v) { return std::to_string(v); }
std::string Show(tf_rdma::Code c) { return CodeName(c); }
std::string Show(const tf_rdma::Status& s) {
  return std::string(CodeName(s.code())) +
         (s.ok() ? "" : ": " + Escape(s.message()));
}
std::string Show(const std::map<std::string, std::string>& m) {
  std::string out = "{";
  for (const auto& kv : m) {
    if (out.size() > 1) out += ", ";
    out += Escape(kv.first) + ": " + Escape(kv.second);
  }
  return out + "}";
}

void Failure(const char* file, int line, const std::string& what) {
  ++g_test_failures;
  std::printf("  %s:%d: FAILED %s\n", file, line, what.c_str());
  std::fflush(stdout);
}

bool Check(bool ok, const char* file, int line, const std::string& what) {
  ++g_checks;
  if (!ok) Failure(file, line, what);
  return ok;
}

// `a` and `b` are evaluated once (a check may read a socket).
template <typename Op, typename A, typename B>
bool CheckCompare(Op compare, const char* file, int line, const char* op,
                  const char* a_text, const char* b_text, const A& a,
                  const B& b) {
  ++g_checks;
  bool ok = compare(a, b);
  if (!ok) {
    Failure(file, line,
            std::string(a_text) + " " + op + " " + b_text + "\n      left:  " +
                Show(a) + "\n      right: " + Show(b));
  }
  return ok;
}

bool CheckStatus(const tf_rdma::Status& s, tf_rdma::Code want,
                 const char* file, int line, const char* text) {
  ++g_checks;
  if (s.code() == want) return true;
  Failure(file, line,
          std::string(text) + "\n      want:  " + CodeName(want) +
              "\n      got:   " + Show(s));
  return false;
}

bool CheckContains(const std::string& haystack, const std::string& needle,
                   const char* file, int line, const char* text) {
  ++g_checks;
  if (haystack.find(needle) != std::string::npos) return true;
  Failure(file, line,
          std::string(text) + "\n      text:  " + Escape(haystack) +
              "\n      lacks: " + Escape(needle));
  return false;
}

}  // namespace ut

#define UT_CONCAT2(a, b) a##b
#define UT_CONCAT(a, b) UT_CONCAT2(a, b)
#define UT_DEFINE(name, known_bug)                                       \
  static void UT_CONCAT(test_, name)();                                  \
  static ::ut::Registrar UT_CONCAT(registrar_, name)(                    \
      #name, &UT_CONCAT(test_, name), known_bug);                        \
  static void UT_CONCAT(test_, name)()
// A test; runs by default.
#define TEST(name) UT_DEFINE(name, false)
// A check of a product bug that is not fixed yet: runs only with
// --known-bugs or when named exactly. Make it a TEST once the fix lands.
#define KNOWN_BUG(name) UT_DEFINE(name, true)

#define EXPECT_TRUE(c) ::ut::Check(static_cast<bool>(c), __FILE__, __LINE__, "EXPECT_TRUE(" #c ")")
#define EXPECT_FALSE(c) ::ut::Check(!(c), __FILE__, __LINE__, "EXPECT_FALSE(" #c ")")
#define UT_CMP(a, b, op)                                                   \
  ::ut::CheckCompare([](const auto& x, const auto& y) { return x op y; }, \
                     __FILE__, __LINE__, #op, #a, #b, (a), (b))
#define EXPECT_EQ(a, b) UT_CMP(a, b, ==)
#define EXPECT_NE(a, b) UT_CMP(a, b, !=)
#define EXPECT_LT(a, b) UT_CMP(a, b, <)
#define EXPECT_LE(a, b) UT_CMP(a, b, <=)
#define EXPECT_GT(a, b) UT_CMP(a, b, >)
#define EXPECT_GE(a, b) UT_CMP(a, b, >=)
#define EXPECT_OK(s) \
  ::ut::CheckStatus((s), ::tf_rdma::Code::kOk, __FILE__, __LINE__, "EXPECT_OK(" #s ")")
#define EXPECT_CODE(s, code)                                                    \
  ::ut::CheckStatus((s), ::tf_rdma::Code::code, __FILE__, __LINE__, \
                    "EXPECT_CODE(" #s ", " #code ")")
#define EXPECT_CONTAINS(text, part) \
  ::ut::CheckContains((text), (part), __FILE__, __LINE__, "EXPECT_CONTAINS(" #text ", " #part ")")
// ASSERT_*: the same check, and the test stops if it fails.
#define ASSERT_TRUE(c) do { if (!EXPECT_TRUE(c)) return; } while (0)
#define ASSERT_EQ(a, b) do { if (!EXPECT_EQ(a, b)) return; } while (0)
#define ASSERT_OK(s) do { if (!EXPECT_OK(s)) return; } while (0)

// ---------------------------------------------------------------------------
// Helpers.

namespace {

using tf_rdma::Code;
using tf_rdma::Deadline;
using tf_rdma::Region;
using tf_rdma::Status;
using u128 = unsigned __int128;

constexpr uint64_t kMax64 = UINT64_MAX;

int64_t MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now() - t0)
      .count();
}

// A connected AF_UNIX stream pair, closed at scope exit.
struct SocketPair {
  int fd[2] = {-1, -1};
  SocketPair() {
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fd) != 0) {
      fd[0] = fd[1] = -1;
    }
  }
  ~SocketPair() {
    CloseEnd(0);
    CloseEnd(1);
  }
  void CloseEnd(int i) {
    if (fd[i] >= 0) close(fd[i]);
    fd[i] = -1;
  }
  bool ok() const { return fd[0] >= 0 && fd[1] >= 0; }
};

// What is readable on `fd` right now, without waiting.
std::string Drain(int fd) {
  std::string out;
  char buf[4096];
  while (true) {
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

bool WriteString(int fd, const std::string& s) {
  return write(fd, s.data(), s.size()) == static_cast<ssize_t>(s.size());
}

// True if the shm segment `shm_name` ("/tfrdma.1.2") is linked in /dev/shm.
bool ShmExists(const std::string& shm_name) {
  struct stat st;
  return stat(("/dev/shm" + shm_name).c_str(), &st) == 0;
}

// This process's tfrdma segments still in /dev/shm.
std::vector<std::string> OwnSegments() {
  std::vector<std::string> out;
  std::string prefix = "tfrdma." + std::to_string(getpid()) + ".";
  if (DIR* dir = opendir("/dev/shm")) {
    while (struct dirent* e = readdir(dir)) {
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) {
        out.push_back(e->d_name);
      }
    }
    closedir(dir);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string Hex(const tf_rdma::Digest256& d) {
  return tf_rdma::ToHex(d.data(), d.size());
}

std::string HmacHex(const std::string& key, const std::string& msg) {
  return Hex(tf_rdma::HmacSha256(key.data(), key.size(), msg.data(),
                                 msg.size()));
}

const char* kGoodSecret = "0123456789abcdef";  // kMinSecretBytes long

std::string Config(const std::string& extra) {
  return std::string("task=/job:worker/task:0\nlisten=127.0.0.1:0\nsecret=") +
         kGoodSecret + "\n" + extra;
}

tf_rdma::SlotSpec GoodSlot() {
  tf_rdma::SlotSpec s;
  s.tensor_name = "x";
  s.peer = "/job:worker/task:1";
  s.region = "r";
  s.region_bytes = 8192;
  s.credit_bytes = 4096;
  s.offset = 128;
  s.stride = 1024;
  s.nbytes = 960;  // stride - kSlotHeaderBytes
  s.depth = 2;
  s.credit_index = 3;
  return s;
}

// The slot layout of engine.h's protocol comment, restated here apart from
// the engine's own helpers (CopyOffset, CreditWord in engine_internal.h), so
// that it pins the layout they must follow: copy c of a slot starts at
// offset + c * stride (64-byte header: sequence word at +0, call word at +8,
// then the payload), and its credit line is line credit_index * depth + c of
// the credit region, kCreditLineBytes each, the credit word first.
uint64_t CopyOffset(const tf_rdma::SlotSpec& s, uint64_t copy) {
  return s.offset + copy * s.stride;
}
uint64_t CreditLineOffset(const tf_rdma::SlotSpec& s, uint64_t copy) {
  return (static_cast<uint64_t>(s.credit_index) * s.depth + copy) *
         tf_rdma::kCreditLineBytes;
}

// The 128-bit oracle of a write's bounds (as tests/fuzz/wire_fuzz.cc).
bool WriteFits(uint64_t offset, uint64_t nbytes, uint64_t notice,
               uint64_t region) {
  return u128(offset) + nbytes <= region && u128(notice) + 8 <= region &&
         notice % 8 == 0;
}

// Values next to the bounds that matter for `size`.
std::vector<uint64_t> EdgeValues(uint64_t size) {
  std::vector<uint64_t> v = {0, 1, 7, 8, 9, 64, size - 9, size - 8, size - 1,
                             size, size + 1, size + 8, uint64_t{1} << 32,
                             uint64_t{1} << 63, kMax64 - 8, kMax64 - 7,
                             kMax64 - 1, kMax64};
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------
// Wire format: frame header, fields, numbers, OPEN requests, write bounds.

TEST(wire_frame_header_layout) {
  tf_rdma::FrameHeader h;
  EXPECT_EQ(sizeof(h), size_t{48});
  EXPECT_EQ(h.magic, tf_rdma::kFrameMagic);
  EXPECT_EQ(offsetof(tf_rdma::FrameHeader, magic), size_t{0});
  EXPECT_EQ(offsetof(tf_rdma::FrameHeader, type), size_t{4});
  EXPECT_EQ(offsetof(tf_rdma::FrameHeader, flags), size_t{6});
  EXPECT_EQ(offsetof(tf_rdma::FrameHeader, a), size_t{8});
  EXPECT_EQ(offsetof(tf_rdma::FrameHeader, e), size_t{40});
  h.type = tf_rdma::kWrite;
  h.flags = 0x0102;
  h.a = 0x1122334455667788ull;
  h.b = 1;
  h.c = kMax64;
  h.d = 0;
  h.e = uint64_t{1} << 63;
  unsigned char bytes[48];
  std::memcpy(bytes, &h, sizeof(h));
  // Little-endian on the wire: the magic reads "TFRD", a's low byte first.
  EXPECT_EQ(std::string(reinterpret_cast<char*>(bytes), 4), std::string("TFRD"));
  EXPECT_EQ(bytes[4], 3);
  EXPECT_EQ(bytes[5], 0);
  EXPECT_EQ(bytes[6], 0x02);
  EXPECT_EQ(bytes[8], 0x88);
  EXPECT_EQ(bytes[15], 0x11);
  EXPECT_EQ(bytes[47], 0x80);
  tf_rdma::FrameHeader back;
  std::memcpy(&back, bytes, sizeof(back));
  EXPECT_EQ(back.magic, h.magic);
  EXPECT_EQ(back.type, h.type);
  EXPECT_EQ(back.flags, h.flags);
  EXPECT_EQ(back.a, h.a);
  EXPECT_EQ(back.b, h.b);
  EXPECT_EQ(back.c, h.c);
  EXPECT_EQ(back.d, h.d);
  EXPECT_EQ(back.e, h.e);
}

TEST(wire_frame_header_over_socket) {
  SocketPair sp;
  ASSERT_TRUE(sp.ok());
  tf_rdma::FrameHeader h;
  h.type = tf_rdma::kOpenReply;
  std::string body = "x=1\n";
  h.a = 7;
  h.b = body.size();
  h.c = static_cast<uint64_t>(Code::kPermissionDenied);
  ASSERT_OK(tf_rdma::SendAll(sp.fd[0], &h, sizeof(h), Deadline(5000)));
  ASSERT_OK(tf_rdma::SendAll(sp.fd[0], body.data(), body.size(), Deadline(5000)));
  tf_rdma::FrameHeader got;
  got.magic = 0;
  ASSERT_OK(tf_rdma::RecvAll(sp.fd[1], &got, sizeof(got)));
  EXPECT_EQ(got.magic, tf_rdma::kFrameMagic);
  EXPECT_EQ(got.type, uint16_t{tf_rdma::kOpenReply});
  EXPECT_EQ(got.a, uint64_t{7});
  ASSERT_EQ(got.b, uint64_t{4});
  EXPECT_EQ(got.c, static_cast<uint64_t>(Code::kPermissionDenied));
  std::string got_body(got.b, '\0');
  ASSERT_OK(tf_rdma::RecvAll(sp.fd[1], &got_body[0], got_body.size()));
  EXPECT_EQ(got_body, body);
  EXPECT_EQ(Drain(sp.fd[1]), std::string());  // nothing more was sent
}

TEST(wire_fields_round_trip) {
  std::map<std::string, std::string> f = {
      {"name", "model/dense/kernel:0"},
      {"empty", ""},
      {"equals", "a=b=c"},
      {"spaces", " lead and trail "},
      {"size", "4096"},
  };
  std::string body = tf_rdma::EncodeFields(f);
  // One "key=value\n" line per field, in key order.
  EXPECT_EQ(body, std::string("empty=\nequals=a=b=c\nname=model/dense/kernel:0\n"
                              "size=4096\nspaces= lead and trail \n"));
  EXPECT_EQ(tf_rdma::DecodeFields(body), f);
  EXPECT_EQ(tf_rdma::EncodeFields({}), std::string());
  EXPECT_TRUE(tf_rdma::DecodeFields("").empty());
}

TEST(wire_decode_fields_edge_cases) {
  using M = std::map<std::string, std::string>;
  // A last line without its newline still counts.
  EXPECT_EQ(tf_rdma::DecodeFields("a=1\nb=2"), (M{{"a", "1"}, {"b", "2"}}));
  // Lines without '=' are skipped, empty lines too; the first '=' splits.
  EXPECT_EQ(tf_rdma::DecodeFields("junk\n\na==\n=v\n"),
            (M{{"a", "="}, {"", "v"}}));
  // A repeated key: the last one wins.
  EXPECT_EQ(tf_rdma::DecodeFields("k=1\nk=2\n"), (M{{"k", "2"}}));
  // No escaping: a value with a newline does not survive a round trip (the
  // engine only encodes its own numbers and plan names).
  M with_newline = {{"k", "a\nb=c"}};
  EXPECT_EQ(tf_rdma::DecodeFields(tf_rdma::EncodeFields(with_newline)),
            (M{{"k", "a"}, {"b", "c"}}));
}

TEST(wire_parse_uint_accepts_canonical) {
  struct Case {
    const char* text;
    uint64_t value;
  } cases[] = {{"0", 0},
               {"1", 1},
               {"9", 9},
               {"10", 10},
               {"4096", 4096},
               {"4294967296", uint64_t{1} << 32},
               {"9223372036854775808", uint64_t{1} << 63},
               {"18446744073709551614", kMax64 - 1},
               {"18446744073709551615", kMax64}};
  for (const Case& c : cases) {
    uint64_t v = 12345;
    EXPECT_TRUE(tf_rdma::ParseUint(c.text, &v));
    EXPECT_EQ(v, c.value);
  }
}

TEST(wire_parse_uint_rejects) {
  const char* bad[] = {
      "",     "00",   "01",    "007",  "-1",  "+1",   "-0",   " 1",
      "1 ",   "1\n",  "\t1",   "1.0",  "1e3", "0x10", "abc",  "12a",
      "18446744073709551616",   // 2^64
      "18446744073709551625",   // 2^64 + 9: wraps to 9 without the check
      "99999999999999999999",   // 20 digits, past 2^64 - 1
      "100000000000000000000",  // 21 digits
      "000000000000000000001",
  };
  for (const char* text : bad) {
    uint64_t v = 777;
    bool ok = tf_rdma::ParseUint(text, &v);
    if (!EXPECT_FALSE(ok)) std::printf("      input: %s\n", ut::Escape(text).c_str());
    // Not written on failure: DecodeDescriptor (regions.cc) relies on an
    // absent field leaving the default.
    EXPECT_EQ(v, uint64_t{777});
  }
  // An embedded NUL is not a digit.
  uint64_t v = 0;
  EXPECT_FALSE(tf_rdma::ParseUint(std::string("1\0" "2", 3), &v));
}

TEST(wire_parse_open_request_good) {
  std::map<std::string, std::string> f = {
      {"name", "grads"},
      {"size", "1048576"},
      {"plan_hash", "abc123"},
      {"credit_id", "4294967295"},  // 2^32 - 1: the largest region id
      {"credit_size", "4096"},
      {"credit_shm", "/tfrdma.1.2"},
  };
  tf_rdma::OpenRequest r;
  ASSERT_OK(tf_rdma::ParseOpenRequest(tf_rdma::EncodeFields(f), &r));
  EXPECT_EQ(r.name, std::string("grads"));
  EXPECT_EQ(r.size, uint64_t{1048576});
  EXPECT_EQ(r.plan_hash, std::string("abc123"));
  EXPECT_EQ(r.credit_id, uint32_t{4294967295u});
  EXPECT_EQ(r.credit_size, uint64_t{4096});
  EXPECT_EQ(r.refusal, std::string());
  EXPECT_EQ(r.fields["credit_shm"], std::string("/tfrdma.1.2"));
  // Name of exactly kMaxRegionNameBytes, size 0 and 2^64 - 1 are in range
  // (the engine checks sizes against its own limits later).
  f["name"] = std::string(tf_rdma::kMaxRegionNameBytes, 'n');
  f["size"] = "18446744073709551615";
  f["refusal"] = "restarted";
  ASSERT_OK(tf_rdma::ParseOpenRequest(tf_rdma::EncodeFields(f), &r));
  EXPECT_EQ(r.name.size(), tf_rdma::kMaxRegionNameBytes);
  EXPECT_EQ(r.size, kMax64);
  EXPECT_EQ(r.refusal, std::string("restarted"));
}

TEST(wire_parse_open_request_bad) {
  const std::map<std::string, std::string> good = {
      {"name", "grads"}, {"size", "4096"}, {"credit_id", "1"},
      {"credit_size", "4096"}};
  struct Case {
    const char* key;
    std::string value;  // "<absent>": the field is left out
  } cases[] = {
      {"name", ""},
      {"name", "<absent>"},
      {"name", std::string(tf_rdma::kMaxRegionNameBytes + 1, 'n')},
      {"size", "<absent>"},
      {"size", "-1"},
      {"size", "01"},
      {"size", "4096 "},
      {"size", "18446744073709551616"},       // 2^64
      {"size", "18446744073709555712"},       // 2^64 + 4096 (issue 13)
      {"credit_size", "<absent>"},
      {"credit_size", "x"},
      {"credit_id", "<absent>"},
      {"credit_id", "4294967296"},            // 2^32: not a region id
      {"credit_id", "-1"},
  };
  for (const Case& c : cases) {
    auto f = good;
    if (c.value == "<absent>") {
      f.erase(c.key);
    } else {
      f[c.key] = c.value;
    }
    tf_rdma::OpenRequest r;
    Status s = tf_rdma::ParseOpenRequest(tf_rdma::EncodeFields(f), &r);
    if (!EXPECT_CODE(s, kInvalidArgument)) {
      std::printf("      field %s=%s\n", c.key, ut::Escape(c.value).c_str());
    }
  }
  tf_rdma::OpenRequest r;
  EXPECT_CODE(tf_rdma::ParseOpenRequest("", &r), kInvalidArgument);
  EXPECT_CODE(tf_rdma::ParseOpenRequest("garbage without fields", &r),
              kInvalidArgument);
}

TEST(wire_check_write_bounds) {
  const uint64_t R = 4096;
  auto ok = [&](uint64_t off, uint64_t n, uint64_t notice, uint64_t region) {
    return tf_rdma::CheckWriteBounds(off, n, notice, region, "r").ok();
  };
  EXPECT_TRUE(ok(0, R, 0, R));            // the whole region
  EXPECT_TRUE(ok(64, 1000, 0, R));        // inside
  EXPECT_TRUE(ok(R - 1, 1, R - 8, R));    // exactly at the end, last word
  EXPECT_TRUE(ok(R, 0, 0, R));            // empty write at the end
  EXPECT_FALSE(ok(R, 1, 0, R));           // one byte past
  EXPECT_FALSE(ok(R - 1, 2, 0, R));       // one byte past
  EXPECT_FALSE(ok(1, R, 0, R));           // one byte past
  EXPECT_FALSE(ok(R + 1, 0, 0, R));       // offset past the end
  // offset + nbytes wraps past 2^64 to a small number.
  EXPECT_FALSE(ok(8, kMax64 - 7, 0, R));
  EXPECT_FALSE(ok(kMax64, 1, 0, R));
  EXPECT_FALSE(ok(kMax64, kMax64, 0, R));
  EXPECT_FALSE(ok(64, kMax64, 0, kMax64));
  // The notice word: 8-aligned and all 8 bytes inside.
  EXPECT_FALSE(ok(0, 0, 4, R));           // misaligned
  EXPECT_FALSE(ok(0, 0, R - 4, R));       // misaligned, half outside
  EXPECT_FALSE(ok(0, 0, R, R));           // past the end
  EXPECT_FALSE(ok(0, 0, kMax64 - 7, R));  // aligned, would wrap with + 8
  EXPECT_FALSE(ok(0, 0, 0, 4));           // no room for a word
  EXPECT_FALSE(ok(0, 0, 0, 0));
  EXPECT_TRUE(ok(0, 0, 0, 8));
  // The message names the region and the values.
  Status s = tf_rdma::CheckWriteBounds(4000, 200, 8, R, "grads#3");
  EXPECT_CODE(s, kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "grads#3");
  EXPECT_CONTAINS(s.message(), "4000");
  EXPECT_CONTAINS(s.message(), "200");
}

TEST(wire_write_bounds_agree_with_oracle) {
  // CheckWriteBounds, the writer-side RemoteRegions::Find (tcp, verbs) and
  // the shm pair's Contains-based check must all agree with the 128-bit
  // oracle on every combination of edge values.
  for (uint64_t region : {uint64_t{0}, uint64_t{8}, uint64_t{4096},
                          kMax64 - 7, kMax64}) {
    tf_rdma::RemoteRegions remote;
    tf_rdma::RegionDescriptor d;
    d.id = 1;
    d.size = region;
    int handle = remote.Add(d);
    std::vector<uint64_t> edges = EdgeValues(region);
    int mismatches = 0;
    for (uint64_t off : edges) {
      for (uint64_t n : edges) {
        for (uint64_t notice : edges) {
          bool want = WriteFits(off, n, notice, region);
          bool a = tf_rdma::CheckWriteBounds(off, n, notice, region, "r").ok();
          tf_rdma::RegionDescriptor out;
          bool b = remote.Find(handle, off, n, notice, &out).ok();
          if ((a != want || b != want) && ++mismatches <= 3) {
            ut::Failure(__FILE__, __LINE__,
                        "bounds disagree: offset " + std::to_string(off) +
                            " nbytes " + std::to_string(n) + " notice " +
                            std::to_string(notice) + " region " +
                            std::to_string(region) + ": oracle " +
                            ut::Show(want) + ", CheckWriteBounds " +
                            ut::Show(a) + ", RemoteRegions::Find " +
                            ut::Show(b));
          }
          ++ut::g_checks;
        }
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
  tf_rdma::RemoteRegions remote;
  tf_rdma::RegionDescriptor out;
  EXPECT_CODE(remote.Find(0, 0, 0, 0, &out), kInvalidArgument);   // no region
  EXPECT_CODE(remote.Find(-1, 0, 0, 0, &out), kInvalidArgument);
}

// ---------------------------------------------------------------------------
// Socket helpers.

TEST(wire_recv_line_split_across_writes) {
  SocketPair sp;
  ASSERT_TRUE(sp.ok());
  std::thread writer([&] {
    WriteString(sp.fd[0], "HEL");
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    WriteString(sp.fd[0], "LO 1");
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    WriteString(sp.fd[0], "\nNEXT");  // the line ends mid-write
  });
  std::string line;
  Status s = tf_rdma::RecvLine(sp.fd[1], &line, 64, Deadline(10000));
  writer.join();
  EXPECT_OK(s);
  EXPECT_EQ(line, std::string("HELLO 1"));
  // Bytes after the newline stay in the socket for the next reader.
  EXPECT_EQ(Drain(sp.fd[1]), std::string("NEXT"));
}

TEST(wire_recv_line_two_lines_in_one_write) {
  SocketPair sp;
  ASSERT_TRUE(sp.ok());
  ASSERT_TRUE(WriteString(sp.fd[0], "one\ntwo\n\nrest"));
  std::string line;
  EXPECT_OK(tf_rdma::RecvLine(sp.fd[1], &line, 64, Deadline(5000)));
  EXPECT_EQ(line, std::string("one"));
  EXPECT_OK(tf_rdma::RecvLine(sp.fd[1], &line, 64, Deadline(5000)));
  EXPECT_EQ(line, std::string("two"));
  EXPECT_OK(tf_rdma::RecvLine(sp.fd[1], &line, 64, Deadline(5000)));
  EXPECT_EQ(line, std::string(""));
  EXPECT_EQ(Drain(sp.fd[1]), std::string("rest"));
}

TEST(wire_recv_line_max_bytes) {
  {
    SocketPair sp;
    ASSERT_TRUE(sp.ok());
    ASSERT_TRUE(WriteString(sp.fd[0], "abcde\n"));  // exactly max_bytes
    std::string line;
    EXPECT_OK(tf_rdma::RecvLine(sp.fd[1], &line, 5, Deadline(5000)));
    EXPECT_EQ(line, std::string("abcde"));
  }
  {
    SocketPair sp;
    ASSERT_TRUE(sp.ok());
    ASSERT_TRUE(WriteString(sp.fd[0], "abcdef\n"));  // one byte too many
    std::string line;
    Status s = tf_rdma::RecvLine(sp.fd[1], &line, 5, Deadline(5000));
    EXPECT_CODE(s, kInvalidArgument);
    EXPECT_CONTAINS(s.message(), "longer than 5");
  }
  {
    // A long line with no newline at all, longer than the internal buffer,
    // is refused once max_bytes is passed, not read on forever.
    SocketPair sp;
    ASSERT_TRUE(sp.ok());
    ASSERT_TRUE(WriteString(sp.fd[0], std::string(5000, 'x')));
    std::string line;
    EXPECT_CODE(tf_rdma::RecvLine(sp.fd[1], &line, 4096, Deadline(5000)),
                kInvalidArgument);
    EXPECT_LE(line.size(), size_t{4097});
  }
}

TEST(wire_recv_line_deadline_without_data) {
  SocketPair sp;
  ASSERT_TRUE(sp.ok());
  ASSERT_TRUE(WriteString(sp.fd[0], "no newline yet"));
  auto t0 = std::chrono::steady_clock::now();
  std::string line;
  Status s = tf_rdma::RecvLine(sp.fd[1], &line, 64, Deadline(150));
  int64_t ms = MsSince(t0);
  EXPECT_CODE(s, kDeadlineExceeded);
  EXPECT_CONTAINS(s.message(), "150 ms");
  EXPECT_GE(ms, int64_t{140});
  EXPECT_LT(ms, int64_t{5000});
  // Nothing at all: the same.
  SocketPair idle;
  ASSERT_TRUE(idle.ok());
  t0 = std::chrono::steady_clock::now();
  EXPECT_CODE(tf_rdma::RecvLine(idle.fd[1], &line, 64, Deadline(100)),
              kDeadlineExceeded);
  EXPECT_LT(MsSince(t0), int64_t{5000});
}

TEST(wire_recv_line_peer_closed) {
  SocketPair sp;
  ASSERT_TRUE(sp.ok());
  ASSERT_TRUE(WriteString(sp.fd[0], "half a li"));
  sp.CloseEnd(0);
  std::string line;
  EXPECT_CODE(tf_rdma::RecvLine(sp.fd[1], &line, 64, Deadline(5000)),
              kUnavailable);
  char c;
  EXPECT_CODE(tf_rdma::RecvAll(sp.fd[1], &c, 1), kUnavailable);
}

TEST(wire_send_all_deadline_when_peer_stops_reading) {
  SocketPair sp;
  ASSERT_TRUE(sp.ok());
  std::vector<char> big(16 << 20, 'z');  // far more than a socket buffers
  struct iovec iov;
  iov.iov_base = big.data();
  iov.iov_len = big.size();
  size_t sent = 0;
  auto t0 = std::chrono::steady_clock::now();
  Status s = tf_rdma::SendAllv(sp.fd[0], &iov, 1, Deadline(200), &sent);
  int64_t ms = MsSince(t0);
  EXPECT_CODE(s, kDeadlineExceeded);
  EXPECT_GT(sent, size_t{0});
  EXPECT_LT(sent, big.size());
  EXPECT_CONTAINS(s.message(), std::to_string(sent) + " of " +
                                   std::to_string(big.size()));
  EXPECT_GE(ms, int64_t{190});
  EXPECT_LT(ms, int64_t{5000});
}

TEST(wire_send_all_to_closed_peer) {
  SocketPair sp;
  ASSERT_TRUE(sp.ok());
  sp.CloseEnd(1);
  // MSG_NOSIGNAL: an error, not a SIGPIPE that kills the process.
  std::string data(1000, 'a');
  EXPECT_CODE(tf_rdma::SendAll(sp.fd[0], data.data(), data.size(),
                               Deadline(2000)),
              kUnavailable);
}

TEST(wire_send_allv_many_iovecs) {
  SocketPair sp;
  ASSERT_TRUE(sp.ok());
  // Pieces of every size (including empty ones), 1 MiB in all: partial
  // sends must resume in the right iovec at the right byte.
  std::vector<std::string> pieces;
  std::string want;
  for (int i = 0; pieces.size() < 40; ++i) {
    size_t n = (i % 5 == 0) ? 0 : static_cast<size_t>((i * 7919) % 60000);
    std::string p(n, '\0');
    for (size_t k = 0; k < n; ++k) p[k] = static_cast<char>('a' + (i + k) % 26);
    want += p;
    pieces.push_back(p);
  }
  std::vector<struct iovec> iov(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    iov[i].iov_base = &pieces[i][0];
    iov[i].iov_len = pieces[i].size();
  }
  std::string got(want.size(), '\0');
  Status recv_status;
  std::thread reader([&] {
    recv_status = tf_rdma::RecvAll(sp.fd[1], &got[0], got.size());
  });
  size_t sent = 0;
  Status s = tf_rdma::SendAllv(sp.fd[0], iov.data(), static_cast<int>(iov.size()),
                               Deadline(10000), &sent);
  reader.join();
  EXPECT_OK(s);
  EXPECT_OK(recv_status);
  EXPECT_EQ(sent, want.size());
  EXPECT_TRUE(got == want);
}

TEST(wire_split_host_port) {
  std::string host;
  int port = -1;
  EXPECT_OK(tf_rdma::SplitHostPort("10.0.0.1:2222", &host, &port));
  EXPECT_EQ(host, std::string("10.0.0.1"));
  EXPECT_EQ(port, 2222);
  EXPECT_OK(tf_rdma::SplitHostPort("[::1]:65535", &host, &port));
  EXPECT_EQ(host, std::string("::1"));
  EXPECT_EQ(port, 65535);
  EXPECT_OK(tf_rdma::SplitHostPort("localhost:0", &host, &port));
  EXPECT_EQ(port, 0);
  EXPECT_OK(tf_rdma::SplitHostPort(":80", &host, &port));  // any address
  EXPECT_EQ(host, std::string());
  for (const char* bad : {"", "host", "host:", "host:65536", "host:-1",
                          "host:80x", "host:x80", "host:99999999999"}) {
    Status s = tf_rdma::SplitHostPort(bad, &host, &port);
    if (!EXPECT_CODE(s, kInvalidArgument)) {
      std::printf("      input: %s\n", ut::Escape(bad).c_str());
    }
  }
}

TEST(wire_listen_dial_loopback) {
  int lfd = -1, port = 0;
  ASSERT_OK(tf_rdma::Listen("127.0.0.1", 0, &lfd, &port));
  EXPECT_GT(port, 0);
  int cfd = -1;
  Status s = tf_rdma::Dial("127.0.0.1", port, Deadline(5000), &cfd);
  EXPECT_OK(s);
  int afd = s.ok() ? accept(lfd, nullptr, nullptr) : -1;
  EXPECT_GE(afd, 0);
  if (afd >= 0) {
    tf_rdma::TuneSocket(cfd, 1000);
    EXPECT_EQ(tf_rdma::PeerAddress(cfd), "127.0.0.1:" + std::to_string(port));
    EXPECT_CONTAINS(tf_rdma::PeerAddress(afd), "127.0.0.1:");
    std::string hello = "HELLO task=/job:worker/task:1\n";
    EXPECT_OK(tf_rdma::SendAll(cfd, hello.data(), hello.size(), Deadline(5000)));
    std::string line;
    EXPECT_OK(tf_rdma::RecvLine(afd, &line, 1024, Deadline(5000)));
    EXPECT_EQ(line, std::string("HELLO task=/job:worker/task:1"));
    close(afd);
  }
  if (cfd >= 0) close(cfd);
  close(lfd);
  // A socket that is not connected has no peer address.
  int sfd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(tf_rdma::PeerAddress(sfd), std::string("?"));
  close(sfd);
}

// ---------------------------------------------------------------------------
// Regions.

TEST(region_create_size_checks) {
  for (uint64_t size : {uint64_t{0}, uint64_t{1}, uint64_t{4095},
                        uint64_t{4097}, uint64_t{8191}, kMax64}) {
    std::unique_ptr<Region> r;
    Status s = Region::Create(size, &r);
    if (!EXPECT_CODE(s, kInvalidArgument)) {
      std::printf("      size %llu\n", static_cast<unsigned long long>(size));
    }
    EXPECT_TRUE(r == nullptr);
  }
  std::unique_ptr<Region> r;
  ASSERT_OK(Region::Create(2 * tf_rdma::kPageBytes, &r));
  EXPECT_EQ(r->size(), 2 * tf_rdma::kPageBytes);
  std::string prefix = "/tfrdma." + std::to_string(getpid()) + ".";
  EXPECT_EQ(r->shm_name().rfind(prefix, 0), size_t{0});
  // Zero-filled, and page-aligned.
  bool zero = true;
  for (uint64_t i = 0; i < r->size(); ++i) zero = zero && r->data()[i] == 0;
  EXPECT_TRUE(zero);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(r->data()) % tf_rdma::kPageBytes,
            uintptr_t{0});
  // Names are not reused within the process.
  std::unique_ptr<Region> r2;
  ASSERT_OK(Region::Create(tf_rdma::kPageBytes, &r2));
  EXPECT_NE(r->shm_name(), r2->shm_name());
}

TEST(region_contains) {
  std::unique_ptr<Region> r;
  ASSERT_OK(Region::Create(4096, &r));
  EXPECT_TRUE(r->Contains(0, 4096));
  EXPECT_TRUE(r->Contains(0, 0));
  EXPECT_TRUE(r->Contains(4096, 0));
  EXPECT_TRUE(r->Contains(4088, 8));
  EXPECT_TRUE(r->Contains(4095, 1));
  EXPECT_FALSE(r->Contains(4096, 1));
  EXPECT_FALSE(r->Contains(4097, 0));
  EXPECT_FALSE(r->Contains(4089, 8));
  EXPECT_FALSE(r->Contains(1, 4096));
  EXPECT_FALSE(r->Contains(0, 4097));
  // No sum that wraps: offset + nbytes would be small modulo 2^64.
  EXPECT_FALSE(r->Contains(8, kMax64 - 7));
  EXPECT_FALSE(r->Contains(kMax64, 1));
  EXPECT_FALSE(r->Contains(kMax64, 0));
  EXPECT_FALSE(r->Contains(0, kMax64));
  EXPECT_FALSE(r->Contains(uint64_t{1} << 63, uint64_t{1} << 63));
}

TEST(region_create_open_share_bytes) {
  std::unique_ptr<Region> owner, peer;
  ASSERT_OK(Region::Create(8192, &owner));
  ASSERT_OK(Region::Open(owner->shm_name(), 8192, &peer));
  EXPECT_EQ(peer->shm_name(), owner->shm_name());
  EXPECT_EQ(peer->size(), uint64_t{8192});
  EXPECT_NE(static_cast<void*>(peer->data()), static_cast<void*>(owner->data()));
  std::memcpy(peer->data() + 5000, "payload", 7);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(owner->data()) + 5000, 7),
            std::string("payload"));
  owner->data()[8191] = 0xab;
  EXPECT_EQ(peer->data()[8191], 0xab);
  // A notice word published through one mapping is seen through the other.
  tf_rdma::PublishWord(peer->Word(64), 41);
  EXPECT_EQ(owner->Word(64)->load(), uint64_t{41});
}

TEST(region_open_checks) {
  std::unique_ptr<Region> owner, peer;
  ASSERT_OK(Region::Create(8192, &owner));
  // Wrong size, either way.
  Status s = Region::Open(owner->shm_name(), 4096, &peer);
  EXPECT_CODE(s, kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "8192");
  EXPECT_CODE(Region::Open(owner->shm_name(), 12288, &peer), kInvalidArgument);
  EXPECT_CODE(Region::Open(owner->shm_name(), 0, &peer), kInvalidArgument);
  EXPECT_TRUE(peer == nullptr);
  // Not a tf_rdma segment name: refused before anything is opened.
  for (const char* bad : {"", "/", "tfrdma.1.2", "/etc/passwd", "/tfrdma",
                          "/tfrdma.1/../../etc/passwd", "/other.1.2"}) {
    Status b = Region::Open(bad, 4096, &peer);
    if (!EXPECT_CODE(b, kInvalidArgument)) {
      std::printf("      name %s\n", ut::Escape(bad).c_str());
    }
  }
  // A well-formed name that does not exist.
  s = Region::Open("/tfrdma." + std::to_string(getpid()) + ".999999999", 4096,
                   &peer);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(peer == nullptr);
}

TEST(region_segment_removed_on_destruction) {
  std::unique_ptr<Region> owner;
  ASSERT_OK(Region::Create(4096, &owner));
  std::string name = owner->shm_name();
  EXPECT_TRUE(ShmExists(name));
  {
    // A peer's mapping going away leaves the owner's name alone.
    std::unique_ptr<Region> peer;
    ASSERT_OK(Region::Open(name, 4096, &peer));
  }
  EXPECT_TRUE(ShmExists(name));
  owner.reset();
  EXPECT_FALSE(ShmExists(name));
  // Unlink(): the name goes at once, the mapping stays usable.
  ASSERT_OK(Region::Create(4096, &owner));
  name = owner->shm_name();
  owner->Unlink();
  EXPECT_FALSE(ShmExists(name));
  owner->data()[100] = 7;
  EXPECT_EQ(owner->data()[100], 7);
  owner->Unlink();  // twice is harmless
  owner.reset();
  EXPECT_FALSE(ShmExists(name));
}

TEST(region_remove_stale_keeps_live_segments) {
  std::unique_ptr<Region> live;
  ASSERT_OK(Region::Create(4096, &live));
  live->data()[0] = 42;
  // A non-owner mapping of it is open too: still live.
  std::unique_ptr<Region> peer;
  ASSERT_OK(Region::Open(live->shm_name(), 4096, &peer));
  uint64_t bytes = 12345;
  tf_rdma::RemoveStaleSegments(&bytes);
  EXPECT_TRUE(ShmExists(live->shm_name()));
  std::unique_ptr<Region> again;
  EXPECT_OK(Region::Open(live->shm_name(), 4096, &again));
  EXPECT_EQ(live->data()[0], 42);
  tf_rdma::RemoveStaleSegments(nullptr);  // null `bytes` is allowed
  EXPECT_TRUE(ShmExists(live->shm_name()));
}

TEST(region_remove_stale_removes_dead_owners_segment) {
  // A child process creates a region and is then SIGKILLed: its lock goes
  // with it, its segment's name stays in /dev/shm until a collector runs.
  int to_parent[2], to_child[2];
  ASSERT_TRUE(pipe(to_parent) == 0);
  ASSERT_TRUE(pipe(to_child) == 0);
  pid_t child = fork();
  ASSERT_TRUE(child >= 0);
  if (child == 0) {
    close(to_parent[0]);
    close(to_child[1]);
    std::unique_ptr<Region> r;
    Status s = Region::Create(2 * tf_rdma::kPageBytes, &r);
    std::string msg = (s.ok() ? r->shm_name() : "ERROR " + s.message()) + "\n";
    ssize_t n = write(to_parent[1], msg.data(), msg.size());
    char c;
    n = read(to_child[0], &c, 1);  // until the parent kills us (or EOF)
    (void)n;
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  std::string name;
  char c;
  while (read(to_parent[0], &c, 1) == 1 && c != '\n') name.push_back(c);
  close(to_parent[0]);
  bool created = name.rfind("/tfrdma." + std::to_string(child) + ".", 0) == 0;
  if (created) {
    // Alive (another process, holding its lock): never collected.
    EXPECT_TRUE(ShmExists(name));
    tf_rdma::RemoveStaleSegments(nullptr);
    EXPECT_TRUE(ShmExists(name));
  }
  kill(child, SIGKILL);
  close(to_child[1]);
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  if (!EXPECT_TRUE(created)) {
    std::printf("      the child said: %s\n", name.c_str());
    return;
  }
  // A file in /dev/shm that is not a tfrdma segment name is never touched.
  std::string other = "/tfrdma-unittest." + std::to_string(getpid());
  int ofd = shm_open(other.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  EXPECT_GE(ofd, 0);
  // Dead: collected. Others' stale segments may go too, and an engine
  // starting elsewhere on this host may collect the child's first (then
  // this call has nothing of the child's to count).
  uint64_t bytes = 0;
  int removed = tf_rdma::RemoveStaleSegments(&bytes);
  bool gone = !ShmExists(name);
  EXPECT_TRUE(gone);
  if (!gone) shm_unlink(name.c_str());
  if (removed > 0) EXPECT_GT(bytes, uint64_t{0});
  EXPECT_GE(removed, 0);
  EXPECT_TRUE(ShmExists(other));
  if (ofd >= 0) close(ofd);
  shm_unlink(other.c_str());
}

TEST(region_create_larger_than_dev_shm) {
  // A region /dev/shm cannot hold fails at creation with ResourceExhausted
  // (posix_fallocate), not with a SIGBUS at first touch, and leaves nothing.
  // tmpfs refuses a fallocate larger than the whole file system at once,
  // without allocating; without a size limit there is no safe size to ask.
  struct statvfs fs;
  if (statvfs("/dev/shm", &fs) != 0 || fs.f_blocks == 0) {
    std::printf("  (skipped: /dev/shm has no size limit)\n");
    return;
  }
  uint64_t total = static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize;
  uint64_t size = (total * 2 / tf_rdma::kPageBytes + 1) * tf_rdma::kPageBytes;
  std::vector<std::string> before = OwnSegments();
  std::unique_ptr<Region> r;
  Status s = Region::Create(size, &r);
  EXPECT_CODE(s, kResourceExhausted);
  EXPECT_CONTAINS(s.message(), std::to_string(size));
  EXPECT_CONTAINS(s.message(), "shm-size");
  EXPECT_TRUE(r == nullptr);
  EXPECT_EQ(OwnSegments().size(), before.size());
}

// ---------------------------------------------------------------------------
// EngineConfig::Parse.

TEST(config_parse_valid) {
  tf_rdma::EngineConfig c;
  ASSERT_OK(tf_rdma::EngineConfig::Parse(
      Config("transport=shm,tcp\ntimeout_ms=1500\npoll_us=0\n"
             "collective_spin_us=750\n"
             "peer=/job:worker/task:1 10.0.0.2:2222\n"
             "peer=/job:ps/task:0 [::1]:3333\n\n"
             "verbs_device=mlx5_0\nverbs_port=1\nverbs_gid_index=-1\n"
             "verbs_queue_depth=256\n"),
      &c));
  EXPECT_EQ(c.task, std::string("/job:worker/task:0"));
  EXPECT_EQ(c.listen, std::string("127.0.0.1:0"));
  EXPECT_EQ(c.secret, std::string(kGoodSecret));
  EXPECT_EQ(c.transport, std::string("shm,tcp"));
  EXPECT_EQ(c.timeout_ms, int64_t{1500});
  EXPECT_EQ(c.poll_us, int64_t{0});
  EXPECT_EQ(c.collective_spin_us, int64_t{750});
  EXPECT_EQ(c.peers.size(), size_t{2});
  EXPECT_EQ(c.peers["/job:worker/task:1"], std::string("10.0.0.2:2222"));
  EXPECT_EQ(c.peers["/job:ps/task:0"], std::string("[::1]:3333"));
  EXPECT_EQ(c.verbs.device, std::string("mlx5_0"));
  EXPECT_EQ(c.verbs.port, 1);
  EXPECT_EQ(c.verbs.gid_index, -1);
  EXPECT_EQ(c.verbs.queue_depth, 256);
  // Defaults where a key is absent.
  tf_rdma::EngineConfig d;
  ASSERT_OK(tf_rdma::EngineConfig::Parse(Config(""), &d));
  EXPECT_EQ(d.transport, std::string("auto"));
  EXPECT_EQ(d.timeout_ms, int64_t{60000});
  EXPECT_EQ(d.poll_us, int64_t{50});
  EXPECT_EQ(d.collective_spin_us, tf_rdma::kAutoSpin);
  EXPECT_EQ(d.stall_warning_ms, int64_t{10000});
  EXPECT_TRUE(d.peers.empty());
  // A secret may contain '=' (only the first one splits).
  ASSERT_OK(tf_rdma::EngineConfig::Parse(
      "task=t\nlisten=:0\nsecret=abc=def=ghi=jklmnop\n", &d));
  EXPECT_EQ(d.secret, std::string("abc=def=ghi=jklmnop"));
}

TEST(config_parse_missing_fields) {
  tf_rdma::EngineConfig c;
  c.task = "untouched";
  std::string secret = std::string("secret=") + kGoodSecret + "\n";
  Status s = tf_rdma::EngineConfig::Parse("listen=:0\n" + secret, &c);
  EXPECT_CODE(s, kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "no task");
  EXPECT_EQ(c.task, std::string("untouched"));  // not written on failure
  s = tf_rdma::EngineConfig::Parse("task=t\n" + secret, &c);
  EXPECT_CODE(s, kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "no listen");
  s = tf_rdma::EngineConfig::Parse("task=t\nlisten=:0\n", &c);
  EXPECT_CODE(s, kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "TF_RDMA_SECRET");
  EXPECT_CODE(tf_rdma::EngineConfig::Parse("task=\nlisten=:0\n" + secret, &c),
              kInvalidArgument);
  EXPECT_CODE(tf_rdma::EngineConfig::Parse("", &c), kInvalidArgument);
}

TEST(config_parse_transport_list) {
  for (const char* good : {"auto", "verbs", "shm", "tcp", "shm,tcp",
                           "verbs,shm,tcp", "tcp,verbs"}) {
    tf_rdma::EngineConfig c;
    Status s = tf_rdma::EngineConfig::Parse(
        Config(std::string("transport=") + good + "\n"), &c);
    if (EXPECT_OK(s)) EXPECT_EQ(c.transport, std::string(good));
  }
  for (const char* bad : {"", ",", "udp", "shm,udp", "shm,shm", "tcp,shm,tcp",
                          "auto,tcp", "AUTO", "Shm", " shm", "shm, tcp",
                          "rdma"}) {
    tf_rdma::EngineConfig c;
    Status s = tf_rdma::EngineConfig::Parse(
        Config(std::string("transport=") + bad + "\n"), &c);
    if (!EXPECT_CODE(s, kInvalidArgument)) {
      std::printf("      transport=%s\n", ut::Escape(bad).c_str());
    }
  }
}

TEST(config_parse_numbers) {
  struct Case {
    const char* line;
    bool ok;
  } cases[] = {
      {"timeout_ms=1", true},
      {"timeout_ms=0", false},
      {"timeout_ms=-5", false},
      {"timeout_ms=1e3", false},
      {"timeout_ms=01000", false},
      {"timeout_ms=", false},
      {"timeout_ms=18446744073709551616", false},
      {"poll_us=0", true},
      {"poll_us=10000", true},
      {"poll_us=10001", false},
      {"poll_us=-1", false},
      {"poll_us=5.5", false},
      {"collective_spin_us=auto", true},
      {"collective_spin_us=0", true},
      {"collective_spin_us=100000", true},
      {"collective_spin_us=100001", false},
      {"collective_spin_us=-1", false},
      {"collective_spin_us=Auto", false},  // settings.py lowers the case
      {"stall_warning_ms=0", true},
      {"stall_warning_ms=250", true},
      {"stall_warning_ms=-1", false},
      {"stall_warning_ms=1.5", false},
      {"stall_warning_ms=ten", false},
      {"region_budget=0", true},                     // auto
      {"region_budget=12884901888", true},
      {"region_budget=12G", false},                  // settings.py expands it
      {"region_budget=-1", false},
      {"region_budget=18446744073709551616", false},
      {"verbs_port=-1", true},
      {"verbs_mtu=4096", true},
      {"verbs_inline=1073741824", true},      // 2^30: the largest accepted
      {"verbs_inline=1073741825", false},
      {"verbs_inline=-1073741825", false},
      {"verbs_port=2147483648", false},       // would not fit an int
      {"verbs_port=abc", false},
      {"verbs_port=", false},
      {"verbs_port=-", false},
      {"verbs_port=--1", false},
      {"verbs_port=+1", false},
      {"verbs_speed=1", false},               // unknown verbs key
  };
  for (const Case& c : cases) {
    tf_rdma::EngineConfig cfg;
    Status s = tf_rdma::EngineConfig::Parse(Config(std::string(c.line) + "\n"),
                                            &cfg);
    bool good = c.ok ? EXPECT_OK(s) : EXPECT_CODE(s, kInvalidArgument);
    if (!good) std::printf("      line %s\n", c.line);
  }
  tf_rdma::EngineConfig cfg;
  ASSERT_OK(tf_rdma::EngineConfig::Parse(
      Config("verbs_traffic_class=-7\nverbs_inline=1073741824\n"), &cfg));
  EXPECT_EQ(cfg.verbs.traffic_class, -7);
  EXPECT_EQ(cfg.verbs.inline_bytes, 1 << 30);
  ASSERT_OK(tf_rdma::EngineConfig::Parse(
      Config("region_budget=12884901888\n"), &cfg));
  EXPECT_EQ(cfg.region_budget, 12884901888ull);
}

TEST(config_parse_secret_length) {
  tf_rdma::EngineConfig c;
  std::string base = "task=t\nlisten=:0\nsecret=";
  std::string short_secret(tf_rdma::kMinSecretBytes - 1, 's');
  Status s = tf_rdma::EngineConfig::Parse(base + short_secret + "\n", &c);
  EXPECT_CODE(s, kInvalidArgument);
  EXPECT_CONTAINS(s.message(), std::to_string(tf_rdma::kMinSecretBytes - 1));
  EXPECT_CONTAINS(s.message(), std::to_string(tf_rdma::kMinSecretBytes));
  EXPECT_CODE(tf_rdma::EngineConfig::Parse(base + "x\n", &c), kInvalidArgument);
  std::string enough(tf_rdma::kMinSecretBytes, 's');
  EXPECT_OK(tf_rdma::EngineConfig::Parse(base + enough + "\n", &c));
  EXPECT_EQ(c.secret.size(), tf_rdma::kMinSecretBytes);
  // Counted in bytes: 8 two-byte characters are 16 bytes.
  std::string utf8;
  for (int i = 0; i < 8; ++i) utf8 += "\xc3\xa9";
  EXPECT_OK(tf_rdma::EngineConfig::Parse(base + utf8 + "\n", &c));
}

TEST(config_parse_bad_lines) {
  tf_rdma::EngineConfig c;
  Status s = tf_rdma::EngineConfig::Parse(Config("just words\n"), &c);
  EXPECT_CODE(s, kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "just words");
  s = tf_rdma::EngineConfig::Parse(Config("colour=blue\n"), &c);
  EXPECT_CODE(s, kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "colour");
  s = tf_rdma::EngineConfig::Parse(Config("peer=/job:worker/task:1\n"), &c);
  EXPECT_CODE(s, kInvalidArgument);
  EXPECT_CONTAINS(s.message(), "peer");
  // Keys are case-sensitive.
  EXPECT_CODE(tf_rdma::EngineConfig::Parse(Config("Task=x\n"), &c),
              kInvalidArgument);
}

// ---------------------------------------------------------------------------
// SlotSpec::Validate and the layout it guards.

TEST(slot_validate_good) {
  tf_rdma::SlotSpec s = GoodSlot();
  EXPECT_OK(s.Validate());
  // Exactly filling the region, and the credit region.
  s.offset = 0;
  s.stride = 4096;
  s.nbytes = 4096 - tf_rdma::kSlotHeaderBytes;
  s.depth = 2;
  s.credit_index = 31;  // (31 + 1) * 2 * 64 = 4096
  EXPECT_OK(s.Validate());
  // An empty tensor still has its header.
  s = GoodSlot();
  s.nbytes = 0;
  s.stride = 64;
  EXPECT_OK(s.Validate());
  s.depth = tf_rdma::kMaxSlotDepth;
  s.credit_bytes = 4096 * 8;
  EXPECT_OK(s.Validate());
}

TEST(slot_validate_depth) {
  for (int64_t depth : {int64_t{0}, int64_t{-1}, tf_rdma::kMaxSlotDepth + 1,
                        int64_t{1} << 58, INT64_MIN, INT64_MAX}) {
    tf_rdma::SlotSpec s = GoodSlot();
    s.depth = depth;
    s.region_bytes = uint64_t{1} << 40;
    s.credit_bytes = uint64_t{1} << 40;
    Status st = s.Validate();
    if (!EXPECT_CODE(st, kInvalidArgument)) {
      std::printf("      depth %lld\n", static_cast<long long>(depth));
    }
    EXPECT_CONTAINS(st.message(), "depth");
  }
  tf_rdma::SlotSpec s = GoodSlot();
  s.depth = 1;
  EXPECT_OK(s.Validate());
}

TEST(slot_validate_overflow) {
  auto refused = [](const tf_rdma::SlotSpec& s) {
    return s.Validate().code() == Code::kInvalidArgument;
  };
  tf_rdma::SlotSpec s = GoodSlot();
  // depth 2^58 x stride 128 = 2^65: wraps to 0 in 64 bits.
  s.depth = int64_t{1} << 58;
  s.stride = 128;
  s.nbytes = 64;
  EXPECT_TRUE(refused(s));
  // A legal depth whose span wraps: 64 copies of 2^58 bytes = 2^64 -> 0
  // (the issue-13 finding), and 2^64/64 + 64 bytes each -> 4096.
  s = GoodSlot();
  s.offset = 0;
  s.depth = 64;
  s.stride = uint64_t{1} << 58;
  s.nbytes = 64;
  s.credit_bytes = 4096 * 2;
  s.credit_index = 0;
  EXPECT_TRUE(refused(s));
  s.stride = (uint64_t{1} << 58) + 64;
  EXPECT_TRUE(refused(s));
  // offset + span wraps.
  s = GoodSlot();
  s.offset = kMax64 - 63;  // a multiple of 64
  s.depth = 1;
  EXPECT_TRUE(refused(s));
  s.offset = kMax64 - 1023;  // 2^64 - 1024: 2 copies wrap to 1024
  s.depth = 2;
  EXPECT_TRUE(refused(s));
  // nbytes + header wraps (and would make any stride "large enough").
  s = GoodSlot();
  s.nbytes = kMax64 - 10;
  EXPECT_TRUE(refused(s));
  s.nbytes = kMax64 - 63;  // 64 + nbytes = 2^64 exactly -> 0
  s.stride = 64;
  EXPECT_TRUE(refused(s));
  // credit_index: (index + 1) * depth * 64 wraps.
  s = GoodSlot();
  s.credit_index = INT64_MAX;
  EXPECT_TRUE(refused(s));
  s.credit_index = (int64_t{1} << 62) - 1;  // (2^62) * 2 * 64 = 2^69
  EXPECT_TRUE(refused(s));
  s.credit_index = -1;
  EXPECT_TRUE(refused(s));
  s.credit_index = INT64_MIN;
  EXPECT_TRUE(refused(s));
}

TEST(slot_validate_offsets_and_sizes) {
  auto code = [](const tf_rdma::SlotSpec& s) { return s.Validate().code(); };
  tf_rdma::SlotSpec s = GoodSlot();
  // Offsets past the region, and one copy too many.
  s.offset = s.region_bytes;
  EXPECT_EQ(code(s), Code::kInvalidArgument);
  s.offset = s.region_bytes + 64;
  EXPECT_EQ(code(s), Code::kInvalidArgument);
  s = GoodSlot();
  s.offset = s.region_bytes - s.depth * s.stride;  // exactly fits
  EXPECT_EQ(code(s), Code::kOk);
  s.offset += 64;  // 64 bytes past the end
  Status st = s.Validate();
  EXPECT_CODE(st, kInvalidArgument);
  EXPECT_CONTAINS(st.message(), "region too small");
  s = GoodSlot();
  s.depth = 8;  // 8 x 1024 from 128 > 8192
  EXPECT_EQ(code(s), Code::kInvalidArgument);
  // The stride holds the header and the payload, 64-aligned.
  s = GoodSlot();
  s.nbytes = s.stride - tf_rdma::kSlotHeaderBytes + 1;
  EXPECT_EQ(code(s), Code::kInvalidArgument);
  s = GoodSlot();
  s.stride = 1000;
  s.nbytes = 100;
  EXPECT_EQ(code(s), Code::kInvalidArgument);
  s = GoodSlot();
  s.offset = 100;
  EXPECT_EQ(code(s), Code::kInvalidArgument);
  s = GoodSlot();
  s.stride = 0;
  s.nbytes = 0;
  EXPECT_EQ(code(s), Code::kInvalidArgument);
  // Region sizes are whole pages.
  s = GoodSlot();
  s.region_bytes = 8192 + 64;
  EXPECT_EQ(code(s), Code::kInvalidArgument);
  s = GoodSlot();
  s.credit_bytes = 4000;
  EXPECT_EQ(code(s), Code::kInvalidArgument);
  // Credit lines: index 31 of depth 2 fits 4096 bytes, 32 does not.
  s = GoodSlot();
  s.credit_index = 31;
  EXPECT_EQ(code(s), Code::kOk);
  s.credit_index = 32;
  st = s.Validate();
  EXPECT_CODE(st, kInvalidArgument);
  EXPECT_CONTAINS(st.message(), "credit index 32");
  s.credit_bytes = 0;
  s.credit_index = 0;
  EXPECT_EQ(code(s), Code::kInvalidArgument);
  // The message names the tensor and the region.
  s = GoodSlot();
  s.depth = 0;
  EXPECT_CONTAINS(s.Validate().message(), "tensor 'x' in region 'r'");
}

TEST(slot_layout_within_bounds_when_valid) {
  // Credit and sequence arithmetic reachable without an engine: for every
  // slot Validate accepts, each copy's sequence word, call word and payload
  // and each credit word (engine.h's layout, CopyOffset / CreditLineOffset
  // above) pass the receiving side's bounds check. The engine's own helpers
  // are internal; this pins the layout they must follow.
  std::vector<tf_rdma::SlotSpec> specs;
  for (int64_t depth : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{64}}) {
    for (uint64_t nbytes : {uint64_t{0}, uint64_t{1}, uint64_t{960},
                            uint64_t{4032}}) {
      tf_rdma::SlotSpec s = GoodSlot();
      s.depth = depth;
      s.nbytes = nbytes;
      s.stride = (tf_rdma::kSlotHeaderBytes + nbytes + 63) / 64 * 64;
      s.offset = 192;
      s.region_bytes = (s.offset + depth * s.stride + 4095) / 4096 * 4096;
      s.credit_bytes = 4096 * ((depth * 64 * 3 + 4095) / 4096);
      s.credit_index = static_cast<int64_t>(s.credit_bytes / 64 / depth) - 1;
      specs.push_back(s);
    }
  }
  int valid = 0;
  for (const tf_rdma::SlotSpec& s : specs) {
    if (!EXPECT_OK(s.Validate())) continue;
    ++valid;
    for (int64_t c = 0; c < s.depth; ++c) {
      uint64_t copy = CopyOffset(s, c);
      uint64_t credit = CreditLineOffset(s, c);
      bool ok = EXPECT_OK(tf_rdma::CheckWriteBounds(
                    copy + tf_rdma::kSlotHeaderBytes, s.nbytes, copy,
                    s.region_bytes, "data")) &&
                EXPECT_OK(tf_rdma::CheckWriteBounds(
                    copy, 0, copy + tf_rdma::kCallWordOffset, s.region_bytes,
                    "data")) &&
                EXPECT_OK(tf_rdma::CheckWriteBounds(0, 0, credit,
                                                    s.credit_bytes, "credit"));
      if (!ok) {
        std::printf("      depth %lld nbytes %llu copy %lld\n",
                    static_cast<long long>(s.depth),
                    static_cast<unsigned long long>(s.nbytes),
                    static_cast<long long>(c));
        break;
      }
    }
    // The last copy ends at most at the region's end, and two slots'
    // credit lines never overlap: the next index starts past this one.
    EXPECT_LE(CopyOffset(s, s.depth - 1) + s.stride, s.region_bytes);
    tf_rdma::SlotSpec next = s;
    next.credit_index = s.credit_index + 1;
    EXPECT_EQ(CreditLineOffset(next, 0),
              CreditLineOffset(s, s.depth - 1) + tf_rdma::kCreditLineBytes);
    EXPECT_CODE(next.Validate(), kInvalidArgument);  // it would not fit
  }
  EXPECT_EQ(valid, static_cast<int>(specs.size()));
}

TEST(slot_describe) {
  tf_rdma::SlotSpec s = GoodSlot();
  EXPECT_EQ(s.Describe(7),
            std::string("tensor 'x' (peer /job:worker/task:1, step 7)"));
  s.match_calls = true;
  EXPECT_EQ(s.Describe(7),
            std::string("tensor 'x' (peer /job:worker/task:1, call 7)"));
  s.peer_host = "node-b";  // what the engine fills in from the cluster
  EXPECT_EQ(s.Describe(7),
            std::string("tensor 'x' (peer /job:worker/task:1 on node-b, call 7)"));
}

// ---------------------------------------------------------------------------
// SHA-256 and HMAC-SHA256.

TEST(sha256_known_vectors) {
  auto sha = [](const std::string& m) {
    return Hex(tf_rdma::Sha256Of(m.data(), m.size()));
  };
  EXPECT_EQ(sha("abc"), std::string("ba7816bf8f01cfea414140de5dae2223"
                                    "b00361a396177a9cb410ff61f20015ad"));
  EXPECT_EQ(sha(""), std::string("e3b0c44298fc1c149afbf4c8996fb924"
                                 "27ae41e4649b934ca495991b7852b855"));
  // 448 bits: the padding spills into a second block.
  EXPECT_EQ(sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            std::string("248d6a61d20638b8e5c026930c3e6039"
                        "a33ce45964ff2167f6ecedd419db06c1"));
  EXPECT_EQ(sha(std::string(1000000, 'a')),
            std::string("cdc76e5c9914fb9281a1c7e284d73e67"
                        "f1809a48a497200e046d39ccc7112cd0"));
}

TEST(sha256_incremental_matches_one_shot) {
  std::string msg;
  for (int i = 0; i < 200; ++i) msg.push_back(static_cast<char>(i * 37 + 11));
  tf_rdma::Sha256 h;
  int mismatches = 0;
  // Every length 0..200 (block edges 55, 56, 63, 64, 119, 128 included),
  // fed in two pieces split at every point.
  for (size_t len = 0; len <= msg.size(); ++len) {
    tf_rdma::Digest256 want = tf_rdma::Sha256Of(msg.data(), len);
    for (size_t cut = 0; cut <= len; cut += (len > 70 ? 7 : 1)) {
      h.Reset();
      h.Update(msg.data(), cut);
      h.Update(msg.data() + cut, len - cut);
      if (h.Finish() != want) ++mismatches;
      ++ut::g_checks;
    }
  }
  EXPECT_EQ(mismatches, 0);
  // Byte by byte.
  h.Reset();
  for (char c : std::string("abc")) h.Update(&c, 1);
  EXPECT_EQ(Hex(h.Finish()), std::string("ba7816bf8f01cfea414140de5dae2223"
                                         "b00361a396177a9cb410ff61f20015ad"));
}

TEST(hmac_sha256_rfc4231) {
  // Test case 1.
  EXPECT_EQ(HmacHex(std::string(20, '\x0b'), "Hi There"),
            std::string("b0344c61d8db38535ca8afceaf0bf12b"
                        "881dc200c9833da726e9376c2e32cff7"));
  // Test case 2: a key shorter than the output.
  EXPECT_EQ(HmacHex("Jefe", "what do ya want for nothing?"),
            std::string("5bdcc146bf60754e6a042426089575c7"
                        "5a003f089d2739839dec58b964ec3843"));
  // Test case 3.
  EXPECT_EQ(HmacHex(std::string(20, '\xaa'), std::string(50, '\xdd')),
            std::string("773ea91e36800e46854db8ebd09181a7"
                        "2959098b3ef8c122d9635514ced565fe"));
  // Test case 6: a key longer than the block is hashed first.
  EXPECT_EQ(HmacHex(std::string(131, '\xaa'),
                    "Test Using Larger Than Block-Size Key - Hash Key First"),
            std::string("60e431591ee0b67f0d8a26aacbf5b77f"
                        "8e0bc6213728c5140546040f0ee37f54"));
}

TEST(hex_and_constant_time_equal) {
  const uint8_t bytes[] = {0x00, 0x0f, 0xa0, 0xff};
  EXPECT_EQ(tf_rdma::ToHex(bytes, 4), std::string("000fa0ff"));
  EXPECT_EQ(tf_rdma::ToHex(bytes, 0), std::string());
  uint8_t a[32], b[32];
  for (int i = 0; i < 32; ++i) a[i] = b[i] = static_cast<uint8_t>(i);
  EXPECT_TRUE(tf_rdma::ConstantTimeEqual(a, b, 32));
  EXPECT_TRUE(tf_rdma::ConstantTimeEqual(a, b, 0));
  for (int i : {0, 17, 31}) {
    b[i] ^= 0x80;
    EXPECT_FALSE(tf_rdma::ConstantTimeEqual(a, b, 32));
    b[i] ^= 0x80;
  }
}

// ---------------------------------------------------------------------------
// Trace hooks (kernels/common/trace.h): the engine records through a sink
// only while the sink's level word is at trace::kLevel or above.

namespace {

std::atomic<int> g_trace_word{-1};
int64_t g_trace_clock = 1000;
std::vector<std::string> g_trace_events;

int64_t TraceClock() { return g_trace_clock += 10; }

void CollectTraceEvent(const tf_rdma::trace::Event& e) {
  g_trace_events.push_back(
      std::string(e.name) + " key=" + *e.key + " bytes=" +
      std::to_string(e.bytes) + " peer=" + *e.peer + " step=" +
      std::to_string(e.step) + (e.kind ? std::string(" kind=") + e.kind : "") +
      " [" + std::to_string(e.start_ns) + "," + std::to_string(e.end_ns) + "]");
}

}  // namespace

TEST(trace_records_only_while_the_level_is_on) {
  namespace trace = tf_rdma::trace;
  const std::string key = "dense/kernel:0", peer = "/job:worker/task:1";
  g_trace_events.clear();
  trace::Uninstall();
  EXPECT_FALSE(trace::On());  // no sink: never on
  EXPECT_EQ(trace::Claim(), int64_t{0});
  trace::Install(trace::Sink{&g_trace_word, &TraceClock, &CollectTraceEvent});
  g_trace_word.store(trace::kLevel - 1);  // a session below tf_rdma's level
  EXPECT_FALSE(trace::On());
  int64_t since = trace::Claim();
  EXPECT_EQ(since, int64_t{0});
  EXPECT_EQ(trace::Span(since).End(trace::kWrite, key, 8, peer, 1), int64_t{0});
  EXPECT_EQ(trace::Span::At(since).End(trace::kSend, key, 8, peer, 1),
            int64_t{0});
  EXPECT_EQ(g_trace_events.size(), size_t{0});

  g_trace_word.store(trace::kLevel);
  EXPECT_TRUE(trace::On());
  g_trace_clock = 1000;
  since = trace::Claim();  // 1010
  EXPECT_EQ(since, int64_t{1010});
  trace::Span wait(since);  // starts at 1020
  int64_t written_from = wait.End(trace::kCreditWait, key, 4096, peer, 7);
  EXPECT_EQ(written_from, int64_t{1030});
  trace::Span::At(written_from).End(trace::kWrite, key, 4096, peer, 7);
  trace::Span::At(since).End(trace::kSend, key, 4096, peer, 7);
  trace::Event e;
  std::string group = "/job:worker/task:0 /job:worker/task:1";
  std::string instance = "grads";
  e.name = trace::kCollective;
  e.key = &instance;
  e.peer = &group;
  e.bytes = 64;
  e.step = 3;
  e.kind = "allreduce";
  e.start_ns = 5;
  e.end_ns = 9;
  trace::Record(e);
  e.start_ns = 0;  // untraced: dropped
  trace::Record(e);
  ASSERT_EQ(g_trace_events.size(), size_t{4});
  EXPECT_EQ(g_trace_events[0],
            std::string("tf_rdma.credit_wait key=dense/kernel:0 bytes=4096 "
                        "peer=/job:worker/task:1 step=7 [1020,1030]"));
  EXPECT_EQ(g_trace_events[1],
            std::string("tf_rdma.write key=dense/kernel:0 bytes=4096 "
                        "peer=/job:worker/task:1 step=7 [1030,1040]"));
  EXPECT_EQ(g_trace_events[2],
            std::string("tf_rdma.send key=dense/kernel:0 bytes=4096 "
                        "peer=/job:worker/task:1 step=7 [1010,1050]"));
  EXPECT_EQ(g_trace_events[3],
            std::string("tf_rdma.collective key=grads bytes=64 "
                        "peer=/job:worker/task:0 /job:worker/task:1 step=3 "
                        "kind=allreduce [5,9]"));

  // The session ends: a transfer claimed now is untraced again.
  g_trace_word.store(-1);
  EXPECT_FALSE(trace::On());
  EXPECT_EQ(trace::Claim(), int64_t{0});
  trace::Uninstall();
  g_trace_word.store(trace::kLevel);
  EXPECT_FALSE(trace::On());  // the built-in sink's word, not ours
  g_trace_word.store(-1);
  EXPECT_EQ(g_trace_events.size(), size_t{4});
}

TEST(recent_keeps_the_newest_traced_events_per_key) {
  namespace trace = tf_rdma::trace;
  namespace recent = tf_rdma::recent;
  recent::Clear();
  const std::string a = "a:0", b = "b#\"1", peer = "/job:worker/task:1";
  trace::Event e;
  e.name = trace::kSend;
  e.peer = &peer;
  e.bytes = 8;
  e.key = &a;
  for (uint64_t step = 1; step <= recent::kEventsPerKey + 5; ++step) {
    e.step = step;
    e.start_ns = static_cast<int64_t>(step) * 100;
    e.end_ns = e.start_ns + 7;
    trace::Record(e);  // through the trace layer, as the engine does
  }
  e.key = &b;
  e.step = 9;
  trace::Record(e);
  e.start_ns = 0;  // untraced: neither recorded nor kept
  trace::Record(e);
  std::string json = recent::Json();
  // Key a: steps 6..261 (the 5 oldest were dropped), oldest first.
  EXPECT_TRUE(json.find("\"step\": 5,") == std::string::npos);
  size_t first = json.find("\"step\": 6,");
  size_t last = json.find("\"step\": " +
                          std::to_string(recent::kEventsPerKey + 5) + ",");
  EXPECT_TRUE(first != std::string::npos && last != std::string::npos &&
              first < last);
  EXPECT_TRUE(json.find("\"start_ns\": 600, \"end_ns\": 607}") !=
              std::string::npos);
  // Key b, escaped as a JSON string, holds its one traced event.
  size_t at = json.find("\"b#\\\"1\": [{\"name\": \"tf_rdma.send\"");
  EXPECT_TRUE(at != std::string::npos);
  size_t step9 = 0;  // a's step 9 (kept) and b's one event
  for (size_t p = json.find("\"step\": 9,"); p != std::string::npos;
       p = json.find("\"step\": 9,", p + 1)) {
    ++step9;
  }
  EXPECT_EQ(step9, size_t{2});
  recent::Clear();
  EXPECT_EQ(recent::Json().find("tf_rdma.send"), std::string::npos);
}

// The timeline (kernels/common/timeline.h): while it runs, tracing is on
// whatever the sink's word says, every event goes to the sink and to the
// file, and the file is a Chrome trace with the clock offsets measured.
TEST(timeline_writes_every_event_and_the_clock_offsets) {
  namespace trace = tf_rdma::trace;
  namespace timeline = tf_rdma::timeline;
  EXPECT_EQ(timeline::FileName("/job:worker/task:1", 42),
            std::string("worker-1.42.json"));
  EXPECT_EQ(timeline::FileName("/job:my job/task:0", 7),
            std::string("my_job-0.7.json"));
  char dir_template[] = "/tmp/tfrdma-timeline-XXXXXX";
  ASSERT_TRUE(mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template;
  g_trace_events.clear();
  g_trace_word.store(-1);  // the sink's own session is off
  trace::Install(trace::Sink{&g_trace_word, &TraceClock, &CollectTraceEvent});
  EXPECT_FALSE(trace::On());
  std::atomic<int> measured{0};
  timeline::Clocks clocks;
  clocks.peers = [] {
    return std::vector<std::string>{"/job:worker/task:1"};
  };
  clocks.measure = [&measured](const std::string& peer, int64_t,
                               timeline::ClockOffset* out) {
    ++measured;
    out->peer = peer;
    out->offset_ns = -1234;
    out->rtt_ns = 5678;
    return true;
  };
  std::string path;
  ASSERT_OK(timeline::Start(dir, "/job:worker/task:0", clocks, &path));
  EXPECT_EQ(path, dir + "/worker-0." + std::to_string(getpid()) + ".json");
  EXPECT_TRUE(timeline::Running());
  EXPECT_TRUE(trace::On());  // the tap turns tracing on
  std::string again;
  EXPECT_CODE(timeline::Start(dir, "/job:worker/task:0", clocks, &again),
              kFailedPrecondition);
  const std::string key = "a\"b", peer = "/job:worker/task:1";
  trace::Span::At(trace::Claim()).End(trace::kWrite, key, 4096, peer, 3);
  timeline::Stop();
  EXPECT_FALSE(timeline::Running());
  EXPECT_FALSE(trace::On());  // the sink's word decides again
  EXPECT_EQ(g_trace_events.size(), size_t{1});  // the sink got it as well
  EXPECT_GE(measured.load(), 1);                // at least at Stop

  std::string text;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
    std::fclose(f);
  }
  ASSERT_TRUE(text.size() > 4);
  EXPECT_EQ(text.substr(0, 2), std::string("[\n"));
  EXPECT_EQ(text.substr(text.size() - 4), std::string("}\n]\n"));
  EXPECT_CONTAINS(text, "\"name\":\"process_name\"");
  EXPECT_CONTAINS(text, "\"args\":{\"name\":\"/job:worker/task:0\"}");
  EXPECT_CONTAINS(text, "{\"ph\":\"X\",\"name\":\"tf_rdma.write\"");
  EXPECT_CONTAINS(text, "\"dur\":0.010,\"args\":{\"key\":\"a\\\"b\",\"bytes\":4096,"
                        "\"peer\":\"/job:worker/task:1\",\"step\":3}},\n");
  EXPECT_CONTAINS(text, "\"peer\":\"/job:worker/task:1\",\"offset_ns\":-1234,"
                        "\"rtt_ns\":5678,");
  EXPECT_CONTAINS(text, "\"dropped_events\":0");

  // A second start in this process takes the next free name.
  std::string second;
  ASSERT_OK(timeline::Start(dir, "/job:worker/task:0", clocks, &second));
  EXPECT_EQ(second, dir + "/worker-0." + std::to_string(getpid()) + ".2.json");
  timeline::Stop();
  // Not a directory: an error that names the file.
  std::string none;
  tf_rdma::Status s = timeline::Start(dir + "/missing", "/job:worker/task:0",
                                      clocks, &none);
  EXPECT_FALSE(s.ok());
  EXPECT_CONTAINS(s.message(), dir + "/missing/worker-0.");
  EXPECT_FALSE(trace::On());
  trace::Uninstall();
  std::remove(path.c_str());
  std::remove(second.c_str());
  rmdir(dir.c_str());
}

// ---------------------------------------------------------------------------
// Deadlines and notice words.

TEST(wait_deadline) {
  Deadline now(0);
  EXPECT_TRUE(now.Expired());
  EXPECT_EQ(now.RemainingMs(), int64_t{0});
  Deadline past(-50);
  EXPECT_TRUE(past.Expired());
  EXPECT_EQ(past.RemainingMs(), int64_t{0});  // never negative
  Deadline later(100000);
  EXPECT_FALSE(later.Expired());
  EXPECT_GT(later.RemainingMs(), int64_t{90000});
  EXPECT_LE(later.RemainingMs(), int64_t{100000});
  EXPECT_EQ(later.timeout_ms(), int64_t{100000});
  // A week (settings.py's largest TF_RDMA_TIMEOUT) is still in the future.
  Deadline week(int64_t{7} * 24 * 3600 * 1000);
  EXPECT_FALSE(week.Expired());
}

TEST(wait_for_word) {
  std::atomic<uint64_t> word{5};
  // Already there (>=, not ==).
  EXPECT_OK(tf_rdma::WaitForWord(&word, 5, Deadline(0), nullptr));
  EXPECT_OK(tf_rdma::WaitForWord(&word, 3, Deadline(0), nullptr));
  // Not reached: DeadlineExceeded after about the deadline.
  auto t0 = std::chrono::steady_clock::now();
  Status s = tf_rdma::WaitForWord(&word, 6, Deadline(120), nullptr);
  int64_t ms = MsSince(t0);
  EXPECT_CODE(s, kDeadlineExceeded);
  EXPECT_GE(ms, int64_t{110});
  EXPECT_LT(ms, int64_t{5000});
  // The check's error ends the wait before the deadline.
  int calls = 0;
  t0 = std::chrono::steady_clock::now();
  s = tf_rdma::WaitForWord(&word, 6, Deadline(30000), [&calls]() {
    return ++calls >= 2 ? tf_rdma::Unavailable("peer went away") : Status::Ok();
  });
  EXPECT_CODE(s, kUnavailable);
  EXPECT_EQ(s.message(), std::string("peer went away"));
  EXPECT_LT(MsSince(t0), int64_t{10000});
  // A peer that published and then went away (its goodbye is what the
  // check sees): the word is read again, and the data counts.
  s = tf_rdma::WaitForWord(&word, 6, Deadline(30000), [&word]() {
    word.store(6);
    return tf_rdma::Unavailable("peer stopped its endpoint");
  });
  EXPECT_OK(s);
}

TEST(wait_for_word_woken_by_publish) {
  std::atomic<uint64_t> word{0};
  // A value whose low 32 bits do not change (the futex watches those).
  const uint64_t target = uint64_t{1} << 32;
  std::thread publisher([&word, target] {
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    tf_rdma::PublishWord(&word, target);
  });
  auto t0 = std::chrono::steady_clock::now();
  Status s = tf_rdma::WaitForWord(&word, target, Deadline(20000), nullptr);
  int64_t ms = MsSince(t0);
  publisher.join();
  EXPECT_OK(s);
  EXPECT_EQ(word.load(), target);
  EXPECT_LT(ms, int64_t{10000});
}

// A notice word whose writer wakes only counted sleepers (wait.h): over many
// rounds, the writer publishing at every moment of the waiter's way to sleep,
// no wake-up is lost (a lost one costs a 50 ms slice; a round that slow now
// and then is the busy machine preempting us, every 10th round sleeps for
// sure), and the count is taken while a waiter sleeps and given back after.
// For WaitForWord, for a WaitForAnyWord over two such words, and across two
// mappings of one segment (the waiter's and the shm writer's).
TEST(wait_wakes_only_counted_sleepers) {
  struct alignas(64) Header {  // a slot header: word, call word, count
    std::atomic<uint64_t> word{0};
    uint64_t call = 0;
    std::atomic<uint32_t> sleepers{0};
  };
  Header h[2];
  EXPECT_TRUE(tf_rdma::SleepersOf(&h[0].word) == &h[0].sleepers);
  std::unique_ptr<Region> owner, peer;
  ASSERT_OK(Region::Create(4096, &owner));
  ASSERT_OK(Region::Open(owner->shm_name(), 4096, &peer));
  EXPECT_TRUE(owner->Sleepers(64) == tf_rdma::SleepersOf(owner->Word(64)));
  EXPECT_TRUE(owner->Sleepers(4096 - 16) == nullptr);  // no room: always wake
  enum Mode { kWaitForWord, kWaitForAnyWord, kTwoMappings };
  for (Mode mode : {kWaitForWord, kWaitForAnyWord, kTwoMappings}) {
    // The waiter's word and count, and the writer's view of them.
    std::atomic<uint64_t>* word = mode == kWaitForAnyWord ? &h[1].word
                                  : mode == kTwoMappings  ? owner->Word(64)
                                                          : &h[0].word;
    std::atomic<uint64_t>* written =
        mode == kTwoMappings ? peer->Word(64) : word;
    std::atomic<uint32_t>* count = tf_rdma::SleepersOf(word);
    int slow_rounds = 0;
    for (uint64_t round = 1; round <= 300; ++round) {
      // Most rounds publish within µs (racing the waiter's count and its
      // last look); every 10th waits until the waiter is counted asleep.
      const int pauses = static_cast<int>((round * 7919) % 3000);
      const bool after_sleep = round % 10 == 0;
      // Each round's value differs in the low half (the futex's): steps do.
      const uint64_t target = round;
      std::thread publisher([=] {
        if (after_sleep) {  // (at most 100 ms: a waiter never counted)
          auto until = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(100);
          while (count->load() == 0 &&
                 std::chrono::steady_clock::now() < until) {
            std::this_thread::yield();
          }
        } else {
          for (int i = 0; i < pauses; ++i) tf_rdma::CpuRelax();
        }
        tf_rdma::PublishWord(written, target, tf_rdma::SleepersOf(written));
      });
      auto t0 = std::chrono::steady_clock::now();
      if (mode != kWaitForAnyWord) {
        EXPECT_OK(tf_rdma::WaitForWord(word, target, Deadline(5000), nullptr,
                                       0, count));
      } else {
        while (word->load() < target) {
          tf_rdma::WordWatch watch[2];
          for (int w = 0; w < 2; ++w) {
            watch[w] = tf_rdma::WordWatch{
                &h[w].word, static_cast<uint32_t>(h[w].word.load()), true,
                tf_rdma::SleepersOf(&h[w].word)};
          }
          tf_rdma::WaitForAnyWord(watch, 2,
                                  std::chrono::steady_clock::now() +
                                      std::chrono::seconds(5));
        }
      }
      if (MsSince(t0) >= 45) ++slow_rounds;
      publisher.join();
      EXPECT_EQ(count->load(), uint32_t{0});
    }
    EXPECT_LE(slow_rounds, 2);
  }
}

// A wait asked to spin burns its CPU until the word moves (no sleep, so no
// wake-up to pay); one that is not sleeps after a few µs, and a spin ends
// after its budget even when the word never moves.
TEST(wait_for_word_spins_for_its_budget) {
  const uint64_t target = uint64_t{1} << 32;
  struct Case {
    int64_t spin_us;
    int publish_after_ms;
    int64_t min_cpu_ms, max_cpu_ms;
  } cases[] = {
      {0, 60, 0, 5},             // sleeps: almost no CPU
      {1000000, 60, 5, 5000},    // spins until the publish, about 60 ms
      {20000, 300, 0, 150},      // spins 20 ms, then sleeps
  };
  for (const Case& c : cases) {
    std::atomic<uint64_t> word{0};
    std::thread publisher([&word, &c, target] {
      std::this_thread::sleep_for(
          std::chrono::milliseconds(c.publish_after_ms));
      tf_rdma::PublishWord(&word, target);
    });
    int64_t cpu0 = tf_rdma::ThreadCpuNs();
    Status s = tf_rdma::WaitForWord(&word, target, Deadline(20000), nullptr,
                                    c.spin_us);
    int64_t cpu_ms = (tf_rdma::ThreadCpuNs() - cpu0) / 1000000;
    publisher.join();
    EXPECT_OK(s);
    EXPECT_GE(cpu_ms, c.min_cpu_ms);
    EXPECT_LE(cpu_ms, c.max_cpu_ms);
  }
}

// ---------------------------------------------------------------------------
// Transports: the shm and tcp write paths, and the tcp receiver's checks.

TEST(transport_shm_pair_write) {
  std::unique_ptr<Region> reader;
  ASSERT_OK(Region::Create(8192, &reader));
  tf_rdma::shm::Pair pair;
  tf_rdma::RegionDescriptor d;
  ASSERT_OK(pair.Expose(3, *reader, &d));
  EXPECT_EQ(d.id, uint32_t{3});
  EXPECT_EQ(d.size, uint64_t{8192});
  EXPECT_EQ(d.shm_name, reader->shm_name());
  int handle = -1;
  ASSERT_OK(pair.AddRemoteRegion(d, &handle));
  std::string payload = "tensor bytes";
  ASSERT_OK(pair.Write(handle, 64, payload.data(), payload.size(), 0, 9,
                       Deadline(1000)));
  EXPECT_EQ(std::string(reinterpret_cast<char*>(reader->data()) + 64,
                        payload.size()),
            payload);
  EXPECT_EQ(reader->Word(0)->load(), uint64_t{9});
  // A notice alone (a credit), at the last word.
  EXPECT_OK(pair.Write(handle, 0, nullptr, 0, 8184, 2, Deadline(1000)));
  EXPECT_EQ(reader->Word(8184)->load(), uint64_t{2});
  // Refused writes change nothing.
  std::vector<uint8_t> before(reader->data(), reader->data() + 8192);
  std::string big(200, 'X');
  EXPECT_CODE(pair.Write(handle, 8000, big.data(), big.size(), 0, 10,
                         Deadline(1000)),
              kInvalidArgument);
  EXPECT_CODE(pair.Write(handle, 8, big.data(), kMax64 - 7, 0, 10,
                         Deadline(1000)),
              kInvalidArgument);
  EXPECT_CODE(pair.Write(handle, 0, big.data(), 8, 4, 10, Deadline(1000)),
              kInvalidArgument);
  EXPECT_CODE(pair.Write(handle, 0, big.data(), 8, 8192, 10, Deadline(1000)),
              kInvalidArgument);
  EXPECT_CODE(pair.Write(handle + 1, 0, big.data(), 8, 0, 10, Deadline(1000)),
              kInvalidArgument);
  EXPECT_CODE(pair.Write(-1, 0, big.data(), 8, 0, 10, Deadline(1000)),
              kInvalidArgument);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), reader->data()));
  // A descriptor whose size does not match the segment is refused.
  d.size = 4096;
  int h2 = -1;
  EXPECT_CODE(pair.AddRemoteRegion(d, &h2), kInvalidArgument);
}

TEST(transport_tcp_pair_write_then_apply) {
  SocketPair sp;
  ASSERT_TRUE(sp.ok());
  std::unique_ptr<Region> reader;
  ASSERT_OK(Region::Create(8192, &reader));
  tf_rdma::TuneSocket(sp.fd[1], 1000);
  std::mutex send_mu;
  tf_rdma::tcp::Pair writer(sp.fd[0], &send_mu);
  tf_rdma::RegionDescriptor d;
  d.id = 7;
  d.size = reader->size();
  int handle = -1;
  ASSERT_OK(writer.AddRemoteRegion(d, &handle));
  std::string payload(3000, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i);
  ASSERT_OK(writer.Write(handle, 1024, payload.data(), payload.size(), 64, 12,
                         Deadline(5000)));
  // The frame as the reader's progress thread sees it.
  tf_rdma::FrameHeader h;
  ASSERT_OK(tf_rdma::RecvAll(sp.fd[1], &h, sizeof(h)));
  EXPECT_EQ(h.magic, tf_rdma::kFrameMagic);
  EXPECT_EQ(h.type, uint16_t{tf_rdma::kWrite});
  EXPECT_EQ(h.a, uint64_t{7});
  EXPECT_EQ(h.b, uint64_t{1024});
  EXPECT_EQ(h.c, uint64_t{3000});
  EXPECT_EQ(h.d, uint64_t{64});
  EXPECT_EQ(h.e, uint64_t{12});
  Region* target = reader.get();
  auto lookup = [target](uint32_t id) { return id == 7 ? target : nullptr; };
  ASSERT_OK(tf_rdma::tcp::ApplyWrite(sp.fd[1], h, lookup));
  EXPECT_TRUE(std::memcmp(reader->data() + 1024, payload.data(),
                          payload.size()) == 0);
  EXPECT_EQ(reader->Word(64)->load(), uint64_t{12});
  EXPECT_EQ(Drain(sp.fd[1]), std::string());  // exactly one frame was sent
  // A credit: no payload, notice only.
  ASSERT_OK(writer.Write(handle, 0, nullptr, 0, 128, 3, Deadline(5000)));
  ASSERT_OK(tf_rdma::RecvAll(sp.fd[1], &h, sizeof(h)));
  EXPECT_EQ(h.c, uint64_t{0});
  ASSERT_OK(tf_rdma::tcp::ApplyWrite(sp.fd[1], h, lookup));
  EXPECT_EQ(reader->Word(128)->load(), uint64_t{3});
  // Out of bounds on the writer's side: refused before a byte is sent.
  EXPECT_CODE(writer.Write(handle, 8000, payload.data(), 200, 0, 1,
                           Deadline(1000)),
              kInvalidArgument);
  EXPECT_CODE(writer.Write(handle, 0, payload.data(), 8, 12, 1, Deadline(1000)),
              kInvalidArgument);
  EXPECT_CODE(writer.Write(handle + 1, 0, payload.data(), 8, 0, 1,
                           Deadline(1000)),
              kInvalidArgument);
  EXPECT_EQ(Drain(sp.fd[1]), std::string());
  EXPECT_FALSE(writer.broken());
}

TEST(transport_tcp_apply_write_rejects_bad_frames) {
  std::unique_ptr<Region> reader;
  ASSERT_OK(Region::Create(4096, &reader));
  Region* target = reader.get();
  auto lookup = [target](uint32_t id) { return id == 7 ? target : nullptr; };
  SocketPair sp;
  ASSERT_TRUE(sp.ok());
  // As the engine does: a read that stalls fails instead of blocking (a
  // check that let a bad frame through would otherwise wait forever).
  tf_rdma::TuneSocket(sp.fd[1], 1000);
  // Payload bytes a bad frame might have carried: they must stay unread.
  ASSERT_TRUE(WriteString(sp.fd[0], std::string(64, 'P')));
  auto frame = [](uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    tf_rdma::FrameHeader h;
    h.type = tf_rdma::kWrite;
    h.a = a;
    h.b = b;
    h.c = c;
    h.d = d;
    h.e = 99;
    return h;
  };
  // A region id past 32 bits must not be truncated into region 7.
  EXPECT_CODE(tf_rdma::tcp::ApplyWrite(sp.fd[1], frame((uint64_t{1} << 32) + 7,
                                                       0, 8, 0), lookup),
              kPermissionDenied);
  EXPECT_CODE(tf_rdma::tcp::ApplyWrite(sp.fd[1], frame(8, 0, 8, 0), lookup),
              kPermissionDenied);
  EXPECT_CODE(tf_rdma::tcp::ApplyWrite(sp.fd[1], frame(7, 4090, 8, 0), lookup),
              kInvalidArgument);
  EXPECT_CODE(tf_rdma::tcp::ApplyWrite(sp.fd[1], frame(7, 8, kMax64 - 7, 0),
                                       lookup),
              kInvalidArgument);
  EXPECT_CODE(tf_rdma::tcp::ApplyWrite(sp.fd[1], frame(7, 0, 8, 4), lookup),
              kInvalidArgument);
  EXPECT_CODE(tf_rdma::tcp::ApplyWrite(sp.fd[1], frame(7, 0, 8, 4096), lookup),
              kInvalidArgument);
  bool untouched = true;
  for (uint64_t i = 0; i < reader->size(); ++i) {
    untouched = untouched && reader->data()[i] == 0;
  }
  EXPECT_TRUE(untouched);
  EXPECT_EQ(Drain(sp.fd[1]).size(), size_t{64});
  // The peer dies mid-payload: an error, and the notice is not published.
  ASSERT_TRUE(WriteString(sp.fd[0], std::string(10, 'Q')));
  sp.CloseEnd(0);
  EXPECT_CODE(tf_rdma::tcp::ApplyWrite(sp.fd[1], frame(7, 64, 100, 8), lookup),
              kUnavailable);
  EXPECT_EQ(reader->Word(8)->load(), uint64_t{0});
}

TEST(status_basics) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_TRUE(ok.Prefixed("context").ok());
  EXPECT_EQ(ok.Prefixed("context").message(), std::string());
  Status s = tf_rdma::Unavailable("peer gone").Prefixed("tensor 'x'");
  EXPECT_CODE(s, kUnavailable);
  EXPECT_EQ(s.message(), std::string("tensor 'x': peer gone"));
  Status e = tf_rdma::ErrnoStatus("open", ENOENT);
  EXPECT_CODE(e, kInternal);
  EXPECT_CONTAINS(e.message(), "open: ");
}

// ---------------------------------------------------------------------------
// Which transport a pair uses (kernels/common/transport_choice.h).

namespace {

using tf_rdma::ChooseTransport;
using tf_rdma::HostKind;
using tf_rdma::PairEnd;
using tf_rdma::TransportChoice;
using tf_rdma::Verbs;

std::vector<std::string> Allowed(const std::string& setting) {
  std::vector<std::string> out;
  Status s = tf_rdma::ParseTransportSetting(setting, &out);
  if (!s.ok()) std::printf("      bad setting: %s\n", s.message().c_str());
  return out;
}

// An end as the handshake knows it: its setting, verbs, boot id + netns.
PairEnd Identified(const std::string& task, const std::string& setting,
                   Verbs verbs, const std::string& boot,
                   const std::string& netns,
                   const std::string& shm = "12:1") {
  PairEnd e;
  e.task = task;
  e.allowed = Allowed(setting);
  e.verbs = verbs;
  e.identified = true;
  e.boot_id = boot;
  e.netns = netns;
  e.shm_id = shm;
  return e;
}

// An end as a prediction knows it: an address and what it is to this
// machine.
PairEnd AtAddress(const std::string& task, const std::string& host,
                  HostKind kind, const std::string& setting = "auto",
                  Verbs verbs = Verbs::kUnusable) {
  PairEnd e;
  e.task = task;
  e.allowed = setting.empty() ? std::vector<std::string>() : Allowed(setting);
  e.verbs = verbs;
  e.host = host;
  e.host_kind = kind;
  return e;
}

}  // namespace

TEST(transport_setting_parse) {
  std::vector<std::string> names;
  EXPECT_OK(tf_rdma::ParseTransportSetting("auto", &names));
  EXPECT_EQ(tf_rdma::Join(names, ","), std::string("verbs,shm,tcp"));
  EXPECT_OK(tf_rdma::ParseTransportSetting("tcp,shm", &names));
  EXPECT_EQ(tf_rdma::Join(names, ","), std::string("tcp,shm"));
  for (const char* bad : {"", "rdma", "shm,shm", "auto,tcp", ",", "shm,,tcp", ",shm", "shm,"}) {
    Status s = tf_rdma::ParseTransportSetting(bad, &names);
    EXPECT_CODE(s, kInvalidArgument);
    EXPECT_CONTAINS(s.message(), "is not auto or a list of verbs, shm, tcp");
  }
}

TEST(transport_choice_same_host_by_boot_id_and_netns) {
  // The handshake: both ends' identities decide, whatever the addresses say.
  PairEnd reader = Identified("r", "auto", Verbs::kUnusable, "boot1", "net:[1]");
  PairEnd writer = Identified("w", "shm,tcp", Verbs::kUnusable, "boot1",
                              "net:[1]");
  writer.host = "10.0.0.9";
  writer.host_kind = HostKind::kRemote;
  TransportChoice c = ChooseTransport(reader, writer);
  EXPECT_EQ(c.transport, std::string("shm"));
  EXPECT_TRUE(c.same_host);
  EXPECT_EQ(c.fallback, std::string());
  EXPECT_CONTAINS(c.host_reason, "same boot id and network namespace");
  EXPECT_TRUE(c.shared_shm);
  EXPECT_EQ(c.reason, c.host_reason + ", and one /dev/shm");
}

TEST(transport_choice_one_host_needs_one_dev_shm) {
  // Containers with the host's network: one boot, one network namespace,
  // a /dev/shm each. Never shm; tcp says why.
  PairEnd reader = Identified("r", "auto", Verbs::kUnusable, "boot1", "net:[1]",
                              "12:1");
  PairEnd writer = Identified("w", "auto", Verbs::kUnusable, "boot1", "net:[1]",
                              "40:1");
  TransportChoice c = ChooseTransport(reader, writer);
  EXPECT_EQ(c.transport, std::string("tcp"));
  EXPECT_TRUE(c.same_host);
  EXPECT_FALSE(c.shared_shm);
  EXPECT_CONTAINS(c.reason, "each end has a /dev/shm of its own");
  // An end that does not say which /dev/shm it has gets no shm either.
  writer.shm_id = "";
  EXPECT_EQ(ChooseTransport(reader, writer).transport, std::string("tcp"));
  // Only shm allowed: no transport, and why.
  writer = Identified("w", "shm", Verbs::kUnusable, "boot1", "net:[1]", "40:1");
  c = ChooseTransport(reader, writer);
  EXPECT_EQ(c.transport, std::string());
  EXPECT_CONTAINS(c.reason, "one host, but not one /dev/shm");
  // The same directory (a bind mount of it too): shm.
  writer.shm_id = "12:1";
  EXPECT_EQ(ChooseTransport(reader, writer).transport, std::string("shm"));
}

TEST(transport_choice_different_netns_or_boot) {
  // Network namespaces of one machine count as hosts: tcp, even on
  // loopback addresses.
  PairEnd reader = Identified("r", "auto", Verbs::kUnusable, "boot1", "net:[1]");
  reader.host_kind = HostKind::kLoopback;
  PairEnd writer = Identified("w", "auto", Verbs::kUnusable, "boot1", "net:[2]");
  writer.host_kind = HostKind::kLoopback;
  TransportChoice c = ChooseTransport(reader, writer);
  EXPECT_EQ(c.transport, std::string("tcp"));
  EXPECT_FALSE(c.same_host);
  EXPECT_CONTAINS(c.host_reason, "different network namespaces");
  writer.netns = "net:[1]";
  writer.boot_id = "boot2";
  c = ChooseTransport(reader, writer);
  EXPECT_EQ(c.transport, std::string("tcp"));
  EXPECT_CONTAINS(c.host_reason, "boot ids differ");
  // A host id without a namespace part (as a HELLO field without '/' parses)
  // is another host.
  writer.boot_id = "boot1";
  writer.netns = "";
  EXPECT_EQ(ChooseTransport(reader, writer).transport, std::string("tcp"));
}

TEST(transport_choice_address_only_prediction) {
  // No identities: the addresses decide.
  PairEnd me = AtAddress("a", "", HostKind::kLocal);
  struct Case {
    const char* host;
    HostKind kind;
    bool same;
    const char* why;
  };
  for (const Case& k : std::vector<Case>{
           {"127.0.0.1", HostKind::kLoopback, true, "addresses of this host"},
           {"10.1.1.1", HostKind::kLocal, true, "addresses of this host"},
           {"192.0.2.9", HostKind::kRemote, false,
            "different hosts: b is on 192.0.2.9 (not this machine)"},
           {"", HostKind::kUnknown, false, "different hosts"}}) {
    PairEnd peer = AtAddress("b", k.host, k.kind, "");
    TransportChoice c = ChooseTransport(me, peer);
    EXPECT_EQ(c.same_host, k.same);
    EXPECT_EQ(c.transport, std::string(k.same ? "shm" : "tcp"));
    EXPECT_CONTAINS(c.host_reason, k.why);
  }
  // Both on loopback.
  PairEnd lo = AtAddress("a", "localhost", HostKind::kLoopback);
  TransportChoice c =
      ChooseTransport(lo, AtAddress("b", "127.0.0.2", HostKind::kLoopback));
  EXPECT_CONTAINS(c.host_reason, "both tasks are on loopback addresses");
  // Two tasks of another machine with the same host string.
  c = ChooseTransport(AtAddress("a", "Node7", HostKind::kRemote),
                      AtAddress("b", "node7", HostKind::kRemote));
  EXPECT_TRUE(c.same_host);
  EXPECT_EQ(c.transport, std::string("shm"));
  EXPECT_CONTAINS(c.host_reason, "both tasks are on host Node7");
  c = ChooseTransport(AtAddress("a", "node7", HostKind::kRemote),
                      AtAddress("b", "node8", HostKind::kRemote));
  EXPECT_FALSE(c.same_host);
  EXPECT_CONTAINS(c.host_reason, "a is on node7, b is on node8");
  // One end identified is not enough: the addresses decide.
  PairEnd known = Identified("a", "auto", Verbs::kUnusable, "boot1", "net:[1]");
  known.host_kind = HostKind::kLocal;
  c = ChooseTransport(known, AtAddress("b", "192.0.2.9", HostKind::kRemote, ""));
  EXPECT_FALSE(c.same_host);
  EXPECT_CONTAINS(c.host_reason, "not this machine");
}

TEST(transport_choice_verbs_allowed_and_unavailable) {
  // Both ends have a device: verbs, on one host too.
  PairEnd r = Identified("r", "auto", Verbs::kUsable, "b", "n");
  r.verbs_detail = "mlx5_0 port 1";
  PairEnd w = Identified("w", "verbs,shm,tcp", Verbs::kUsable, "b", "n");
  TransportChoice c = ChooseTransport(r, w);
  EXPECT_EQ(c.transport, std::string("verbs"));
  EXPECT_EQ(c.fallback, std::string());
  EXPECT_CONTAINS(c.reason, "both ends have a usable RDMA device (mlx5_0");
  // The peer has none (it did not offer verbs): the next that fits.
  w.verbs = Verbs::kUnusable;
  w.allowed = Allowed("shm,tcp");
  EXPECT_EQ(ChooseTransport(r, w).transport, std::string("shm"));
  // This end has none: verbs is skipped even though the peer offers it.
  r.verbs = Verbs::kUnusable;
  w = Identified("w", "auto", Verbs::kUsable, "b", "other-netns");
  EXPECT_EQ(ChooseTransport(r, w).transport, std::string("tcp"));
  // A prediction: the peer's device is not known. Verbs, and the fallback.
  PairEnd me = AtAddress("a", "", HostKind::kLocal, "auto", Verbs::kUsable);
  me.verbs_detail = "mlx5_0 port 1";
  c = ChooseTransport(me, AtAddress("b", "192.0.2.9", HostKind::kRemote, "",
                                    Verbs::kUnknown));
  EXPECT_EQ(c.transport, std::string("verbs"));
  EXPECT_EQ(c.fallback, std::string("tcp"));
  EXPECT_CONTAINS(c.reason, "RDMA device mlx5_0 port 1 (when the other end "
                            "has a usable device too; else tcp)");
  c = ChooseTransport(me, AtAddress("b", "127.0.0.1", HostKind::kLoopback, "",
                                    Verbs::kUnknown));
  EXPECT_EQ(c.fallback, std::string("shm"));
  // Verbs without tcp where verbs is not usable: the endpoint does not
  // start, so no pair connects.
  PairEnd strict = AtAddress("a", "", HostKind::kLocal, "shm,verbs");
  strict.verbs_detail = "no RDMA devices";
  c = ChooseTransport(strict, AtAddress("b", "127.0.0.1", HostKind::kLoopback,
                                        ""));
  EXPECT_EQ(c.transport, std::string());
  EXPECT_CONTAINS(c.reason, "TF_RDMA_TRANSPORT=shm,verbs asks for verbs, "
                            "which is not usable here (no RDMA devices)");
  // With tcp in the list it falls back.
  strict.allowed = Allowed("shm,verbs,tcp");
  c = ChooseTransport(strict, AtAddress("b", "192.0.2.9", HostKind::kRemote,
                                        ""));
  EXPECT_EQ(c.transport, std::string("tcp"));
}

TEST(transport_choice_allowed_list_order) {
  // The chooser's order decides; the peer's list only filters.
  PairEnd r = Identified("r", "tcp,shm", Verbs::kUnusable, "b", "n");
  PairEnd w = Identified("w", "shm,tcp", Verbs::kUnusable, "b", "n");
  TransportChoice c = ChooseTransport(r, w);
  EXPECT_EQ(c.transport, std::string("tcp"));
  EXPECT_TRUE(c.same_host);
  EXPECT_CONTAINS(c.reason, "tcp comes before shm");
  c = ChooseTransport(w, r);
  EXPECT_EQ(c.transport, std::string("shm"));
  // Only tcp here: same host, but shm is not allowed.
  r.allowed = Allowed("tcp");
  c = ChooseTransport(r, w);
  EXPECT_EQ(c.transport, std::string("tcp"));
  EXPECT_CONTAINS(c.reason, "shm is not among the transports both ends allow");
  // Nothing in common: the handshake's denial, naming both lists (the
  // usable ones: this end's verbs is dropped, it has no device).
  r = Identified("/job:w/task:1", "verbs,tcp", Verbs::kUnusable, "b", "n");
  w = Identified("/job:w/task:0", "verbs", Verbs::kUsable, "b2", "n");
  c = ChooseTransport(r, w);
  EXPECT_EQ(c.transport, std::string());
  EXPECT_EQ(c.reason, std::string("no common transport: /job:w/task:0 allows "
                                  "verbs, /job:w/task:1 allows tcp "
                                  "(different hosts)"));
  // shm only, another host.
  r = Identified("r", "shm", Verbs::kUnusable, "b", "n");
  w = Identified("w", "shm", Verbs::kUnusable, "b", "n2");
  c = ChooseTransport(r, w);
  EXPECT_EQ(c.transport, std::string());
  EXPECT_CONTAINS(c.reason, "no common transport: w allows shm, r allows shm "
                            "(different hosts)");
  // A peer's list is escaped in the reason (it comes off the wire).
  w = Identified("w", "shm", Verbs::kUnusable, "b", "n2");
  w.allowed = {"sh\x01m"};
  c = ChooseTransport(r, w);
  EXPECT_CONTAINS(c.reason, "w allows sh\\x01m");
}

TEST(transport_choice_classify_host) {
  std::set<std::string> local = {"10.1.1.1"};
  EXPECT_TRUE(tf_rdma::ClassifyHost("127.0.0.1", local) == HostKind::kLoopback);
  EXPECT_TRUE(tf_rdma::ClassifyHost("localhost", local) == HostKind::kLoopback);
  EXPECT_TRUE(tf_rdma::ClassifyHost("[::1]", local) == HostKind::kLoopback);
  EXPECT_TRUE(tf_rdma::ClassifyHost("10.1.1.1", local) == HostKind::kLocal);
  EXPECT_TRUE(tf_rdma::ClassifyHost("192.0.2.9", local) == HostKind::kRemote);
  EXPECT_TRUE(tf_rdma::ClassifyHost("", local) == HostKind::kUnknown);
  // This machine's own interfaces are local (or loopback).
  for (const std::string& address : tf_rdma::LocalAddresses()) {
    if (address.find('%') != std::string::npos) continue;  // link-local scope
    HostKind kind = tf_rdma::ClassifyHost(address, tf_rdma::LocalAddresses());
    EXPECT_TRUE(kind == HostKind::kLocal || kind == HostKind::kLoopback);
  }
  std::string boot, netns;
  tf_rdma::ThisHost(&boot, &netns);
  EXPECT_FALSE(boot.empty());
  EXPECT_CONTAINS(netns, "net:[");
}

TEST(region_collect_stale_segments_of_given_owners) {
  // Names of pids that cannot run (above pid_max): only this test's. A
  // stale regular segment goes; a locked one, a directory and another
  // owner's stale segment stay (the pid filter), and nothing is an error.
  constexpr int64_t kNobody = 99999999, kOther = 99999998;
  std::string stale = "tfrdma." + std::to_string(kNobody) + ".1";
  std::string locked = "tfrdma." + std::to_string(kNobody) + ".2";
  std::string dir = "tfrdma." + std::to_string(kNobody) + ".3";
  std::string other = "tfrdma." + std::to_string(kOther) + ".1";
  auto make = [](const std::string& name, off_t size) {
    int fd = shm_open(("/" + name).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd >= 0 && ftruncate(fd, size) != 0) std::printf("      ftruncate\n");
    return fd;
  };
  int stale_fd = make(stale, 8192);
  int locked_fd = make(locked, 4096);
  int other_fd = make(other, 4096);
  ASSERT_TRUE(stale_fd >= 0 && locked_fd >= 0 && other_fd >= 0);
  close(stale_fd);
  close(other_fd);
  // The lock an owner holds; a separate open file description, so that the
  // collector's exclusive lock on its own one conflicts.
  EXPECT_TRUE(flock(locked_fd, LOCK_SH) == 0);
  EXPECT_TRUE(mkdir(("/dev/shm/" + dir).c_str(), 0700) == 0);
  tf_rdma::StaleSegments got = tf_rdma::CollectStaleSegments({kNobody});
  EXPECT_EQ(got.removed.size(), size_t{1});
  if (!got.removed.empty()) EXPECT_EQ(got.removed[0], stale);
  EXPECT_EQ(got.bytes, uint64_t{8192});
  EXPECT_EQ(got.errors.size(), size_t{0});
  EXPECT_FALSE(ShmExists("/" + stale));
  EXPECT_TRUE(ShmExists("/" + locked));
  EXPECT_TRUE(ShmExists("/" + other));
  // Released: stale too; and without a filter, every owner's.
  close(locked_fd);
  got = tf_rdma::CollectStaleSegments();
  EXPECT_FALSE(ShmExists("/" + locked));
  EXPECT_FALSE(ShmExists("/" + other));
  EXPECT_GE(got.removed.size(), size_t{2});
  rmdir(("/dev/shm/" + dir).c_str());
  shm_unlink(("/" + locked).c_str());
  shm_unlink(("/" + other).c_str());
}

// ---------------------------------------------------------------------------
// Known product bugs (run with --known-bugs; see the header).

TEST(config_timeout_ms_past_clock_range) {
  // A bound past the clock's range (~9.2e12 ms of nanoseconds) used to wrap
  // Deadline into the past, so every wait failed at once; and Parse cast
  // 2^64 - 1 to -1. Parse now refuses more than kMaxDeadlineMs and Deadline
  // clamps to it (the ops' timeout_ms attribute reaches Deadline directly).
  tf_rdma::EngineConfig c;
  EXPECT_FALSE(tf_rdma::EngineConfig::Parse(
                   Config("timeout_ms=18446744073709551615\n"), &c)
                   .ok());
  EXPECT_FALSE(tf_rdma::EngineConfig::Parse(
                   Config("timeout_ms=" +
                          std::to_string(tf_rdma::kMaxDeadlineMs + 1) + "\n"),
                   &c)
                   .ok());
  EXPECT_TRUE(tf_rdma::EngineConfig::Parse(
                  Config("timeout_ms=" +
                         std::to_string(tf_rdma::kMaxDeadlineMs) + "\n"),
                  &c)
                  .ok());
  Deadline far(int64_t{10000000000000});  // 1e13 ms, about 317 years
  EXPECT_FALSE(far.Expired());
  EXPECT_GT(far.RemainingMs(), int64_t{0});
  Deadline most(std::numeric_limits<int64_t>::max());
  EXPECT_FALSE(most.Expired());
}

TEST(stats_busy_clock_counts_overlapping_waits_once) {
  // Two waits overlapping for 1 s of their 2 s each: 3 s busy, not 4.
  tf_rdma::BusyClock busy;
  tf_rdma::Clock::time_point t0 = tf_rdma::Clock::now();
  auto at = [&](int s) { return t0 + std::chrono::seconds(s); };
  busy.End(at(0));  // an End without a Begin changes nothing
  EXPECT_EQ(busy.BusyNs(at(0)), uint64_t{0});
  busy.Begin(at(0));
  busy.Begin(at(1));
  EXPECT_EQ(busy.waiting(), 2);
  busy.End(at(2));
  EXPECT_EQ(busy.BusyNs(at(2)), uint64_t{2000000000});  // still waiting
  busy.End(at(3));
  EXPECT_EQ(busy.waiting(), 0);
  EXPECT_EQ(busy.BusyNs(at(10)), uint64_t{3000000000});
}

TEST(stats_table_waits_and_json) {
  tf_rdma::TransferStats stats;
  tf_rdma::PeerCounters* shm = stats.For("/job:w/task:1", "shm");
  EXPECT_TRUE(shm == stats.For("/job:w/task:1", "shm"));  // one per pair
  tf_rdma::PeerCounters* tcp = stats.For("/job:w/task:1", "tcp");
  EXPECT_TRUE(shm != tcp);
  tf_rdma::PeerCounters::Add(&shm->bytes_sent, 4096);
  tf_rdma::PeerCounters::Add(&shm->writes, 1);
  // A wait that never began ends as nothing; one that began counts once.
  tf_rdma::Clock::time_point since{};
  tf_rdma::TransferStats::EndWait(&since, &stats.data_busy, &shm->data_waits,
                                  &shm->data_wait_ns);
  EXPECT_EQ(shm->data_waits.load(), uint64_t{0});
  tf_rdma::TransferStats::StartWait(&since, &stats.data_busy);
  tf_rdma::Clock::time_point first = since;
  tf_rdma::TransferStats::StartWait(&since, &stats.data_busy);  // no-op
  EXPECT_TRUE(since == first);
  EXPECT_EQ(stats.data_busy.waiting(), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  tf_rdma::TransferStats::EndWait(&since, &stats.data_busy, &shm->data_waits,
                                  &shm->data_wait_ns);
  tf_rdma::TransferStats::EndWait(&since, &stats.data_busy, &shm->data_waits,
                                  &shm->data_wait_ns);  // already ended
  EXPECT_EQ(shm->data_waits.load(), uint64_t{1});
  EXPECT_GE(shm->data_wait_ns.load(), uint64_t{20000000});
  EXPECT_EQ(stats.data_busy.waiting(), 0);
  EXPECT_GE(stats.data_busy.BusyNs(tf_rdma::Clock::now()),
            shm->data_wait_ns.load());
  std::string json = stats.Json();
  EXPECT_CONTAINS(json, "{\"peer\": \"/job:w/task:1\", \"transport\": "
                        "\"shm\", \"bytes_sent\": 4096, \"bytes_received\": 0, "
                        "\"writes\": 1, \"receives\": 0, \"credit_waits\": 0, "
                        "\"credit_wait_ns\": 0, \"data_waits\": 1, ");
  EXPECT_CONTAINS(json, "\"transport\": \"tcp\", \"bytes_sent\": 0");
  EXPECT_CONTAINS(json, "\"credit_waiting\": 0, \"data_waiting\": 0, "
                        "\"collectives_inline\": 0, "
                        "\"collectives_handed_off\": 0}");
}

// ---------------------------------------------------------------------------

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);  // a failing send test must not kill the run
  signal(SIGALRM, ut::OnTestTimeout);
  setvbuf(stdout, nullptr, _IOLBF, 0);
  bool list = false, known_bugs = false;
  std::vector<std::string> filters;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--list") {
      list = true;
    } else if (a == "--known-bugs") {
      known_bugs = true;
    } else if (a == "-h" || a == "--help") {
      std::printf("usage: %s [--list] [--known-bugs] [NAME-SUBSTRING...]\n",
                  argv[0]);
      return 0;
    } else {
      filters.push_back(a);
    }
  }
  auto selected = [&](const ut::TestCase& t) {
    std::string name = t.name;
    if (t.known_bug && !known_bugs) {
      return std::find(filters.begin(), filters.end(), name) != filters.end();
    }
    if (filters.empty()) return true;
    for (const std::string& f : filters) {
      if (name.find(f) != std::string::npos) return true;
    }
    return false;
  };
  if (list) {
    for (const ut::TestCase& t : ut::Registry()) {
      std::printf("%s%s\n", t.name, t.known_bug ? "  (known bug)" : "");
    }
    return 0;
  }
  std::vector<std::string> segments_before = OwnSegments();
  int ran = 0, failed = 0, not_run_bugs = 0;
  std::vector<std::string> failed_names;
  auto t_all = std::chrono::steady_clock::now();
  std::printf("engine_unittest: pid %d\n", static_cast<int>(getpid()));
  for (const ut::TestCase& t : ut::Registry()) {
    if (!selected(t)) {
      if (t.known_bug) ++not_run_bugs;
      continue;
    }
    ++ran;
    ut::g_test_failures = 0;
    ut::g_current = t.name;
    std::printf("[ RUN  ] %s\n", t.name);
    auto t0 = std::chrono::steady_clock::now();
    alarm(ut::kTestTimeoutS);
    try {
      t.fn();
    } catch (const std::exception& e) {
      ut::Failure(__FILE__, __LINE__,
                  std::string("uncaught exception: ") + e.what());
    } catch (...) {
      ut::Failure(__FILE__, __LINE__, "uncaught exception");
    }
    alarm(0);
    long ms = static_cast<long>(MsSince(t0));
    if (ut::g_test_failures == 0) {
      std::printf("[  OK  ] %s (%ld ms)\n", t.name, ms);
    } else {
      ++failed;
      failed_names.push_back(t.name);
      std::printf("[ FAIL ] %s (%ld ms, %d failed checks)\n", t.name, ms,
                  ut::g_test_failures);
    }
  }
  // No test may leave a segment of this process in /dev/shm.
  std::vector<std::string> left = OwnSegments();
  if (left.size() > segments_before.size()) {
    ++failed;
    failed_names.push_back("(segments left in /dev/shm)");
    std::printf("[ FAIL ] segments left in /dev/shm:");
    for (const std::string& n : left) std::printf(" %s", n.c_str());
    std::printf("\n");
    for (const std::string& n : left) shm_unlink(("/" + n).c_str());
  }
  std::printf("\n");
  for (const std::string& n : failed_names) std::printf("FAILED: %s\n", n.c_str());
  if (not_run_bugs > 0) {
    std::printf("(%d known-bug test(s) not run: --known-bugs runs them)\n",
                not_run_bugs);
  }
  std::printf("engine_unittest: ran %d tests, %d failed, %ld checks, %ld ms\n",
              ran, failed, ut::g_checks, static_cast<long>(MsSince(t_all)));
  if (ran == 0) {
    std::printf("engine_unittest: no test matched\n");
    return 2;
  }
  return failed == 0 ? 0 : 1;
}
