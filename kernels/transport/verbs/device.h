// The verbs backend as the core library sees it: an RDMA device opened by
// the plugin, and the pairs it makes.
//
// The backend lives in its own shared object, tf_rdma/_tf_rdma_verbs.so,
// built only where the libibverbs headers exist and linked to libibverbs.
// The core library never links libibverbs: it dlopens the plugin when the
// verbs transport is allowed (verbs/factory.h) and talks to it only
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
#include "kernels/transport/factory.h"
#include "kernels/transport/transport.h"

namespace tf_rdma {

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
#define TF_RDMA_VERBS_ENTRY "tf_rdma_verbs_open_v2"
constexpr uint64_t kVerbsAbi =
    (sizeof(VerbsSettings) << 32) | (sizeof(Status) << 16) |
    (sizeof(RegionDescriptor) << 8) | sizeof(Notice) |
    (static_cast<uint64_t>(sizeof(PairCounters)) << 56);
using VerbsOpenFn = VerbsDevice* (*)(uint64_t abi,
                                     const VerbsSettings& settings,
                                     Status* why);

}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_VERBS_DEVICE_H_
