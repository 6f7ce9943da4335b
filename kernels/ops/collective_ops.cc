// TfRdmaCollective: allreduce, broadcast, reduce and allgather over the
// engine's channels (kernels/engine/collective.h).
//
// One op takes a list of tensors of one dtype — a gradient bucket — and lays
// them out at fixed 64-byte-aligned offsets in one buffer, runs the
// collective on that buffer in place and returns the tensors as slices of
// it (no copy out). A single tensor whose buffer TensorFlow can hand over is
// reduced in place (no copy in either). The op is asynchronous: a
// collective that must wait for a peer waits on an engine thread, so
// TensorFlow's threads never block on a peer, and each bucket's op starts
// as soon as its inputs exist; a small oneshot collective whose peers are
// there completes on the op's thread (StartCollective).
#include <complex>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include "kernels/common/reduce.h"
#include "kernels/engine/collective.h"
#include "kernels/engine/engine.h"
#include "kernels/ops/tf_status.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/bfloat16.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

// The dtypes a collective takes: the planned transfers' (send_recv_ops.cc)
// but bool, which has no sum. tf_rdma/collectives checks the same list
// (tests/test_constants.py holds the copies together).
#define TF_RDMA_COLLECTIVE_TYPES                                           \
  "{half, bfloat16, float, double, int8, int16, int32, int64, uint8, "     \
  "uint16, uint32, uint64, complex64, complex128}"

namespace tf_rdma {
namespace {

using tensorflow::AsyncOpKernel;
using tensorflow::DataType;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::shape_inference::InferenceContext;

REGISTER_OP("TfRdmaCollective")
    .Input("inputs: N * T")
    .Output("outputs: N * T")
    .Attr("T: " TF_RDMA_COLLECTIVE_TYPES)
    .Attr("N: int >= 1")
    .Attr("kind: {'allreduce', 'broadcast', 'reduce', 'allgather'}")
    .Attr("reduction: {'sum', 'mean', 'min', 'max', 'prod'} = 'sum'")
    .Attr("algorithm: {'lp', 'ring', 'tree', 'rhd', 'oneshot'}")
    .Attr("group: list(string)")
    .Attr("rank: int >= 0")
    .Attr("root: int >= 0 = 0")
    .Attr("instance: string")
    .Attr("block_bytes: int >= 1")
    .Attr("depth: int >= 1 = 4")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      std::string kind;
      TF_RETURN_IF_ERROR(c->GetAttr("kind", &kind));
      if (kind != "allgather") {
        for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
        return absl::OkStatus();
      }
      if (c->num_inputs() != 1) {
        return absl::InvalidArgumentError(
            "allgather takes one tensor, got " +
            std::to_string(c->num_inputs()));
      }
      std::vector<std::string> group;
      TF_RETURN_IF_ERROR(c->GetAttr("group", &group));
      tensorflow::shape_inference::ShapeHandle in = c->input(0);
      if (!c->RankKnown(in)) {
        c->set_output(0, c->UnknownShape());
        return absl::OkStatus();
      }
      if (c->Rank(in) == 0) {
        return absl::InvalidArgumentError(
            "allgather concatenates along axis 0; a scalar has none");
      }
      tensorflow::shape_inference::DimensionHandle first;
      TF_RETURN_IF_ERROR(c->Multiply(c->Dim(in, 0),
                                     static_cast<int64_t>(group.size()),
                                     &first));
      tensorflow::shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, first, &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(R"doc(
A collective among the tasks of `group` (rank order) through tf_rdma.

kind: allreduce, broadcast (from `root`), reduce (to `root`; the other ranks
  get their inputs back) or allgather (concatenation along axis 0).
algorithm: lp (pipelined chain), ring, tree (binomial) or rhd (recursive
  halving and doubling); see kernels/engine/collective.cc.
instance: names this collective; the same on every rank, distinct for
  collectives that may run concurrently.
block_bytes: the pipelining unit. depth: blocks in flight per channel.
)doc");

template <typename T>
TF_RDMA_VECTORIZE void DivideBy(void* buf, uint64_t count, int divisor) {
  T* d = static_cast<T*>(buf);
  const T by = static_cast<T>(divisor);
  for (uint64_t i = 0; i < count; ++i) d[i] = d[i] / by;
}

// The reduction of `reduction` for T, and the mean's division.
template <typename T, bool kOrdered>
absl::Status Reducers(const std::string& reduction, ReduceFn* reduce,
                      std::function<void(void*, uint64_t, int)>* divide) {
  *divide = DivideBy<T>;
  if (reduction == "sum" || reduction == "mean") {
    *reduce = ReduceInto<T, SumOp>;
  } else if (reduction == "prod") {
    *reduce = ReduceInto<T, ProdOp>;
  } else if constexpr (kOrdered) {
    *reduce = reduction == "min" ? ReduceInto<T, MinOp> : ReduceInto<T, MaxOp>;
  } else {
    return absl::InvalidArgumentError(
        "reduction '" + reduction +
        "' needs ordered values; complex numbers have no order (use sum, "
        "mean or prod)");
  }
  return absl::OkStatus();
}

absl::Status ReducersFor(DataType dtype, const std::string& reduction,
                         ReduceFn* reduce,
                         std::function<void(void*, uint64_t, int)>* divide) {
  switch (dtype) {
#define TF_RDMA_CASE(DT, T) \
  case tensorflow::DT:      \
    return Reducers<T, true>(reduction, reduce, divide);
    TF_RDMA_CASE(DT_HALF, Eigen::half)
    TF_RDMA_CASE(DT_BFLOAT16, tensorflow::bfloat16)
    TF_RDMA_CASE(DT_FLOAT, float)
    TF_RDMA_CASE(DT_DOUBLE, double)
    TF_RDMA_CASE(DT_INT8, int8_t)
    TF_RDMA_CASE(DT_INT16, int16_t)
    TF_RDMA_CASE(DT_INT32, int32_t)
    TF_RDMA_CASE(DT_INT64, int64_t)
    TF_RDMA_CASE(DT_UINT8, uint8_t)
    TF_RDMA_CASE(DT_UINT16, uint16_t)
    TF_RDMA_CASE(DT_UINT32, uint32_t)
    TF_RDMA_CASE(DT_UINT64, uint64_t)
#undef TF_RDMA_CASE
    case tensorflow::DT_COMPLEX64:
      return Reducers<std::complex<float>, false>(reduction, reduce, divide);
    case tensorflow::DT_COMPLEX128:
      return Reducers<std::complex<double>, false>(reduction, reduce, divide);
    default:
      return absl::InvalidArgumentError(
          "tf_rdma collectives do not take " +
          tensorflow::DataTypeString(dtype));
  }
}

// Result memory that stays mapped: TensorFlow's CPU allocator hands large
// tensors to malloc, which maps fresh pages for each and unmaps them on
// free, so every call would fault its result in again (measured on the
// 2-vCPU VM: 64 MiB of first touches ~130 ms, ten times the memcpy). The
// pool keeps a few freed buffers per op and size; a buffer goes back when
// the last tensor aliasing it is dropped, so a step that still holds the
// previous step's result simply gets another one.
class BufferPool {
 public:
  ~BufferPool() {
    for (auto& entry : free_) std::free(entry.second);
  }
  void* Take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->first == bytes) {
          void* p = it->second;
          free_.erase(it);
          return p;
        }
      }
    }
    return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  }
  void Give(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < kKeep) {
      free_.emplace_back(bytes, p);
    } else {
      std::free(p);
    }
  }

 private:
  static constexpr size_t kKeep = 4;
  std::mutex mu_;
  std::vector<std::pair<size_t, void*>> free_;
};

class PooledBuffer : public tensorflow::TensorBuffer {
 public:
  PooledBuffer(std::shared_ptr<BufferPool> pool, void* data, size_t bytes,
               size_t capacity)
      : tensorflow::TensorBuffer(data),
        pool_(std::move(pool)),
        bytes_(bytes),
        capacity_(capacity) {}
  ~PooledBuffer() override { pool_->Give(data(), capacity_); }
  size_t size() const override { return bytes_; }
  tensorflow::TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(
      tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(bytes_);
    proto->set_allocated_bytes(bytes_);
    proto->set_allocator_name("tf_rdma_collective");
  }
  bool OwnsMemory() const override { return true; }

 private:
  std::shared_ptr<BufferPool> pool_;
  size_t bytes_;
  size_t capacity_;
};

// A bucket of an allreduce or reduce of at least this many bytes is read
// where its tensors are (input pieces, collective.h) instead of being copied
// into one buffer first: that copy is one more pass over all of a training
// step's gradient bytes, while reserving the pieces' address range costs a
// few µs, more than copying a small bucket.
constexpr uint64_t kPiecesFromBytes = uint64_t{256} << 10;

// Elements between buffers of a bucket, so that each starts 64-byte aligned.
int64_t AlignedElements(int64_t elements, int64_t element_bytes) {
  int64_t unit = std::max<int64_t>(1, 64 / element_bytes);
  return (elements + unit - 1) / unit * unit;
}

// Reads the attributes TfRdmaCollective and TfRdmaAllGatherV share.
absl::Status ReadCommonAttrs(OpKernelConstruction* ctx, DataType* dtype,
                             CollectiveSpec* spec) {
  std::string algorithm;
  int64_t block_bytes = 0;
  TF_RETURN_IF_ERROR(ctx->GetAttr("T", dtype));
  TF_RETURN_IF_ERROR(ctx->GetAttr("algorithm", &algorithm));
  TF_RETURN_IF_ERROR(ctx->GetAttr("group", &spec->group));
  TF_RETURN_IF_ERROR(ctx->GetAttr("rank", &spec->rank));
  TF_RETURN_IF_ERROR(ctx->GetAttr("instance", &spec->instance));
  TF_RETURN_IF_ERROR(ctx->GetAttr("block_bytes", &block_bytes));
  TF_RETURN_IF_ERROR(ctx->GetAttr("depth", &spec->depth));
  TF_RETURN_IF_ERROR(ctx->GetAttr("timeout_ms", &spec->timeout_ms));
  ParseAlgorithm(algorithm, &spec->algorithm);
  spec->dtype = tensorflow::DataTypeString(*dtype);
  spec->element_bytes = tensorflow::DataTypeSize(*dtype);
  spec->block_bytes = static_cast<uint64_t>(block_bytes);
  if (spec->rank >= static_cast<int>(spec->group.size())) {
    return absl::InvalidArgumentError(
        "rank " + std::to_string(spec->rank) + " is not in a group of " +
        std::to_string(spec->group.size()));
  }
  return absl::OkStatus();
}

class CollectiveOp : public AsyncOpKernel {
 public:
  explicit CollectiveOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    std::string kind;
    OP_REQUIRES_OK(ctx, ReadCommonAttrs(ctx, &dtype_, &spec_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kind", &kind));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("reduction", &spec_.reduction));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("root", &spec_.root));
    ParseKind(kind, &spec_.kind);
    OP_REQUIRES(ctx, spec_.root < static_cast<int>(spec_.group.size()),
                absl::InvalidArgumentError(
                    "root " + std::to_string(spec_.root) +
                    " is not in a group of " +
                    std::to_string(spec_.group.size())));
    OP_REQUIRES_OK(ctx,
                   ReducersFor(dtype_, spec_.reduction, &reduce_, &divide_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const int n = ctx->num_inputs();
    const int64_t eb = spec_.element_bytes;
    const bool is_root = spec_.rank == spec_.root;
    const bool out_of_place = spec_.kind == CollectiveKind::kAllReduce ||
                              spec_.kind == CollectiveKind::kReduce;
    // The buffer the collective writes, how many elements it holds, and
    // where this rank's data is read from (the input itself where the
    // collective works out of place, see RunCollective).
    Tensor buffer, source;
    bool reads_input = false;
    int64_t elements = 0;
    // A large bucket of an allreduce or reduce: its tensors are read where
    // they are (StartCollective's input pieces), not copied into the
    // buffer first; `inputs` keeps them alive until the collective is done.
    std::vector<InputPiece> pieces;
    std::vector<Tensor> inputs;
    if (spec_.kind == CollectiveKind::kAllGather) {
      const Tensor& in = ctx->input(0);
      OP_REQUIRES_ASYNC(ctx, in.dims() >= 1,
                        absl::InvalidArgumentError(
                            "allgather concatenates along axis 0; a scalar "
                            "has none"),
                        done);
      TensorShape shape = in.shape();
      shape.set_dim(0, shape.dim_size(0) * spec_.group.size());
      buffer = Pooled(shape);
      ctx->set_output(0, buffer);
      elements = in.NumElements();
      std::memcpy(static_cast<char*>(buffer.data()) +
                      spec_.rank * elements * eb,
                  in.data(), elements * eb);
    } else if (n == 1) {
      // One tensor: in place in the input's own buffer if TensorFlow can
      // hand it over, else into a pooled buffer, reading the input there.
      const Tensor& in = ctx->input(0);
      elements = in.NumElements();
      Tensor* out = nullptr;
      if (spec_.kind == CollectiveKind::kReduce && !is_root) {
        buffer = Pooled(in.shape());  // scratch; the output is the input
        source = in;
        reads_input = true;
        ctx->set_output(0, in);
      } else if (ctx->forward_input_to_output_with_shape(0, 0, in.shape(),
                                                          &out)) {
        buffer = *out;
      } else {
        buffer = Pooled(in.shape());
        ctx->set_output(0, buffer);
        if (out_of_place) {
          source = in;
          reads_input = true;
        } else if (is_root) {
          std::memcpy(buffer.data(), in.data(), in.TotalBytes());
        }
      }
    } else {
      // A bucket: the tensors at fixed aligned offsets of one buffer, the
      // outputs slices of it (a non-root reduce gives its inputs back).
      std::vector<int64_t> offsets(n);
      for (int i = 0; i < n; ++i) {
        offsets[i] = elements;
        elements += AlignedElements(ctx->input(i).NumElements(), eb);
      }
      buffer = Pooled(TensorShape({elements}));
      char* base = static_cast<char*>(buffer.data());
      const bool in_pieces =
          out_of_place &&
          static_cast<uint64_t>(elements * eb) >= kPiecesFromBytes;
      for (int i = 0; i < n; ++i) {
        const Tensor& in = ctx->input(i);
        int64_t end = i + 1 < n ? offsets[i + 1] : elements;
        if (in_pieces) {
          if (in.TotalBytes() > 0) {
            pieces.push_back(InputPiece{
                static_cast<uint64_t>(offsets[i] * eb),
                static_cast<const uint8_t*>(in.data()), in.TotalBytes()});
          }
          inputs.push_back(in);
        } else {
          std::memcpy(base + offsets[i] * eb, in.data(), in.TotalBytes());
          std::memset(base + offsets[i] * eb + in.TotalBytes(), 0,
                      (end - offsets[i]) * eb - in.TotalBytes());
        }
        if (spec_.kind == CollectiveKind::kReduce && !is_root) {
          ctx->set_output(i, in);
          continue;
        }
        Tensor out;
        OP_REQUIRES_ASYNC(
            ctx,
            out.CopyFrom(buffer.Slice(offsets[i],
                                      offsets[i] + in.NumElements()),
                         in.shape()),
            absl::InternalError("cannot shape a bucket slice"), done);
        ctx->set_output(i, out);
      }
    }
    if (!reads_input) source = buffer;
    CollectiveSpec spec = spec_;
    spec.count = static_cast<uint64_t>(elements);
    bool divide = spec_.reduction == "mean" &&
                  (spec_.kind == CollectiveKind::kAllReduce ||
                   (spec_.kind == CollectiveKind::kReduce && is_root));
    uint8_t* data = static_cast<uint8_t*>(const_cast<void*>(buffer.data()));
    const int size = static_cast<int>(spec.group.size());
    const bool has_pieces = !pieces.empty();
    // On this thread if the call needs no wait, else on an engine thread
    // (StartCollective); the tensors stay referenced until then, and no
    // longer. The engine thread keeps this callback a while after it
    // returns, and the caller that done() wakes often runs first (a task
    // bound to one CPU): a reference still held here then makes the next
    // call's Pooled() find its buffer taken and use another one, so the
    // calls alternate between two result buffers, twice the memory a
    // large result moves through the caches (a 64 MiB ring allreduce of
    // two bound ranks took 11 instead of 9.5 ms in the engine).
    StartCollective(
        spec,
        has_pieces ? nullptr : static_cast<const uint8_t*>(source.data()),
        data, reduce_,
        [this, ctx, done, buffer, source, inputs, divide, data,
         count = spec.count, size](const Status& s) mutable {
          if (s.ok() && divide) divide_(data, count, size);
          ctx->SetStatus(ToTf(s));
          buffer = Tensor();
          source = Tensor();
          inputs.clear();
          done();
        },
        std::move(pieces));
  }

 private:
  Tensor Pooled(const TensorShape& shape) {
    size_t bytes = shape.num_elements() * spec_.element_bytes;
    size_t capacity = std::max<size_t>(bytes, 64);
    auto* buffer =
        new PooledBuffer(pool_, pool_->Take(capacity), bytes, capacity);
    Tensor t(dtype_, shape, buffer);
    buffer->Unref();  // `t` holds the reference now
    return t;
  }

  std::shared_ptr<BufferPool> pool_ = std::make_shared<BufferPool>();
  DataType dtype_;
  CollectiveSpec spec_;
  ReduceFn reduce_;
  std::function<void(void*, uint64_t, int)> divide_;
};

REGISTER_KERNEL_BUILDER(Name("TfRdmaCollective").Device(tensorflow::DEVICE_CPU),
                        CollectiveOp);

// TfRdmaAllGatherV: an allgather of tensors whose first dimension differs
// from rank to rank (the rows of a sparse gradient: each worker's batch
// touches its own rows of an embedding table).
//
// What: rank r holds rows_r rows of one row shape; every rank gets the
// sum of rows_r rows, concatenated in rank order (tf.concat of every rank's
// tensor), which is what MultiWorkerMirroredStrategy's all-gather of
// IndexedSlices returns.
// How: two allgathers on the engine (kernels/engine/collective.cc). First a
// header per rank (rows, elements per row, dtype: three int64), so that
// every rank learns the largest row count m, and a rank whose row shape or
// dtype differs fails on every rank with both values instead of hanging or
// mixing bytes. Then the rows, each rank's padded to m, as one allgather of
// m rows per rank; the output keeps each rank's real rows.
// Why padded: the algorithms cut a message into P equal pieces (ring, rhd)
// or pass whole pieces down a chain or tree; padding reuses them as they
// are. Their channels are sized by the block, not by the message, so m may
// change from call to call without new memory (the payload's hash leaves the
// count out; the header exchange is what makes the ranks agree on it).
// Cost: one small header allgather per call (latency-bound, a few alpha),
// and P*m rows moved instead of the sum of rows_r; workers with batches of
// one size pad little.
REGISTER_OP("TfRdmaAllGatherV")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: " TF_RDMA_COLLECTIVE_TYPES)
    .Attr("algorithm: {'lp', 'ring', 'tree', 'rhd', 'oneshot'}")
    .Attr("group: list(string)")
    .Attr("rank: int >= 0")
    .Attr("instance: string")
    .Attr("block_bytes: int >= 1")
    .Attr("depth: int >= 1 = 4")
    .Attr("timeout_ms: int = -1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle in = c->input(0);
      if (!c->RankKnown(in)) {
        c->set_output(0, c->UnknownShape());
        return absl::OkStatus();
      }
      if (c->Rank(in) == 0) {
        return absl::InvalidArgumentError(
            "allgatherv concatenates along axis 0; a scalar has none");
      }
      tensorflow::shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Concatenates along axis 0 the tensors of every rank of `group`, in rank
order; their first dimensions may differ, the rest and the dtype must agree
(else every rank fails with both values). See TfRdmaCollective for the
other attributes; the collective uses the instances `instance`#header and
`instance`#rows.
)doc");

class AllGatherVOp : public AsyncOpKernel {
 public:
  explicit AllGatherVOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadCommonAttrs(ctx, &dtype_, &spec_));
    spec_.kind = CollectiveKind::kAllGather;
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& in = ctx->input(0);
    OP_REQUIRES_ASYNC(ctx, in.dims() >= 1,
                      absl::InvalidArgumentError(
                          "allgatherv concatenates along axis 0; a scalar "
                          "has none"),
                      done);
    Tensor keep = in;  // until the gather is done, as the callback above
    Engine::Get()->Schedule([this, ctx, done, keep]() mutable {
      ctx->SetStatus(ToTf(Gather(ctx, keep)));
      keep = Tensor();
      done();
    });
  }

 private:
  static constexpr int kHeaderWords = 3;  // rows, elements per row, dtype

  Status Gather(OpKernelContext* ctx, const Tensor& in) {
    const int size = static_cast<int>(spec_.group.size());
    const uint64_t eb = spec_.element_bytes;
    int64_t row_elements = 1;
    for (int d = 1; d < in.dims(); ++d) row_elements *= in.dim_size(d);
    const int64_t rows = in.dim_size(0);

    // 1. Every rank's header.
    std::vector<int64_t> headers(kHeaderWords * size, 0);
    int64_t* own = &headers[kHeaderWords * spec_.rank];
    own[0] = rows;
    own[1] = row_elements;
    own[2] = static_cast<int64_t>(dtype_);
    CollectiveSpec header = spec_;
    header.instance += "#header";
    header.dtype = "int64";
    header.element_bytes = 8;
    header.count = kHeaderWords;
    header.block_bytes = 8 * kHeaderWords * static_cast<uint64_t>(size);
    auto* words = reinterpret_cast<uint8_t*>(headers.data());
    TF_RDMA_RETURN_IF_ERROR(RunCollective(header, words, words, NoReduce()));
    int64_t most = 0;
    for (int r = 0; r < size; ++r) {
      const int64_t* h = &headers[kHeaderWords * r];
      if (h[1] != row_elements || h[2] != own[2] || h[0] < 0) {
        return InvalidArgument(
            "allgatherv '" + spec_.instance + "': rank " + std::to_string(r) +
            " (" + spec_.group[r] + ") gathers " + std::to_string(h[0]) +
            " rows of " + std::to_string(h[1]) + " elements of " +
            tensorflow::DataTypeString(static_cast<DataType>(h[2])) +
            ", rank " + std::to_string(spec_.rank) + " (" +
            spec_.group[spec_.rank] + ") " + std::to_string(rows) +
            " rows of " + std::to_string(row_elements) + " elements of " +
            spec_.dtype +
            ": every rank's rows must have the same shape and dtype");
      }
      most = std::max(most, h[0]);
    }

    // 2. The rows, padded to the most rows of any rank.
    const uint64_t piece = static_cast<uint64_t>(most * row_elements);
    Tensor padded;
    TF_RDMA_RETURN_IF_ERROR(Allocated(ctx->allocate_temp(
        dtype_, TensorShape({static_cast<int64_t>(piece) * size}), &padded)));
    auto* base = static_cast<uint8_t*>(const_cast<void*>(padded.data()));
    std::memcpy(base + spec_.rank * piece * eb, in.data(), in.TotalBytes());
    std::memset(base + spec_.rank * piece * eb + in.TotalBytes(), 0,
                piece * eb - in.TotalBytes());
    CollectiveSpec payload = spec_;
    payload.instance += "#rows";
    payload.count = piece;
    payload.count_in_hash = false;
    if (piece > 0) {
      TF_RDMA_RETURN_IF_ERROR(RunCollective(payload, base, base, NoReduce()));
    }

    // 3. Each rank's real rows, in rank order.
    int64_t total = 0;
    for (int r = 0; r < size; ++r) total += headers[kHeaderWords * r];
    TensorShape shape = in.shape();
    shape.set_dim(0, total);
    Tensor* out = nullptr;
    TF_RDMA_RETURN_IF_ERROR(Allocated(ctx->allocate_output(0, shape, &out)));
    auto* dst = static_cast<uint8_t*>(const_cast<void*>(out->data()));
    for (int r = 0; r < size; ++r) {
      uint64_t bytes = headers[kHeaderWords * r] * row_elements * eb;
      std::memcpy(dst, base + r * piece * eb, bytes);
      dst += bytes;
    }
    return Status::Ok();
  }

  static Status Allocated(const absl::Status& s) {
    return s.ok() ? Status::Ok()
                  : Internal("cannot allocate: " + std::string(s.message()));
  }

  static ReduceFn NoReduce() {
    return [](void*, const void*, const void*, uint64_t) {};
  }

  DataType dtype_;
  CollectiveSpec spec_;
};

REGISTER_KERNEL_BUILDER(Name("TfRdmaAllGatherV").Device(tensorflow::DEVICE_CPU),
                        AllGatherVOp);

}  // namespace
}  // namespace tf_rdma
