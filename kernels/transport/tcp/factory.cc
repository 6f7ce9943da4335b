#include "kernels/transport/tcp/factory.h"

#include "kernels/transport/tcp/pair.h"

namespace tf_rdma {
namespace tcp {
namespace {

// Nothing to open: a pair writes frames on its connection's socket.
class TcpTransport : public Transport {
 public:
  const char* name() const override { return "tcp"; }
  Status NewPair(const PairSetup& setup, const Deadline& deadline,
                 std::unique_ptr<::tf_rdma::Pair>* out) override {
    out->reset(new Pair(setup.fd, setup.send_mu));
    return Status::Ok();
  }
};

}  // namespace

Status OpenTransport(const TransportOptions& options,
                     std::unique_ptr<Transport>* out) {
  out->reset(new TcpTransport());
  return Status::Ok();
}

}  // namespace tcp
}  // namespace tf_rdma
