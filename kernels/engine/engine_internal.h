// The engine's internals, shared by the files that define its methods
// (kernels/engine/*.cc, one per job; engine.h says what each does): the
// state its threads share, the slot layout and step counting, and what more
// than one of those files uses. The ops see engine.h only.
#ifndef TF_RDMA_ENGINE_ENGINE_INTERNAL_H_
#define TF_RDMA_ENGINE_ENGINE_INTERNAL_H_

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/region.h"
#include "kernels/common/status.h"
#include "kernels/common/trace.h"
#include "kernels/common/wait.h"
#include "kernels/common/wire.h"
#include "kernels/engine/engine.h"
#include "kernels/transport/transport.h"

namespace tf_rdma {

// ---------------------------------------------------------------------------
// State shared by the threads of the engine.

struct Connection {
  int fd = -1;               // closed by the last holder (see CloseConnection)
  std::string peer;          // the peer's task
  std::string peer_address;  // where the socket goes, for messages
  std::string incarnation;   // the peer process's id (see "Restarted peers")
  bool dialed = false;       // true: we write data, the peer writes credits
  std::unique_ptr<Pair> pair;
  std::mutex send_mu;        // one frame at a time on fd
  // One taker of the pair's notices at a time (the progress thread, or the
  // read loop draining them when the socket closes): two could publish one
  // word's notices out of order.
  std::mutex notice_mu;

  std::mutex mu;  // guards the fields below
  std::condition_variable cv;
  bool dead = false;
  std::atomic<bool> gone{false};  // = dead, for lock-free checks
  Code dead_code = Code::kUnavailable;
  std::string dead_reason;
  bool said_goodbye = false;  // the peer stopped on purpose (kGoodbye)
  uint64_t next_request = 1;
  std::set<uint64_t> outstanding;  // requests waiting for their reply
  // Requests whose asker stopped waiting (its deadline passed): a late
  // reply to one is dropped, not taken as a protocol error (the newest
  // kMaxAbandonedRequests).
  std::set<uint64_t> abandoned;
  std::map<uint64_t, std::pair<FrameHeader, std::string>> replies;
  std::set<uint32_t> peer_writable;  // our region ids this peer may write
  // The reader thread's own: the current second of QUERY frames
  // (kMaxQueriesPerSecond).
  std::chrono::steady_clock::time_point query_second{};
  int queries_this_second = 0;

  ~Connection() {
    pair.reset();
    if (fd >= 0) close(fd);
  }
};

struct LocalRegion {
  uint32_t id = 0;
  std::string name;       // plan region name (credit regions: name + "#credit")
  std::string plan_hash;
  std::string peer;       // data: the writer; credit: the reader
  std::unique_ptr<Region> memory;
  // Data regions: the writer's connection and its credit region there, set
  // when the writer opens the region. Guarded by Engine::mu_.
  std::shared_ptr<Connection> writer;
  int credit_handle = -1;
  // Why a writer's OPEN of this region was refused (plan mismatch, the
  // writer restarted), so that the reader's waiting ops fail with the
  // reason instead of a timeout; later OPENs are refused with it too.
  std::string refusal;
  bool opened = false;  // a writer opened it (Engine::mu_)
  // The counters of the writer's peer and transport (stats.h), set with
  // `writer`; read lock-free by the recvs that count what they took.
  std::atomic<PeerCounters*> stats{nullptr};
  // The credits this side sent its writer, by credit line (line -> step),
  // sent again when the writer opens the region on a new connection (a
  // credit can be lost with the old one). Guarded by credit_mu, which is
  // held while a credit is written, so that no older value overtakes a
  // newer one; taken before Engine::mu_.
  std::mutex credit_mu;
  std::map<uint64_t, uint64_t> credits_sent;
  // Released (peers.cc, "Releasing a peer's regions"): its writer went
  // away, its name is gone from /dev/shm and from the endpoint's tables,
  // and its memory is unmapped once nothing can touch it (Engine::mu_).
  std::atomic<bool> retired{false};
  // Received tensors that alias this region now (SlotBuffer): it is not
  // unmapped while any does.
  std::atomic<int64_t> held{0};
};

// What the slots of a region, as this side has seen them, match by: calls
// (a rewritten function's), order (collectives, hand-written plans) or both.
// Only a region of matched-call slots alone is released when its peer goes
// (peers.cc). Kept by region name, for the life of the process.
enum RegionKind : int { kKindMatched = 1, kKindInOrder = 2 };

// A step that fails is given back (the next op on the slot retries the same
// step, so a late peer loses nothing) when it is the newest claim. If later
// steps were already claimed, the step order can no longer be kept: the slot
// is then poisoned and every later op on it fails with the first error.
struct StepCounter {
  uint64_t claimed = 0;  // last step handed out
  std::string poisoned;  // non-empty: why the slot can no longer be used
};

struct SendSlot {
  SlotSpec spec;
  std::mutex mu;
  StepCounter steps;
  // match_calls, under mu: per copy, the step last written into it and
  // whether a send is writing it now (AcquireCopy).
  std::vector<uint64_t> issued;
  std::vector<char> busy;
  // Set once by BindSendSlot (under mu), read lock-free after `bound`.
  std::atomic<bool> bound{false};
  // In order: the last step written (and so, over tcp, handed to the
  // socket), which an OPEN on a new connection tells the reader
  // (OpenSendRegion, "Connections that drop" in regions.cc).
  std::atomic<uint64_t> written{0};
  // The SendRegion::epoch it was bound in (under mu): a matched-call slot
  // bound in a newer one starts its copies' state again.
  uint64_t epoch = 0;
  std::shared_ptr<Connection> conn;
  int data_handle = -1;
  Region* credits = nullptr;
  uint32_t credits_id = 0;  // the credit region's id here, for OPEN requests
  PeerCounters* stats = nullptr;  // the peer's, for conn's transport
  // Dynamic slots: the current payload area (see kDynamicMetaBytes), under
  // dynamic_mu.
  std::mutex dynamic_mu;
  uint64_t generation = 0;
  uint64_t capacity = 0;
  int payload_handle = -1;
};

// Whether a send slot's `credits` may be read (caller holds slot.mu). A slot
// stays bound to a lost connection until its next send binds it again
// (BindSendSlot, which then names the loss), while the credit region of a
// matched-call region is unmapped a timeout after that connection ended
// (peers.cc, "Releasing a peer's regions"): past the loss, its words are
// not read.
inline bool CreditsMapped(const SendSlot& slot) {
  return slot.bound.load(std::memory_order_acquire) &&
         slot.credits != nullptr && slot.conn != nullptr &&
         !slot.conn->gone.load(std::memory_order_acquire);
}

// A peer's data region that this process writes into, and the credit region
// here that the peer writes back into: opened with one OPEN request, shared by
// every slot in it.
struct SendRegion {
  std::mutex mu;  // held while opening
  std::string peer;  // the reader
  // The credit region, created with the first OPEN and kept for retries
  // and reconnections (one per region, however often OPEN is refused).
  LocalRegion* credit_region = nullptr;
  std::mutex state_mu;  // guards open, conn and refusal (also Engine::mu_)
  bool open = false;
  std::shared_ptr<Connection> conn;
  // Non-empty: the reader restarted after this region was opened.
  std::string refusal;
  bool refusal_told = false;  // sent to the new reader (BindSendSlot)
  // Counts its openings on a new connection (under state_mu): the reader's
  // region of a matched-call plan is a fresh one each time (peers.cc).
  uint64_t epoch = 0;
  int data_handle = -1;
  Region* credits = nullptr;
  uint32_t credits_id = 0;
};

struct RecvSlot {
  SlotSpec spec;
  std::mutex mu;
  StepCounter steps;
  // Inline polls in a row that missed their data, and polls (PollRecv).
  std::atomic<int> poll_misses{0};
  std::atomic<uint32_t> polls{0};
  // Waits of this slot's recvs with the poller now (WaitRecvAsync until
  // TakePending): none while data lands means its recv has not started.
  std::atomic<int> waits{0};
  // match_calls, under mu (MatchRecv): per copy, the step last taken, and
  // the step first seen untaken with when it was seen; the calls whose
  // recv failed, whose copies are dropped when they land.
  std::vector<uint64_t> taken;
  std::vector<uint64_t> seen_step;
  std::vector<Clock::time_point> seen_at;
  std::deque<uint64_t> abandoned;
  // The region the state above belongs to: a recv of a fresh region
  // (peers.cc) starts that state again (MatchRecv).
  LocalRegion* matched_region = nullptr;
  // The slot's current region: set at the first claim, replaced (under
  // Engine::mu_) when a matched-call region is released and made afresh.
  std::atomic<LocalRegion*> region{nullptr};
};

// A wait the stall inspector watches (stall.cc): registered when an op
// begins to sleep for its data or its credit, or a send begins to connect,
// until the wait ends.
struct StallWait {
  static constexpr int kData = 0;    // a recv waiting for the sender's notice
  static constexpr int kCredit = 1;  // a send waiting for a copy's credit
  // A send connecting: dialling its peer, then opening its region there.
  static constexpr int kConnect = 2;
  int kind = kData;
  const SlotSpec* spec = nullptr;  // the slot's (slots live as long as the engine)
  RecvSlot* recv = nullptr;        // kData
  SendSlot* send = nullptr;        // kCredit, kConnect
  // The slot's step, or with match_calls the call's id (as Describe).
  uint64_t step = 0;
  uint64_t need = 0;  // kCredit, in order: the step the reader must release
  // Inside a collective: "allreduce 'grads'", its instance and this call
  // (the step of the stall line); `step` is then the block's number on its
  // channel. Empty: a send or recv op's transfer.
  std::string collective;
  std::string instance;
  uint64_t collective_step = 0;
  Clock::time_point since;
  // Under Engine::stall_mu_.
  Clock::time_point next_report{};
  bool asking = false;     // a report is asking the peer now
  std::string learnt;      // "which ..." as the peer last answered
  Clock::time_point learnt_at{};
};

// A steady clock reading as ns since its epoch: CLOCK_MONOTONIC on Linux,
// the clock of Python's time.perf_counter.
inline int64_t NanosSinceEpoch(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             t.time_since_epoch())
      .count();
}

constexpr int64_t kCheckEveryMs = 50;  // as WaitForWord's sleep slices
// How long the poller stays aside after a helping send completed a recv
// (poller.cc): longer than the gap between one hop's help and the next's.
constexpr int64_t kAsideUs = 100;
// Requests given up on whose late replies a connection still drops
// (Connection::abandoned).
constexpr size_t kMaxAbandonedRequests = 256;
// Regions one writer task's OPENs may create, over all its connections: each
// holds a file descriptor, so at most a quarter of the process's descriptors,
// and at most this many.
constexpr int kMaxRegionsPerPeer = 1024;
constexpr int kHandshakeTimeoutMs = 10000;
// Connections one writer task may hold to this endpoint at once (it dials
// one; a redialled one overlaps the lost one briefly): each has a reader
// thread and an fd, so a holder of the secret may not open them without end.
constexpr int kMaxConnectionsPerPeer = 8;
// QUERY frames one connection gets answered per second; beyond that its
// reader thread waits out the second (the stall inspector and clock offsets
// ask a few times a second at most).
constexpr int kMaxQueriesPerSecond = 1000;

// Steps (StepCounter).

inline Status ClaimStep(StepCounter* steps, const SlotSpec& spec,
                        uint64_t* step) {
  if (!steps->poisoned.empty()) {
    return FailedPrecondition("tensor '" + spec.tensor_name +
                              "' cannot move any more: " + steps->poisoned);
  }
  *step = ++steps->claimed;
  return Status::Ok();
}

// Called with the slot's mutex held, after step `step` failed with `why`.
inline void GiveBackStep(StepCounter* steps, uint64_t step,
                         const Status& why) {
  if (steps->claimed == step) {
    --steps->claimed;
  } else if (steps->poisoned.empty()) {
    steps->poisoned = "step " + std::to_string(step) +
                      " failed while later steps were in flight (" +
                      why.message() + ")";
  }
}

// The slot layout (engine.h; graph_passes/plan.py).

// The copy an in-order slot uses at `step` (steps count from 1).
inline uint64_t CopyOf(const SlotSpec& spec, uint64_t step) {
  return (step - 1) % static_cast<uint64_t>(spec.depth);
}

// Where copy `copy` of the slot starts in its region (its header).
inline uint64_t CopyOffset(const SlotSpec& spec, uint64_t copy) {
  return spec.offset + copy * spec.stride;
}

// The credit word of copy `copy` of the slot, in the writer's credit region.
inline std::atomic<uint64_t>* CreditWord(Region* credits, const SlotSpec& spec,
                                         uint64_t copy) {
  uint64_t line = static_cast<uint64_t>(spec.credit_index) * spec.depth + copy;
  return credits->Word(line * kCreditLineBytes);
}

// Slot specs (config.cc).

// Where a slot is registered: its region and offset.
// Records a traced recv's data wait, from its claim until now: called once
// its data landed (PollRecv, FinishRecv, the poller's TakePending).
inline void TraceDataWait(const RecvTicket& ticket) {
  if (ticket.traced_since == 0) return;
  const SlotSpec& spec = ticket.slot->spec;
  trace::Span::At(ticket.traced_since)
      .End(trace::kDataWait, spec.tensor_name, spec.nbytes, spec.peer,
           TraceStep(spec, ticket.step, ticket.call));
}

std::string SlotKey(const SlotSpec& spec);
// The error of an op that runs before the endpoint started.
Status NotStarted();
// Checks a new op's slot against the one already registered at its place:
// two ops may share a slot only if they agree on its whole layout.
Status CheckSameSlot(const SlotSpec& spec, const SlotSpec& existing);
// Checks the slot of the first op at its place: it fits its regions, and its
// peer is another task.
Status CheckNewSlot(const SlotSpec& spec, const std::string& own_task);

// OPEN requests and replies (regions.cc).

// A region descriptor as fields of an OPEN request ("credit_" prefix: the
// writer's credit region) or reply (no prefix: the data region).
void EncodeDescriptor(const RegionDescriptor& d, const std::string& prefix,
                      std::map<std::string, std::string>* fields);
RegionDescriptor DecodeDescriptor(std::map<std::string, std::string>& fields,
                                  const std::string& prefix);

// `nbytes` random bytes as hex: nonces, incarnations (handshake.cc).
std::string RandomHex(size_t nbytes);

// The transport setting (engine.cc).

// The transports a setting allows, in order of preference
// (ParseTransportSetting; EngineConfig::Parse checked the setting, so an
// unchecked bad one allows none).
std::vector<std::string> TransportPreference(const std::string& setting);
bool Contains(const std::vector<std::string>& list, const std::string& item);

}  // namespace tf_rdma

#endif  // TF_RDMA_ENGINE_ENGINE_INTERNAL_H_
