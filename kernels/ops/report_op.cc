// TfRdmaReport: what a task's tf_rdma knows, as JSON, from any task.
//
// tf_rdma.stats(), endpoint_info() and the recent transfers (recent.h) are
// per process: a client that runs a rewritten function on worker servers
// has nothing of its own to show, the transfers happen in the servers. A
// small op placed on a task's device (`with tf.device(task)`) asks that
// task's process; TensorFlow carries the string back, so no channel of
// our own is needed. `what`: "recent" (recent::Json, for explain()),
// "stats" (Engine::Stats) or "info" (Engine::Info).
#include <string>

#include "kernels/common/recent.h"
#include "kernels/engine/engine.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_rdma {
namespace {

class ReportOp : public tensorflow::OpKernel {
 public:
  explicit ReportOp(tensorflow::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("what", &what_));
  }

  void Compute(tensorflow::OpKernelContext* ctx) override {
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    std::string report;
    if (what_ == "recent") {
      report = recent::Json();
    } else if (what_ == "stats") {
      report = Engine::Get()->Stats();
    } else {
      report = Engine::Get()->Info();
    }
    out->scalar<tensorflow::tstring>()() = report;
  }

 private:
  std::string what_;
};

}  // namespace

REGISTER_OP("TfRdmaReport")
    .Output("report: string")
    .Attr("what: {'recent', 'stats', 'info'}")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
This task's tf_rdma report as JSON: `recent` the last traced events of each
transfer, `stats` the transfer counters, `info` the endpoint.
)doc");

REGISTER_KERNEL_BUILDER(Name("TfRdmaReport").Device(tensorflow::DEVICE_CPU),
                        ReportOp);

}  // namespace tf_rdma
