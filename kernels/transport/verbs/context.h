// An opened RDMA device: the verbs context, its protection domain, the port
// and GID this process uses, and the memory registered with it.
//
// Registration: every region a peer may write is registered once, with
// local and remote write access, the first time it is exposed to a verbs
// peer (Pair::Expose); the NIC then checks every incoming RDMA WRITE against
// the region's bounds (rkey) in hardware. Registration pins the region's
// pages, which counts against RLIMIT_MEMLOCK: Open refuses a limit below
// VerbsSettings::min_memlock, unless the process has CAP_IPC_LOCK, so that
// the problem shows at start-up instead of at the first large plan.
#ifndef TF_RDMA_TRANSPORT_VERBS_CONTEXT_H_
#define TF_RDMA_TRANSPORT_VERBS_CONTEXT_H_

#include <infiniband/verbs.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "kernels/transport/verbs/device.h"

namespace tf_rdma {
namespace verbs {

class Context : public VerbsDevice {
 public:
  // Opens the device and port the settings name (or the first active one)
  // and chooses the GID. The error says what is missing.
  static Status Open(const VerbsSettings& settings,
                     std::unique_ptr<Context>* out);
  ~Context() override;

  std::string Describe() const override;
  Status NewPair(std::unique_ptr<VerbsPair>* out) override;

  // Registers [data, data + size) for local and remote writes, once; later
  // calls return the same key.
  Status Register(const uint8_t* data, uint64_t size, uint32_t* rkey);
  // The local key the NIC may read [data, data + nbytes) with: a
  // registered range that holds it, else the implicit on-demand-paging
  // region when the device has one; false when the bytes must be staged.
  bool FindLocal(const void* data, uint64_t nbytes, uint32_t* lkey);
  // Why queue pair `qp_num` entered the error state when the device said so
  // with an affiliated asynchronous event (e.g. the peer wrote outside a
  // registered region), else "". Reads the device's pending events.
  std::string AsyncCause(uint32_t qp_num);

  const VerbsSettings& settings() const { return settings_; }
  ibv_context* context() const { return context_; }
  ibv_pd* pd() const { return pd_; }
  uint8_t port() const { return port_; }
  bool ethernet() const { return ethernet_; }
  uint16_t lid() const { return lid_; }
  int gid_index() const { return gid_index_; }
  const ibv_gid& gid() const { return gid_; }
  ibv_mtu mtu() const { return mtu_; }  // min(port's active MTU, setting)
  uint32_t max_message() const { return max_message_; }

 private:
  Context() = default;
  Status ChoosePort();
  Status ChooseGid();
  void OpenOnDemandPaging();  // odp_mr_, or odp_what_ says why not

  VerbsSettings settings_;
  std::set<uint32_t> local_;  // IPv4 addresses of settings_.local_host
  std::string name_;
  bool emulated_ = false;  // the firmware version says "(emulated)"
  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  uint8_t port_ = 0;
  bool ethernet_ = false;
  uint16_t lid_ = 0;
  int gid_tbl_len_ = 0;
  int gid_index_ = 0;
  std::string gid_what_;  // "RoCE v2 GID 3 (10.0.0.5)" for Describe
  ibv_gid gid_ = {};
  ibv_mtu mtu_ = IBV_MTU_1024;
  uint32_t max_message_ = 1u << 30;
  ibv_mr* odp_mr_ = nullptr;  // implicit on-demand paging, when available
  std::string odp_what_;      // "implicit", or why not, for Describe

  std::mutex mu_;
  std::map<uintptr_t, ibv_mr*> registered_;  // by start address
  std::map<uint32_t, ibv_event_type> qp_events_;  // by QP number
};

}  // namespace verbs
}  // namespace tf_rdma

#endif  // TF_RDMA_TRANSPORT_VERBS_CONTEXT_H_
