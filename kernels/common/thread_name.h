// Names for tf_rdma's own threads.
//
// A thread started with std::thread inherits the name of the thread that
// started it: a TensorFlow op thread ("tf_Compute") or the interpreter
// ("python"). `top -H`, `perf`, `gdb` and /proc/<pid>/task/*/comm then
// cannot tell tf_rdma's threads from TensorFlow's. Every thread tf_rdma
// starts names itself first, "tfrdma-<role>" (docs/observability.md,
// "Threads", lists the roles).
#ifndef TF_RDMA_COMMON_THREAD_NAME_H_
#define TF_RDMA_COMMON_THREAD_NAME_H_

#include <pthread.h>

namespace tf_rdma {

// Names the calling thread. Linux keeps at most 15 characters; a longer
// name is refused by the kernel and the thread keeps its old one.
inline void NameThisThread(const char* name) {
  pthread_setname_np(pthread_self(), name);
}

}  // namespace tf_rdma

#endif  // TF_RDMA_COMMON_THREAD_NAME_H_
