// Every API difference between the LibTorch 2.x versions memsave builds against, in one place.
#pragma once

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <cstring>
#include <utility>
#include <vector>

#define MEMSAVE_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace memsave::compat {

/// c10::Allocator with one signature on every 2.x: before 2.3 `allocate` was const and `copy_data` did not
/// exist; from 2.3 `allocate` is non-const and `copy_data` is pure virtual.
class Allocator : public c10::Allocator {
 public:
  virtual c10::DataPtr allocate_bytes(size_t nbytes) = 0;

#if MEMSAVE_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(size_t nbytes) override { return allocate_bytes(nbytes); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t nbytes) const override {
    return const_cast<Allocator*>(this)->allocate_bytes(nbytes);
  }
#endif
};

/// Gives each group built by torch::optim::Optimizer's constructor or add_param_group (`built`) the options
/// it asked for (`asked`, in the same order). LibTorch 2.15 (not yet 2.11) builds a group's options as the
/// defaults merged with the group's, and for optimizers other than its own keeps the defaults alone: every
/// group of a memsave optimizer would run with the defaults (a group without weight decay, say, would decay).
inline void keep_group_options(std::vector<torch::optim::OptimizerParamGroup>& built,
                               const std::vector<torch::optim::OptimizerParamGroup>& asked) {
  for (size_t g = 0; g < asked.size() && g < built.size(); ++g) {
    if (asked[g].has_options()) built[g].set_options(asked[g].options().clone());
  }
}

/// Autocast state per device type: from 2.4 one function takes the device type; before, one per device.
inline bool autocast_enabled(c10::DeviceType device) {
#if MEMSAVE_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if MEMSAVE_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, enabled);
#else
  device == c10::kCPU ? at::autocast::set_cpu_enabled(enabled) : at::autocast::set_enabled(enabled);
#endif
}

inline c10::ScalarType autocast_dtype(c10::DeviceType device) {
#if MEMSAVE_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::kCPU ? at::autocast::get_autocast_cpu_dtype()
                             : at::autocast::get_autocast_gpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) {
#if MEMSAVE_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
#else
  device == c10::kCPU ? at::autocast::set_autocast_cpu_dtype(dtype)
                      : at::autocast::set_autocast_gpu_dtype(dtype);
#endif
}

/// Initializes LibTorch's CUDA state (the caching allocator among it) if nothing has yet: from 2.6 one
/// function takes the device type.
inline void lazy_init_cuda() {
#if MEMSAVE_TORCH_AT_LEAST(2, 6)
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
#else
  at::globalContext().lazyInitCUDA();
#endif
}

/// A reference that keeps an autograd node alive: std::shared_ptr<Node> in 2.11, c10::intrusive_ptr<Node> in
/// 2.15; both have `->`.
using NodeRef = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

}  // namespace memsave::compat
