// The memory meter: exact byte counts of the device pool and of the host arena, budgets that turn into a
// reproducible out-of-memory, scoped peaks, and the breakdown of a training step's peak.
//
//   memsave::install_meter();                         // first line of main(): count every CPU tensor byte
//   memsave::PeakScope scope(torch::kCPU);
//   train_step();
//   auto parts = memsave::breakdown(scope.peak(), net->parameters(), &optimizer, torch::kCPU);
//
// On the CPU the "device pool" is LibTorch's CPU allocator, replaced by a counting one; on CUDA it is the
// caching allocator's own statistics. Host memory that memsave wrappers keep off the device comes from the
// host arena, counted apart, so that on a machine without a GPU the device pool shows what a GPU would save.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace memsave {

/// Byte counts of one pool.
struct MemoryStats {
  int64_t current = 0;  ///< bytes of live tensor storage now
  int64_t peak = 0;     ///< the highest `current` since the last reset (or since the meter was installed)
  int64_t blocks = 0;   ///< live allocations
  std::optional<int64_t> budget;  ///< the budget in force, if any
};

/// Installs the counting allocator in place of LibTorch's CPU allocator. Idempotent, thread-safe, and done
/// by every other function here on first use. Storage allocated before it is not counted, so call it first.
void install_meter();

/// Counts of the device pool of `device` (kCPU: the counting allocator; kCUDA: the caching allocator).
MemoryStats memory_stats(c10::Device device);
/// Sets the peak of `device`'s pool to its current bytes.
void reset_peak(c10::Device device);

/// Bounds `device`'s pool: an allocation that would pass `bytes` throws `c10::OutOfMemoryError` whose message
/// gives the bytes asked, the bytes in use and the budget. `std::nullopt` removes the bound. On CUDA this
/// sets the caching allocator's memory fraction (it bounds reserved bytes, which include the cache).
void set_budget(c10::Device device, std::optional<int64_t> bytes);
std::optional<int64_t> get_budget(c10::Device device);

/// Bytes the host can still provide without swapping: Linux's MemAvailable (/proc/meminfo), or less where the
/// process's memory cgroup (v1 or v2: a container's memory limit) allows less, its limit less its usage but
/// for the inactive file cache. On the CPU the device pool is host memory, so memsave's measuring runs there
/// stop short of it with an out-of-memory (`simulated_device_room()`, memsave/rescue.h) rather than swap or
/// meet the kernel's OOM killer.
int64_t host_memory_available();

/// Sets a budget for its lifetime and restores the previous one.
class ScopedBudget {
 public:
  ScopedBudget(c10::Device device, int64_t bytes);
  ~ScopedBudget();
  ScopedBudget(const ScopedBudget&) = delete;
  ScopedBudget& operator=(const ScopedBudget&) = delete;

 private:
  c10::Device device_;
  std::optional<int64_t> previous_;
};

/// Measures the peak of `device`'s pool from its construction on. Scopes nest: an inner scope does not hide
/// its peak from an outer one, and `memory_stats(device).peak` stays the peak since the last `reset_peak`.
/// NOTE: scopes on one device must be opened and closed by one thread, innermost first.
class PeakScope {
 public:
  explicit PeakScope(c10::Device device);
  ~PeakScope();
  PeakScope(const PeakScope&) = delete;
  PeakScope& operator=(const PeakScope&) = delete;

  /// Bytes in use when the scope opened.
  int64_t start() const { return start_; }
  /// The highest bytes in use since the scope opened.
  int64_t peak() const;

 private:
  c10::Device device_;
  int64_t start_ = 0;
  int64_t outer_peak_ = 0;
};

/// The host arena: host memory that wrappers keep off the device (pinned when a CUDA device is present).
/// Counted apart from the CPU device pool.
c10::Allocator* host_allocator();
MemoryStats host_memory_stats();
void reset_host_peak();
/// True when the host arena hands out page-locked (pinned) memory.
bool host_memory_is_pinned();
/// An empty CPU tensor whose storage comes from the host arena (pinned when a CUDA device is present).
at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype);
/// While open, the CPU tensors this thread allocates come from the host arena instead of the CPU device pool
/// (how the offloading wrappers keep state that CPU code creates, such as an optimizer's, off the "device"
/// when the device is the CPU). That memory stays on the host and is never pinned, not even with CUDA (page-
/// locked memory is scarce, and LibTorch's pinned allocator rounds each block up to a power of two); use
/// host_empty for buffers that copies to or from a device read or write. Scopes nest.
class HostAllocationScope {
 public:
  HostAllocationScope();
  ~HostAllocationScope();
  HostAllocationScope(const HostAllocationScope&) = delete;
  HostAllocationScope& operator=(const HostAllocationScope&) = delete;
};

/// A peak split into what the model and optimizer hold and the rest.
struct MemoryBreakdown {
  int64_t parameters = 0;       ///< storage of the parameters on the device
  int64_t gradients = 0;        ///< storage of their gradients
  int64_t optimizer_state = 0;  ///< storage of the optimizer's state tensors on the device
  int64_t other = 0;            ///< activations, temporaries and everything else: the residual
  int64_t total = 0;            ///< the peak that was split; the four parts sum to it
};

/// Splits `peak` (bytes) of `device`'s pool. Parameters, gradients and state are counted by unique storage,
/// as they are now; `other` is the residual. Measure the peak over a window that includes the optimizer
/// step, when all three are live together, so the residual cannot be negative (it is checked).
MemoryBreakdown breakdown(int64_t peak, const std::vector<at::Tensor>& parameters,
                          const torch::optim::Optimizer* optimizer, c10::Device device);

/// The defined state tensors of an optimizer: LibTorch's SGD, Adam, AdamW, Adagrad, RMSprop and LBFGS, and
/// every optimizer that implements `StateTensors`. Other state types are an error (they would be miscounted).
std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer);

/// Implemented by memsave's own optimizers so the meter can count their state.
class StateTensors {
 public:
  virtual ~StateTensors() = default;
  virtual std::vector<at::Tensor> state_tensors() const = 0;
};

/// "1.5GiB", "300MB", "4096" → bytes. Units: B; kB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB (powers
/// of 1024); case-insensitive. Rejects negative, non-numeric, ambiguous (bare "G") and overflowing sizes.
int64_t parse_bytes(const std::string& text);
/// Bytes in binary units with two decimals: "1.50 GiB", "512 B".
std::string format_bytes(int64_t bytes);

}  // namespace memsave
