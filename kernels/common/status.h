// A small status type for the engine and the transports.
//
// The engine and the transports know nothing about TensorFlow (design.md §2),
// so they report errors with this type; the op layer maps each code to the
// matching tensorflow::errors::* at the op boundary.
#ifndef TF_RDMA_COMMON_STATUS_H_
#define TF_RDMA_COMMON_STATUS_H_

#include <string>
#include <utility>

namespace tf_rdma {

enum class Code {
  kOk = 0,
  kInvalidArgument,    // input that does not fit the plan or the settings
  kDeadlineExceeded,   // a bounded wait ran out
  kUnavailable,        // a peer went away or cannot be reached
  kFailedPrecondition, // used before set-up, or both ends disagree (plan hash)
  kPermissionDenied,   // the peer failed the secret handshake
  kInternal,           // a system call failed
  kResourceExhausted,  // the host ran out of something (/dev/shm space)
  kCancelled,          // TensorFlow cancelled the op's step
};

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message)
      : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

  // Returns a copy whose message starts with `context`.
  Status Prefixed(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return Status(Code::kInvalidArgument, std::move(m));
}
inline Status DeadlineExceeded(std::string m) {
  return Status(Code::kDeadlineExceeded, std::move(m));
}
inline Status Unavailable(std::string m) {
  return Status(Code::kUnavailable, std::move(m));
}
inline Status FailedPrecondition(std::string m) {
  return Status(Code::kFailedPrecondition, std::move(m));
}
inline Status ResourceExhausted(std::string m) {
  return Status(Code::kResourceExhausted, std::move(m));
}
inline Status Cancelled(std::string m) {
  return Status(Code::kCancelled, std::move(m));
}
inline Status PermissionDenied(std::string m) {
  return Status(Code::kPermissionDenied, std::move(m));
}
inline Status Internal(std::string m) {
  return Status(Code::kInternal, std::move(m));
}

// Internal("what: strerror(errno)") for a failed system call.
Status ErrnoStatus(const std::string& what, int err);

#define TF_RDMA_RETURN_IF_ERROR(expr)      \
  do {                                     \
    ::tf_rdma::Status _status = (expr);    \
    if (!_status.ok()) return _status;     \
  } while (0)

}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_STATUS_H_
