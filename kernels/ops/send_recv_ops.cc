// TfRdmaSend / TfRdmaRecv: the ops that replace a cross-task edge.
//
// Both carry the slot's place in the plan as attributes (region, offset,
// stride, depth, credit index, sizes, plan hash) so that each op is
// self-contained: the first op to run on either side sets up the region and
// the connection, later runs only move data. Both are asynchronous kernels:
// the common case (credit or data already there, or data landing within a
// short poll, TF_RDMA_POLL_US) completes inline; a recv that must wait
// longer joins the engine's poller and a send that must wait moves to an
// engine thread, so TensorFlow's inter-op threads never block on a peer. A
// send that completed inline briefly helps the poller: the answer it
// probably expects is completed on its thread (engine/poller.cc).
//
// Cancellation. A step that TensorFlow cancels (a failed component of a
// multi-device function call, a ClusterCoordinator that gives up on a
// closure) starts its CancellationManager. An op that has to wait registers
// a callback there, as TensorFlow's own RecvOp does through its rendezvous:
// the callback sets the ticket's `cancelled` flag and wakes the engine's
// waits, so a recv with the poller ends with Cancelled at once and a wait
// on an engine thread (a send waiting for a credit) within kCheckEveryMs
// (50 ms). The callback holds only the flag and the engine (which lives as
// long as the process), so it may run after the op ended; the op takes it
// off (TryDeregisterCallback, which never blocks) when it completes. Cost:
// one registration per op that waits, none for an op that completes inline.
// Dialling a peer and opening a region are not cancelled: they are bounded
// by the timeout.
#include <atomic>
#include <memory>

#include "kernels/engine/engine.h"
#include "kernels/ops/slot_buffer.h"
#include "kernels/ops/tf_status.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_rdma {
namespace {

using tensorflow::AsyncOpKernel;
using tensorflow::DataType;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::shape_inference::InferenceContext;

// Dtypes whose tensors are plain bytes (DataTypeCanUseMemcpy).
#define TF_RDMA_TYPES                                                      \
  "{half, bfloat16, float, double, int8, int16, int32, int64, uint8, "     \
  "uint16, uint32, uint64, bool, complex64, complex128}"

#define TF_RDMA_SLOT_ATTRS                                                 \
  .Attr("tensor_name: string")                                             \
      .Attr("peer: string")                                                \
      .Attr("region: string")                                              \
      .Attr("plan_hash: string")                                           \
      .Attr("region_bytes: int >= 4096")                                   \
      .Attr("credit_bytes: int >= 4096")                                   \
      .Attr("offset: int >= 0")                                            \
      .Attr("stride: int >= 64")                                           \
      .Attr("depth: int >= 1 = 2")                                         \
      .Attr("credit_index: int >= 0")                                      \
      .Attr("shape: shape")                                                \
      .Attr("dynamic: bool = false")                                       \
      .Attr("timeout_ms: int = -1")                                        \
      .Attr("match_calls: bool = false")

// The planned shape: fully defined for a static slot; a dynamic slot's may
// have unknown dimensions or an unknown rank.
absl::Status PlannedShape(InferenceContext* c,
                          tensorflow::shape_inference::ShapeHandle* out) {
  tensorflow::PartialTensorShape shape;
  bool dynamic = false;
  TF_RETURN_IF_ERROR(c->GetAttr("shape", &shape));
  TF_RETURN_IF_ERROR(c->GetAttr("dynamic", &dynamic));
  if (!dynamic && !shape.IsFullyDefined()) {
    return absl::InvalidArgumentError(
        "a static tf_rdma slot needs a fully defined shape, got " +
        shape.DebugString() + " (set dynamic=true for the dynamic path)");
  }
  return c->MakeShapeFromPartialTensorShape(shape, out);
}

// Reads the slot attributes shared by both ops.
absl::Status ReadSpec(OpKernelConstruction* ctx, DataType dtype,
                      SlotSpec* spec, tensorflow::PartialTensorShape* shape,
                      bool* dynamic) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("tensor_name", &spec->tensor_name));
  TF_RETURN_IF_ERROR(ctx->GetAttr("peer", &spec->peer));
  TF_RETURN_IF_ERROR(ctx->GetAttr("region", &spec->region));
  TF_RETURN_IF_ERROR(ctx->GetAttr("plan_hash", &spec->plan_hash));
  int64_t v;
  TF_RETURN_IF_ERROR(ctx->GetAttr("region_bytes", &v));
  spec->region_bytes = v;
  TF_RETURN_IF_ERROR(ctx->GetAttr("credit_bytes", &v));
  spec->credit_bytes = v;
  TF_RETURN_IF_ERROR(ctx->GetAttr("offset", &v));
  spec->offset = v;
  TF_RETURN_IF_ERROR(ctx->GetAttr("stride", &v));
  spec->stride = v;
  TF_RETURN_IF_ERROR(ctx->GetAttr("depth", &spec->depth));
  TF_RETURN_IF_ERROR(ctx->GetAttr("credit_index", &spec->credit_index));
  TF_RETURN_IF_ERROR(ctx->GetAttr("timeout_ms", &spec->timeout_ms));
  TF_RETURN_IF_ERROR(ctx->GetAttr("match_calls", &spec->match_calls));
  TF_RETURN_IF_ERROR(ctx->GetAttr("shape", shape));
  TF_RETURN_IF_ERROR(ctx->GetAttr("dynamic", dynamic));
  if (*dynamic) {
    if (shape->dims() > kMaxDynamicRank) {
      return absl::InvalidArgumentError(
          "tensor '" + spec->tensor_name + "' has rank " +
          std::to_string(shape->dims()) + "; the dynamic path takes at most " +
          std::to_string(kMaxDynamicRank));
    }
    spec->nbytes = kDynamicMetaBytes;
    spec->dynamic = true;
  } else {
    TensorShape full;
    if (!shape->AsTensorShape(&full)) {
      return absl::InvalidArgumentError(
          "tensor '" + spec->tensor_name + "' has shape " +
          shape->DebugString() +
          "; a static tf_rdma slot needs a fully defined shape");
    }
    spec->nbytes = full.num_elements() * tensorflow::DataTypeSize(dtype);
  }
  return ToTf(spec->Validate());
}

// The call an op runs in, for slots that match calls: TensorFlow gives every
// component of one multi-device function call, on every task, the same step
// id (engine/match.cc).
uint64_t CallOf(OpKernelContext* ctx) {
  return static_cast<uint64_t>(ctx->step_id());
}

// Registers `ticket`'s wait with the step's CancellationManager (see
// "Cancellation" above); returns the token to deregister, or kInvalidToken
// where the op runs without one. A step already cancelled sets the flag at
// once: the wait then ends at its first check.
template <typename Ticket>
tensorflow::CancellationToken WatchCancellation(OpKernelContext* ctx,
                                                Ticket* ticket) {
  tensorflow::CancellationManager* cm = ctx->cancellation_manager();
  if (cm == nullptr) return tensorflow::CancellationManager::kInvalidToken;
  auto flag = std::make_shared<std::atomic<bool>>(false);
  ticket->cancelled = flag;
  Engine* engine = Engine::Get();
  tensorflow::CancellationToken token = cm->get_cancellation_token();
  if (!cm->RegisterCallback(token, [flag, engine] {
        flag->store(true, std::memory_order_release);
        engine->WakeCancelled();
      })) {
    flag->store(true, std::memory_order_release);
    return tensorflow::CancellationManager::kInvalidToken;
  }
  return token;
}

void StopWatching(OpKernelContext* ctx, tensorflow::CancellationToken token) {
  if (token != tensorflow::CancellationManager::kInvalidToken) {
    ctx->cancellation_manager()->TryDeregisterCallback(token);
  }
}

// A dead peer's Unavailable, worded for TensorFlow's ClusterCoordinator. It
// tells a worker failure (the closure is run again elsewhere) from a ps
// failure (raised to the user) by the text: an Unavailable that names
// "/job:worker" and not "GRPC error information from remote target /job:ps"
// is a worker failure. TensorFlow prefixes the error of a worker's component
// with the worker's name, so a worker's op that lost its ps would be retried
// on a live worker for ever. The error of an op whose peer is a ps therefore
// carries that phrase and the ps as TensorFlow names it, as gRPC's own
// errors do (docs/reliability.md).
absl::Status ForCoordinator(const SlotSpec& spec, absl::Status s) {
  const std::string ps = "/job:ps/task:";
  if (!absl::IsUnavailable(s) || spec.peer.rfind(ps, 0) != 0) return s;
  return absl::UnavailableError(
      std::string(s.message()) +
      " (GRPC error information from remote target /job:ps/replica:0/task:" +
      spec.peer.substr(ps.size()) + ": tf_rdma lost this parameter server)");
}

// Records a traced op's event (tf_rdma.send / tf_rdma.recv), from its claim
// until now; nothing for an untraced one (kernels/common/trace.h).
void TraceOp(const char* name, const SlotSpec& spec, int64_t traced_since,
             uint64_t step, uint64_t call, uint64_t bytes) {
  trace::Span::At(traced_since)
      .End(name, spec.tensor_name, bytes, spec.peer,
           TraceStep(spec, step, call));
}

class SendOp : public AsyncOpKernel {
 public:
  explicit SendOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &dtype_));
    OP_REQUIRES_OK(ctx, ReadSpec(ctx, dtype_, &spec_, &shape_, &dynamic_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& input = ctx->input(0);
    bool fits = dynamic_ ? shape_.IsCompatibleWith(input.shape())
                         : shape_.IsIdenticalTo(input.shape());
    OP_REQUIRES_ASYNC(
        ctx, fits && input.dims() <= kMaxDynamicRank,
        absl::InvalidArgumentError(
            "tf_rdma send of tensor '" + spec_.tensor_name + "': shape " +
            input.shape().DebugString() + " does not match the planned " +
            shape_.DebugString()),
        done);
    Engine* engine = Engine::Get();
    SendTicket ticket;
    SendSlot* slot = slot_.load(std::memory_order_acquire);
    const bool known = slot != nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, ToTf(engine->ClaimSend(spec_, &ticket, CallOf(ctx), &slot)),
        done);
    if (!known) slot_.store(slot, std::memory_order_release);
    DynamicMeta meta;
    if (dynamic_) {
      meta.nbytes = input.tensor_data().size();
      meta.rank = input.dims();
      for (int i = 0; i < input.dims(); ++i) meta.dims[i] = input.dim_size(i);
    }
    const void* data = input.tensor_data().data();
    Status now;
    const uint64_t nbytes = dynamic_ ? meta.nbytes : spec_.nbytes;
    if (dynamic_ ? engine->TrySendDynamicNow(&ticket, data, meta, &now)
                 : engine->TrySendNow(&ticket, data, &now)) {
      TraceOp(trace::kSend, spec_, ticket.traced_since, ticket.step,
              ticket.call, nbytes);
      OP_REQUIRES_OK_ASYNC(ctx, ForCoordinator(spec_, ToTf(now)), done);
      done();
      // An answer often follows a send: wait for it on this thread, which
      // then goes on to run what the answer unblocks (engine/poller.cc).
      engine->HelpRecvs();
      return;
    }
    // `keep` holds the input buffer until the write is done, and no
    // longer: the engine thread keeps this closure a while after done()
    // (see the collective op's callback, collective_ops.cc).
    Tensor keep = input;
    bool dynamic = dynamic_;
    tensorflow::CancellationToken token = WatchCancellation(ctx, &ticket);
    engine->Schedule(
        [this, ctx, done, ticket, keep, meta, dynamic, engine, nbytes,
         token]() mutable {
          const void* data = keep.tensor_data().data();
          Status s = dynamic ? engine->FinishSendDynamic(ticket, data, meta)
                             : engine->FinishSend(ticket, data);
          StopWatching(ctx, token);
          TraceOp(trace::kSend, spec_, ticket.traced_since, ticket.step,
                  ticket.call, nbytes);
          ctx->SetStatus(ForCoordinator(spec_, ToTf(s)));
          keep = Tensor();
          done();
        });
  }

 private:
  DataType dtype_;
  SlotSpec spec_;
  tensorflow::PartialTensorShape shape_;
  bool dynamic_ = false;
  // The engine's slot for spec_ once a call has claimed it (ClaimSend's
  // `known`); calls of the kernel may run at once.
  std::atomic<SendSlot*> slot_{nullptr};
};

class RecvOp : public AsyncOpKernel {
 public:
  explicit RecvOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
    OP_REQUIRES_OK(ctx, ReadSpec(ctx, dtype_, &spec_, &shape_, &dynamic_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Engine* engine = Engine::Get();
    RecvTicket ticket;
    RecvSlot* slot = slot_.load(std::memory_order_acquire);
    const bool known = slot != nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, ToTf(engine->ClaimRecv(spec_, &ticket, CallOf(ctx), &slot)),
        done);
    if (!known) slot_.store(slot, std::memory_order_release);
    if (engine->PollRecv(&ticket)) {
      Emit(ctx, ticket);
      done();
      return;
    }
    tensorflow::CancellationToken token = WatchCancellation(ctx, &ticket);
    engine->WaitRecvAsync(
        ticket,
        [this, ctx, done, token](const Status& s, const RecvTicket& t) {
          StopWatching(ctx, token);
          if (s.ok()) {
            Emit(ctx, t);
          } else {
            TraceOp(trace::kRecv, spec_, t.traced_since, t.step, t.call,
                    spec_.nbytes);
            ctx->SetStatus(ForCoordinator(spec_, ToTf(s)));
          }
          done();
        });
  }

 private:
  // Hands the slot (or, for a dynamic slot, the payload its meta points
  // at) to TensorFlow as the output; on a bad meta the copy is released.
  void Emit(OpKernelContext* ctx, RecvTicket ticket) {
    TensorShape shape;
    uint64_t nbytes = spec_.nbytes;
    if (!dynamic_) {
      shape_.AsTensorShape(&shape);
    } else {
      DynamicMeta meta;
      Status s = Engine::Get()->ResolveDynamic(&ticket, &meta);
      absl::Status shaped = ToTf(s);
      if (shaped.ok()) {
        shaped = TensorShape::BuildTensorShape(
            absl::Span<const int64_t>(meta.dims, meta.rank), &shape);
      }
      if (shaped.ok() && (!shape_.IsCompatibleWith(shape) ||
                          shape.num_elements() *
                                  tensorflow::DataTypeSize(dtype_) !=
                              static_cast<int64_t>(meta.nbytes))) {
        shaped = absl::InvalidArgumentError(
            "tf_rdma recv of tensor '" + spec_.tensor_name + "': the sender "
            "wrote shape " + shape.DebugString() + " and " +
            std::to_string(meta.nbytes) + " bytes, which does not fit the "
            "planned " + shape_.DebugString() + " of " +
            tensorflow::DataTypeString(dtype_));
      }
      if (!shaped.ok()) {
        Engine::Get()->Release(ticket);
        TraceOp(trace::kRecv, spec_, ticket.traced_since, ticket.step,
                ticket.call, spec_.nbytes);
        ctx->SetStatus(shaped);
        return;
      }
      nbytes = meta.nbytes;
    }
    TraceOp(trace::kRecv, spec_, ticket.traced_since, ticket.step,
            ticket.call, nbytes);
    auto* buffer = new SlotBuffer(ticket, nbytes);
    Tensor out(dtype_, shape, buffer);
    buffer->Unref();  // `out` holds the reference now
    ctx->set_output(0, out);
  }

  DataType dtype_;
  SlotSpec spec_;
  tensorflow::PartialTensorShape shape_;
  bool dynamic_ = false;
  std::atomic<RecvSlot*> slot_{nullptr};  // as SendOp's
};

}  // namespace

REGISTER_OP("TfRdmaSend")
    .Input("tensor: T")
    .Attr("T: " TF_RDMA_TYPES)
    TF_RDMA_SLOT_ATTRS
    .SetIsStateful()
    // Its Unavailable (a dead peer) reaches the caller as Unavailable, not
    // turned into Internal as a non-communication op's would be: a
    // ClusterCoordinator tells worker from ps failures by it
    // (docs/reliability.md).
    .SetIsDistributedCommunication()
    .SetShapeFn([](InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle planned, merged;
      TF_RETURN_IF_ERROR(PlannedShape(c, &planned));
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), planned, &merged));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Writes `tensor` into its planned slot in the peer task's region (one-sided
write, then the step's sequence number as the notice). With `dynamic`, the
shape may have unknown dims: the bytes go to a payload area that grows on
demand and the slot carries the shape. Waits, without holding
an inter-op thread, for the slot copy to be free (a credit from the receiver)
when `depth` steps are in flight. Fails with DeadlineExceeded after
`timeout_ms` (or TF_RDMA_TIMEOUT), with Unavailable if the peer went away.
With `match_calls`, the write carries the call's step id and only the recv
of the same call takes it, so calls may overlap; without it, the n-th send
pairs with the peer's n-th recv.
)doc");

REGISTER_OP("TfRdmaRecv")
    .Output("tensor: dtype")
    .Attr("dtype: " TF_RDMA_TYPES)
    TF_RDMA_SLOT_ATTRS
    .SetIsStateful()
    .SetIsDistributedCommunication()  // as TfRdmaSend's
    .SetShapeFn([](InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle planned;
      TF_RETURN_IF_ERROR(PlannedShape(c, &planned));
      c->set_output(0, planned);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Returns the tensor the peer task wrote into this slot for the current step,
without copying it: the output aliases the slot (or, with `dynamic`, the
payload area the slot points at), which goes back to the sender as a credit
when the last reference to the output is dropped.
)doc");

REGISTER_KERNEL_BUILDER(Name("TfRdmaSend").Device(tensorflow::DEVICE_CPU),
                        SendOp);
REGISTER_KERNEL_BUILDER(Name("TfRdmaRecv").Device(tensorflow::DEVICE_CPU),
                        RecvOp);

}  // namespace tf_rdma
