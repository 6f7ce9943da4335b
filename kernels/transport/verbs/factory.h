// Opens the verbs backend: the core library's side of the verbs plugin
// (verbs/device.h). This file is compiled into the core, not the plugin
// (setup.py): it loads the plugin with dlopen, opens the RDMA device the
// settings ask for, and sets up each connection's queue pair over the
// control connection.
#ifndef TF_RDMA_TRANSPORT_VERBS_FACTORY_H_
#define TF_RDMA_TRANSPORT_VERBS_FACTORY_H_

#include <memory>
#include <string>

#include "kernels/transport/factory.h"

namespace tf_rdma {
namespace verbs {

// The plugin's file: TF_RDMA_VERBS_LIBRARY if set, else _tf_rdma_verbs.so
// next to the core library.
std::string PluginPath();

// dlopens the plugin and opens the device the settings ask for. On failure
// the status says why verbs cannot be used here: the plugin was not built
// (no libibverbs headers at build time), libibverbs is not installed, no
// device, port down, memlock too low, or a bad setting (InvalidArgument).
Status OpenTransport(const TransportOptions& options,
                     std::unique_ptr<Transport>* out);

}  // namespace verbs
}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_VERBS_FACTORY_H_
