#include "kernels/transport/factory.h"

#include "kernels/transport/shm/factory.h"
#include "kernels/transport/tcp/factory.h"
#include "kernels/transport/tcp/pair.h"
#include "kernels/transport/verbs/factory.h"

namespace tf_rdma {

Status OpenTransport(const std::string& name, const TransportOptions& options,
                     std::unique_ptr<Transport>* out) {
  if (name == "shm") return shm::OpenTransport(options, out);
  if (name == "tcp") return tcp::OpenTransport(options, out);
  if (name == "verbs") return verbs::OpenTransport(options, out);
  return InvalidArgument("no transport named '" + name + "'");
}

Status ApplyWriteFrame(int fd, const FrameHeader& h,
                       const RegionLookup& lookup,
                       const std::function<void()>& landed) {
  return tcp::ApplyWrite(fd, h, lookup, landed);
}

}  // namespace tf_rdma
