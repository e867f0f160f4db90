// A thread-per-lane emulation of the CUDA primitives that kernels/optim_cuda_kernels.cuh and
// kernels/fingerprint_cuda.cuh are written against, so that the kernels' indexing, striding, reductions and
// launch logic run, as host C++, on a machine without a GPU: every CUDA thread of a thread block is an OS
// thread, __syncthreads a barrier of the block, __shfl_xor_sync an exchange through a barrier of the warp and
// atomicAdd a host atomic. Thread blocks run one after another (the kernels never wait on another block), so
// __shared__ arrays can be plain statics.
//
// It checks what CUDA leaves undefined and a GPU would not report: a shuffle or a barrier that some thread of
// its warp or block does not reach (it has returned, or waits elsewhere). The program then stops with a
// message instead of computing something plausible.
//
// Include it before the kernels. It defines CUDA's keywords as macros, so it belongs in a test's translation
// unit only.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__CUDACC__)
#error "simt.h emulates CUDA on the host; compile this file with the host compiler"
#endif

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct SimtIndex {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local SimtIndex threadIdx, blockIdx, blockDim, gridDim;

inline std::uint32_t max(std::uint32_t a, std::uint32_t b) { return a < b ? b : a; }
inline std::int64_t min(std::int64_t a, std::int64_t b) { return b < a ? b : a; }

namespace simt {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "simt: block %u thread %u: %s\n", blockIdx.x, threadIdx.x, what);
  std::abort();
}

/// A reusable barrier of `count` threads that refuses to complete once one of them has returned.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}

  void arrive_and_wait(const char* where) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (returned_ > 0) fail_with(where, "a thread it waits for has returned");
    const std::uint64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return;
    }
    const bool woken = changed_.wait_for(lock, std::chrono::seconds(60),
                                         [&] { return generation_ != generation || returned_ > 0; });
    if (!woken) fail_with(where, "waited 60 s: some threads of the group wait at another barrier");
    if (generation_ == generation) fail_with(where, "a thread it waits for has returned");
  }

  /// The calling thread has returned from the kernel.
  void leave() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++returned_;
    if (arrived_ > 0) changed_.notify_all();
  }

 private:
  [[noreturn]] static void fail_with(const char* where, const char* why) {
    char message[256];
    std::snprintf(message, sizeof(message), "%s: %s", where, why);
    fail(message);
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  const int count_;
  int arrived_ = 0;
  int returned_ = 0;
  std::uint64_t generation_ = 0;
};

struct Warp {
  Barrier barrier{32};
  std::uint64_t slot[2][32] = {};  // shuffles alternate between the two: one barrier per shuffle
};

/// The thread block being run.
struct Block {
  explicit Block(int threads) : barrier(threads), warps(static_cast<size_t>(threads / 32)) {}
  Barrier barrier;
  std::vector<Warp> warps;
};
inline thread_local Block* current = nullptr;
inline thread_local std::uint64_t shuffles = 0;  // of this thread, so far

/// Runs kernel(args...) as a grid of `grid` thread blocks of `threads` threads (a multiple of 32).
template <typename... Params, typename... Args>
void run(void (*kernel)(Params...), int grid, int threads, const Args&... args) {
  if (grid < 1 || threads < 32 || threads % 32 != 0 || threads > 1024) {
    std::fprintf(stderr, "simt: bad launch: %d blocks of %d threads\n", grid, threads);
    std::abort();
  }
  for (int b = 0; b < grid; ++b) {
    Block block(threads);
    std::vector<std::thread> lanes;
    lanes.reserve(static_cast<size_t>(threads));
    for (int t = 0; t < threads; ++t) {
      lanes.emplace_back([&, t] {
        threadIdx = {static_cast<unsigned>(t), 0, 0};
        blockIdx = {static_cast<unsigned>(b), 0, 0};
        blockDim = {static_cast<unsigned>(threads), 0, 0};
        gridDim = {static_cast<unsigned>(grid), 0, 0};
        current = &block;
        shuffles = 0;
        kernel(args...);
        block.warps[static_cast<size_t>(t / 32)].barrier.leave();
        block.barrier.leave();
        current = nullptr;
      });
    }
    for (std::thread& lane : lanes) lane.join();
  }
}

}  // namespace simt

inline void __syncthreads() { simt::current->barrier.arrive_and_wait("__syncthreads"); }

/// The value of `value` in lane (this lane ^ lane_mask) of the warp; every lane of the warp must call it.
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(std::uint64_t), "a register value");
  if (mask != 0xffffffffu) simt::fail("__shfl_xor_sync: only full-warp masks are emulated");
  if (lane_mask < 0 || lane_mask > 31) simt::fail("__shfl_xor_sync: lane mask outside the warp");
  simt::Warp& warp = simt::current->warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32;
  // A lane writes this shuffle's half of the slots, which the last shuffle but one read: every lane has
  // passed the previous shuffle's barrier, so has read it.
  std::uint64_t* slot = warp.slot[simt::shuffles % 2];
  ++simt::shuffles;
  std::memcpy(&slot[lane], &value, sizeof(T));
  warp.barrier.arrive_and_wait("__shfl_xor_sync");
  T result;
  std::memcpy(&result, &slot[lane ^ static_cast<unsigned>(lane_mask)], sizeof(T));
  return result;
}

/// Adds `value` to `*address` atomically and returns the value before (the 64-bit overload CUDA has).
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}
