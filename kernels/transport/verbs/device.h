// The verbs backend as the core library sees it: an RDMA device opened by
// the plugin, and the pairs it makes.
//
// The backend lives in its own shared object, tf_rdma/_tf_rdma_verbs.so,
// built only where the libibverbs headers exist and linked to libibverbs.
// The core library never links libibverbs: it dlopens the plugin when the
// verbs transport is allowed (transport/plugin.h) and talks to it only
// through the abstract classes below, which include no verbs header. Both
// libraries are compiled by setup.py with the same compiler and flags, and
// the entry point's name carries an interface version, so a stale plugin is
// refused by name instead of crashing.
#ifndef TF_RDMA_TRANSPORT_VERBS_DEVICE_H_
#define TF_RDMA_TRANSPORT_VERBS_DEVICE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/common/status.h"
#include "kernels/transport/transport.h"

namespace tf_rdma {

// The verbs settings (TF_RDMA_VERBS_*, tf_rdma/settings.py; checked there
// and again by the plugin).
struct VerbsSettings {
  std::string device;        // "" = the first device with an active port
  int port = 0;              // 0 = the device's first active port
  int gid_index = -1;        // -1 = chosen (RoCE v2 GID of local_host)
  int mtu = 0;               // path MTU in bytes (256..4096); 0 = the port's
  int service_level = 0;     // 0..15
  int traffic_class = 0;     // 0..255
  int timeout = 14;          // ack timeout 4.096 us * 2^timeout, 1..31
  int retry_count = 7;       // 0..7
  int queue_depth = 128;     // send work requests per pair, 4..32768
  int inline_bytes = 64;     // payloads this small are posted inline, 0..1024
  uint64_t min_memlock = 64ull << 20;  // below this (and without
                                       // CAP_IPC_LOCK) verbs is not usable
  std::string local_host;    // the host this endpoint listens on
  int64_t timeout_ms = 60000;  // bound of one write's completion
};

// A pair over an RC queue pair. Connecting it takes one exchange of
// addresses (LID, GID, QP number, PSN, MTU) over the control connection.
class VerbsPair : public Pair {
 public:
  const char* transport() const override { return "verbs"; }
  // This end's address, one line of text for the peer's Connect.
  virtual std::string address() const = 0;
  // Brings the queue pair up against the peer's address (RTR, then RTS).
  virtual Status Connect(const std::string& peer_address) = 0;
};

class VerbsDevice {
 public:
  virtual ~VerbsDevice() = default;
  // "mlx5_0 port 1, RoCE v2, GID 3 (10.0.0.5), MTU 4096".
  virtual std::string Describe() const = 0;
  // A new, unconnected pair.
  virtual Status NewPair(std::unique_ptr<VerbsPair>* out) = 0;
};

// The plugin's one exported symbol: opens the device the settings name.
// Returns nullptr with *why saying what is missing (no device, port down,
// memlock too low, a bad setting, ...).
// `abi` is kVerbsAbi as the core was compiled: the sizes of the types that
// cross the boundary, so that a plugin built from other sources is refused
// even when its entry point has the same name.
#define TF_RDMA_VERBS_ENTRY "tf_rdma_verbs_open_v1"
constexpr uint64_t kVerbsAbi =
    (sizeof(VerbsSettings) << 32) | (sizeof(Status) << 16) |
    (sizeof(RegionDescriptor) << 8) | sizeof(Notice);
using VerbsOpenFn = VerbsDevice* (*)(uint64_t abi,
                                     const VerbsSettings& settings,
                                     Status* why);

}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_VERBS_DEVICE_H_
