// Collectives on the engine: allreduce, broadcast, reduce and allgather
// among a group of tasks, by five algorithms (lp, ring, tree, rhd and
// oneshot, the latency path for small messages).
//
// The algorithms see only the engine's write/wait interface. Every transfer
// between two ranks goes through a *channel*: one engine slot in the
// receiver's memory, named after the collective instance and the two ranks,
// with `depth` copies of one block. Sending block k is one step on the slot
// (a one-sided write with its notice); receiving it is waiting for the notice
// and reading the block where it landed (a reduction reads it there, no
// staging copy); releasing it hands the copy back to the sender as a credit.
// So a channel is a bounded FIFO of blocks with flow control for free, on
// shm, tcp and (later) verbs alike, and both ends only have to agree on the
// order and the sizes of the blocks, which follow from the schedule.
//
// A collective runs in place on one buffer of the caller's (the op's output),
// sequentially, on an engine thread (a small oneshot call whose peers are
// there completes on the op's own thread: StartCollective, the inline path
// in collective.cc); waits are bounded by the timeout, and a
// failure names the collective, its instance, the algorithm, the rank and the
// peer. After a failure the instance is poisoned: its channels' step counters
// can no longer be trusted, so later calls fail at once with the first error.
#ifndef TF_RDMA_ENGINE_COLLECTIVE_H_
#define TF_RDMA_ENGINE_COLLECTIVE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/common/status.h"

namespace tf_rdma {

enum class CollectiveKind { kAllReduce, kBroadcast, kReduce, kAllGather };
enum class Algorithm { kLp, kRing, kTree, kRhd, kOneShot };

// The blocks of one channel, in flight at once, by default.
constexpr int64_t kDefaultChannelDepth = 4;

// Spinning for a latency-bound collective's blocks.
//
// A rank that waits for a peer's block spins a few µs, then sleeps on the
// block's notice word; the peer's write wakes it. On a VM that wake-up
// costs tens of µs, more than a small collective's whole exchange: a 4 KiB
// allreduce of two ranks is a few µs of copying, and the rank that arrives
// first otherwise sleeps through its peer's arrival and pays a wake-up on
// every call (docs/benchmarks.md, "Small messages"). So a collective of at
// most this many bytes (per rank; an allgather's whole output) spins for
// its blocks for up to EngineConfig::collective_spin_us before it sleeps,
// as MPI's ranks do. Larger collectives keep the short spin: their waits
// are for a peer's copy of a large block, which a wake-up barely adds to,
// and spinning through them measurably slowed a 64 MiB pipeline (2 ranks,
// 2 vCPUs). The budget is per wait, so a collective whose peer is late by
// more than it sleeps after burning one budget. The default ("auto") spins
// only where this host runs no more of the cluster's tasks than it has
// CPUs: where tasks share cores, a spinning rank takes the core its peer
// needs (4 ranks on 2 vCPUs took 2x as long with 500 µs spins).
constexpr uint64_t kLatencyBoundBytes = uint64_t{1} << 20;

struct CollectiveSpec {
  std::string instance;  // the call site's name; the same on every rank
  CollectiveKind kind = CollectiveKind::kAllReduce;
  Algorithm algorithm = Algorithm::kRing;
  std::string reduction = "sum";   // for messages and the hash
  std::string dtype;               // for messages and the hash
  std::vector<std::string> group;  // tasks in rank order
  int rank = 0;
  int root = 0;
  uint64_t count = 0;          // elements per rank (allgather: per piece)
  // false: the count may change from call to call (the channels are sized
  // by the block, not the message); the ranks agree on it another way
  // (TfRdmaAllGatherV exchanges it first).
  bool count_in_hash = true;
  uint64_t element_bytes = 1;
  uint64_t block_bytes = 1 << 20;  // rounded down to whole elements
  int64_t depth = kDefaultChannelDepth;
  int64_t timeout_ms = -1;         // < 0: the engine's default

  // Checks ranks, sizes and that group[rank] is this process's task.
  Status Validate(const std::string& own_task) const;
  // What every rank must agree on (the channels' plan hash): a rank that
  // disagrees gets a plan hash mismatch naming both, not wrong data.
  std::string Hash() const;
  // "allreduce 'grads/bucket0' (ring, rank 0 of 2)".
  std::string Describe() const;
  // Every field equal: a call of an instance with the spec of its last
  // admitted call (each call of a traced function after its first) needs
  // neither Validate nor Hash again. A new field must be compared there.
  bool SameAs(const CollectiveSpec& other) const;
};

const char* KindName(CollectiveKind kind);
const char* AlgorithmName(Algorithm algorithm);
bool ParseKind(const std::string& name, CollectiveKind* out);
bool ParseAlgorithm(const std::string& name, Algorithm* out);

// dst[i] = a[i] (op) b[i] for i < count elements; dst may be a.
using ReduceFn = std::function<void(void* dst, const void* a, const void* b,
                                    uint64_t count)>;

// Runs the collective into `buf`: count * element_bytes bytes, or for
// allgather group.size() pieces of that.
//   allreduce, reduce: out of place — this rank's data is read from `src`
//     (which may be `buf`: in place), and each range of `buf` is written
//     before it is read, so `buf` needs no initial contents. For reduce only
//     the root's `buf` holds the result afterwards.
//   broadcast, allgather: in place — the root's data (allgather: this rank's
//     piece) must already be in `buf`; `src` is not read.
// Out of place saves a copy of the input: the first step that touches a
// range reads the input where it is, then works in the buffer.
// Blocks the calling thread; every wait is bounded.
Status RunCollective(const CollectiveSpec& spec, const uint8_t* src,
                     uint8_t* buf, const ReduceFn& reduce);

// A piece of this rank's input for an allreduce or reduce of a bucket: a
// tensor where it is, at its byte offset in the collective's buffer.
struct InputPiece {
  uint64_t offset = 0;
  const uint8_t* data = nullptr;
  uint64_t bytes = 0;
};

// The same without holding the calling thread in a wait: `done` is called
// once with the outcome, on this thread if the call completes without
// waiting (a oneshot collective of one block whose peers are there: the
// inline path, collective.cc), else on an engine thread. `src` and `buf`
// must stay valid until then. An allreduce or reduce may take its input
// as `pieces` instead of `src` (null): sorted by offset, not overlapping,
// the bytes between them reading as zeros; each block is read where its
// piece lies (a block across pieces is gathered first), so a bucket of
// tensors needs no copy into one buffer first.
using CollectiveDone = std::function<void(const Status&)>;
void StartCollective(const CollectiveSpec& spec, const uint8_t* src,
                     uint8_t* buf, const ReduceFn& reduce,
                     CollectiveDone done,
                     std::vector<InputPiece> pieces = {});

}  // namespace tf_rdma

#endif  // TF_RDMA_ENGINE_COLLECTIVE_H_
