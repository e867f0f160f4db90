// Every API difference between the LibTorch 2.x versions memsave builds against, in one place.
#pragma once

#include <c10/core/Allocator.h>
#include <torch/version.h>

#include <cstring>

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

}  // namespace memsave::compat
