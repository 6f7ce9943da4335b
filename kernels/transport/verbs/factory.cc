#include "kernels/transport/verbs/factory.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdlib>

#include "kernels/common/text.h"
#include "kernels/common/wire.h"
#include "kernels/transport/verbs/device.h"

namespace tf_rdma {
namespace verbs {
namespace {

constexpr size_t kMaxLine = 4096;

Status OpenDevice(const VerbsSettings& settings,
                  std::unique_ptr<VerbsDevice>* out) {
  std::string path = PluginPath();
  struct stat st;
  const char* forced = std::getenv("TF_RDMA_VERBS_LIBRARY");
  if (forced != nullptr && forced[0] != '\0' && stat(path.c_str(), &st) != 0) {
    return Unavailable("TF_RDMA_VERBS_LIBRARY=" + path +
                       " names no file; unset it to use the plugin built "
                       "with tf_rdma");
  }
  if (stat(path.c_str(), &st) != 0) {
    return Unavailable("the verbs plugin " + path +
                       " was not built (the libibverbs headers, Debian's "
                       "libibverbs-dev, were missing when tf_rdma was "
                       "built: install them and rebuild)");
  }
  // Loaded once per process and never unloaded: the device it opens lives
  // as long as the engine.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    return Unavailable("the verbs plugin could not be loaded (" +
                       std::string(err ? err : "unknown error") +
                       "); is libibverbs installed, from rdma-core 31 or "
                       "later?");
  }
  auto open = reinterpret_cast<VerbsOpenFn>(dlsym(handle, TF_RDMA_VERBS_ENTRY));
  if (open == nullptr) {
    return Unavailable("the verbs plugin " + path + " has no " +
                       std::string(TF_RDMA_VERBS_ENTRY) +
                       ": it was built by another tf_rdma version; rebuild");
  }
  Status why;
  VerbsDevice* device = open(kVerbsAbi, settings, &why);
  if (device == nullptr) return why;
  out->reset(device);
  return Status::Ok();
}

// The opened RDMA device, making one RC queue pair per connection.
class VerbsTransport : public Transport {
 public:
  explicit VerbsTransport(std::unique_ptr<VerbsDevice> device)
      : device_(std::move(device)) {}
  const char* name() const override { return "verbs"; }
  std::string Describe() const override { return device_->Describe(); }
  Status NewPair(const PairSetup& setup, const Deadline& deadline,
                 std::unique_ptr<Pair>* out) override;

 private:
  std::unique_ptr<VerbsDevice> device_;
};

// The verbs leg of the handshake: each side sends "VERBS <address>" (its
// queue pair's LID, GID, QP number, PSN and MTU), the dialling side first;
// the accepting side brings its queue pair up before it answers, so that it
// is ready to receive by the time the dialling side can send.
Status VerbsTransport::NewPair(const PairSetup& setup,
                               const Deadline& deadline,
                               std::unique_ptr<Pair>* out) {
  std::unique_ptr<VerbsPair> pair;
  TF_RDMA_RETURN_IF_ERROR(device_->NewPair(&pair).Prefixed(
      "setting up a verbs queue pair for " + setup.peer));
  std::string mine = "VERBS " + pair->address() + "\n";
  std::string line;
  if (setup.dialed) {
    TF_RDMA_RETURN_IF_ERROR(
        SendAll(setup.fd, mine.data(), mine.size(), deadline));
  }
  TF_RDMA_RETURN_IF_ERROR(RecvLine(setup.fd, &line, kMaxLine, deadline));
  if (line.rfind("DENIED ", 0) == 0) {
    return Unavailable("refused: " + Printable(line.substr(7), 400));
  }
  if (line.rfind("VERBS ", 0) != 0) {
    return Unavailable("expected the peer's verbs address, got '" +
                       Printable(line, 60) + "'");
  }
  TF_RDMA_RETURN_IF_ERROR(pair->Connect(line.substr(6)).Prefixed(
      "connecting the verbs queue pair to " + setup.peer));
  if (!setup.dialed) {
    TF_RDMA_RETURN_IF_ERROR(
        SendAll(setup.fd, mine.data(), mine.size(), deadline));
  }
  *out = std::move(pair);
  return Status::Ok();
}

}  // namespace

std::string PluginPath() {
  const char* forced = std::getenv("TF_RDMA_VERBS_LIBRARY");
  if (forced != nullptr && forced[0] != '\0') return forced;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&PluginPath), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "_tf_rdma_verbs.so";
  }
  std::string self = info.dli_fname;
  size_t slash = self.rfind('/');
  std::string dir = slash == std::string::npos ? "." : self.substr(0, slash);
  return dir + "/_tf_rdma_verbs.so";
}

Status OpenTransport(const TransportOptions& options,
                     std::unique_ptr<Transport>* out) {
  VerbsSettings settings = options.verbs;
  settings.local_host = options.local_host;
  settings.timeout_ms = options.timeout_ms;
  std::unique_ptr<VerbsDevice> device;
  TF_RDMA_RETURN_IF_ERROR(OpenDevice(settings, &device));
  out->reset(new VerbsTransport(std::move(device)));
  return Status::Ok();
}

}  // namespace verbs
}  // namespace tf_rdma
