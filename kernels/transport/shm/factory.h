// Opens the shm backend (transport/factory.h is the registry).
#ifndef TF_RDMA_TRANSPORT_SHM_FACTORY_H_
#define TF_RDMA_TRANSPORT_SHM_FACTORY_H_

#include <memory>

#include "kernels/transport/factory.h"

namespace tf_rdma {
namespace shm {

Status OpenTransport(const TransportOptions& options,
                     std::unique_ptr<Transport>* out);

}  // namespace shm
}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_SHM_FACTORY_H_
