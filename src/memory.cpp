#include "memsave/memory.h"

#include "compat.h"
#include "memory_internal.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/optim.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace memsave {
namespace {

/// Open HostAllocationScopes of this thread.
thread_local int host_scopes = 0;

/// A CPU allocator over a counted pool. Blocks carry their size, so `data == context` as LibTorch requires.
class CountingAllocator final : public compat::Allocator {
 public:
  CountingAllocator(const char* pool_name, kernels::BytePool& pool, kernels::RawMemory raw,
                    CountingAllocator& (*in_host_scope)() = nullptr)
      : pool_name_(pool_name), raw_(raw), in_host_scope_(in_host_scope), pool_(pool) {}

  c10::DataPtr allocate_bytes(size_t nbytes) override {
    if (in_host_scope_ != nullptr && host_scopes > 0) return in_host_scope_().allocate_bytes(nbytes);
    const c10::Device cpu(c10::kCPU);
    if (nbytes == 0) return {nullptr, nullptr, &kernels::free_block, cpu};
    const kernels::Block block = kernels::allocate_block(pool_, nbytes, raw_);
    const auto asked = static_cast<int64_t>(nbytes);
    TORCH_CHECK_WITH(OutOfMemoryError, block.status != kernels::BlockStatus::kOverBudget,
                     "memsave: ", pool_name_, " out of memory: tried to allocate ", format_bytes(asked), " (",
                     asked, " bytes) with ", format_bytes(pool_.current()), " (", pool_.current(),
                     " bytes) in use and a budget of ", format_bytes(pool_.budget()), " (", pool_.budget(),
                     " bytes)");
    TORCH_CHECK_WITH(OutOfMemoryError, block.status != kernels::BlockStatus::kOutOfMemory,
                     "memsave: ", pool_name_, " out of memory: the system could not provide ",
                     format_bytes(asked), " (", asked, " bytes)");
    return {block.data, block.data, &kernels::free_block, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &kernels::free_block; }

  kernels::BytePool& pool() { return pool_; }

 private:
  const char* pool_name_;
  kernels::RawMemory raw_;
  /// Where allocations go while the thread has a HostAllocationScope open (a function, so the allocator is
  /// made on first use).
  CountingAllocator& (*in_host_scope_)();
  kernels::BytePool& pool_;
};

// NOTE: the pools and allocators are leaked on purpose: tensors freed during static destruction still reach
// their pool through the block header, so the pools must outlive every other static.
kernels::BytePool& cpu_pool() {
  static auto* pool = new kernels::BytePool();
  return *pool;
}

kernels::BytePool& host_pool() {
  static auto* pool = new kernels::BytePool();
  return *pool;
}

bool& host_pinned() {
  static bool pinned = false;
  return pinned;
}

CountingAllocator& host_arena() {
  static auto* allocator = [] {
    kernels::RawMemory raw = kernels::aligned_host_memory();
#ifdef MEMSAVE_WITH_CUDA
    if (auto pinned = detail::cuda_pinned_memory()) {
      raw = *pinned;
      host_pinned() = true;
    }
#endif
    return new CountingAllocator("host arena", host_pool(), raw);
  }();
  return *allocator;
}

/// The host arena's memory for what stays on the host (the state that CPU code makes in a
/// HostAllocationScope): never pinned, since no copy to or from a device reads it. Counted with the arena.
CountingAllocator& host_scope_arena() {
  static auto* allocator = new CountingAllocator("host arena", host_pool(), kernels::aligned_host_memory());
  return *allocator;
}

CountingAllocator& cpu_allocator() {
  static auto* allocator =
      new CountingAllocator("CPU device pool", cpu_pool(), kernels::aligned_host_memory(), &host_scope_arena);
  return *allocator;
}

#ifndef MEMSAVE_WITH_CUDA
[[noreturn]] void no_cuda() {
  TORCH_CHECK(false, "memsave: this build has no CUDA support (configure with -DMEMSAVE_WITH_CUDA=ON)");
}
#endif

c10::Device normalize(c10::Device device) {
  if (device.is_cpu()) return c10::Device(c10::kCPU);
  TORCH_CHECK(device.is_cuda(), "memsave: the meter has no pool for device ", device);
#ifdef MEMSAVE_WITH_CUDA
  return c10::Device(c10::kCUDA, device.has_index() ? device.index() : detail::cuda_current_device());
#else
  no_cuda();
#endif
}

detail::DeviceCounts counts(c10::Device device) {
  if (device.is_cpu()) {
    kernels::BytePool& pool = cpu_allocator().pool();
    return {pool.current(), pool.peak(), pool.blocks()};
  }
#ifdef MEMSAVE_WITH_CUDA
  return detail::cuda_counts(device.index());
#else
  no_cuda();
#endif
}

void reset_counted_peak(c10::Device device) {
  if (device.is_cpu()) return cpu_allocator().pool().reset_peak();
#ifdef MEMSAVE_WITH_CUDA
  detail::cuda_reset_peak(device.index());
#else
  no_cuda();
#endif
}

/// Per device: the peak carried over from before the innermost open PeakScope, and the budget.
struct DeviceMeter {
  int64_t carried_peak = 0;
  std::optional<int64_t> budget;
};

std::mutex& meters_mutex() {
  static std::mutex mutex;
  return mutex;
}

DeviceMeter& meter(c10::Device device) {
  static std::unordered_map<c10::Device, DeviceMeter> meters;
  return meters[device];
}

// The meter installs itself when the program starts, so tensors made before main() are counted too.
[[maybe_unused]] const bool installed_at_start = (install_meter(), true);

}  // namespace

void install_meter() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::SetCPUAllocator(&cpu_allocator(), /*priority=*/std::numeric_limits<uint8_t>::max());
    TORCH_CHECK(c10::GetCPUAllocator() == &cpu_allocator(),
                "memsave: could not install the counting CPU allocator");
  });
}

MemoryStats memory_stats(c10::Device device) {
  install_meter();
  device = normalize(device);
  std::lock_guard<std::mutex> lock(meters_mutex());
  const detail::DeviceCounts now = counts(device);
  const DeviceMeter& m = meter(device);
  return {now.current, std::max(m.carried_peak, now.peak), now.blocks, m.budget};
}

void reset_peak(c10::Device device) {
  install_meter();
  device = normalize(device);
  std::lock_guard<std::mutex> lock(meters_mutex());
  meter(device).carried_peak = 0;
  reset_counted_peak(device);
}

void set_budget(c10::Device device, std::optional<int64_t> bytes) {
  install_meter();
  TORCH_CHECK(!bytes || *bytes >= 0, "set_budget: bytes must be >= 0, got ", *bytes);
  device = normalize(device);
  std::lock_guard<std::mutex> lock(meters_mutex());
  if (device.is_cpu()) {
    cpu_allocator().pool().set_budget(bytes.value_or(kernels::BytePool::kUnbounded));
  } else {
#ifdef MEMSAVE_WITH_CUDA
    detail::cuda_set_budget(device.index(), bytes);
#else
    no_cuda();
#endif
  }
  meter(device).budget = bytes;
}

std::optional<int64_t> get_budget(c10::Device device) {
  device = normalize(device);
  std::lock_guard<std::mutex> lock(meters_mutex());
  return meter(device).budget;
}

namespace {

/// The number a cgroup file holds (its first word); none for "max" (cgroup v2's no limit), a missing file, or
/// cgroup v1's no limit (the largest page-aligned 64-bit count).
std::optional<int64_t> cgroup_number(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(word.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || value < 0 || value >= (int64_t{1} << 62)) return std::nullopt;
  return value;
}

/// The value of `key` in a file of "key value" lines (/proc/meminfo, memory.stat).
std::optional<int64_t> keyed_number(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string name;
  long long value = 0;
  while (in >> name >> value) {
    if (name == key) return value;
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return std::nullopt;
}

}  // namespace

namespace detail {

int64_t host_memory_available(const std::string& root) {
  // MemAvailable counts the page cache the kernel would drop; free pages alone (sysconf) undercount it.
  int64_t available = 0;
  if (const auto kib = keyed_number(root + "/proc/meminfo", "MemAvailable:"))
    available = *kib * 1024;
  else
    available = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));

  // A memory cgroup (a container's limit) may allow less: of each limit on the way to the hierarchy's root,
  // what its usage leaves, the inactive file cache not counted (the kernel reclaims it before the cgroup's
  // OOM killer acts). The memory controller of cgroup v1 where it is mounted, else cgroup v2's.
  struct Files {
    const char* limit;
    const char* usage;
    const char* inactive;  ///< the inactive file cache's key in memory.stat
  };
  static constexpr Files kV1{"memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"};
  static constexpr Files kV2{"memory.max", "memory.current", "inactive_file"};
  const Files* files = nullptr;
  std::string base, path, line;
  std::ifstream cgroups(root + "/proc/self/cgroup");
  while (std::getline(cgroups, line)) {  // "id:controllers:path"
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    std::string controllers(1, ',');
    controllers.append(line, first + 1, second - first - 1).push_back(',');
    if (controllers.find(",memory,") != std::string::npos &&
        std::ifstream(root + "/sys/fs/cgroup/memory/" + kV1.limit)) {
      std::tie(files, base, path) =
          std::make_tuple(&kV1, root + "/sys/fs/cgroup/memory", line.substr(second + 1));
      break;
    }
    if (controllers == ",," && std::ifstream(root + "/sys/fs/cgroup/cgroup.controllers"))
      std::tie(files, base, path) = std::make_tuple(&kV2, root + "/sys/fs/cgroup", line.substr(second + 1));
  }
  if (files == nullptr) return available;
  // A container sees its own cgroup at the mount's root, under a path from outside it: directories that do
  // not exist are skipped.
  for (;;) {
    const std::string dir = base + (path == "/" ? "" : path);
    if (const auto max = cgroup_number(dir + "/" + files->limit)) {
      const int64_t used = cgroup_number(dir + "/" + files->usage).value_or(0) -
                           keyed_number(dir + "/memory.stat", files->inactive).value_or(0);
      available = std::min(available, std::max<int64_t>(0, *max - std::max<int64_t>(0, used)));
    }
    const auto slash = path.rfind('/');
    if (path == "/" || slash == std::string::npos) break;
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
  return available;
}

}  // namespace detail

int64_t host_memory_available() { return detail::host_memory_available(""); }

ScopedBudget::ScopedBudget(c10::Device device, int64_t bytes)
    : device_(normalize(device)), previous_(get_budget(device)) {
  set_budget(device_, bytes);
}

ScopedBudget::~ScopedBudget() { set_budget(device_, previous_); }

PeakScope::PeakScope(c10::Device device) : device_(normalize(device)) {
  install_meter();
  std::lock_guard<std::mutex> lock(meters_mutex());
  DeviceMeter& m = meter(device_);
  outer_peak_ = std::max(m.carried_peak, counts(device_).peak);
  m.carried_peak = 0;
  reset_counted_peak(device_);
  start_ = counts(device_).current;
}

PeakScope::~PeakScope() {
  std::lock_guard<std::mutex> lock(meters_mutex());
  DeviceMeter& m = meter(device_);
  m.carried_peak = std::max({outer_peak_, m.carried_peak, counts(device_).peak});
}

int64_t PeakScope::peak() const {
  std::lock_guard<std::mutex> lock(meters_mutex());
  return std::max(meter(device_).carried_peak, counts(device_).peak);
}

c10::Allocator* host_allocator() { return &host_arena(); }

MemoryStats host_memory_stats() {
  kernels::BytePool& pool = host_arena().pool();
  return {pool.current(), pool.peak(), pool.blocks(), std::nullopt};
}

void reset_host_peak() { host_arena().pool().reset_peak(); }

bool host_memory_is_pinned() {
  host_arena();
  return host_pinned();
}

HostAllocationScope::HostAllocationScope() { ++host_scopes; }
HostAllocationScope::~HostAllocationScope() { --host_scopes; }

void detail::record_host_use(const at::Tensor& host, c10::Device device) {
#ifdef MEMSAVE_WITH_CUDA
  if (device.is_cuda()) cuda_record_host_use(host, cuda_current_stream(device.index()));
#else
  (void)host;
  (void)device;
#endif
}

at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_generic(sizes, host_allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                   std::nullopt);
}

at::Tensor detail::host_empty_like(const at::Tensor& t, at::ScalarType dtype) {
  if (t.is_contiguous() || !t.is_non_overlapping_and_dense()) return host_empty(t.sizes(), dtype);
  return at::detail::empty_strided_generic(t.sizes(), t.strides(), host_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::CPU), dtype);
}

namespace {

/// Whether a storage is in `device`'s pool. On the CPU a storage that the meter did not allocate (made before
/// it was installed, or wrapping external memory) is an error: counting it would be a guess.
bool in_pool(const c10::Storage& storage, c10::Device device) {
  if (!device.is_cpu()) return true;
  const c10::DataPtr& data = storage.data_ptr();
  if (data.get() == nullptr) return false;
  TORCH_CHECK(data.get_deleter() == &kernels::free_block, "breakdown: a tensor's storage at ", data.get(),
              " was not allocated through the meter (made before install_meter(), or external memory)");
  return kernels::block_pool(data.get()) == &cpu_allocator().pool();
}

/// Adds the bytes of each not yet seen storage of `tensors` in `device`'s pool.
template <typename Tensors>
int64_t unique_storage_bytes(const Tensors& tensors, c10::Device device,
                             std::unordered_set<const void*>& seen) {
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage() || normalize(t.device()) != device) continue;
    if (!in_pool(t.storage(), device)) continue;
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second) bytes += t.storage().nbytes();
  }
  return bytes;
}

/// Appends the defined tensors (LibTorch leaves the state it does not use, such as max_exp_avg_sq,
/// undefined).
template <typename Tensors>
void append(std::vector<at::Tensor>& out, const Tensors& tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.defined()) out.push_back(t);
  }
}

}  // namespace

std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer) {
  if (const auto* own = dynamic_cast<const StateTensors*>(&optimizer)) return own->state_tensors();
  namespace optim = torch::optim;
  std::vector<at::Tensor> out;
  for (const auto& entry : optimizer.state()) {
    const optim::OptimizerParamState* state = entry.second.get();
    if (const auto* s = dynamic_cast<const optim::AdamParamState*>(state)) {
      append(out, std::vector<at::Tensor>{s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()});
    } else if (const auto* s = dynamic_cast<const optim::AdamWParamState*>(state)) {
      append(out, std::vector<at::Tensor>{s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()});
    } else if (const auto* s = dynamic_cast<const optim::SGDParamState*>(state)) {
      append(out, std::vector<at::Tensor>{s->momentum_buffer()});
    } else if (const auto* s = dynamic_cast<const optim::AdagradParamState*>(state)) {
      append(out, std::vector<at::Tensor>{s->sum()});
    } else if (const auto* s = dynamic_cast<const optim::RMSpropParamState*>(state)) {
      append(out, std::vector<at::Tensor>{s->square_avg(), s->momentum_buffer(), s->grad_avg()});
    } else if (const auto* s = dynamic_cast<const optim::LBFGSParamState*>(state)) {
      append(out, std::vector<at::Tensor>{s->d(), s->H_diag(), s->prev_flat_grad()});
      append(out, s->old_dirs());
      append(out, s->old_stps());
      append(out, s->ro());
      if (s->al()) append(out, *s->al());
    } else {
      TORCH_CHECK(false, "optimizer_state_tensors: unknown optimizer state type ", typeid(*state).name(),
                  "; implement memsave::StateTensors on the optimizer so its state can be counted");
    }
  }
  return out;
}

MemoryBreakdown breakdown(int64_t peak, const std::vector<at::Tensor>& parameters,
                          const torch::optim::Optimizer* optimizer, c10::Device device) {
  device = normalize(device);
  std::unordered_set<const void*> seen;
  MemoryBreakdown parts;
  parts.total = peak;
  parts.parameters = unique_storage_bytes(parameters, device, seen);
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : parameters) grads.push_back(p.grad());
  parts.gradients = unique_storage_bytes(grads, device, seen);
  if (optimizer != nullptr) {
    parts.optimizer_state = unique_storage_bytes(optimizer_state_tensors(*optimizer), device, seen);
  }
  parts.other = peak - parts.parameters - parts.gradients - parts.optimizer_state;
  TORCH_CHECK(parts.other >= 0, "breakdown: parameters, gradients and optimizer state hold ",
              peak - parts.other, " bytes, more than the peak of ", peak,
              " bytes; measure the peak over a window that includes the optimizer step");
  return parts;
}

}  // namespace memsave
