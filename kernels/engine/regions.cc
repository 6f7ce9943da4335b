// Regions: the engine's own regions, and the OPEN requests in which a
// writer asks for its region here.

#include "kernels/engine/engine.h"

#include <map>
#include <memory>
#include <string>

#include "kernels/common/text.h"
#include "kernels/common/wire.h"
#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

void EncodeDescriptor(const RegionDescriptor& d, const std::string& prefix,
                      std::map<std::string, std::string>* fields) {
  (*fields)[prefix + "id"] = std::to_string(d.id);
  (*fields)[prefix + "size"] = std::to_string(d.size);
  (*fields)[prefix + "shm"] = d.shm_name;
  if (d.remote_addr != 0) {
    (*fields)[prefix + "addr"] = std::to_string(d.remote_addr);
    (*fields)[prefix + "rkey"] = std::to_string(d.rkey);
  }
}

RegionDescriptor DecodeDescriptor(std::map<std::string, std::string>& fields,
                                  const std::string& prefix) {
  RegionDescriptor d;
  uint64_t id = 0, rkey = 0;
  ParseUint(fields[prefix + "id"], &id);
  ParseUint(fields[prefix + "size"], &d.size);
  d.shm_name = fields[prefix + "shm"];
  ParseUint(fields[prefix + "addr"], &d.remote_addr);
  ParseUint(fields[prefix + "rkey"], &rkey);
  d.id = static_cast<uint32_t>(id);
  d.rkey = static_cast<uint32_t>(rkey);
  return d;
}

Status Engine::NewLocalRegion(const std::string& name, uint64_t size,
                              const std::string& plan_hash,
                              const std::string& peer, LocalRegion** out,
                              std::unique_ptr<Region>* premade) {
  // Caller holds mu_.
  std::unique_ptr<Region> memory;
  if (premade != nullptr && *premade && (*premade)->size() == size) {
    memory = std::move(*premade);
  } else {
    TF_RDMA_RETURN_IF_ERROR(Region::Create(size, &memory).Prefixed(
        "region '" + Printable(name) + "' for " + peer));
  }
  auto region = std::make_unique<LocalRegion>();
  region->id = static_cast<uint32_t>(regions_.size());
  region->name = name;
  region->plan_hash = plan_hash;
  region->peer = peer;
  region->memory = std::move(memory);
  *out = region.get();
  regions_.push_back(std::move(region));
  return Status::Ok();
}

Status Engine::FindOrCreateDataRegion(const std::string& name, uint64_t size,
                                      const std::string& plan_hash,
                                      const std::string& writer,
                                      LocalRegion** out,
                                      std::unique_ptr<Region>* premade) {
  // Caller holds mu_.
  auto it = data_regions_.find(name);
  if (it != data_regions_.end()) {
    LocalRegion* r = it->second;
    Status mismatch;
    if (r->plan_hash != plan_hash) {
      // The name and hash may come from a peer's OPEN: escaped and cut
      // (they end up in the log and in refusals).
      mismatch = FailedPrecondition(
          "plan hash mismatch for region '" + Printable(name) +
          "': one side has plan " + Printable(r->plan_hash, 64) +
          ", the other has plan " + Printable(plan_hash, 64) +
          " (both tasks must run the same plan)");
    } else if (r->memory->size() != size || r->peer != writer) {
      mismatch = FailedPrecondition(
          "region '" + Printable(name) + "' was set up with " +
          std::to_string(r->memory->size()) + " bytes written by " + r->peer +
          ", now asked for " + std::to_string(size) + " bytes written by " +
          writer);
    }
    if (!mismatch.ok()) {
      // The region's own writer and reader disagree for good: ops already
      // waiting on it fail with this reason instead of timing out. (Another
      // task asking for it is only refused; it cannot spoil the region.)
      if (r->peer == writer) r->refusal = mismatch.message();
      return mismatch;
    }
    *out = r;
    return Status::Ok();
  }
  std::string limit = RegionBytesLimitLocked(writer, size);
  if (!limit.empty()) return FailedPrecondition(limit);
  auto refused = refused_names_.find(name);
  if (refused != refused_names_.end()) {
    return FailedPrecondition(refused->second);
  }
  TF_RDMA_RETURN_IF_ERROR(
      NewLocalRegion(name, size, plan_hash, writer, out, premade));
  data_regions_[name] = *out;
  region_bytes_of_[writer] += size;
  return Status::Ok();
}

// What one writer and all of them may hold here. Each region holds a file
// descriptor: a quarter of the process's limit for the regions one writer
// task's OPENs made, half of it for all of them, so that writers with the
// secret cannot take the descriptors this process needs to accept
// connections and make its own regions.
std::string Engine::RegionLimitLocked(const std::string& peer) {
  // Caller holds mu_.
  int total = 0;
  for (const auto& kv : regions_opened_by_) total += kv.second;
  const int mine = regions_opened_by_[peer];
  if (mine >= max_regions_per_peer_) {
    return peer + " has already opened " + std::to_string(mine) +
           " regions on this endpoint, the most allowed (a quarter of the "
           "process's file descriptor limit, at most " +
           std::to_string(kMaxRegionsPerPeer) + ")";
  }
  if (total >= 2 * max_regions_per_peer_) {
    return "the writers of this endpoint have already opened " +
           std::to_string(total) + " regions on it, the most allowed for all "
           "of them together (twice one writer's: half of the process's "
           "file descriptor limit, at most " +
           std::to_string(2 * kMaxRegionsPerPeer) + ")";
  }
  return "";
}

// And each region holds its bytes of /dev/shm, which the host's other tasks
// need too: the regions written here may take the region budget together
// (TF_RDMA_REGION_BUDGET, by default three quarters of /dev/shm's size),
// those of one writer task half of it, whoever made them (its OPEN or a
// recv here), so that no writer can take what the others need and a plan
// gets the same answer whichever side comes first. A region larger than
// all of /dev/shm is left to Region::Create, whose error says how to get a
// larger one: no budget would help it.
std::string Engine::RegionBytesLimitLocked(const std::string& writer,
                                           uint64_t size) {
  // Caller holds mu_.
  if (region_budget_ == 0 || size > ShmBytes()) return "";
  uint64_t total = 0;
  for (const auto& kv : region_bytes_of_) total += kv.second;
  const uint64_t mine = region_bytes_of_[writer];
  const std::string budget =
      std::to_string(region_budget_) + " bytes (TF_RDMA_REGION_BUDGET; by "
      "default three quarters of /dev/shm's size)";
  if (mine + size > region_budget_ / 2) {
    return "a region of " + std::to_string(size) + " bytes written by " +
           writer + " would exceed that writer's share of this endpoint's "
           "/dev/shm budget: its regions here hold " + std::to_string(mine) +
           " bytes, one writer's may hold at most half of the budget of " +
           budget;
  }
  if (total + size > region_budget_) {
    return "a region of " + std::to_string(size) + " bytes written by " +
           writer + " would exceed this endpoint's /dev/shm budget: the "
           "regions written here hold " + std::to_string(total) +
           " bytes, the budget is " + budget;
  }
  return "";
}

Region* Engine::RegionForPeer(const Connection& conn, uint32_t id) {
  {
    std::lock_guard<std::mutex> lock(const_cast<Connection&>(conn).mu);
    if (!conn.peer_writable.count(id)) return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  return id < regions_.size() && !regions_[id]->retired.load()
             ? regions_[id]->memory.get()
             : nullptr;
}

namespace {

// Region names tf_rdma generates carry the writer and the reader: a plan's
// "<plan>/<writer>-><reader>", a collective's "coll:<instance>:<writer>>
// <reader>", and their dynamic payload areas "<region>#<tensor>#<n>". A
// writer may open only names of these forms that name itself and this
// reader (other names come from raw ops and belong to their first writer).
bool NameBelongsTo(const std::string& name, const std::string& writer,
                   const std::string& reader) {
  // The pair's part ends the name, or is followed by a payload area's '#'.
  auto names = [&](const std::string& pair) {
    size_t at = name.rfind(pair);
    while (at != std::string::npos) {
      size_t end = at + pair.size();
      if (end == name.size() || name[end] == '#') return true;
      at = at == 0 ? std::string::npos : name.rfind(pair, at - 1);
    }
    return false;
  };
  if (name.rfind("coll:", 0) == 0) return names(":" + writer + ">" + reader);
  if (name.find("->") != std::string::npos) {
    return names("/" + writer + "->" + reader);
  }
  return true;
}

}  // namespace

// OPEN: a writer asks for its region here. Bounded on purpose, since the
// writer chooses the name and the size: the name must be its own (above);
// each writer task may create at most kMaxRegionsPerPeer regions; the size
// is reserved in /dev/shm when the region is created (Region::Create), so
// asking for more than there is fails with an error instead of a SIGBUS
// later; and a region keeps the writer that first opened it (a second live
// writer is refused; a writer whose connection was lost is replaced).
//
// "Lost" is the writer's view before it is the reader's: a writer redials as
// soon as it finds its connection gone, and its OPEN on the new connection
// can arrive before this side's reader thread has seen the old one close.
// A writer process dials at most one connection to a peer at a time (it
// dials again only once the old one is gone for it), so an OPEN from the
// same process (task and incarnation) on another connection proves the old
// one dead: it is closed here and the new one takes the region over, rather
// than the OPEN being refused for a writer that no longer exists.
// Connections that drop. Over tcp a write counts as done once it is in the
// socket's buffer, and so does a credit; a connection reset while both
// processes live can lose either, and the writer dials again at its next
// send and opens its regions on the new connection. For a region whose
// slots pair the n-th send with the n-th recv, each side would then wait for
// what the other believes sent: a recv for a step that never came, a send
// for a credit that never came, every later op until its timeout, for good.
// So an OPEN on a new connection carries, for each in-order slot the writer
// has written, the word its last step must have landed in ("landed":
// "<offset>:<step>,..."): a step that did not land cannot be sent again (the
// tensor is gone), and the region is refused on both sides at once with what
// was lost, as for a restarted peer. And the reader sends its credits again
// over the new connection (LocalRegion::credits_sent), whichever of them
// the old one lost. Cost: nothing on the data path but a lock and a map
// entry per in-order recv's release; a few bytes per slot in an OPEN.
std::string Engine::LostInFlightLocked(const LocalRegion& region,
                                       const std::string& landed,
                                       const std::string& writer,
                                       Status* malformed) {
  // Caller holds mu_.
  for (const std::string& item : Split(landed, ',')) {
    size_t colon = item.find(':');
    uint64_t offset = 0, step = 0;
    if (colon == std::string::npos ||
        !ParseUint(item.substr(0, colon), &offset) ||
        !ParseUint(item.substr(colon + 1), &step) || offset % 8 != 0 ||
        region.memory->size() < 8 || offset > region.memory->size() - 8) {
      *malformed = InvalidArgument("landed '" + Printable(item, 60) +
                                   "' is not <word offset>:<step> inside "
                                   "region '" + Printable(region.name) + "'");
      return "";
    }
    uint64_t got =
        region.memory->Word(offset)->load(std::memory_order_acquire);
    if (got >= step) continue;
    std::string tensor = "the tensor whose copy starts at byte " +
                         std::to_string(offset);
    for (RecvSlot* slot : recv_slot_list_) {
      if (slot->spec.region != region.name) continue;
      for (int64_t c = 0; c < slot->spec.depth; ++c) {
        if (CopyOffset(slot->spec, c) == offset) {
          tensor = "tensor '" + slot->spec.tensor_name + "'";
        }
      }
    }
    return "step " + std::to_string(step) + " of " + tensor + " from " +
           writer + " never arrived at " + config_.task +
           " (it holds step " + std::to_string(got) +
           "): the connection was lost while the step was in flight. "
           "tf_rdma does not resume transfers half-way through a job: "
           "restart every task of the job so that all start again from "
           "step 1 (Keras BackupAndRestore or your checkpoints resume the "
           "training)";
  }
  return "";
}

void Engine::ResendCredits(LocalRegion* region,
                           const std::shared_ptr<Connection>& conn) {
  std::lock_guard<std::mutex> credit_lock(region->credit_mu);
  int handle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (region->writer != conn) return;
    handle = region->credit_handle;
  }
  for (const auto& kv : region->credits_sent) {
    Status s = conn->pair->Write(handle, 0, nullptr, 0,
                                 kv.first * kCreditLineBytes, kv.second,
                                 Deadline(config_.timeout_ms));
    if (!s.ok()) break;  // the new connection failed too: the next one
  }
}

void Engine::HandleOpen(const std::shared_ptr<Connection>& conn,
                        uint64_t request_id, const std::string& body) {
  OpenRequest request;
  Status s = ParseOpenRequest(body, &request).Prefixed(
      "malformed OPEN request from " + conn->peer);
  std::map<std::string, std::string>& f = request.fields;
  const std::string& name = request.name;
  uint64_t size = request.size;
  std::map<std::string, std::string> reply;
  if (s.ok() && conn->dialed) {
    s = FailedPrecondition("OPEN request on a connection we dialled");
  }
  if (s.ok() && !NameBelongsTo(name, conn->peer, config_.task)) {
    s = PermissionDenied("region '" + Printable(name) + "' belongs to another "
                         "pair of tasks than " + conn->peer + " -> " +
                         config_.task);
  }
  // The memory of a region this OPEN will make is made first, outside mu_:
  // reserving and populating a large segment takes seconds (0.7 s a GiB
  // here), and every WRITE frame into this endpoint takes mu_. Memory made
  // for an OPEN that then finds the region made meanwhile goes unused (it
  // is unmapped when this returns, outside mu_ too).
  std::unique_ptr<Region> premade;
  if (s.ok()) {
    bool make;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = data_regions_.find(name);
      make = it == data_regions_.end()
                 ? !refused_names_.count(name) &&
                       RegionLimitLocked(conn->peer).empty() &&
                       RegionBytesLimitLocked(conn->peer, size).empty()
                 : it->second->opened && it->second->writer != conn &&
                       MatchedRegion(name.substr(0, name.find('#')));
    }
    if (make) {
      s = Region::Create(size, &premade)
              .Prefixed("region '" + Printable(name) + "' for " + conn->peer);
    }
  }
  LocalRegion* region = nullptr;
  std::shared_ptr<Connection> replaced;  // the same writer's old connection
  bool reopened = false;  // an opened region, now on this connection
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    bool exists = data_regions_.count(name) > 0;
    // Counted per writer task, not per connection: regions outlive their
    // connection, so a count that restarted with each connection let a
    // peer that reconnects create regions (fds, /dev/shm) without end.
    int& created = regions_opened_by_[conn->peer];
    if (!exists) {
      std::string limit = RegionLimitLocked(conn->peer);
      if (!limit.empty()) s = FailedPrecondition(limit);
    }
    if (s.ok()) {
      s = FindOrCreateDataRegion(name, size, f["plan_hash"], conn->peer,
                                 &region, &premade);
    }
    // Another live connection writing into the region: the same process's
    // old one is replaced (it reconnected), anyone else's is refused.
    auto take_over_from_writer = [&]() {
      if (region->writer && region->writer != conn &&
          !region->writer->gone.load()) {
        if (region->writer->peer == conn->peer &&
            region->writer->incarnation == conn->incarnation) {
          replaced = region->writer;
        } else {
          s = FailedPrecondition("region '" + Printable(name) +
                                 "' already has a connected writer");
        }
      }
    };
    // A matched-call region lives as long as its writer's connection
    // (peers.cc): opened again on another one, it starts afresh.
    if (s.ok() && region->opened && region->writer != conn &&
        MatchedRegion(name.substr(0, name.find('#')))) {
      take_over_from_writer();
      if (s.ok()) {
        RetireRegionLocked(region, conn->peer + " opened it again on a new "
                                   "connection");
        exists = false;
        s = FindOrCreateDataRegion(name, size, f["plan_hash"], conn->peer,
                                   &region, &premade);
      }
    }
    if (s.ok() && !exists) ++created;
    // The writer refuses to go on with this region (it saw this process
    // restart; see "Restarted peers"): ops waiting on it fail with why.
    if (s.ok() && !request.refusal.empty() && region->refusal.empty()) {
      region->refusal = Printable(request.refusal, 1000);
    }
    if (s.ok() && !region->refusal.empty()) {
      s = FailedPrecondition(region->refusal);
    }
    // Steps the old connection lost ("Connections that drop").
    if (s.ok() && exists && region->opened && region->writer != conn &&
        !f["landed"].empty() && !MatchedRegion(name.substr(0, name.find('#')))) {
      Status malformed;
      std::string lost =
          LostInFlightLocked(*region, f["landed"], conn->peer, &malformed);
      if (!malformed.ok()) {
        s = malformed;
      } else if (!lost.empty()) {
        region->refusal = lost;
        s = FailedPrecondition(lost);
        poller_recheck_.store(true);
        RingPoller();
      }
    }
    if (s.ok()) take_over_from_writer();
    reopened = s.ok() && exists && region->opened && region->writer != conn;
    if (s.ok() && region->writer != conn) {
      RegionDescriptor credits = DecodeDescriptor(f, "credit_");
      credits.id = request.credit_id;
      credits.size = request.credit_size;
      int handle = -1;
      s = conn->pair->AddRemoteRegion(credits, &handle);
      if (s.ok()) {
        region->writer = conn;
        region->credit_handle = handle;
        region->opened = true;
        region->stats.store(stats_.For(conn->peer, conn->pair->transport()),
                            std::memory_order_release);
      }
    }
  }
  if (replaced) {
    CloseConnection(replaced,
                    Unavailable(conn->peer + " dialled again; its new "
                                "connection replaces this one"));
  }
  // Outside mu_: verbs registers the region here (pins it, once), which
  // takes a while for a large one.
  RegionDescriptor exposed;
  if (s.ok()) s = conn->pair->Expose(region->id, *region->memory, &exposed);
  if (s.ok()) {
    std::lock_guard<std::mutex> cl(conn->mu);
    conn->peer_writable.insert(region->id);
    EncodeDescriptor(exposed, "", &reply);
  }
  if (!s.ok()) {
    LogLimited("refused region for " + conn->peer + ": " + s.message());
  }
  SendReply(conn, kOpenReply, request_id, s, reply);
  if (s.ok() && reopened && !MatchedRegion(name.substr(0, name.find('#')))) {
    ResendCredits(region, conn);
  }
}

void Engine::RefuseWriter(const std::string& region_name, const Status& why) {
  // Caller holds mu_. The writer already opened the region with another
  // plan: tell it why its data is refused, then drop it (on an engine
  // thread: the send may wait up to its deadline, not under mu_).
  auto it = data_regions_.find(region_name);
  if (it == data_regions_.end() || !it->second->writer) return;
  std::shared_ptr<Connection> writer = it->second->writer;
  Schedule([this, writer, why] {
    FrameHeader h;
    h.type = kError;
    h.b = why.message().size();
    SendFrame(writer, h, why.message(), Deadline(kHandshakeTimeoutMs));
    CloseConnection(writer, why);
  });
}

}  // namespace tf_rdma
