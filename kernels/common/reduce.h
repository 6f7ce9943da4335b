// The element-wise reductions of the collectives: dst[i] = a[i] (op) b[i].
// Shared by the collective ops (every dtype) and the engine's C loop for
// the benchmarks (c_api.cc, floats), so that both reduce with the same
// vector code.
#ifndef TF_RDMA_COMMON_REDUCE_H_
#define TF_RDMA_COMMON_REDUCE_H_

#include <cstdint>

namespace tf_rdma {

template <typename T>
struct SumOp {
  T operator()(T a, T b) const { return a + b; }
};
template <typename T>
struct ProdOp {
  T operator()(T a, T b) const { return a * b; }
};
template <typename T>
struct MinOp {
  T operator()(T a, T b) const { return b < a ? b : a; }
};
template <typename T>
struct MaxOp {
  T operator()(T a, T b) const { return a < b ? b : a; }
};

// The reductions run over every byte a collective reduces, so they must be
// vector code. GCC at -O2 vectorizes a loop only if no scalar remainder and
// no run-time alias check are needed ("very cheap" cost model), which left
// these loops one element per instruction: ReduceInto was 34% of the CPU
// time of a 64 MiB ring allreduce (perf, 2 ranks, 2026-12-06). The dynamic
// cost model vectorizes them, with a check that `dst` and `a` (the same
// buffer for an in-place sum) do not overlap otherwise. Element-wise, so
// the results are the scalar loop's, bit for bit.
#if defined(__GNUC__) && !defined(__clang__)
#define TF_RDMA_VECTORIZE \
  __attribute__((optimize("tree-vectorize", "vect-cost-model=dynamic")))
#else
#define TF_RDMA_VECTORIZE
#endif

template <typename T, template <typename> class Op>
TF_RDMA_VECTORIZE void ReduceInto(void* dst, const void* a, const void* b,
                                  uint64_t count) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* __restrict y = static_cast<const T*>(b);
  Op<T> op;
  for (uint64_t i = 0; i < count; ++i) d[i] = op(x[i], y[i]);
}

}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_REDUCE_H_
