#include "kernels/engine/collective.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include <sys/mman.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels/common/sha256.h"
#include "kernels/engine/engine.h"

namespace tf_rdma {

const char* KindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return "allreduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kReduce: return "reduce";
    case CollectiveKind::kAllGather: return "allgather";
  }
  return "?";
}

const char* AlgorithmName(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kLp: return "lp";
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "tree";
    case Algorithm::kRhd: return "rhd";
    case Algorithm::kOneShot: return "oneshot";
  }
  return "?";
}

bool ParseKind(const std::string& name, CollectiveKind* out) {
  for (CollectiveKind k : {CollectiveKind::kAllReduce, CollectiveKind::kBroadcast,
                           CollectiveKind::kReduce, CollectiveKind::kAllGather}) {
    if (name == KindName(k)) {
      *out = k;
      return true;
    }
  }
  return false;
}

bool ParseAlgorithm(const std::string& name, Algorithm* out) {
  for (Algorithm a :
       {Algorithm::kLp, Algorithm::kRing, Algorithm::kTree, Algorithm::kRhd,
        Algorithm::kOneShot}) {
    if (name == AlgorithmName(a)) {
      *out = a;
      return true;
    }
  }
  return false;
}

Status CollectiveSpec::Validate(const std::string& own_task) const {
  std::string what = Describe();
  int size = static_cast<int>(group.size());
  if (size < 1) return InvalidArgument(what + ": the group is empty");
  if (rank < 0 || rank >= size) {
    return InvalidArgument(what + ": rank " + std::to_string(rank) +
                           " is not in [0, " + std::to_string(size) + ")");
  }
  if (root < 0 || root >= size) {
    return InvalidArgument(what + ": root " + std::to_string(root) +
                           " is not in [0, " + std::to_string(size) + ")");
  }
  if (std::set<std::string>(group.begin(), group.end()).size() != group.size()) {
    return InvalidArgument(what + ": a task appears twice in the group");
  }
  if (group[rank] != own_task) {
    return InvalidArgument(what + ": rank " + std::to_string(rank) + " is " +
                           group[rank] + " but this process is " + own_task);
  }
  if (element_bytes == 0 || block_bytes < element_bytes) {
    return InvalidArgument(what + ": block of " + std::to_string(block_bytes) +
                           " bytes is smaller than one element (" +
                           std::to_string(element_bytes) + " bytes)");
  }
  if (depth < 1) {
    return InvalidArgument(what + ": depth " + std::to_string(depth) +
                           " must be >= 1");
  }
  return Status::Ok();
}

std::string CollectiveSpec::Hash() const {
  std::string text = std::string(KindName(kind)) + "|" +
                     AlgorithmName(algorithm) + "|" + reduction + "|" + dtype +
                     "|" + std::to_string(root) + "|" +
                     (count_in_hash ? std::to_string(count) : "any") +
                     "|" + std::to_string(element_bytes) + "|" +
                     std::to_string(block_bytes) + "|" + std::to_string(depth);
  for (const std::string& t : group) text += "|" + t;
  Digest256 d = Sha256Of(text.data(), text.size());
  return ToHex(d.data(), 8);
}

bool CollectiveSpec::SameAs(const CollectiveSpec& o) const {
  return std::tie(instance, kind, algorithm, reduction, dtype, group, rank,
                  root, count, count_in_hash, element_bytes, block_bytes,
                  depth, timeout_ms) ==
         std::tie(o.instance, o.kind, o.algorithm, o.reduction, o.dtype,
                  o.group, o.rank, o.root, o.count, o.count_in_hash,
                  o.element_bytes, o.block_bytes, o.depth, o.timeout_ms);
}
// A tripwire for SameAs: a field added to CollectiveSpec changes its size.
static_assert(sizeof(CollectiveSpec) == 184 || sizeof(void*) != 8,
              "compare the new CollectiveSpec field in SameAs");

std::string CollectiveSpec::Describe() const {
  return std::string(KindName(kind)) + " '" + instance + "' (" +
         AlgorithmName(algorithm) + ", rank " + std::to_string(rank) + " of " +
         std::to_string(group.size()) + ")";
}

namespace {

// A channel's slot spec (Runner::Channel), and the engine's slots for it
// once claimed: later claims skip their lookup by name (Engine::ClaimSend's
// `known`).
struct ChannelSlots {
  SlotSpec spec;
  SendSlot* send = nullptr;
  RecvSlot* recv = nullptr;
};

// Per instance, per process: calls of one instance run one at a time (their
// blocks share channels), and the first failure sticks. A call holds the
// instance from its admission to its end, which may come on another thread
// than its start (the inline path), so a flag rather than a held mutex.
struct InstanceState {
  std::mutex mu;  // guards everything below but `channels`
  std::condition_variable idle;  // notified when `busy` clears
  bool busy = false;
  std::string hash;
  std::string describe;
  std::string poisoned;
  uint64_t calls = 0;  // the step its trace events name
  // The spec of the last admitted call and the task it was checked for:
  // a call with the same one skips Validate and Hash (Admit) and reuses
  // the channels' slot specs.
  bool checked = false;
  CollectiveSpec checked_spec;
  std::string checked_task;
  std::string call_describe;  // "allreduce 'grads'"
  // Runner::Channel's slot specs for checked_spec, used only by the call
  // that holds the instance (busy), so without `mu`.
  std::map<std::pair<int, int>, ChannelSlots> channels;
};

std::mutex g_instances_mu;
std::map<std::string, std::unique_ptr<InstanceState>>* g_instances =
    new std::map<std::string, std::unique_ptr<InstanceState>>();

InstanceState* GetInstance(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_instances_mu);
  auto& entry = (*g_instances)[name];
  if (!entry) entry.reset(new InstanceState);
  return entry.get();
}

uint64_t RoundUp(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

// Streaming the copies of a large result.
//
// What: the copy of a received block into the buffer, where the call reads
// that block no more (it is not sent on: the last step of an allgather or
// a broadcast chain), uses non-temporal stores when the result is at least
// kStreamResultBytes.
// Why: an ordinary store to a line not in the cache first reads the line
// (read for ownership), so a memcpy into cold memory moves three bytes for
// every byte copied; a streaming store writes the line whole without
// reading it, so two. A result this large does not stay in a core's cache
// (L2 is 1 to 2 MiB on current servers) for its consumer anyway, and
// glibc's memcpy streams only copies above its own threshold (114 MiB on
// the 2-vCPU VM), far above a block. Sends into a peer's channel stay
// ordinary stores: the peer reads the block within a few blocks, and
// streaming them made a 64 MiB ring at P = 2 about 20% slower (13.7 to
// 14.2 ms against 11.1 to 11.9 ms, 2026-12-06).
// Cost: the same bytes, the same bits; measured in docs/benchmarks.md
// ("Streaming the result").
constexpr uint64_t kStreamResultBytes = uint64_t{8} << 20;

// memcpy with non-temporal stores for the 16-byte-aligned part of `dst`
// (a plain memcpy where the CPU has no SSE2), then a store fence so the
// bytes are visible to whoever this thread signals next.
void StreamCopy(uint8_t* dst, const uint8_t* src, uint64_t n) {
#if defined(__SSE2__)
  const uint64_t head =
      std::min<uint64_t>(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  uint64_t i = head;
  for (; i + 64 <= n; i += 64) {
    const auto* from = reinterpret_cast<const __m128i*>(src + i);
    auto* to = reinterpret_cast<__m128i*>(dst + i);
    __m128i a = _mm_loadu_si128(from), b = _mm_loadu_si128(from + 1);
    __m128i c = _mm_loadu_si128(from + 2), d = _mm_loadu_si128(from + 3);
    _mm_stream_si128(to, a);
    _mm_stream_si128(to + 1, b);
    _mm_stream_si128(to + 2, c);
    _mm_stream_si128(to + 3, d);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

// A byte range of the buffer.
struct Range {
  uint64_t offset = 0;
  uint64_t length = 0;
};

class Runner {
 public:
  // `spec` and `hash` outlive the runner; `channels` are the instance's
  // (InstanceState), kept from call to call.
  Runner(const CollectiveSpec& spec, const std::string& hash,
         std::map<std::pair<int, int>, ChannelSlots>* channels,
         const uint8_t* src, uint8_t* buf, const ReduceFn& reduce)
      : spec_(spec),
        src_(src),
        buf_(buf),
        reduce_(reduce),
        size_(static_cast<int>(spec.group.size())),
        rank_(spec.rank),
        block_(std::max(spec.element_bytes,
                        spec.block_bytes / spec.element_bytes *
                            spec.element_bytes)),
        hash_(hash),
        engine_(Engine::Get()),
        spin_us_(All().length <= kLatencyBoundBytes
                     ? engine_->config().collective_spin_us
                     : 0),
        stream_results_(All().length >= kStreamResultBytes),
        channels_(*channels) {}

  // This rank's input as pieces (StartCollective); src_ is then an
  // address range reserved for the input's layout, never readable, that
  // In() translates.
  void SetInputPieces(std::vector<InputPiece> pieces) {
    pieces_ = std::move(pieces);
  }

  Status Run();
  // Runs the call as far as it goes: with `may_wait` to its end (*status
  // set, true); without, waiting for nothing, false where it would have
  // to wait (call again with `may_wait` on a thread that may). Only a
  // oneshot collective of one block advances without waiting (the inline
  // path, see StartCollective); any other call does nothing until it may.
  bool Advance(bool may_wait, Status* status);

 private:
  void Alone();
  int Mod(int x) const { return ((x % size_) + size_) % size_; }
  uint64_t Blocks(uint64_t length) const {
    return (length + block_ - 1) / block_;
  }
  Range All() const {
    uint64_t n = spec_.count * spec_.element_bytes;
    return {0, spec_.kind == CollectiveKind::kAllGather ? n * size_ : n};
  }
  // Elements [lo, hi) as bytes.
  Range Elements(uint64_t lo, uint64_t hi) const {
    return {lo * spec_.element_bytes, (hi - lo) * spec_.element_bytes};
  }
  // Chunk c of P near-equal element ranges (the ring's unit).
  Range Chunk(int c) const {
    c = Mod(c);
    return Elements(spec_.count * c / size_, spec_.count * (c + 1) / size_);
  }
  // Allgather: the pieces of ranks [first, end).
  Range Pieces(int first, int end) const {
    uint64_t piece = spec_.count * spec_.element_bytes;
    return {piece * first, piece * (end - first)};
  }

  // This rank's input at `p` for n bytes, `p` inside src_'s range (else
  // `p` itself): with input pieces, the piece that holds all n bytes, or a
  // copy gathered from the pieces (zeros between them), valid until the
  // next call.
  const uint8_t* In(const uint8_t* p, uint64_t n);

  // Channels and blocks.
  const SlotSpec& Channel(int from, int to) { return Slots(from, to).spec; }
  ChannelSlots& Slots(int from, int to);
  // Claim the next block of this rank's channel to `to`, or from `from`.
  Status ClaimSendTo(int to, SendTicket* ticket) {
    ChannelSlots& c = Slots(rank_, to);
    return engine_->ClaimSend(c.spec, ticket, 0, &c.send);
  }
  Status ClaimRecvFrom(int from, RecvTicket* ticket) {
    ChannelSlots& c = Slots(from, rank_);
    return engine_->ClaimRecv(c.spec, ticket, 0, &c.recv);
  }
  Status Fail(const Status& s, const char* verb, int peer) const;
  Status SendBlock(int to, const uint8_t* data, uint64_t nbytes);
  // Receives a block into dst: a copy, or with `local` the reduction
  // dst = local (op) block. `last`: this call reads dst no more (the block
  // is not sent on), so a copy of a large result may stream (StreamCopy).
  Status RecvBlock(int from, uint8_t* dst, uint64_t nbytes,
                   const uint8_t* local, bool last = false);

  // The two primitives. A range's own data is in the input (src_) until
  // the range is first written, in the buffer after that (RunCollective
  // works out of place): `local`, `send_from` and `reduce_with` say which
  // (reduce_with null: receive by copying).
  Status Exchange(int to, Range send, const uint8_t* send_from, int from,
                  Range recv, const uint8_t* reduce_with, bool last = false);
  Status RingTurn(int to, Range send, const uint8_t* send_from, int from,
                  Range reduced, Range gathered);
  // A Flow's received copies are `last` (RecvBlock) where it sends them to
  // no one, unless `sent_later`: another step sends them on.
  Status Flow(const std::vector<int>& from, const std::vector<int>& to,
              Range range, bool reduce, const uint8_t* local,
              bool sent_later = false);
  Status Send(int to, Range range, const uint8_t* local) {
    return Flow({}, {to}, range, false, local);
  }
  // `sent_later`: a later step of the call sends the range on.
  Status Recv(int from, Range range, bool sent_later) {
    return Flow({from}, {}, range, false, buf_, sent_later);
  }

  // The algorithms.
  Status Ring();
  Status RingAllGather(int owned_shift, bool pieces, int first_step = 0);
  Status Lp();
  Status LpChain(const std::vector<int>& order, Range range, bool reduce);
  Status LpAllGather();
  Status LpAllReduce();
  Status Tree();
  void TreeLinks(int root, int* parent, std::vector<int>* children) const;
  Status Rhd();
  Status RhdAllGather();
  Status OneShot();
  Status OneShotReduce(uint64_t at, uint64_t n,
                       std::vector<uint8_t>* scratch);

  // The inline path: a oneshot call of one block as three resumable
  // stages, the sends in OneShot()'s order, the receives (claimed and
  // polled together), then the reduction or copies (OneShot()'s, in the
  // same order: the same bits).
  bool Inlinable() const;
  void PlanOneBlock();
  const uint8_t* OneBlockSource() const;
  bool SendOneBlock(bool may_wait, Status* status);
  bool RecvOneBlock(bool may_wait, Status* status);
  void CombineOneBlock();
  bool planned_ = false;
  uint64_t piece_ = 0;          // the block's bytes
  std::vector<int> send_to_;    // in the order of the sends
  std::vector<int> recv_from_;  // in rank order
  size_t sent_ = 0;             // sends done
  bool send_claimed_ = false;   // send_ is claimed, not yet written
  SendTicket send_;
  std::vector<RecvTicket> recvs_;  // by recv_from_'s index, once claimed
  std::vector<char> arrived_;
  bool polled_ = false;  // the receives were polled for a spin's budget

  // Recursive halving over the active (power-of-two) ranks: see Rhd().
  int active_ = 1;  // P', the largest power of two <= P
  int extra_ = 0;   // P - P'
  int NewRank(int r) const {
    if (r < 2 * extra_) return r % 2 == 0 ? r / 2 : -1;
    return r - extra_;
  }
  int OldRank(int nr) const { return nr < extra_ ? 2 * nr : nr + extra_; }
  // The element ranges a new rank holds before each halving step, then
  // after the last; steps go d = P'/2, P'/4, ..., 1.
  std::vector<std::pair<uint64_t, uint64_t>> HalvingRanges(int nr) const;
  Range RangeOf(int nr) const {
    auto ranges = HalvingRanges(nr);
    return Elements(ranges.back().first, ranges.back().second);
  }

  const CollectiveSpec& spec_;
  const uint8_t* src_;
  uint8_t* buf_;
  const ReduceFn& reduce_;
  const int size_;
  const int rank_;
  const uint64_t block_;
  const std::string& hash_;
  Engine* engine_;
  // How long a wait for a block spins before it sleeps (see
  // kLatencyBoundBytes); 0: WaitForWord's few µs.
  const int64_t spin_us_;
  // The result is large enough for RecvBlock's last copies to stream
  // (kStreamResultBytes).
  const bool stream_results_;
  // The slot spec of each (from, to) channel, built on its first use.
  std::map<std::pair<int, int>, ChannelSlots>& channels_;
  std::vector<InputPiece> pieces_;  // empty: the input is at src_
  std::vector<uint8_t> gathered_;
};

const uint8_t* Runner::In(const uint8_t* p, uint64_t n) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(src_);
  const uintptr_t at_address = reinterpret_cast<uintptr_t>(p);
  if (pieces_.empty() || at_address < base ||
      at_address >= base + All().length) {
    return p;
  }
  const uint64_t at = at_address - base;
  auto after = std::upper_bound(
      pieces_.begin(), pieces_.end(), at,
      [](uint64_t a, const InputPiece& piece) { return a < piece.offset; });
  if (after != pieces_.begin()) {
    const InputPiece& piece = *(after - 1);
    if (at + n <= piece.offset + piece.bytes) {
      return piece.data + (at - piece.offset);
    }
  }
  gathered_.assign(n, 0);
  for (const InputPiece& piece : pieces_) {
    uint64_t lo = std::max(at, piece.offset);
    uint64_t hi = std::min(at + n, piece.offset + piece.bytes);
    if (lo < hi) {
      std::memcpy(gathered_.data() + (lo - at),
                  piece.data + (lo - piece.offset), hi - lo);
    }
  }
  return gathered_.data();
}

// A channel from rank `from` to rank `to`: one slot of `depth` copies of a
// block, alone in a region of the receiver's named after the instance and
// both tasks (so instances never share memory, and concurrent instances
// never interleave blocks).
ChannelSlots& Runner::Slots(int from, int to) {
  auto key = std::make_pair(from, to);
  auto it = channels_.find(key);
  if (it != channels_.end()) return it->second;
  SlotSpec s;
  s.tensor_name = spec_.instance;
  s.peer = spec_.group[from == rank_ ? to : from];
  s.region = "coll:" + spec_.instance + ":" + spec_.group[from] + ">" +
             spec_.group[to];
  s.plan_hash = hash_;
  s.nbytes = block_;
  s.stride = RoundUp(kSlotHeaderBytes + block_, 64);
  s.depth = spec_.depth;
  s.offset = 0;
  s.region_bytes = RoundUp(s.stride * s.depth, kPageBytes);
  s.credit_bytes = RoundUp(kCreditLineBytes * s.depth, kPageBytes);
  s.credit_index = 0;
  s.timeout_ms = spec_.timeout_ms;
  return channels_.emplace(key, ChannelSlots{s}).first->second;
}

// A rank that times out waiting for one peer may be waiting on a healthy
// rank that waits, in turn, for the one that stalled (in a ring, rank 1
// waits for rank 0, which waits for a stopped rank 2). The rank that stalled
// is visible from here in another way: it stops releasing the blocks sent
// to it. So a timeout also names every peer that still holds blocks this
// rank sent it, as the likely cause.
Status Runner::Fail(const Status& s, const char* verb, int peer) const {
  Status failed =
      s.Prefixed(spec_.Describe() + ": " + verb + " " + spec_.group[peer]);
  if (s.code() != Code::kDeadlineExceeded) return failed;
  std::string behind;
  for (const auto& kv : channels_) {
    if (kv.first.first != rank_) continue;
    uint64_t written = 0, released = 0;
    if (engine_->SendProgress(kv.second.spec, &written, &released) &&
        written > released) {
      behind += (behind.empty() ? "" : ", ") + spec_.group[kv.first.second] +
                " (has released block " + std::to_string(released) + " of " +
                std::to_string(written) + " sent)";
    }
  }
  if (behind.empty()) return failed;
  return Status(failed.code(),
                failed.message() + "; not taking the blocks this rank sent: " +
                    behind + ", stalled or gone and likely what the group "
                    "waits for");
}

Status Runner::SendBlock(int to, const uint8_t* data, uint64_t nbytes) {
  data = In(data, nbytes);
  SendTicket ticket;
  Status s = ClaimSendTo(to, &ticket);
  if (s.ok()) {
    ticket.nbytes = nbytes;
    s = engine_->FinishSend(ticket, data);
  }
  return s.ok() ? s : Fail(s, "sending to", to);
}

Status Runner::RecvBlock(int from, uint8_t* dst, uint64_t nbytes,
                         const uint8_t* local, bool last) {
  RecvTicket ticket;
  Status s = ClaimRecvFrom(from, &ticket);
  ticket.nbytes = nbytes;  // the last block may be shorter (counters)
  ticket.spin_us = spin_us_;
  if (s.ok()) s = engine_->FinishRecv(&ticket);
  if (!s.ok()) return Fail(s, "receiving from", from);
  trace::Span apply(ticket.traced_since);
  if (local != nullptr) {
    reduce_(dst, In(local, nbytes), ticket.payload,
            nbytes / spec_.element_bytes);
  } else if (last && stream_results_) {
    StreamCopy(dst, ticket.payload, nbytes);
  } else {
    std::memcpy(dst, ticket.payload, nbytes);
  }
  const SlotSpec& channel = Channel(from, rank_);
  apply.End(local != nullptr ? trace::kReduce : trace::kCopy,
            channel.tensor_name, nbytes, channel.peer, ticket.step);
  engine_->Release(ticket);
  return Status::Ok();
}

// Exchange: send one range to `to` while receiving another from `from`,
// block by block, interleaved (send block k, then receive block k).
//
// Both partners of a step run the same loop, so neither waits for more than
// the other has already sent; with channels of depth >= 1 this cannot
// deadlock, and with depth >= 2 the next block is written while the last is
// still being consumed. The two ranges are disjoint, so working in place is
// safe. Used by ring (neighbours) and rhd (partners).
Status Runner::Exchange(int to, Range send, const uint8_t* send_from,
                        int from, Range recv, const uint8_t* reduce_with,
                        bool last) {
  uint64_t send_blocks = Blocks(send.length);
  uint64_t recv_blocks = Blocks(recv.length);
  for (uint64_t k = 0; k < std::max(send_blocks, recv_blocks); ++k) {
    uint64_t at = k * block_;
    if (k < send_blocks) {
      TF_RDMA_RETURN_IF_ERROR(SendBlock(
          to, send_from + send.offset + at,
          std::min(block_, send.length - at)));
    }
    if (k < recv_blocks) {
      uint64_t where = recv.offset + at;
      TF_RDMA_RETURN_IF_ERROR(
          RecvBlock(from, buf_ + where, std::min(block_, recv.length - at),
                    reduce_with ? reduce_with + where : nullptr, last));
    }
  }
  return Status::Ok();
}

// Flow: for each block of `range`, receive it from every rank in `from`
// (reducing into, or copying into, the buffer), then send it on to every rank
// in `to`. A chain or a tree is a set of Flows; the pipeline comes from the
// block loop: while this rank forwards block k, its upstream already writes
// block k+1 into the channel, up to `depth` blocks ahead.
Status Runner::Flow(const std::vector<int>& from, const std::vector<int>& to,
                    Range range, bool reduce, const uint8_t* local,
                    bool sent_later) {
  const bool last = to.empty() && !sent_later;
  for (uint64_t k = 0; k < Blocks(range.length); ++k) {
    uint64_t at = range.offset + k * block_;
    uint64_t n = std::min(block_, range.offset + range.length - at);
    const uint8_t* mine = local + at;  // this rank's data for the block
    for (int f : from) {
      TF_RDMA_RETURN_IF_ERROR(
          RecvBlock(f, buf_ + at, n, reduce ? mine : nullptr, last));
      mine = buf_ + at;
    }
    for (int t : to) TF_RDMA_RETURN_IF_ERROR(SendBlock(t, mine, n));
  }
  return Status::Ok();
}

// ring: the bandwidth-optimal algorithm of Patarasuk and Yuan.
//
// The buffer is cut into P chunks. Reduce-scatter: in step s (of P-1) rank r
// sends chunk r-s to its right neighbour and reduces chunk r-s-1 arriving
// from its left; after P-1 steps rank r holds chunk r+1 fully reduced.
// Allgather: P-1 more steps pass the finished chunks around the ring. Each
// step moves n/P bytes in blocks, so with pipelining every link is busy all
// the time. Cost: 2(P-1)·α + 2(P-1)/P·n·β + (P-1)/P·n·γ — bandwidth term
// independent of P, latency term linear in P (the price for small messages).
// reduce(root) = reduce-scatter, then every rank sends its chunk to the
// root; broadcast(root) = the root scatters the chunks, then the allgather.
Status Runner::Ring() {
  int next = Mod(rank_ + 1), prev = Mod(rank_ - 1);
  switch (spec_.kind) {
    case CollectiveKind::kAllGather:
      return RingAllGather(0, true);
    case CollectiveKind::kBroadcast:
      if (rank_ == spec_.root) {
        for (int q = 0; q < size_; ++q) {
          if (q != rank_) TF_RDMA_RETURN_IF_ERROR(Send(q, Chunk(q + 1), buf_));
        }
      } else {
        TF_RDMA_RETURN_IF_ERROR(
            Recv(spec_.root, Chunk(rank_ + 1), /*sent_later=*/true));
      }
      return RingAllGather(1, false);
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kReduce:
      break;
  }
  const bool all = spec_.kind == CollectiveKind::kAllReduce;
  for (int s = 0; s < size_ - 1; ++s) {
    const uint8_t* from = s == 0 ? src_ : buf_;
    if (all && s == size_ - 2) {
      // The turn: the reduce-scatter's last step and the allgather's first
      // as one loop over blocks.
      TF_RDMA_RETURN_IF_ERROR(RingTurn(next, Chunk(rank_ - s), from, prev,
                                       Chunk(rank_ + 1), Chunk(rank_)));
      return RingAllGather(1, false, /*first_step=*/1);
    }
    TF_RDMA_RETURN_IF_ERROR(
        Exchange(next, Chunk(rank_ - s), from, prev, Chunk(rank_ - s - 1),
                 src_));
  }
  if (rank_ != spec_.root) return Send(spec_.root, Chunk(rank_ + 1), buf_);
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) TF_RDMA_RETURN_IF_ERROR(Recv(q, Chunk(q + 1), false));
  }
  return Status::Ok();
}

// The ring's turn from reduce-scatter to allgather. In the reduce-scatter's
// last step a rank finishes chunk r+1 block by block, and the allgather's
// first step sends that chunk on. Run as two loops, the chunk is written
// whole to the buffer and read back whole to be sent, long out of cache
// for a large message (a 64 MiB ring at P = 2 spent 19% more CPU than the
// bench's copy floor, which sends each sum while it is in cache). Here each
// block of the sum goes to the next rank right after it is reduced: per
// block k, send k of `send`, receive k and reduce it into `reduced`, send k
// of `reduced` on, receive k of `gathered` from `from`. Every rank runs the
// same loop, so a block it waits for has been sent by its neighbour in the
// same turn of the loop; a channel carries the two steps' blocks in the
// same order on both ends.
Status Runner::RingTurn(int to, Range send, const uint8_t* send_from,
                        int from, Range reduced, Range gathered) {
  const uint64_t send_blocks = Blocks(send.length);
  const uint64_t reduced_blocks = Blocks(reduced.length);
  const uint64_t gathered_blocks = Blocks(gathered.length);
  const uint64_t blocks =
      std::max(send_blocks, std::max(reduced_blocks, gathered_blocks));
  for (uint64_t k = 0; k < blocks; ++k) {
    const uint64_t at = k * block_;
    if (k < send_blocks) {
      TF_RDMA_RETURN_IF_ERROR(SendBlock(to, send_from + send.offset + at,
                                        std::min(block_, send.length - at)));
    }
    if (k < reduced_blocks) {
      const uint64_t where = reduced.offset + at;
      const uint64_t n = std::min(block_, reduced.length - at);
      TF_RDMA_RETURN_IF_ERROR(RecvBlock(from, buf_ + where, n, src_ + where));
      TF_RDMA_RETURN_IF_ERROR(SendBlock(to, buf_ + where, n));
    }
    if (k < gathered_blocks) {
      const uint64_t where = gathered.offset + at;
      TF_RDMA_RETURN_IF_ERROR(
          RecvBlock(from, buf_ + where, std::min(block_, gathered.length - at),
                    nullptr, /*last=*/size_ == 2));
    }
  }
  return Status::Ok();
}

// The ring's allgather phase; rank r starts with chunk (or piece) r+shift.
// Steps before `first_step` are done already (RingTurn did the first).
Status Runner::RingAllGather(int owned_shift, bool pieces, int first_step) {
  int next = Mod(rank_ + 1), prev = Mod(rank_ - 1);
  auto part = [&](int c) {
    c = Mod(c);
    return pieces ? Pieces(c, c + 1) : Chunk(c);
  };
  for (int s = first_step; s < size_ - 1; ++s) {
    int send = rank_ + owned_shift - s;
    TF_RDMA_RETURN_IF_ERROR(Exchange(next, part(send), buf_, prev,
                                     part(send - 1), nullptr,
                                     /*last=*/s == size_ - 2));
  }
  return Status::Ok();
}

// lp: linear pipelining along a chain (Zhao, Wang et al.).
//
// The ranks form a chain; the message is cut into blocks of b bytes. Block k
// moves from rank i to rank i+1 while block k+1 arrives at rank i, so after a
// fill of P-1 block times every link carries a block at once. A reduction
// adds the local block (reading the incoming one where it landed in the
// channel) before forwarding. Broadcast costs (P-1+n/b)·α + (b(P-1)+n)·β:
// for n >> b(P-1) that is n·β, independent of P — the chain's point; a tree
// sends the whole message log P times in sequence. reduce(root) ends the
// chain at the root, broadcast(root) starts it there; allreduce is both in
// one pipeline (LpAllReduce).
Status Runner::Lp() {
  std::vector<int> order(size_);
  switch (spec_.kind) {
    case CollectiveKind::kAllGather:
      return LpAllGather();
    case CollectiveKind::kBroadcast:
      for (int i = 0; i < size_; ++i) order[i] = Mod(spec_.root + i);
      return LpChain(order, All(), false);
    case CollectiveKind::kReduce:
      for (int i = 0; i < size_; ++i) order[i] = Mod(spec_.root + 1 + i);
      return LpChain(order, All(), true);
    case CollectiveKind::kAllReduce:
      break;
  }
  return LpAllReduce();
}

// lp allreduce: the reduce chain and the broadcast chain as one pipeline.
//
// Blocks are reduced up the chain 0 → P-1 and broadcast back down it
// P-1 → 0. Run one after the other, the two chains each pay the fill of
// P-1 block times, and a link carries data in one direction at a time.
// In the paper's combined schedule block k starts back down the chain as
// soon as rank P-1 has reduced it, while block k+1 is still on its way up:
// one fill for the whole allreduce, both directions of every link busy.
//
// Rank v in iteration t reduces block t (receive from v-1, add its own,
// send to v+1) and then passes block t - L(v) down (receive from v+1 into
// the buffer, send to v-1). L(v) = 2(P-1-v) is the round trip from v to the
// end of the chain and back, in block times: block t - L(v) is the one that
// arrives from above at about the moment block t arrives from below, so no
// rank waits on a direction while the other has work. Rank P-1 (L = 0) sends
// each block down as soon as it has reduced it.
//
// No deadlock for any depth >= 1: a rank blocks on a send only until its
// neighbour releases a block that neighbour reached earlier in its own
// loop, because neighbouring lags differ by 2 <= 2·depth iterations.
// Cost, with h = α + b·β the send of a block, g = b·γ its reduction and
// d = b·δ its copy: a middle rank does h + g + h + d per block, so
// (n/b + 2(P-1))·(2h + g + d) at most; on links whose sends cost the CPU
// nothing (RDMA) about half of the two chains run one after the other.
Status Runner::LpAllReduce() {
  const int v = rank_;  // the chain is the ranks in order
  const uint64_t blocks = Blocks(All().length);
  const uint64_t lag = 2 * static_cast<uint64_t>(size_ - 1 - v);
  for (uint64_t t = 0; t < blocks + lag; ++t) {
    if (t < blocks) {  // up: block t
      uint64_t at = t * block_;
      uint64_t n = std::min(block_, All().length - at);
      const uint8_t* mine = src_ + at;
      if (v > 0) {
        TF_RDMA_RETURN_IF_ERROR(RecvBlock(v - 1, buf_ + at, n, mine));
        mine = buf_ + at;
      }
      if (v < size_ - 1) TF_RDMA_RETURN_IF_ERROR(SendBlock(v + 1, mine, n));
    }
    if (t >= lag) {  // down: block t - lag
      uint64_t at = (t - lag) * block_;
      uint64_t n = std::min(block_, All().length - at);
      if (v < size_ - 1) {
        TF_RDMA_RETURN_IF_ERROR(
            RecvBlock(v + 1, buf_ + at, n, nullptr, /*last=*/v == 0));
      }
      if (v > 0) TF_RDMA_RETURN_IF_ERROR(SendBlock(v - 1, buf_ + at, n));
    }
  }
  return Status::Ok();
}

Status Runner::LpChain(const std::vector<int>& order, Range range,
                       bool reduce) {
  int v = static_cast<int>(std::find(order.begin(), order.end(), rank_) -
                           order.begin());
  std::vector<int> from, to;
  if (v > 0) from.push_back(order[v - 1]);
  if (v < size_ - 1) to.push_back(order[v + 1]);
  return Flow(from, to, range, reduce, reduce ? src_ : buf_);
}

// lp allgather: down the chain 0 → P-1 rank v forwards pieces 0..v-1 as they
// arrive, then sends its own; the last rank then holds everything, and back
// up the chain rank v sends its own piece, then forwards pieces v+1..P-1.
Status Runner::LpAllGather() {
  int v = rank_;
  bool has_next = v < size_ - 1, has_prev = v > 0;
  std::vector<int> next, prev;
  if (has_next) next.push_back(v + 1);
  if (has_prev) prev.push_back(v - 1);
  for (int p = 0; p < v; ++p) {
    TF_RDMA_RETURN_IF_ERROR(Flow(prev, next, Pieces(p, p + 1), false, buf_));
  }
  if (has_next) TF_RDMA_RETURN_IF_ERROR(Send(v + 1, Pieces(v, v + 1), buf_));
  if (has_prev) TF_RDMA_RETURN_IF_ERROR(Send(v - 1, Pieces(v, v + 1), buf_));
  for (int p = v + 1; p < size_; ++p) {
    TF_RDMA_RETURN_IF_ERROR(Flow(next, prev, Pieces(p, p + 1), false, buf_));
  }
  return Status::Ok();
}

// tree: a binomial tree, pipelined by blocks.
//
// With v the rank relative to the root, v's children are v + 2^k for every
// 2^k below v's lowest set bit, its parent v - lowbit(v): ceil(log2 P)
// levels, the root with the most children. reduce = every rank receives
// each block from its children (reducing it in), then sends it to its
// parent; broadcast = the reverse. Blocks pipeline through the levels like
// the chain's, but a rank with c children moves each block c times, so the
// bandwidth term is about ceil(log2 P)·n·β at the root against n·β for lp:
// the tree wins on latency (log P hops), loses on bandwidth.
// allreduce = reduce to rank 0, then broadcast from it; allgather = each
// subtree's pieces gathered to rank 0 (contiguous), then broadcast.
Status Runner::Tree() {
  int parent = -1;  // set by TreeLinks
  std::vector<int> children;
  auto up = [&] {
    return parent < 0 ? std::vector<int>{} : std::vector<int>{parent};
  };
  switch (spec_.kind) {
    case CollectiveKind::kBroadcast:
      TreeLinks(spec_.root, &parent, &children);
      return Flow(up(), children, All(), false, buf_);
    case CollectiveKind::kReduce:
      TreeLinks(spec_.root, &parent, &children);
      return Flow(children, up(), All(), true, src_);
    case CollectiveKind::kAllReduce:
      TreeLinks(0, &parent, &children);
      TF_RDMA_RETURN_IF_ERROR(Flow(children, up(), All(), true, src_));
      break;
    case CollectiveKind::kAllGather: {
      TreeLinks(0, &parent, &children);
      auto subtree_end = [&](int v) {
        int low = v == 0 ? size_ : (v & -v);
        return std::min(size_, v + low);
      };
      for (int c : children) {
        TF_RDMA_RETURN_IF_ERROR(
            Recv(c, Pieces(c, subtree_end(c)), /*sent_later=*/true));
      }
      if (parent >= 0) {
        TF_RDMA_RETURN_IF_ERROR(
            Send(parent, Pieces(rank_, subtree_end(rank_)), buf_));
      }
      break;
    }
  }
  return Flow(up(), children, All(), false, buf_);
}

void Runner::TreeLinks(int root, int* parent,
                       std::vector<int>* children) const {
  int v = Mod(rank_ - root);
  *parent = -1;
  for (int mask = 1; mask < size_; mask <<= 1) {
    if (v & mask) {
      *parent = Mod(v - mask + root);
      return;
    }
    if (v + mask < size_) children->push_back(Mod(v + mask + root));
  }
}

std::vector<std::pair<uint64_t, uint64_t>> Runner::HalvingRanges(
    int nr) const {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  uint64_t lo = 0, hi = spec_.count;
  for (int d = active_ / 2; d >= 1; d /= 2) {
    ranges.emplace_back(lo, hi);
    uint64_t mid = lo + (hi - lo) / 2;
    if (nr & d) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  ranges.emplace_back(lo, hi);
  return ranges;
}

// rhd: recursive halving and doubling (Rabenseifner; MPI's "bidirectional
// exchange").
//
// Over P' = 2^k ranks, the halving phase pairs rank i with i XOR d for
// d = P'/2, ..., 1: each sends the half of its current range it gives away
// and reduces the half it keeps, so after log P' steps each rank owns 1/P'
// of the vector fully reduced; the doubling phase retraces the steps and
// swaps the finished parts. Each step is one exchange, both directions of a
// pair at once: 2·log P·α + 2(P-1)/P·n·β + (P-1)/P·n·γ — the ring's
// bandwidth with only logarithmic latency. When P is not a power of two,
// ranks r < 2(P-P') pair up first: each odd one hands its vector to its even
// neighbour (which reduces it in) and sits out until the end, when it gets
// the result back — one extra n·(β[+γ]) on the critical path.
// reduce(root) = fold, halving, every active rank sends its part to the
// root; broadcast(root) = the root scatters the parts, doubling, unfold.
Status Runner::Rhd() {
  active_ = 1;
  while (active_ * 2 <= size_) active_ *= 2;
  extra_ = size_ - active_;
  if (spec_.kind == CollectiveKind::kAllGather) return RhdAllGather();
  const int r = rank_, root = spec_.root;
  const int nr = NewRank(r);
  const bool folded = r < 2 * extra_;
  CollectiveKind kind = spec_.kind;
  if (kind != CollectiveKind::kBroadcast && folded) {
    if (nr < 0) {  // odd: hand over, then (maybe) wait for the result
      TF_RDMA_RETURN_IF_ERROR(Send(r - 1, All(), src_));
      if (kind == CollectiveKind::kAllReduce) return Recv(r - 1, All(), false);
      if (r != root) return Status::Ok();
      for (int k = 0; k < active_; ++k) {
        TF_RDMA_RETURN_IF_ERROR(Recv(OldRank(k), RangeOf(k), false));
      }
      return Status::Ok();
    }
    TF_RDMA_RETURN_IF_ERROR(Flow({r + 1}, {}, All(), true, src_));
  }
  if (kind == CollectiveKind::kBroadcast) {
    // Scatter from the root: every active rank gets the part it would own
    // after halving.
    if (r == root) {
      for (int k = 0; k < active_; ++k) {
        if (OldRank(k) != r) {
          TF_RDMA_RETURN_IF_ERROR(Send(OldRank(k), RangeOf(k), buf_));
        }
      }
    } else if (nr >= 0) {
      TF_RDMA_RETURN_IF_ERROR(
          Recv(root, RangeOf(nr), /*sent_later=*/true));
    }
    if (nr < 0) {  // an odd folded rank: the root or waiting for the unfold
      return r == root ? Status::Ok() : Recv(r - 1, All(), false);
    }
  }
  auto ranges = HalvingRanges(nr);
  if (kind != CollectiveKind::kBroadcast) {
    // The first step reads the input, unless the fold already wrote it all.
    const uint8_t* local = folded ? buf_ : src_;
    int step = 0;
    for (int d = active_ / 2; d >= 1; d /= 2, ++step, local = buf_) {
      auto whole = ranges[step], keep = ranges[step + 1];
      uint64_t give_lo = keep.first == whole.first ? keep.second : whole.first;
      uint64_t give_hi = keep.first == whole.first ? whole.second : keep.first;
      int partner = OldRank(nr ^ d);
      TF_RDMA_RETURN_IF_ERROR(Exchange(partner, Elements(give_lo, give_hi),
                                       local, partner,
                                       Elements(keep.first, keep.second),
                                       local));
    }
  }
  if (kind == CollectiveKind::kReduce) {
    if (r != root) return Send(root, RangeOf(nr), buf_);
    for (int k = 0; k < active_; ++k) {
      if (k != nr) TF_RDMA_RETURN_IF_ERROR(Recv(OldRank(k), RangeOf(k), false));
    }
    return Status::Ok();
  }
  int step = static_cast<int>(ranges.size()) - 2;
  for (int d = 1; d < active_; d *= 2, --step) {
    auto whole = ranges[step], own = ranges[step + 1];
    uint64_t other_lo = own.first == whole.first ? own.second : whole.first;
    uint64_t other_hi = own.first == whole.first ? whole.second : own.first;
    int partner = OldRank(nr ^ d);
    TF_RDMA_RETURN_IF_ERROR(Exchange(partner, Elements(own.first, own.second),
                                     buf_, partner,
                                     Elements(other_lo, other_hi), nullptr,
                                     /*last=*/2 * d >= active_ && !folded));
  }
  if (folded && !(kind == CollectiveKind::kBroadcast && r + 1 == root)) {
    return Send(r + 1, All(), buf_);
  }
  return Status::Ok();
}

// rhd allgather: recursive doubling. After the fold (odd ranks hand their
// piece to their even neighbour), new rank k holds the pieces of a
// contiguous run of old ranks, and so does every aligned group of new ranks:
// step d swaps the runs of the two groups of size d that make one of 2d.
Status Runner::RhdAllGather() {
  const int r = rank_;
  const int nr = NewRank(r);
  const bool folded = r < 2 * extra_;
  if (folded && nr < 0) {
    TF_RDMA_RETURN_IF_ERROR(Send(r - 1, Pieces(r, r + 1), buf_));
    return Recv(r - 1, All(), false);
  }
  if (folded) {
    TF_RDMA_RETURN_IF_ERROR(
        Recv(r + 1, Pieces(r + 1, r + 2), /*sent_later=*/true));
  }
  // The old ranks of new rank k are [OldRank(k), end_old(k)).
  auto first_old = [&](int k) { return OldRank(k); };
  auto end_old = [&](int k) { return k < extra_ ? 2 * k + 2 : k + extra_ + 1; };
  for (int d = 1; d < active_; d *= 2) {
    int mine = nr - nr % d, theirs = (nr ^ d) - (nr ^ d) % d;
    TF_RDMA_RETURN_IF_ERROR(Exchange(
        OldRank(nr ^ d), Pieces(first_old(mine), end_old(mine + d - 1)), buf_,
        OldRank(nr ^ d), Pieces(first_old(theirs), end_old(theirs + d - 1)),
        nullptr, /*last=*/2 * d >= active_ && !folded));
  }
  if (folded) return Send(r + 1, All(), buf_);
  return Status::Ok();
}

// oneshot: every rank sends straight to every rank that needs its data, in
// one step; the latency path for small messages.
//
// allreduce: each rank writes its input into a channel of every other rank,
// then reduces the P inputs in rank order (0, 1, ..., P-1), reading the
// peers' where they landed; the order is the same on every rank, so all get
// the same bits. reduce: the same with the root alone receiving; broadcast:
// the root writes to every rank; allgather: every rank writes its piece to
// every rank. One block time of latency (α) instead of the 2(P-1) of ring or
// the 2 log P of rhd, for (P-1)·n·β sent and (P-1)·n·γ reduced per rank:
// P-1 times the bytes of ring, so only worth it while α dominates, which is
// what the cost model's choice weighs. Messages longer than a block go block
// by block, each block one-shot.
Status Runner::OneShot() {
  const uint64_t length = All().length;
  const int root = spec_.root;
  std::vector<uint8_t> scratch;
  if (spec_.kind == CollectiveKind::kAllGather) {
    uint64_t piece = spec_.count * spec_.element_bytes;
    for (uint64_t at = 0; at < piece; at += block_) {
      uint64_t n = std::min(block_, piece - at);
      for (int i = 1; i < size_; ++i) {
        TF_RDMA_RETURN_IF_ERROR(
            SendBlock(Mod(rank_ + i), buf_ + rank_ * piece + at, n));
      }
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        TF_RDMA_RETURN_IF_ERROR(
            RecvBlock(q, buf_ + q * piece + at, n, nullptr, /*last=*/true));
      }
    }
    return Status::Ok();
  }
  for (uint64_t at = 0; at < length; at += block_) {
    uint64_t n = std::min(block_, length - at);
    if (spec_.kind == CollectiveKind::kBroadcast) {
      if (rank_ != root) {
        TF_RDMA_RETURN_IF_ERROR(
            RecvBlock(root, buf_ + at, n, nullptr, /*last=*/true));
        continue;
      }
      for (int i = 1; i < size_; ++i) {
        TF_RDMA_RETURN_IF_ERROR(SendBlock(Mod(rank_ + i), buf_ + at, n));
      }
      continue;
    }
    // allreduce and reduce
    if (spec_.kind == CollectiveKind::kAllReduce) {
      for (int i = 1; i < size_; ++i) {
        TF_RDMA_RETURN_IF_ERROR(SendBlock(Mod(rank_ + i), src_ + at, n));
      }
    } else if (rank_ != root) {
      TF_RDMA_RETURN_IF_ERROR(SendBlock(root, src_ + at, n));
      continue;
    }
    TF_RDMA_RETURN_IF_ERROR(OneShotReduce(at, n, &scratch));
  }
  return Status::Ok();
}

// buf[at, at+n) = x_0 op x_1 op ... op x_{P-1}, in rank order, where x_q is
// rank q's block: this rank's own from the input, the others' from their
// channels. The first two operands are held at once (two tickets), the
// rest are reduced in one by one. Working in place, this rank's input is
// the buffer, which the first reduction overwrites: a rank after 1 keeps a
// copy of its block first.
Status Runner::OneShotReduce(uint64_t at, uint64_t n,
                             std::vector<uint8_t>* scratch) {
  const uint8_t* mine = In(src_ + at, n);
  if (src_ == buf_ && rank_ >= 2) {
    scratch->assign(mine, mine + n);
    mine = scratch->data();
  }
  RecvTicket held[2];
  const uint8_t* first[2];
  for (int q = 0; q < 2; ++q) {
    if (q == rank_) {
      first[q] = mine;
      continue;
    }
    Status s = ClaimRecvFrom(q, &held[q]);
    held[q].nbytes = n;
    held[q].spin_us = spin_us_;
    if (s.ok()) s = engine_->FinishRecv(&held[q]);
    if (!s.ok()) {
      if (q == 1 && rank_ != 0) engine_->Release(held[0]);  // taken already
      return Fail(s, "receiving from", q);
    }
    first[q] = held[q].payload;
  }
  // Traced as the reduction of the later of the two received operands.
  const int last = rank_ == 1 ? 0 : 1;
  trace::Span apply(held[last].traced_since);
  reduce_(buf_ + at, first[0], first[1], n / spec_.element_bytes);
  const SlotSpec& channel = Channel(last, rank_);
  apply.End(trace::kReduce, channel.tensor_name, n, channel.peer,
            held[last].step);
  for (int q = 0; q < 2; ++q) {
    if (q != rank_) engine_->Release(held[q]);
  }
  for (int q = 2; q < size_; ++q) {
    if (q == rank_) {
      reduce_(buf_ + at, buf_ + at, mine, n / spec_.element_bytes);
    } else {
      TF_RDMA_RETURN_IF_ERROR(RecvBlock(q, buf_ + at, n, buf_ + at));
    }
  }
  return Status::Ok();
}

// The inline path (StartCollective): a oneshot collective of one block on
// the op's own thread.
//
// What: the thread that runs the op writes the block to every peer whose
// credit is there, polls for the peers' blocks for up to the collective's
// spin (at least EngineConfig::poll_us), and if all are there reduces or
// copies them and completes the op, all on TensorFlow's thread. Where it
// would have to wait longer (a peer late, a credit not back, a first call
// that must connect), the call, with the tickets it holds, moves to an
// engine thread, which goes on from the same point with the bounded,
// stall-watched waits of every other collective.
// Why: handing every call to an engine thread costs that thread's
// wake-up and then TensorFlow's (the op's done), about 45 µs a call on a
// VM (docs/benchmarks.md, "Small messages"): more than a small
// collective's whole exchange. The hand-off stays for the waits: a
// collective that waits must not hold TensorFlow's inter-op thread.
// The poll is PollFor's (wait.h): it yields the core between its looks
// where this host runs more of the cluster's tasks than it has CPUs
// (Engine::shares_cores).
// Cost: the op's thread polls for at most the spin's budget (PollFor); the
// result is the same bits as OneShot()'s (same order of operands).
bool Runner::Inlinable() const {
  if (spec_.algorithm != Algorithm::kOneShot) return false;
  uint64_t piece = spec_.kind == CollectiveKind::kAllGather
                       ? spec_.count * spec_.element_bytes
                       : All().length;
  return piece <= block_;
}

void Runner::PlanOneBlock() {
  planned_ = true;
  const bool gather = spec_.kind == CollectiveKind::kAllGather;
  piece_ = gather ? spec_.count * spec_.element_bytes : All().length;
  const int root = spec_.root;
  bool to_all = false, from_all = false;
  switch (spec_.kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kAllGather:
      to_all = from_all = true;
      break;
    case CollectiveKind::kBroadcast:
      to_all = rank_ == root;
      if (rank_ != root) recv_from_.push_back(root);
      break;
    case CollectiveKind::kReduce:
      from_all = rank_ == root;
      if (rank_ != root) send_to_.push_back(root);
      break;
  }
  for (int i = 1; to_all && i < size_; ++i) send_to_.push_back(Mod(rank_ + i));
  for (int q = 0; from_all && q < size_; ++q) {
    if (q != rank_) recv_from_.push_back(q);
  }
}

const uint8_t* Runner::OneBlockSource() const {
  switch (spec_.kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kReduce:
      return src_;
    case CollectiveKind::kAllGather:
      return buf_ + rank_ * piece_;
    case CollectiveKind::kBroadcast:
      break;
  }
  return buf_;
}

bool Runner::SendOneBlock(bool may_wait, Status* status) {
  while (sent_ < send_to_.size()) {
    const int to = send_to_[sent_];
    Status s;
    if (!send_claimed_) {
      send_ = SendTicket();  // (a credit wait noted on the last send ended)
      s = ClaimSendTo(to, &send_);
      if (!s.ok()) {
        *status = Fail(s, "sending to", to);
        return true;
      }
      send_.nbytes = piece_;
      send_claimed_ = true;
    }
    if (may_wait) {
      s = engine_->FinishSend(send_, In(OneBlockSource(), piece_));
    } else if (!engine_->TrySendNow(&send_, In(OneBlockSource(), piece_),
                                    &s)) {
      return false;
    }
    send_claimed_ = false;
    if (!s.ok()) {
      *status = Fail(s, "sending to", to);
      return true;
    }
    ++sent_;
  }
  return true;
}

bool Runner::RecvOneBlock(bool may_wait, Status* status) {
  if (recvs_.size() != recv_from_.size()) {
    recvs_.resize(recv_from_.size());
    arrived_.assign(recv_from_.size(), 0);
    for (size_t i = 0; i < recv_from_.size(); ++i) {
      Status s = ClaimRecvFrom(recv_from_[i], &recvs_[i]);
      if (!s.ok()) {
        *status = Fail(s, "receiving from", recv_from_[i]);
        for (size_t j = 0; j < i; ++j) engine_->CancelRecv(&recvs_[j], s);
        return true;
      }
      recvs_[i].nbytes = piece_;
      recvs_[i].spin_us = spin_us_;
    }
  }
  size_t left = 0;
  for (char a : arrived_) left += a ? 0 : 1;
  if (!may_wait) {
    const Clock::time_point until =
        Clock::now() + std::chrono::microseconds(std::max(
                           spin_us_, engine_->config().poll_us));
    auto all_there = [&] {
      for (size_t i = 0; i < recvs_.size(); ++i) {
        if (!arrived_[i] && engine_->TakeRecvNow(&recvs_[i])) {
          arrived_[i] = 1;
          --left;
        }
      }
      return left == 0;
    };
    if (!PollFor(all_there, until, engine_->shares_cores())) {
      polled_ = true;
      return false;
    }
    return true;
  }
  for (size_t i = 0; i < recvs_.size(); ++i) {
    if (arrived_[i]) continue;
    if (polled_) recvs_[i].spin_us = 0;  // it has spun inline already
    Status s = engine_->FinishRecv(&recvs_[i]);
    if (!s.ok()) {
      // The others: blocks taken go back to their writers, waits not
      // finished are given up (the instance is poisoned now).
      for (size_t j = 0; j < recvs_.size(); ++j) {
        if (arrived_[j]) {
          engine_->Release(recvs_[j]);
        } else if (j != i) {
          engine_->CancelRecv(&recvs_[j], s);
        }
      }
      *status = Fail(s, "receiving from", recv_from_[i]);
      return true;
    }
    arrived_[i] = 1;
  }
  return true;
}

// With every block there: the reduction in rank order (OneShotReduce's
// operands in its order), the broadcast's copy or the allgather's copies;
// then the blocks go back to their writers.
void Runner::CombineOneBlock() {
  auto held = [this](int q) -> const RecvTicket& {
    size_t i = std::find(recv_from_.begin(), recv_from_.end(), q) -
               recv_from_.begin();
    return recvs_[i];
  };
  const bool reduces = spec_.kind == CollectiveKind::kAllReduce ||
                       spec_.kind == CollectiveKind::kReduce;
  if (reduces && !recv_from_.empty()) {
    const uint64_t elements = piece_ / spec_.element_bytes;
    std::vector<uint8_t> scratch;
    const uint8_t* mine = In(src_, piece_);
    if (src_ == buf_ && rank_ >= 2) {
      scratch.assign(src_, src_ + piece_);
      mine = scratch.data();
    }
    auto operand = [&](int q) {
      return q == rank_ ? mine : held(q).payload;
    };
    // Traced as the reduction of the last operand received.
    const RecvTicket& last = recvs_.back();
    trace::Span apply(last.traced_since);
    reduce_(buf_, operand(0), operand(1), elements);
    for (int q = 2; q < size_; ++q) reduce_(buf_, buf_, operand(q), elements);
    const SlotSpec& channel = Channel(recv_from_.back(), rank_);
    apply.End(trace::kReduce, channel.tensor_name, piece_, channel.peer,
              last.step);
  } else if (!reduces) {
    const bool gather = spec_.kind == CollectiveKind::kAllGather;
    for (size_t i = 0; i < recvs_.size(); ++i) {
      trace::Span copy(recvs_[i].traced_since);
      std::memcpy(buf_ + (gather ? recv_from_[i] * piece_ : 0),
                  recvs_[i].payload, piece_);
      const SlotSpec& channel = Channel(recv_from_[i], rank_);
      copy.End(trace::kCopy, channel.tensor_name, piece_, channel.peer,
               recvs_[i].step);
    }
  }
  for (const RecvTicket& t : recvs_) engine_->Release(t);
}

// A group of one: the result is this rank's own input, which an
// out-of-place call (the input not forwarded, or a bucket's input pieces)
// still has to copy into the buffer; nothing else does it.
void Runner::Alone() {
  const Range all = All();
  if (src_ == buf_) return;
  for (uint64_t at = 0; at < all.length; at += block_) {
    const uint64_t n = std::min<uint64_t>(block_, all.length - at);
    std::memcpy(buf_ + at, In(src_ + at, n), n);
  }
}

bool Runner::Advance(bool may_wait, Status* status) {
  *status = Status::Ok();
  if (size_ == 1) {
    Alone();
    return true;
  }
  if (All().length == 0) return true;
  if (!Inlinable()) {
    if (!may_wait) return false;
    *status = Run();
    return true;
  }
  if (!planned_) PlanOneBlock();
  if (!SendOneBlock(may_wait, status)) return false;
  if (!status->ok()) return true;
  if (!RecvOneBlock(may_wait, status)) return false;
  if (status->ok()) CombineOneBlock();
  return true;
}

Status Runner::Run() {
  if (size_ == 1) {
    Alone();
    return Status::Ok();
  }
  if (All().length == 0) return Status::Ok();
  switch (spec_.algorithm) {
    case Algorithm::kLp: return Lp();
    case Algorithm::kRing: return Ring();
    case Algorithm::kTree: return Tree();
    case Algorithm::kRhd: return Rhd();
    case Algorithm::kOneShot: return OneShot();
  }
  return InvalidArgument("unknown algorithm");
}

// One call of a collective, from its admission to its end.
// Its spec, plan hash and name are the instance's, which no other call
// changes while this one holds the instance (busy): not copied per call.
struct Call {
  InstanceState* state = nullptr;
  uint64_t number = 0;  // of the instance's calls: the step traces name
  int64_t traced_since = 0;
  // Equal to the call's spec in every field (Admit).
  const CollectiveSpec& spec() const { return state->checked_spec; }
  const std::string& hash() const { return state->hash; }
  // As the stall lines name it, "allreduce 'grads'".
  const std::string& describe() const { return state->call_describe; }
};

// Admits a call: checks the endpoint, the spec and the instance (poisoned,
// another layout), then takes the instance, waiting while another call of
// it runs unless `may_wait` is false: then *taken stays false and the
// caller must call again from a thread that may wait.
Status Admit(const CollectiveSpec& spec, bool may_wait, Call* call,
             bool* taken) {
  *taken = false;
  Engine* engine = Engine::Get();
  if (!engine->started()) {
    return FailedPrecondition(
        spec.Describe() + ": the tf_rdma endpoint is not running in this "
        "process; call tf_rdma.start_endpoint (or use RdmaStrategy) first");
  }
  engine->LogCollectiveSpin();
  InstanceState* state = GetInstance(spec.instance);
  const std::string& task = engine->config().task;
  std::unique_lock<std::mutex> lock(state->mu);
  if (state->busy && !may_wait) return Status::Ok();
  // Bounded like every wait: the earlier call's own waits are, but where
  // the pool can start no thread it may be queued behind calls like this.
  const int64_t timeout_ms =
      spec.timeout_ms > 0 ? spec.timeout_ms : engine->config().timeout_ms;
  if (!state->idle.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                            [state] { return !state->busy; })) {
    return DeadlineExceeded(
        spec.Describe() + ": timed out after " + std::to_string(timeout_ms) +
        " ms waiting for an earlier call of this instance in this process "
        "to end (calls of one instance run one at a time)");
  }
  if (!state->poisoned.empty()) {
    return FailedPrecondition(spec.Describe() +
                              " cannot run any more: an earlier call failed (" +
                              state->poisoned + ")");
  }
  if (!state->checked || state->checked_task != task ||
      !spec.SameAs(state->checked_spec)) {
    TF_RDMA_RETURN_IF_ERROR(spec.Validate(task));
    std::string hash = spec.Hash();
    if (state->hash.empty()) {
      state->hash = hash;
      state->describe = spec.Describe();
    } else if (state->hash != hash) {
      return InvalidArgument(
          "collective instance '" + spec.instance + "' was first used by " +
          state->describe + " with another layout (hash " + state->hash +
          "), now with hash " + hash +
          "; give collectives of different shapes, dtypes or algorithms "
          "different names");
    }
    state->checked = true;
    state->checked_spec = spec;
    state->checked_task = task;
    state->call_describe =
        std::string(KindName(spec.kind)) + " '" + spec.instance + "'";
    state->channels.clear();
  }
  state->busy = true;
  *taken = true;
  call->state = state;
  call->number = ++state->calls;
  call->traced_since = trace::Claim();
  engine->CollectiveBegin(spec.instance, call->number);
  return Status::Ok();
}

// Ends an admitted call with its outcome: the peers' view of this task's
// position, the poison of a failure, the trace event and the counters;
// then the instance is free for its next call.
void Finish(const Call& call, const Status& s, bool inline_path) {
  Engine* engine = Engine::Get();
  const CollectiveSpec& spec = call.spec();
  engine->CollectiveEnd(spec.instance, s.ok());
  engine->CountCollective(inline_path);
  if (call.traced_since != 0) {
    std::string group;
    for (const std::string& task : spec.group) {
      group += (group.empty() ? "" : " ") + task;
    }
    uint64_t bytes = spec.count * spec.element_bytes;
    if (spec.kind == CollectiveKind::kAllGather) bytes *= spec.group.size();
    trace::Event e;
    e.name = trace::kCollective;
    e.key = &spec.instance;
    e.bytes = bytes;
    e.peer = &group;
    e.step = call.number;
    e.kind = KindName(spec.kind);
    e.algorithm = AlgorithmName(spec.algorithm);
    e.start_ns = call.traced_since;
    e.end_ns = std::max(call.traced_since, trace::NowNs());
    trace::Record(e);
  }
  {
    std::lock_guard<std::mutex> lock(call.state->mu);
    if (!s.ok()) call.state->poisoned = s.message();
    call.state->busy = false;
  }
  call.state->idle.notify_all();
}

// Advances an admitted call to its end on this thread, its waits named
// after it for the stall inspector.
Status AdvanceToEnd(const Call& call, Runner* runner) {
  Engine* engine = Engine::Get();
  engine->CollectiveWaitsBegin(call.spec().instance, call.describe(),
                               call.number);
  Status s;
  runner->Advance(/*may_wait=*/true, &s);
  engine->CollectiveWaitsEnd();
  return s;
}

}  // namespace

Status RunCollective(const CollectiveSpec& spec, const uint8_t* src,
                     uint8_t* buf, const ReduceFn& reduce) {
  Call call;
  bool taken = false;
  TF_RDMA_RETURN_IF_ERROR(Admit(spec, /*may_wait=*/true, &call, &taken));
  Runner runner(call.spec(), call.hash(), &call.state->channels, src, buf,
                reduce);
  Status s = AdvanceToEnd(call, &runner);
  Finish(call, s, /*inline_path=*/false);
  return s;
}

void StartCollective(const CollectiveSpec& spec, const uint8_t* src,
                     uint8_t* buf, const ReduceFn& reduce,
                     CollectiveDone done, std::vector<InputPiece> pieces) {
  // What the call needs, kept alive until `done` (shared: the engine
  // thread's work item must be copyable).
  struct Started {
    Call call;
    ReduceFn reduce;
    CollectiveDone done;
    std::unique_ptr<Runner> runner;
    // Input pieces: the addresses that stand for the input's layout
    // (reserved, never readable: a read that skipped Runner::In faults
    // instead of reading another buffer), or the pieces gathered into one
    // buffer where no address range could be had.
    void* reserved = nullptr;
    size_t reserved_bytes = 0;
    std::vector<uint8_t> assembled;
    ~Started() {
      if (reserved != nullptr) munmap(reserved, reserved_bytes);
    }
  };
  auto started = std::make_shared<Started>();
  started->reduce = reduce;
  started->done = std::move(done);
  if (!pieces.empty()) {
    uint64_t length = spec.count * spec.element_bytes;
    void* p = mmap(nullptr, std::max<uint64_t>(length, 1), PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p != MAP_FAILED) {
      started->reserved = p;
      started->reserved_bytes = std::max<uint64_t>(length, 1);
      src = static_cast<const uint8_t*>(p);
    } else {
      started->assembled.assign(length, 0);
      for (const InputPiece& piece : pieces) {
        std::memcpy(started->assembled.data() + piece.offset, piece.data,
                    piece.bytes);
      }
      src = started->assembled.data();
      pieces.clear();
    }
  }
  Engine* engine = Engine::Get();
  bool taken = false;
  Status s = Admit(spec, /*may_wait=*/false, &started->call, &taken);
  if (!s.ok()) {
    started->done(s);
    return;
  }
  if (!taken) {
    // Another call of the instance runs: this one waits for it on an
    // engine thread.
    CollectiveSpec copy = spec;
    auto later = std::make_shared<std::vector<InputPiece>>(std::move(pieces));
    engine->Schedule([started, copy, src, buf, later] {
      bool admitted = false;
      Status s = Admit(copy, /*may_wait=*/true, &started->call, &admitted);
      if (s.ok()) {
        Runner runner(started->call.spec(), started->call.hash(),
                      &started->call.state->channels, src, buf,
                      started->reduce);
        runner.SetInputPieces(std::move(*later));
        s = AdvanceToEnd(started->call, &runner);
        Finish(started->call, s, /*inline_path=*/false);
      }
      started->done(s);
    });
    return;
  }
  started->runner.reset(new Runner(started->call.spec(), started->call.hash(),
                                   &started->call.state->channels, src, buf,
                                   started->reduce));
  started->runner->SetInputPieces(std::move(pieces));
  if (started->runner->Advance(/*may_wait=*/false, &s)) {
    Finish(started->call, s, /*inline_path=*/true);
    started->done(s);
    return;
  }
  engine->Schedule([started] {
    Status out = AdvanceToEnd(started->call, started->runner.get());
    Finish(started->call, out, /*inline_path=*/false);
    started->done(out);
  });
}

}  // namespace tf_rdma
