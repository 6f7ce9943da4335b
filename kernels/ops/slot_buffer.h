// A TensorBuffer that aliases a slot copy in a region (zero-copy receive).
//
// The recv op wraps the bytes the sender wrote, in place, as the output
// tensor. When TensorFlow drops the last reference to the buffer (every
// consumer is done, and any tensor sharing it too), the destructor hands the
// slot copy back to the sender as a credit. OwnsMemory() is false, so
// TensorFlow never forwards this buffer to an op as scratch space.
#ifndef TF_RDMA_OPS_SLOT_BUFFER_H_
#define TF_RDMA_OPS_SLOT_BUFFER_H_

#include "kernels/engine/engine.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_rdma {

class SlotBuffer : public tensorflow::TensorBuffer {
 public:
  SlotBuffer(const RecvTicket& ticket, size_t nbytes)
      : tensorflow::TensorBuffer(ticket.payload),
        ticket_(ticket),
        nbytes_(nbytes) {
    // A released region is not unmapped while this tensor aliases it.
    Engine::HoldRegion(ticket_, 1);
  }
  ~SlotBuffer() override {
    Engine::Get()->Release(ticket_);
    Engine::HoldRegion(ticket_, -1);
  }

  size_t size() const override { return nbytes_; }
  tensorflow::TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(
      tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(nbytes_);
    proto->set_allocated_bytes(nbytes_);
    proto->set_allocator_name("tf_rdma_slot");
  }
  bool OwnsMemory() const override { return false; }

 private:
  RecvTicket ticket_;
  size_t nbytes_;
};

}  // namespace tf_rdma

#endif  // TF_RDMA_OPS_SLOT_BUFFER_H_
