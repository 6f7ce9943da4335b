// The engine: one per process. It owns the endpoint (listener + progress
// thread), the connections to peers, the regions, and the per-slot step
// counters; the send/recv ops call into it.
//
// Protocol of a slot (one planned transfer, `depth` copies in the reader's
// region, each copy = 64-byte header whose first word is the sequence word,
// then the payload; see graph_passes/plan.py for the layout):
//
//   writer, step s (s = 1, 2, ...):  copy c = (s-1) % depth
//     1. wait until credit[c] >= s - depth   (the tensor that used copy c
//        at step s-depth was released by the reader; trivially true for the
//        first `depth` steps)
//     2. Write(payload -> copy c, notice: seq word of copy c = s)
//   reader, step s:
//     1. wait until seq[c] >= s
//     2. hand copy c's payload to TensorFlow as the output tensor (no copy)
//     3. when the last reference to that tensor is dropped:
//        Write(no payload, notice: the writer's credit[c] = s)
//
// The credit words live in a small region of the writer's, so credits travel
// exactly like data: a one-sided write with a notice. Nothing on either side
// ever blocks without a deadline, and a dead peer fails every wait on it.
//
// Engine is one class, defined across files named for their jobs:
// engine.cc (start and stop), config.cc (config and slot specs),
// handshake.cc (the bootstrap handshake), peers.cc (restarted peers),
// connections.cc (connections after the handshake), regions.cc (regions and
// OPEN requests), send.cc, match.cc (matching calls), recv.cc, poller.cc
// (waiting for a recv without a thread per wait), thread_pool.{h,cc}
// (blocking-work threads) and stats.{h,cc} (the transfer counters);
// stall.cc (the stall inspector: waits that last, the peer's position);
// engine_internal.h holds the state they share.
#ifndef TF_RDMA_ENGINE_ENGINE_H_
#define TF_RDMA_ENGINE_ENGINE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/region.h"
#include "kernels/common/status.h"
#include "kernels/common/thread_name.h"
#include "kernels/common/trace.h"
#include "kernels/common/transport_choice.h"
#include "kernels/common/wait.h"
#include "kernels/common/wire.h"
#include "kernels/engine/stats.h"
#include "kernels/engine/thread_pool.h"
#include "kernels/transport/factory.h"
#include "kernels/transport/transport.h"

namespace tf_rdma {

constexpr uint64_t kSlotHeaderBytes = 64;
// Where a copy's header holds the id of the call that wrote it (match_calls);
// its first word is the sequence word.
constexpr uint64_t kCallWordOffset = 8;
// Copies per slot at most (graph_passes/plan.py MAX_DEPTH).
constexpr int64_t kMaxSlotDepth = 64;
constexpr uint64_t kCreditLineBytes = 64;
// A notice word's sleepers' count (wait.h) lies after the call word, inside
// the slot header and the credit line.
static_assert(kSleepersOffset >= kCallWordOffset + 8 &&
                  kSleepersOffset + 4 <= kSlotHeaderBytes &&
                  kSleepersOffset + 4 <= kCreditLineBytes,
              "the sleepers' count must fit the header and the credit line");
// The shortest job secret accepted (tf_rdma/settings.py MIN_SECRET_LENGTH).
constexpr size_t kMinSecretBytes = 16;
// A send polls the process's waiting recvs for this many times poll_us.
constexpr int64_t kHelpPollFactor = 4;
// EngineConfig::collective_spin_us: "auto", and what auto spins with a CPU
// per task on this host; the largest value accepted.
constexpr int64_t kAutoSpin = -1;
constexpr int64_t kAutoSpinUs = 500;
constexpr int64_t kMaxSpinUs = 100000;
// EngineConfig::host_cpus at most (tf_rdma/settings.py MAX_HOST_CPUS).
constexpr uint64_t kMaxHostCpus = 65536;

// The dynamic path, for tensors whose shape is only known at run time.
//
// A dynamic slot is an ordinary slot (same header, copies, sequence word and
// credits) whose payload is a fixed-size DynamicMeta: the tensor's shape and
// byte count, and the *generation* of the payload area that holds its bytes.
// Payload areas are separate regions on the reader, one per generation,
// named "<region>#<tensor>#<generation>", each with `depth` copies of
// `capacity` bytes after a first page of per-copy notice words. The writer
// opens generation 1 on the first non-empty tensor and a new generation, at
// least twice as large, whenever a tensor does not fit; older generations
// stay mapped, so tensors still aliasing them stay valid. A step writes the
// payload into copy (step-1) % depth of the current generation, then the
// DynamicMeta into the slot with the step's notice; the reader that sees the
// notice reads the meta, bounds-checks it against the generation it names,
// and hands the payload out without a copy. The slot's credit frees both.
//
// Cost: one extra small write per step (the meta), and an OPEN round trip
// (plus a region allocation on the reader) only when the size grows past
// the capacity; a tensor that shrinks or stays the same costs nothing more.
constexpr uint64_t kDynamicMetaBytes = 256;
constexpr int kMaxDynamicRank = 29;
constexpr uint64_t kDynamicHeaderBytes = 4096;

struct DynamicMeta {
  uint64_t generation = 0;  // 0: no payload area (an empty tensor)
  uint64_t nbytes = 0;
  uint64_t rank = 0;
  int64_t dims[kMaxDynamicRank] = {};
};
static_assert(sizeof(DynamicMeta) <= kDynamicMetaBytes,
              "DynamicMeta must fit a dynamic slot's payload");

struct EngineConfig {
  std::string task;               // this process, "/job:worker/task:0"
  std::string listen;             // "host:port" of the endpoint (port 0: any)
  // Where it listens: "*" every interface, another host only there; ""
  // the host of `listen` (TF_RDMA_BIND; the peers dial the cluster's
  // address of the task whatever this is).
  std::string bind;
  std::string secret;             // the job secret (TF_RDMA_SECRET)
  // "auto" (verbs if usable, then shm, then tcp) or the transports allowed,
  // in order of preference: "verbs", "shm,tcp", ...
  std::string transport = "auto";
  int64_t timeout_ms = 60000;     // default bound of every wait
  int64_t poll_us = 50;           // recv polls this long before handing off
  // How long a latency-bound collective's waits spin before they sleep
  // (collective.h, kLatencyBoundBytes); kAutoSpin until Start() resolves
  // it: kAutoSpinUs where this host runs no more of the cluster's tasks
  // than this process has CPUs, else 0.
  int64_t collective_spin_us = kAutoSpin;
  // The CPUs this host's tasks share when each is bound to its own part of
  // them (TF_RDMA_HOST_CPUS, set by tf-rdma launch when it binds); 0: not
  // known, auto spin counts this process's own CPUs.
  int64_t host_cpus = 0;
  // A wait longer than this is logged by the stall inspector (stall.cc);
  // 0: off.
  int64_t stall_warning_ms = 10000;
  // The bytes of /dev/shm the regions that other tasks open here may take
  // together (TF_RDMA_REGION_BUDGET), one writer task at most half of it;
  // 0: three quarters of /dev/shm's size when the endpoint starts.
  uint64_t region_budget = 0;
  std::map<std::string, std::string> peers;  // task -> endpoint "host:port"
  VerbsSettings verbs;            // verbs_* keys
  // TF_RDMA_TIMELINE: the directory this process's timeline file goes to
  // (kernels/common/timeline.h); empty: no timeline.
  std::string timeline;
  // TF_RDMA_TIMELINE_EVENTS: false (ops) records the ops' events without
  // their phases while the timeline runs (trace.h SetPhases).
  bool timeline_phases = true;

  // Parses "key=value" lines; "peer=<task> <host:port>" may repeat.
  static Status Parse(const std::string& text, EngineConfig* out);
};

// Everything an op knows about its slot: its attributes, i.e. the plan.
struct SlotSpec {
  std::string tensor_name;
  std::string peer;        // the other end's task
  // The peer's host as the cluster names it, for error messages; the
  // engine fills it in its own copy when it makes the slot.
  std::string peer_host;
  std::string region;      // the plan's region name
  std::string plan_hash;
  uint64_t region_bytes = 0;
  uint64_t credit_bytes = 0;
  uint64_t offset = 0;
  uint64_t stride = 0;
  uint64_t nbytes = 0;
  int64_t depth = 2;
  int64_t credit_index = 0;
  int64_t timeout_ms = -1;  // < 0: the engine's default
  // Calls of a rewritten function may overlap: each write carries the
  // call's id and the reader takes only its own call's copy (see
  // match.cc). false: both sides pair their ops in order.
  bool match_calls = false;
  // A dynamic slot (kDynamicMetaBytes): its payload is a DynamicMeta, and
  // the tensor's bytes are counted when the recv resolves it.
  bool dynamic = false;

  // Checks that the slot fits its region and its credit line fits the credit
  // region; the message names the values.
  Status Validate() const;
  // "tensor 'x' (peer /job:worker/task:1 on host-b, step 7)" for error
  // messages (" on host" where peer_host is known); with match_calls, `step`
  // is the call's id ("call 7").
  std::string Describe(uint64_t step) const;
};

struct Connection;
struct StallWait;
struct LocalRegion;
struct SendSlot;
struct RecvSlot;
struct SendRegion;

// What a send writes through: the slot's connection and its region there.
struct SendBinding {
  std::shared_ptr<Connection> conn;
  int data_handle = -1;
  PeerCounters* stats = nullptr;  // of the peer and this connection's transport
};

// A claimed step of a send: which copy, and where the payload goes.
struct SendTicket {
  SendSlot* slot = nullptr;
  uint64_t step = 0;  // match_calls: chosen when the copy is (SendStep)
  uint64_t copy = 0;  // which of the slot's `depth` copies
  uint64_t call = 0;  // match_calls: the call's id, written with the data
  int64_t timeout_ms = 0;  // this op's bound (ops sharing a slot may differ)
  // Bytes to write, if fewer than the slot's nbytes (a collective's last,
  // shorter block); 0: the slot's nbytes.
  uint64_t nbytes = 0;
  // When the send found its copy not yet released (a credit wait began);
  // the epoch: it has not waited (stats.h).
  Clock::time_point waiting_since{};
  // When it was claimed, if tracing was on then (kernels/common/trace.h);
  // 0: untraced, its phases record nothing.
  int64_t traced_since = 0;
  // Set (by the op's CancellationManager callback) when TensorFlow cancels
  // the op's step: its waits end with Cancelled at their next check. Null:
  // not cancellable.
  std::shared_ptr<std::atomic<bool>> cancelled;
};

// A claimed step of a recv.
struct RecvTicket {
  RecvSlot* slot = nullptr;
  // The slot's region when the recv was claimed: the copy it takes lives
  // there, and its credit goes to that region's writer. A matched-call
  // region whose writer went away is replaced by a fresh one (see
  // "Releasing a peer's regions", peers.cc); a ticket keeps its own.
  LocalRegion* region = nullptr;
  uint64_t step = 0;  // match_calls: the writer's step of the copy taken
  uint64_t copy = 0;
  uint64_t call = 0;  // match_calls: take only a copy written by this call
  int64_t timeout_ms = 0;  // this op's bound (ops sharing a slot may differ)
  uint8_t* payload = nullptr;  // valid once the recv completed ok
  // Bytes the writer wrote, if fewer than the slot's nbytes (a collective's
  // last, shorter block); 0: the slot's nbytes. For the counters only.
  uint64_t nbytes = 0;
  // Spin this long for the data before sleeping, where that is longer than
  // WaitForWord's few µs: a latency-bound collective's blocks (collective.cc).
  int64_t spin_us = 0;
  // When the recv first found no data (a data wait began); the epoch: it
  // has not waited (stats.h).
  Clock::time_point waiting_since{};
  int64_t traced_since = 0;    // as SendTicket's
  std::shared_ptr<std::atomic<bool>> cancelled;  // as SendTicket's
};

// The step a trace event of a transfer names: the call's id with
// match_calls (as SlotSpec::Describe), else the slot's step.
inline uint64_t TraceStep(const SlotSpec& spec, uint64_t step, uint64_t call) {
  return spec.match_calls ? call : step;
}

class Engine {
 public:
  // The process's engine. It is never destroyed (tensors may alias its
  // regions until the process ends); Stop() releases what others can see.
  static Engine* Get();

  Status Start(const EngineConfig& config);
  // Closes connections and removes this process's segments from /dev/shm.
  void Stop();
  bool started() const { return started_.load(); }
  const EngineConfig& config() const { return config_; }
  // Logs, once per process, how collectives wait (the first collective
  // calls it: a job without collectives is not told).
  void LogCollectiveSpin();
  // Whether this host runs more of the cluster's tasks than it has CPUs
  // (Start() decides, as for the auto spin): the inline path's poll then
  // yields the core between its looks (collective.cc).
  bool shares_cores() const { return shares_cores_; }
  int listen_port() const { return listen_port_; }
  // A JSON object: task, listen_port, transport (the setting),
  // refused_connections, verbs (the device, or "unusable: <why>"), pairs
  // ({writer, reader, transport} per live connection) and regions ({id,
  // name, segment, bytes}, id = the region's index).
  std::string Info();
  // The transfer counters as JSON (TransferStats::Json) with "task" and
  // "last_collective" ({instance, call, began_ns, ended_ns} on the
  // monotonic clock and waited_ns, or null) added: tf_rdma.stats()
  // (docs/observability.md).
  std::string Stats();

  // Send: ClaimSend in op order, then FinishSend (may block, bounded). A
  // step that fails is retried by the next op on the slot (see StepCounter).
  // TrySendNow does it all without blocking if the slot is connected and
  // the credit is already there; returns false if it would have to wait
  // (and notes in the ticket when a credit wait began, for the counters).
  // `call` identifies the op's call where spec.match_calls. `known`, where
  // the caller claims one spec again and again (an op kernel, a
  // collective's channel): the slot an earlier claim of that same spec
  // found, or null, set on return; with it the slot is not looked up by
  // name again (slots live as long as the engine, so it stays valid).
  Status ClaimSend(const SlotSpec& spec, SendTicket* ticket,
                   uint64_t call = 0, SendSlot** known = nullptr);
  bool TrySendNow(SendTicket* ticket, const void* data, Status* status);
  Status FinishSend(const SendTicket& ticket, const void* data);
  // The same for a dynamic slot: `data` holds meta.nbytes bytes.
  bool TrySendDynamicNow(SendTicket* ticket, const void* data,
                         const DynamicMeta& meta, Status* status);
  Status FinishSendDynamic(const SendTicket& ticket, const void* data,
                           const DynamicMeta& meta);

  // Recv: ClaimRecv, then PollRecv or WaitRecvAsync (bounded); TryRecvNow
  // succeeds only if the data is already there. After a successful finish
  // the caller owns the slot copy until it calls Release.
  // `known` as ClaimSend's.
  Status ClaimRecv(const SlotSpec& spec, RecvTicket* ticket,
                   uint64_t call = 0, RecvSlot** known = nullptr);
  bool TryRecvNow(RecvTicket* ticket);
  // TryRecvNow for a caller that polls several recvs in its own loop (the
  // collectives' inline path): counted and traced like PollRecv's recv
  // when the data is there, else counted as a data wait that began.
  bool TakeRecvNow(RecvTicket* ticket);
  // Gives up a claimed recv that will not be finished (a collective that
  // failed on another of its waits): its step is given back, and a data
  // wait it began ends, counted as failed.
  void CancelRecv(RecvTicket* ticket, const Status& why);
  // TryRecvNow, polled for up to config().poll_us microseconds on the
  // caller's thread. Handing a wait to an engine thread and waking it when
  // the data lands costs tens of microseconds per transfer (measured: a
  // 4 KiB ping-pong round trip fell from ~200 to ~50 us with 50 us of
  // polling); a peer that answers quickly lands within the poll. The poll
  // is PollFor's (wait.h), which yields where the host's tasks share cores.
  bool PollRecv(RecvTicket* ticket);
  // Waits for the data on this thread (bounded by the ticket's timeout); on
  // failure the step has been given back. For engine threads (collectives).
  Status FinishRecv(RecvTicket* ticket);
  // For a dynamic slot, after the recv completed: reads the DynamicMeta at
  // ticket->payload, checks it against the payload area it names, and
  // points ticket->payload at the tensor's bytes.
  Status ResolveDynamic(RecvTicket* ticket, DynamicMeta* meta);
  // Waits for the data without holding a thread: the wait joins the poller
  // (see poller.cc) and `done` is called exactly once with the
  // outcome, on the poller thread (or an engine thread, a helping send's
  // thread, or the tcp connection's reader thread that wrote the data; see
  // there). A failed step has been given back when `done` runs.
  using RecvDone = std::function<void(const Status&, const RecvTicket&)>;
  void WaitRecvAsync(const RecvTicket& ticket, RecvDone done);
  // Called by a send op on TensorFlow's thread once its data is written:
  // if recvs of this process are waiting, polls them for up to
  // kHelpPollFactor * poll_us and completes the first one whose data lands,
  // on this thread. Returns true if it completed one. See poller.cc.
  bool HelpRecvs();
  void Release(const RecvTicket& ticket);
  // Counts a received tensor that aliases the ticket's region (+1 when it
  // is made, -1 when it is dropped): a released region is unmapped only
  // once none does (peers.cc).
  static void HoldRegion(const RecvTicket& ticket, int delta);

  // For a send slot that has written: the last step written and the
  // newest step the reader released (credit words); false if the slot has
  // not been bound. Collectives use it to name a peer that stalled.
  bool SendProgress(const SlotSpec& spec, uint64_t* written,
                    uint64_t* released);

  // Asks `peer` a question over the control connection (query.cc): any
  // live connection with it, either direction; none is Unavailable.
  Status Query(const std::string& peer,
               const std::map<std::string, std::string>& fields,
               const Deadline& deadline,
               std::map<std::string, std::string>* reply);
  // The offset of `peer`'s trace clock from ours (peer - ours, ns) from
  // the `samples` clock queries with the shortest round trip; the offset's
  // error is at most rtt_ns / 2.
  struct ClockSample {
    int64_t offset_ns = 0;
    int64_t rtt_ns = 0;
  };
  Status ClockOffset(const std::string& peer, int samples,
                     const Deadline& deadline, ClockSample* out);
  // ClockOffset to every connected peer, as JSON: {"task": ..., "peers":
  // {peer: {"offset_ns", "rtt_ns"} or {"error"}}}.
  std::string ClockOffsets(int samples, int64_t timeout_ms);
  // The tasks this process has a live control connection with, whichever
  // side dialed, sorted, each once.
  std::vector<std::string> ConnectedPeers();

  // Runs `fn` on an engine thread that may block (in bounded waits).
  void Schedule(std::function<void()> fn);

  // A collective's call (RunCollective, StartCollective), from Begin to
  // End: a peer that asks for this task's position in it (what=position)
  // learns the calls of `instance` completed and whether one runs now.
  void CollectiveBegin(const std::string& instance, uint64_t call);
  void CollectiveEnd(const std::string& instance, bool ok);
  // From here to the matching CollectiveWaitsEnd, the waits on this thread
  // are the call's (a call that starts inline and is handed off waits on
  // two threads in turn): their stall lines name it. `describe` is the
  // collective as the stall lines name it, "allreduce 'grads'".
  void CollectiveWaitsBegin(const std::string& instance,
                            const std::string& describe, uint64_t call);
  void CollectiveWaitsEnd();
  // Counts a collective call by the thread it completed on: the op's own
  // (the inline path) or an engine thread's (tf_rdma.stats()).
  void CountCollective(bool inline_path);
  // Thread CPU nanoseconds of `n` registrations of a wait with the stall
  // inspector and their ends (what a wait that sleeps pays): the cost
  // measured by tests/test_stall.py (tfrdma_stall_bench).
  int64_t StallBench(int64_t n);

  // Wakes the waits of cancelled ops (a ticket's `cancelled` was set):
  // the poller checks them at once; waits on engine threads see it within
  // kCheckEveryMs.
  void WakeCancelled();

  void Log(const std::string& line);
  // Log for lines a peer can cause: at most a few per interval, then one
  // summary line (handshake.cc). Rejections and refusals share an
  // interval; lost connections have one per peer task, so that a peer
  // whose connections come and go cannot hide another peer's loss.
  void LogLimited(const std::string& line) { LogThrough(&rejections_, line); }
  void LogLost(const std::string& peer, const std::string& line);
  // Connections refused or rejected before or in the handshake.
  uint64_t refused_connections() const;

 private:
  Engine() = default;

  // Connections.
  Status GetConnection(const std::string& peer, const Deadline& deadline,
                       std::shared_ptr<Connection>* out);
  Status Dial(const std::string& peer, const Deadline& deadline,
              std::shared_ptr<Connection>* out);
  void AcceptLoop();
  // Admission (handshake.cc): whether a connection from `source` may start
  // a handshake now, cutting short another source's oldest one if the
  // endpoint is full; sets *id, or *busy to why not. Holds handshake_mu_.
  bool AdmitHandshakeLocked(int fd, const std::string& source, uint64_t* id,
                            std::string* busy);
  // Takes handshake `id` out of those admission may cut short; false if it
  // was cut short already. Before its fd is closed or handed over.
  bool SettleHandshake(uint64_t id);
  void Handshake(int fd, uint64_t id);
  void EndHandshake(const std::string& source);
  void ProgressLoop();
  Status AddToProgress(const std::shared_ptr<Connection>& conn);
  void ReadLoop(std::shared_ptr<Connection> conn);
  void HandleFrame(const std::shared_ptr<Connection>& conn);
  // Lines of one kind that a peer can cause, kLogBurst per kLogWindowMs,
  // then a line that counts the rest ("N more <noun>s ...").
  struct LogLimiter {
    explicit LogLimiter(const char* noun) : noun(noun) {}
    const char* noun;
    std::mutex mu;
    Clock::time_point window{};
    int count = 0;
    uint64_t suppressed = 0;
    std::string last;
  };
  void LogThrough(LogLimiter* limiter, const std::string& raw);
  void FlushLimitedLog();
  void FlushLimitedLocked(LogLimiter* limiter);
  // Restarted peers (peers.cc).
  // Whether `peer`'s new `incarnation` may be taken for a restart: not
  // while its old one is connected and answers (peers.cc).
  Status CheckNewIncarnation(const std::string& peer,
                             const std::string& incarnation);
  void NotePeerIncarnation(const std::shared_ptr<Connection>& conn);
  std::string RestartMessage(const std::string& peer, bool peer_writes);
  // Releasing a peer's regions (peers.cc). All with mu_ held.
  // Whether the slots of region `name` seen here all match calls.
  bool MatchedRegion(const std::string& name);
  // Releases what this side holds for `conn`'s writes (a data region it
  // wrote and its payload areas) or for its reads (the send regions into
  // it): only matched-call regions; the others keep today's rules.
  void ReleaseRegionsOfLocked(const std::shared_ptr<Connection>& conn,
                              const std::string& why);
  // Takes a data region (and its payload areas) out of use: unlinked,
  // dropped from data_regions_, unmapped by SweepRetiredLocked later.
  void RetireRegionLocked(LocalRegion* region, const std::string& why);
  // Unmaps released regions that nothing can touch any more.
  void SweepRetiredLocked();
  // The slot's live region, made afresh if its current one was released;
  // rebinds every recv slot of that region name.
  Status CurrentRegion(RecvSlot* slot, LocalRegion** out);
  // Publishes the notices a verbs pair received (progress thread).
  void HandleNotices(const std::shared_ptr<Connection>& conn);
  // Makes the pair of the transport both ends chose, through its backend.
  Status MakePair(const std::string& transport, bool dialed,
                  const std::shared_ptr<Connection>& conn,
                  const Deadline& deadline);
  void CloseConnection(const std::shared_ptr<Connection>& conn,
                       const Status& why);
  // Tells the peer that this endpoint stops on purpose (kGoodbye). Best
  // effort and brief: skipped while another frame is being sent on the
  // connection (the peer then sees the socket close, and logs a lost
  // connection as before).
  void SayGoodbye(const std::shared_ptr<Connection>& conn);
  // Sends a request frame (kOpenRequest or kQuery) with `fields` and waits
  // for its reply by the deadline.
  Status Request(const std::shared_ptr<Connection>& conn, FrameType type,
                 const std::map<std::string, std::string>& fields,
                 const Deadline& deadline,
                 std::map<std::string, std::string>* reply);
  // Answers request `request_id` (type kOpenReply or kQueryReply): the
  // fields if `s` is ok, else its code and message. A reply that cannot be
  // sent closes the connection.
  void SendReply(const std::shared_ptr<Connection>& conn, FrameType type,
                 uint64_t request_id, const Status& s,
                 const std::map<std::string, std::string>& fields);
  void HandleOpen(const std::shared_ptr<Connection>& conn, uint64_t request_id,
                  const std::string& body);
  // Answers a QUERY frame (query.cc), on the connection's reader thread.
  void HandleQuery(const std::shared_ptr<Connection>& conn,
                   uint64_t request_id, const std::string& body);

  // The stall inspector (stall.cc).
  //
  // A wait that begins to sleep: registered until EndStall (which the
  // returned object's owner calls once, however the wait ends).
  std::shared_ptr<StallWait> BeginStall(int kind, RecvSlot* recv,
                                        SendSlot* send, uint64_t step,
                                        uint64_t need);
  void EndStall(const std::shared_ptr<StallWait>& wait);
  void WatchdogLoop();
  void ReportStall(const std::shared_ptr<StallWait>& wait);
  // "recv of tensor 'x' step 7 waits 1.2 s for its data from <peer>".
  std::string StallSubject(const StallWait& wait, Clock::time_point now);
  // ", which <the peer's position>" asked within `deadline`, or, if the
  // peer does not answer, what this side knows; *answered says which.
  std::string PeerPosition(const StallWait& wait, const Deadline& deadline,
                           bool* answered);
  // What this side knows of the peer's progress on the wait's slot.
  std::string LocalFacts(const StallWait& wait);
  // For a timeout's message: "; <peer> <position>", freshly asked (within
  // 250 ms) or, if the peer does not answer, as last learnt, with local
  // facts.
  std::string StallFacts(const std::shared_ptr<StallWait>& wait);
  // Answers what=position (query.cc).
  void AnswerPosition(const std::map<std::string, std::string>& fields,
                      std::map<std::string, std::string>* reply);
  Status SendFrame(const std::shared_ptr<Connection>& conn,
                   const FrameHeader& h, const std::string& body,
                   const Deadline& deadline);

  // Regions and slots. `premade`, if given and of `size` bytes, is the
  // memory a new region takes (made by the caller before it took mu_);
  // otherwise the region's memory is made here, under mu_.
  Status FindOrCreateDataRegion(const std::string& name, uint64_t size,
                                const std::string& plan_hash,
                                const std::string& writer, LocalRegion** out,
                                std::unique_ptr<Region>* premade = nullptr);
  Status NewLocalRegion(const std::string& name, uint64_t size,
                        const std::string& plan_hash, const std::string& peer,
                        LocalRegion** out,
                        std::unique_ptr<Region>* premade = nullptr);
  Region* RegionForPeer(const Connection& conn, uint32_t id);
  // Removes the /dev/shm segments of processes that died, for a few
  // seconds from now (connections.cc).
  void SweepSegmentsOfTheDead();
  // Why `peer` may open no new region here (its own limit or all writers'
  // together), or "" if it may.
  std::string RegionLimitLocked(const std::string& peer);
  // "Connections that drop" (regions.cc): what an OPEN on a new connection
  // says landed but did not (or "", or *malformed), and the credits sent
  // again.
  std::string LostInFlightLocked(const LocalRegion& region,
                                 const std::string& landed,
                                 const std::string& writer, Status* malformed);
  void ResendCredits(LocalRegion* region,
                     const std::shared_ptr<Connection>& conn);
  std::string RegionBytesLimitLocked(const std::string& writer, uint64_t size);
  void RefuseWriter(const std::string& region_name, const Status& why);
  // `step`: the send's (with match_calls its call's), for the stall
  // inspector while it connects.
  Status BindSendSlot(SendSlot* slot, uint64_t step, const Deadline& deadline,
                      SendBinding* out);
  Status OpenRemoteRegion(const std::shared_ptr<Connection>& conn,
                          const std::string& name, uint64_t size,
                          const std::string& plan_hash, uint32_t credits_id,
                          const Region& credits, const Deadline& deadline,
                          int* handle, const std::string& refusal = "",
                          const std::string& landed = "");
  bool CreditReady(const SendTicket& ticket) const;
  // CreditReady, noting in the ticket when a credit wait begins.
  bool CreditReadyOrWait(SendTicket* ticket);
  Status OpenSendRegion(const SlotSpec& spec,
                        const std::shared_ptr<Connection>& conn,
                        const Deadline& deadline, SendRegion* region);
  Status SendStep(SendTicket ticket, const void* data,
                  const DynamicMeta* meta);
  // Matching calls (match.cc): the writer takes any free copy, the reader
  // the copy its call's writer filled.
  Status AcquireCopy(SendTicket* ticket,
                     const std::shared_ptr<Connection>& conn,
                     const Deadline& deadline,
                     const std::function<std::string()>& what);
  bool MatchRecv(RecvTicket* ticket, bool take);
  // `taken`, when given, is the poller's flag of a wait it handed to an
  // engine thread: set, another waiter completed the wait, and this one
  // ends (Cancelled) instead of waiting for a match that was consumed.
  Status WaitForMatch(RecvTicket* ticket, const Deadline& deadline,
                      const std::shared_ptr<StallWait>& stall,
                      const std::atomic<bool>* taken = nullptr);
  void Abandon(const RecvTicket& ticket);
  Status WriteDynamicPayload(const SendTicket& ticket,
                             const SendBinding& binding, const void* data,
                             DynamicMeta* meta, const Deadline& deadline);
  bool PollRecvFor(RecvTicket* ticket);  // PollRecv's loop
  // `stall`: the wait's registration (stall.cc), for the timeout's message.
  // `taken`: as WaitForMatch's.
  Status RecvStep(RecvTicket* ticket, const Deadline& deadline,
                  const std::shared_ptr<StallWait>& stall,
                  const std::atomic<bool>* taken = nullptr);
  // Why a recv that is still waiting must fail now (plan refusal, peer
  // gone), or ok; `what` prefixes the message.
  Status RecvCheck(const RecvTicket& ticket, const std::string& what);
  // With the peer's position (StallFacts) when `stall` is set: may ask the
  // peer, for up to 250 ms.
  Status RecvTimedOut(const RecvTicket& ticket, const std::string& what,
                      const Status& timeout,
                      const std::shared_ptr<StallWait>& stall);
  void GiveBackRecv(RecvTicket* ticket, const Status& why);
  // Counts a recv that ends (ok: its bytes and one receive) and the data
  // wait it had, if any (stats.h). Called once per recv, where it completes.
  void CountRecv(RecvTicket* ticket, bool ok);
  // The counters of the slot's writer (of "none" if it never connected).
  PeerCounters* RecvCounters(RecvSlot* slot);

  // The poller (poller.cc).
  struct PendingRecv;
  void PollerLoop();
  void RingPoller();  // news for the poller: bumps its bell, wakes it
  void WakePoller();  // wakes it if asleep (the bell already bumped)
  // Completes `p` with `s` unless another thread already did; true if this
  // call did.
  bool TakePending(const std::shared_ptr<PendingRecv>& p, const Status& s);
  // HelpRecvs' loop: completed a recv, found none within the budget, or
  // gave the thread back for a recv that has not started (poller.cc).
  enum class Helped { kYes, kNo, kGaveBack };
  Helped HelpRecvsFor(int64_t budget_us);
  // One look at the waiting recvs, on the thread that just published a
  // word (a tcp connection's reader): completes those whose data landed.
  void CompleteLandedRecvs();

  Status CheckPeerAlive(const std::shared_ptr<Connection>& conn,
                        const std::string& what);
  int64_t TimeoutFor(const SlotSpec& spec) const;
  // The host of `peer`'s endpoint address ("" for a task not in the
  // cluster): what a slot's errors say the peer runs on.
  std::string PeerHost(const std::string& peer) const;
  std::string HostId() const;
  // This end of a pair, for ChooseTransport: its setting, verbs device and
  // host identity.
  PairEnd ThisEnd() const;
  std::vector<std::string> AllowedTransports() const;
  // Opens the backends the transport setting allows (transport/factory.h).
  // One that cannot be used here (verbs without a device) is an error only
  // when the setting has no tcp to fall back on; otherwise ("auto",
  // "verbs,tcp", ...) the reason is logged once and kept (Info) and the
  // pairs use the other transports.
  Status StartTransports(const EngineConfig& config, const std::string& host);
  // Logs, one line per peer, the transport its pair is expected to use;
  // returns how many of the peers it expects on this host.
  int PredictTransports();
  // Turns config_.collective_spin_us "auto" into microseconds, given the
  // cluster's tasks on this host (this one included), and words the choice
  // for LogCollectiveSpin.
  void ResolveCollectiveSpin(int tasks_here);
  // Starts the timeline of config_.timeline, if set (timeline.cc); a file
  // that cannot be created is logged, and the endpoint runs without it.
  void StartTimeline();

  EngineConfig config_;
  std::string incarnation_;  // random per Start (see "Restarted peers")
  std::atomic<bool> started_{false};
  std::atomic<bool> stopping_{false};
  int listen_fd_ = -1;
  int listen_port_ = 0;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::thread accept_thread_;
  std::thread progress_thread_;

  std::mutex mu_;  // guards everything below
  std::map<std::string, std::shared_ptr<Connection>> dialed_;  // by peer task
  std::map<std::string, std::unique_ptr<std::mutex>> dial_mu_;
  // Live connections (each with its reader thread), both directions.
  std::set<std::shared_ptr<Connection>> connections_;
  int max_regions_per_peer_ = 1024;  // set by Start
  // The incarnation last seen of each peer task.
  std::map<std::string, std::string> peer_incarnation_;
  // Connections whose notices arrive as messages (verbs), by notice fd.
  std::map<int, std::shared_ptr<Connection>> by_notice_fd_;
  // The backends opened (once per process: verbs holds the RDMA device),
  // by name, and why the others are not used.
  std::map<std::string, std::unique_ptr<Transport>> transports_;
  std::map<std::string, std::string> unusable_;
  std::vector<std::unique_ptr<LocalRegion>> regions_;  // index = id
  std::map<std::string, LocalRegion*> data_regions_;   // by plan region name
  // In-order regions refused for good because their writer restarted, and
  // released (peers.cc): the reason, by name, for whoever asks for them
  // again; at most kMaxRefusedNames.
  std::map<std::string, std::string> refused_names_;
  std::map<std::string, std::unique_ptr<SendSlot>> send_slots_;
  // The regions this process writes into, by plan region name: opened once
  // for all the slots they hold, however many of those bind at the same time.
  std::map<std::string, std::unique_ptr<SendRegion>> send_regions_;
  std::map<std::string, std::unique_ptr<RecvSlot>> recv_slots_;
  // The same slots in the order they were made (under mu_; never removed),
  // and how many there are, for helping sends' copies (HelpRecvsFor).
  std::vector<RecvSlot*> recv_slot_list_;
  std::atomic<uint32_t> recv_slots_made_{0};
  // Regions each writer task's OPENs created (under mu_) and not released
  // yet: the limit is per task, not per connection.
  std::map<std::string, int> regions_opened_by_;
  // The bytes of the data regions each writer task writes into here (made
  // by its OPEN or by a recv here) and not released yet, and the budget of
  // them all (EngineConfig::region_budget, resolved by Start; 0: none).
  std::map<std::string, uint64_t> region_bytes_of_;
  uint64_t region_budget_ = 0;
  // RegionKind bits of each region name, as its slots here were claimed.
  std::map<std::string, int> region_kind_;
  // Released regions not unmapped yet, and from when they may be: after
  // every wait that could still look at them has ended (the longest
  // timeout), once no received tensor aliases them (`base` counts those
  // for its payload areas too).
  struct Retired {
    LocalRegion* region;
    LocalRegion* base;
    Clock::time_point not_before;
  };
  std::vector<Retired> retired_;

  // The sweep for dead peers' segments (SweepSegmentsOfTheDead): whether
  // one runs, and until when (trace::NowNs).
  std::atomic<bool> sweeping_{false};
  std::atomic<int64_t> sweep_until_ns_{0};
  // Handshakes in progress, in all and by source address.
  std::mutex handshake_mu_;
  std::atomic<int> handshakes_{0};
  std::map<std::string, int> handshakes_by_source_;
  // Those whose peer has not proved the secret yet, by admission order:
  // what admission may cut short (under handshake_mu_).
  struct PendingHandshake {
    int fd;
    std::string source;
  };
  std::map<uint64_t, PendingHandshake> pending_handshakes_;
  uint64_t next_handshake_ = 0;
  // The numeric addresses of the cluster's hosts, as PeerAddress writes
  // them ("10.0.0.5", "[fe80::1]"): the sources admission serves first.
  std::set<std::string> cluster_sources_;
  std::atomic<uint64_t> refused_connections_{0};
  LogLimiter rejections_{"rejected connection"};
  // LogLost's, one per peer task up to kMaxLossLimiters, then one for the
  // rest (`losses_`).
  std::mutex losses_mu_;
  std::map<std::string, std::unique_ptr<LogLimiter>> losses_by_peer_;
  LogLimiter losses_{"lost connection"};
  // Limiters with suppressed lines not summed up yet: FlushLimitedLog,
  // called on every turn of the progress loop, has nothing to do at 0.
  std::atomic<int> limiters_owing_{0};

  // ResolveCollectiveSpin's words, logged by the first collective.
  std::string spin_choice_;
  bool shares_cores_ = false;  // set by ResolveCollectiveSpin
  std::once_flag spin_logged_;

  // Blocking-work threads (Schedule).
  ThreadPool pool_{[this](const std::string& line) { LogLimited(line); }};

  // The poller: one thread, started with the first wait it gets.
  std::once_flag poller_once_;
  std::mutex poller_mu_;
  std::vector<std::shared_ptr<PendingRecv>> waiting_;  // not yet completed
  std::atomic<size_t> waiting_count_{0};
  std::atomic<int> helpers_{0};  // sends in HelpRecvsFor now
  std::atomic<uint32_t> poller_bell_{0};  // bumped on news; a futex word
  std::atomic<bool> poller_asleep_{false};
  // Waits were added while sends helped, without waking the poller: the
  // last helper to stop wakes it (WaitRecvAsync, HelpRecvsFor).
  std::atomic<bool> poller_owed_{false};
  // When a HelpRecvsFor last completed a recv or gave its thread back to
  // one (steady clock, ns since its epoch); 0 after one that found none.
  // The poller steps aside after a success (PollerLoop).
  std::atomic<int64_t> helped_at_ns_{0};
  std::atomic<bool> poller_aside_{false};  // asleep on its bell only
  std::atomic<bool> poller_recheck_{false};  // a connection went away
  bool have_waitv_ = true;                   // poller thread only
  std::atomic<int> help_misses_{0};   // HelpRecvs in a row that found nothing

  // The transfer counters (stats.h).
  TransferStats stats_;

  // The stall inspector (stall.cc): the waits sleeping now, the watchdog
  // that reports the long ones, and each collective instance's calls.
  struct CollectivePosition {
    uint64_t completed = 0;  // calls finished (ok or not)
    uint64_t running = 0;    // the call in progress; 0: none
    bool failed = false;     // the last call failed
    Clock::time_point began{};  // when `running` was admitted
    uint64_t busy_at_begin_ns = 0;  // WaitBusyNs() then
  };
  // The busy clocks of both kinds of wait, added (TransferStats): the
  // growth over a call is how long it, or an op beside it, waited for data
  // plus how long for a credit (overlapping waits of both kinds count
  // twice).
  uint64_t WaitBusyNs(Clock::time_point now) const;
  std::mutex stall_mu_;  // guards the fields below
  std::vector<std::shared_ptr<StallWait>> stalls_;
  std::condition_variable stall_cv_;  // the watchdog, asleep while none wait
  bool watchdog_asleep_ = false;
  std::once_flag watchdog_once_;
  std::map<std::string, CollectivePosition> collectives_;
  // The last collective call of this process to finish (Stats'
  // last_collective): its instance (a key of collectives_; null before the
  // first), its number, when it was admitted and finished, and how long
  // it waited in between (the busy clocks' growth).
  const std::string* last_collective_ = nullptr;
  uint64_t last_collective_call_ = 0;
  Clock::time_point last_collective_began_{}, last_collective_ended_{};
  uint64_t last_collective_waited_ns_ = 0;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_ENGINE_ENGINE_H_
