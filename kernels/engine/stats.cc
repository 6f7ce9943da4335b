// Transfer counters (stats.h): the table and the busy clocks.

#include "kernels/engine/stats.h"

#include <chrono>
#include <string>

#include "kernels/common/text.h"

namespace tf_rdma {

namespace {

uint64_t NanosBetween(Clock::time_point from, Clock::time_point to) {
  if (to <= from) return 0;
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count());
}

}  // namespace

void BusyClock::Begin(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (waiting_++ == 0) since_ = now;
}

void BusyClock::End(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (waiting_ == 0) return;  // an End without Begin: ignored, not negative
  if (--waiting_ == 0) busy_ns_ += NanosBetween(since_, now);
}

uint64_t BusyClock::BusyNs(Clock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_ns_ + (waiting_ > 0 ? NanosBetween(since_, now) : 0);
}

int BusyClock::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_;
}

PeerCounters* TransferStats::For(const std::string& peer,
                                 const std::string& transport) {
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<PeerCounters>& entry = table_[{peer, transport}];
  if (!entry) entry.reset(new PeerCounters());
  return entry.get();
}

void TransferStats::StartWait(Clock::time_point* since, BusyClock* busy) {
  if (*since != Clock::time_point{}) return;
  *since = Clock::now();
  busy->Begin(*since);
}

void TransferStats::EndWait(Clock::time_point* since, BusyClock* busy,
                            std::atomic<uint64_t>* count,
                            std::atomic<uint64_t>* ns) {
  if (*since == Clock::time_point{}) return;
  Clock::time_point now = Clock::now();
  busy->End(now);
  PeerCounters::Add(count, 1);
  PeerCounters::Add(ns, NanosBetween(*since, now));
  *since = Clock::time_point{};
}

std::string TransferStats::Json() const {
  Clock::time_point now = Clock::now();
  std::string out = "{\"peers\": [";
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool first = true;
    for (const auto& kv : table_) {
      const PeerCounters& c = *kv.second;
      auto field = [&](const char* name, const std::atomic<uint64_t>& v) {
        out += std::string(", \"") + name + "\": " +
               std::to_string(v.load(std::memory_order_relaxed));
      };
      out += std::string(first ? "" : ", ") +
             "{\"peer\": " + JsonString(kv.first.first) +
             ", \"transport\": " + JsonString(kv.first.second);
      field("bytes_sent", c.bytes_sent);
      field("bytes_received", c.bytes_received);
      field("writes", c.writes);
      field("receives", c.receives);
      field("credit_waits", c.credit_waits);
      field("credit_wait_ns", c.credit_wait_ns);
      field("data_waits", c.data_waits);
      field("data_wait_ns", c.data_wait_ns);
      field("dynamic_regrowths", c.dynamic_regrowths);
      out += "}";
      first = false;
    }
  }
  out += "], \"credit_wait_busy_ns\": " +
         std::to_string(credit_busy.BusyNs(now)) +
         ", \"data_wait_busy_ns\": " + std::to_string(data_busy.BusyNs(now)) +
         ", \"credit_waiting\": " + std::to_string(credit_busy.waiting()) +
         ", \"data_waiting\": " + std::to_string(data_busy.waiting()) +
         ", \"collectives_inline\": " +
         std::to_string(collectives_inline.load(std::memory_order_relaxed)) +
         ", \"collectives_handed_off\": " +
         std::to_string(
             collectives_handed_off.load(std::memory_order_relaxed));
  return out + "}";
}

}  // namespace tf_rdma
