// The engine's config and slot specs (engine.h): parsing and checks.

#include "kernels/engine/engine.h"

#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/common/text.h"
#include "kernels/common/transport_choice.h"
#include "kernels/common/wire.h"
#include "kernels/engine/engine_internal.h"

namespace tf_rdma {

namespace {

// One "verbs_<name>=<value>" config line (the plugin checks the ranges).
Status ParseVerbsSetting(const std::string& key, const std::string& value,
                         VerbsSettings* v) {
  if (key == "verbs_device") {
    v->device = value;
    return Status::Ok();
  }
  static const std::map<std::string, int VerbsSettings::*> kInts = {
      {"verbs_port", &VerbsSettings::port},
      {"verbs_gid_index", &VerbsSettings::gid_index},
      {"verbs_mtu", &VerbsSettings::mtu},
      {"verbs_sl", &VerbsSettings::service_level},
      {"verbs_traffic_class", &VerbsSettings::traffic_class},
      {"verbs_timeout", &VerbsSettings::timeout},
      {"verbs_retry_count", &VerbsSettings::retry_count},
      {"verbs_queue_depth", &VerbsSettings::queue_depth},
      {"verbs_inline", &VerbsSettings::inline_bytes},
      {"verbs_odp", &VerbsSettings::odp}};
  uint64_t number = 0;
  bool negative = !value.empty() && value[0] == '-';
  bool parsed = ParseUint(negative ? value.substr(1) : value, &number) &&
                number <= (1u << 30);
  auto it = kInts.find(key);
  if (it == kInts.end()) {
    return InvalidArgument("unknown engine config key '" + key + "'");
  }
  if (!parsed) {
    return InvalidArgument(key + " '" + value + "' is not an integer");
  }
  v->*(it->second) = negative ? -static_cast<int>(number)
                              : static_cast<int>(number);
  return Status::Ok();
}

bool SameLayout(const SlotSpec& a, const SlotSpec& b) {
  return a.peer == b.peer && a.plan_hash == b.plan_hash &&
         a.region_bytes == b.region_bytes && a.credit_bytes == b.credit_bytes &&
         a.stride == b.stride && a.nbytes == b.nbytes && a.depth == b.depth &&
         a.credit_index == b.credit_index && a.match_calls == b.match_calls;
}

}  // namespace

std::string SlotKey(const SlotSpec& spec) {
  return spec.region + "@" + std::to_string(spec.offset);
}

Status NotStarted() {
  return FailedPrecondition(
      "the tf_rdma endpoint is not running in this process; start a "
      "tf_rdma.Server (or tf_rdma.start_endpoint) for this task first");
}

Status CheckSameSlot(const SlotSpec& spec, const SlotSpec& existing) {
  if (SameLayout(spec, existing)) return Status::Ok();
  return InvalidArgument("tensor '" + spec.tensor_name +
                         "' uses the slot at offset " +
                         std::to_string(spec.offset) + " of region '" +
                         spec.region + "' with a different layout than tensor '" +
                         existing.tensor_name + "'");
}

Status CheckNewSlot(const SlotSpec& spec, const std::string& own_task) {
  TF_RDMA_RETURN_IF_ERROR(spec.Validate());
  if (spec.peer == own_task) {
    return InvalidArgument("tensor '" + spec.tensor_name + "' has its own task " +
                           own_task + " as the peer; a transfer needs two tasks");
  }
  return Status::Ok();
}

Status EngineConfig::Parse(const std::string& text, EngineConfig* out) {
  EngineConfig c;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == std::string::npos) {
      return InvalidArgument("engine config line '" + line +
                             "' is not key=value");
    }
    std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    if (key == "task") {
      c.task = value;
    } else if (key == "listen") {
      c.listen = value;
    } else if (key == "bind") {
      c.bind = value;
    } else if (key == "secret") {
      c.secret = value;
    } else if (key == "transport") {
      std::vector<std::string> names;
      TF_RDMA_RETURN_IF_ERROR(ParseTransportSetting(value, &names));
      c.transport = value;
    } else if (key.rfind("verbs_", 0) == 0) {
      TF_RDMA_RETURN_IF_ERROR(ParseVerbsSetting(key, value, &c.verbs));
    } else if (key == "timeout_ms") {
      uint64_t v;
      if (!ParseUint(value, &v) || v == 0 ||
          v > static_cast<uint64_t>(kMaxDeadlineMs)) {
        return InvalidArgument("timeout_ms '" + value +
                               "' is not an integer in [1, " +
                               std::to_string(kMaxDeadlineMs) + "]");
      }
      c.timeout_ms = static_cast<int64_t>(v);
    } else if (key == "poll_us") {
      uint64_t v;
      if (!ParseUint(value, &v) || v > 10000) {
        return InvalidArgument("poll_us '" + value +
                               "' is not an integer in [0, 10000]");
      }
      c.poll_us = static_cast<int64_t>(v);
    } else if (key == "collective_spin_us") {
      uint64_t v;
      if (value == "auto") {
        c.collective_spin_us = kAutoSpin;
      } else if (ParseUint(value, &v) && v <= kMaxSpinUs) {
        c.collective_spin_us = static_cast<int64_t>(v);
      } else {
        return InvalidArgument("collective_spin_us '" + value +
                               "' is not auto or an integer in [0, " +
                               std::to_string(kMaxSpinUs) + "]");
      }
    } else if (key == "host_cpus") {
      uint64_t v;
      if (!ParseUint(value, &v) || v > kMaxHostCpus) {
        return InvalidArgument("host_cpus '" + value +
                               "' is not an integer in [0, " +
                               std::to_string(kMaxHostCpus) + "]");
      }
      c.host_cpus = static_cast<int64_t>(v);
    } else if (key == "stall_warning_ms") {
      uint64_t v;
      if (!ParseUint(value, &v) || v > static_cast<uint64_t>(kMaxDeadlineMs)) {
        return InvalidArgument("stall_warning_ms '" + value +
                               "' is not an integer in [0, " +
                               std::to_string(kMaxDeadlineMs) + "] (0: off)");
      }
      c.stall_warning_ms = static_cast<int64_t>(v);
    } else if (key == "region_budget") {
      if (!ParseUint(value, &c.region_budget)) {
        return InvalidArgument("region_budget '" + value +
                               "' is not a number of bytes (0: auto)");
      }
    } else if (key == "timeline") {
      c.timeline = value;
    } else if (key == "timeline_events") {
      if (value != "all" && value != "ops") {
        return InvalidArgument("timeline_events '" + value +
                               "' is not all or ops");
      }
      c.timeline_phases = value == "all";
    } else if (key == "peer") {
      size_t sp = value.find(' ');
      if (sp == std::string::npos) {
        return InvalidArgument("peer line '" + value +
                               "' is not '<task> <host:port>'");
      }
      c.peers[value.substr(0, sp)] = value.substr(sp + 1);
    } else {
      return InvalidArgument("unknown engine config key '" + key + "'");
    }
  }
  if (c.task.empty()) return InvalidArgument("engine config has no task");
  if (c.listen.empty()) return InvalidArgument("engine config has no listen");
  if (c.secret.empty()) {
    return InvalidArgument(
        "no job secret: set TF_RDMA_SECRET to the same value on every task "
        "(tf-rdma launch does this for you)");
  }
  if (c.secret.size() < kMinSecretBytes) {
    return InvalidArgument(
        "the job secret (TF_RDMA_SECRET) has " +
        std::to_string(c.secret.size()) + " characters; it needs at least " +
        std::to_string(kMinSecretBytes) +
        ": anyone who records one handshake can try short secrets offline");
  }
  *out = c;
  return Status::Ok();
}

Status SlotSpec::Validate() const {
  // The attributes come from a graph (or the wire): every offset and size
  // computed from them is checked for overflow, so that no value can wrap
  // around into a slot that passes the bounds check and reads or writes
  // outside its region.
  std::string what = "tensor '" + tensor_name + "' in region '" + region + "'";
  if (depth < 1 || depth > kMaxSlotDepth) {
    return InvalidArgument(what + ": depth " + std::to_string(depth) +
                           " must be in [1, " + std::to_string(kMaxSlotDepth) +
                           "]");
  }
  uint64_t min_stride = 0;
  if (__builtin_add_overflow(kSlotHeaderBytes, nbytes, &min_stride) ||
      stride < min_stride || stride % 64 != 0 || offset % 64 != 0) {
    return InvalidArgument(what + ": stride " + std::to_string(stride) +
                           " / offset " + std::to_string(offset) +
                           " must be multiples of 64 and stride >= 64 + " +
                           std::to_string(nbytes) + " bytes");
  }
  if (region_bytes % kPageBytes != 0 || credit_bytes % kPageBytes != 0) {
    return InvalidArgument(what + ": region sizes must be multiples of 4096");
  }
  uint64_t span = 0, end = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(depth), stride, &span) ||
      __builtin_add_overflow(offset, span, &end) || end > region_bytes) {
    return InvalidArgument(
        what + ": " + std::to_string(depth) + " copies of " +
        std::to_string(stride) + " bytes from offset " +
        std::to_string(offset) + " do not fit the region's " +
        std::to_string(region_bytes) + " bytes (region too small for the plan)");
  }
  uint64_t lines = 0, credit_end = 0;
  if (credit_index < 0 ||
      __builtin_mul_overflow(static_cast<uint64_t>(credit_index) + 1,
                             static_cast<uint64_t>(depth), &lines) ||
      __builtin_mul_overflow(lines, kCreditLineBytes, &credit_end) ||
      credit_end > credit_bytes) {
    return InvalidArgument(what + ": credit index " +
                           std::to_string(credit_index) +
                           " does not fit a credit region of " +
                           std::to_string(credit_bytes) + " bytes");
  }
  return Status::Ok();
}

std::string SlotSpec::Describe(uint64_t step) const {
  return "tensor '" + tensor_name + "' (peer " + peer +
         (peer_host.empty() ? "" : " on " + peer_host) +
         (match_calls ? ", call " : ", step ") + std::to_string(step) + ")";
}

}  // namespace tf_rdma
