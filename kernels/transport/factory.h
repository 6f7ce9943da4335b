// The registry of backends: the one place that names them.
//
// The engine opens the backends its transport setting allows by name, when
// it starts, and makes each connection's pair through the Transport of the
// backend the handshake chose (transport.h); it includes no backend's
// header. Each backend has a factory.{h,cc} of its own (shm/, tcp/,
// verbs/), as gloo's transports each have a device.h: the registry below
// maps the names to them. verbs/factory.cc is the core library's side of
// the verbs plugin: it dlopens _tf_rdma_verbs.so, so the core never links
// libibverbs.
#ifndef TF_RDMA_TRANSPORT_FACTORY_H_
#define TF_RDMA_TRANSPORT_FACTORY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/common/status.h"
#include "kernels/common/wire.h"
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
  int odp = 1;               // 1 = implicit on-demand paging when the device
                             // has it (zero-copy sends), 0 = never
  uint64_t min_memlock = 64ull << 20;  // below this (and without
                                       // CAP_IPC_LOCK) verbs is not usable
  std::string local_host;    // the host this endpoint listens on
  int64_t timeout_ms = 60000;  // bound of one write's completion
};

// What the backends are opened with (the engine's config).
struct TransportOptions {
  std::string local_host;      // the host the endpoint listens on
  int64_t timeout_ms = 60000;  // the default bound of every wait
  VerbsSettings verbs;         // verbs_* config keys
};

// Opens the backend `name` ("shm", "tcp", "verbs"). Fails when the name is
// unknown, or (Unavailable, with why) when the backend cannot be used here:
// verbs without its plugin, libibverbs, a device or an active port, or with
// too little locked memory; InvalidArgument for a bad setting.
Status OpenTransport(const std::string& name, const TransportOptions& options,
                     std::unique_ptr<Transport>* out);

// Applies a WRITE frame whose header `h` the engine just read from a
// control connection `fd` (the tcp backend's receiving half, tcp/pair.h):
// checks it against the region it names, reads the payload into it and
// publishes the notice (`landed`, if set, runs between the store of the
// notice word and the wake-up of its sleepers). An error means nothing was
// written and the connection must be closed.
Status ApplyWriteFrame(int fd, const FrameHeader& h,
                       const RegionLookup& lookup,
                       const std::function<void()>& landed = nullptr);

}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_FACTORY_H_
