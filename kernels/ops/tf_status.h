// The engine's Status as TensorFlow's, at the op boundary (same codes).
#ifndef TF_RDMA_OPS_TF_STATUS_H_
#define TF_RDMA_OPS_TF_STATUS_H_

#include "absl/status/status.h"
#include "kernels/common/status.h"

namespace tf_rdma {

inline absl::Status ToTf(const Status& s) {
  switch (s.code()) {
    case Code::kOk:
      return absl::OkStatus();
    case Code::kInvalidArgument:
      return absl::InvalidArgumentError(s.message());
    case Code::kDeadlineExceeded:
      return absl::DeadlineExceededError(s.message());
    case Code::kUnavailable:
      return absl::UnavailableError(s.message());
    case Code::kFailedPrecondition:
      return absl::FailedPreconditionError(s.message());
    case Code::kPermissionDenied:
      return absl::PermissionDeniedError(s.message());
    case Code::kInternal:
      return absl::InternalError(s.message());
    case Code::kResourceExhausted:
      return absl::ResourceExhaustedError(s.message());
    case Code::kCancelled:
      return absl::CancelledError(s.message());
  }
  return absl::UnknownError(s.message());
}

}  // namespace tf_rdma

#endif  // TF_RDMA_OPS_TF_STATUS_H_
