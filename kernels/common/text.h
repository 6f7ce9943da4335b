// Small text helpers shared by the engine and the transports: splitting and
// joining lists, making a peer's bytes safe to log, and JSON strings.
#ifndef TF_RDMA_COMMON_TEXT_H_
#define TF_RDMA_COMMON_TEXT_H_

#include <cstddef>
#include <string>
#include <vector>

namespace tf_rdma {

// The non-empty pieces of `s` between `sep`s ("a,,b" -> {"a", "b"}).
std::vector<std::string> Split(const std::string& s, char sep);

// The parts with `sep` between them.
std::string Join(const std::vector<std::string>& parts, const char* sep);

// Peer-supplied text made safe for one log line: control and non-ASCII
// bytes as \xNN, cut at `max` characters with the original length noted.
std::string Printable(const std::string& text, size_t max = 80);

// `text` as a JSON string, quotes included: '"', '\\' and control bytes
// escaped, other bytes as they are (a reader decodes them as UTF-8, with
// replacement: the engine's own text is ASCII, a peer's may be anything).
std::string JsonString(const std::string& text);

}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_TEXT_H_
