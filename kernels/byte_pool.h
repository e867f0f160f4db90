// Exact, thread-safe byte accounting for one memory pool, and size-carrying blocks.
//
// Torch-free: the LibTorch allocators in src/memory.cpp are thin adapters over this file, so its
// arithmetic is tested (also under sanitizers) without LibTorch.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace memsave::kernels {

/// Current, peak and budget of one pool. All members are safe to call from any thread.
class BytePool {
 public:
  static constexpr std::int64_t kUnbounded = -1;

  /// Accounts `bytes` more in use. Returns false, and changes nothing, when that would pass the budget.
  bool reserve(std::int64_t bytes) noexcept;
  /// Accounts `bytes` fewer in use (the inverse of a successful `reserve`).
  void release(std::int64_t bytes) noexcept;

  std::int64_t current() const noexcept { return current_.load(std::memory_order_relaxed); }
  std::int64_t peak() const noexcept { return peak_.load(std::memory_order_relaxed); }
  /// Number of live blocks (reservations not yet released).
  std::int64_t blocks() const noexcept { return blocks_.load(std::memory_order_relaxed); }
  /// Sets the peak to the bytes in use now.
  void reset_peak() noexcept { peak_.store(current(), std::memory_order_relaxed); }

  /// `kUnbounded` or a limit in bytes (>= 0). A budget below the bytes in use refuses every new reservation
  /// but frees nothing.
  void set_budget(std::int64_t bytes) noexcept { budget_.store(bytes, std::memory_order_relaxed); }
  std::int64_t budget() const noexcept { return budget_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::int64_t> current_{0};
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::int64_t> blocks_{0};
  std::atomic<std::int64_t> budget_{kUnbounded};
};

/// Where a pool's bytes come from: aligned host memory, or pinned memory from the CUDA runtime.
struct RawMemory {
  void* (*allocate)(std::size_t bytes);  ///< nullptr on failure; result aligned to kBlockAlignment
  void (*release)(void* ptr);
};

/// Ordinary host memory aligned to kBlockAlignment.
RawMemory aligned_host_memory() noexcept;

/// Alignment of every block's data, as LibTorch's CPU allocator gives (it vectorizes on it).
inline constexpr std::size_t kBlockAlignment = 64;

enum class BlockStatus { kOk, kOverBudget, kOutOfMemory };

struct Block {
  void* data = nullptr;
  BlockStatus status = BlockStatus::kOk;
};

/// Allocates `bytes` from `raw`, accounted to `pool`. The size, pool and release function are kept in a
/// header just before the data, so `free_block(data)` needs nothing else.
/// NOTE: LibTorch requires `data == context` for CPU allocations; this layout is what makes that possible.
Block allocate_block(BytePool& pool, std::size_t bytes, RawMemory raw) noexcept;

/// Releases a block from `allocate_block` and its bytes from its pool. Null is a no-op.
void free_block(void* data) noexcept;

/// The size that `allocate_block` was asked for.
std::size_t block_size(const void* data) noexcept;

/// The pool a block is accounted to.
const BytePool* block_pool(const void* data) noexcept;

}  // namespace memsave::kernels
