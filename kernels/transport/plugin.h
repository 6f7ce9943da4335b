// Loading the verbs plugin (transport/verbs/device.h) from the core library.
#ifndef TF_RDMA_TRANSPORT_PLUGIN_H_
#define TF_RDMA_TRANSPORT_PLUGIN_H_

#include <memory>
#include <string>

#include "kernels/transport/verbs/device.h"

namespace tf_rdma {

// The plugin's file: TF_RDMA_VERBS_LIBRARY if set, else _tf_rdma_verbs.so
// next to the core library.
std::string VerbsPluginPath();

// dlopens the plugin and opens the device the settings ask for. On failure
// the status says why verbs cannot be used here: the plugin was not built
// (no libibverbs headers at build time), libibverbs is not installed, no
// device, port down, memlock too low, or a bad setting (InvalidArgument).
Status OpenVerbs(const VerbsSettings& settings,
                 std::unique_ptr<VerbsDevice>* out);

}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_PLUGIN_H_
