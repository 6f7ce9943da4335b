#include "kernels/transport/plugin.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdlib>

namespace tf_rdma {

std::string VerbsPluginPath() {
  const char* forced = std::getenv("TF_RDMA_VERBS_LIBRARY");
  if (forced != nullptr && forced[0] != '\0') return forced;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&VerbsPluginPath), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "_tf_rdma_verbs.so";
  }
  std::string self = info.dli_fname;
  size_t slash = self.rfind('/');
  std::string dir = slash == std::string::npos ? "." : self.substr(0, slash);
  return dir + "/_tf_rdma_verbs.so";
}

Status OpenVerbs(const VerbsSettings& settings,
                 std::unique_ptr<VerbsDevice>* out) {
  std::string path = VerbsPluginPath();
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

}  // namespace tf_rdma
