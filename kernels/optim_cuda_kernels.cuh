// The CUDA optimizer kernels and the launch logic around them (chunking, argument packing, the choice of
// kernel), included by optim_cuda.cu. Written against a few CUDA primitives only (threadIdx, blockIdx,
// gridDim, __shfl_xor_sync, __syncthreads, __shared__, max, min), so that tests/kernels can also compile this
// file as host C++ over a thread-per-lane emulation of them and check the kernels' indexing on a machine
// without a GPU (tests/kernels/simt.h).
#pragma once

#include "optim_cuda.h"

#include <cstdint>

#if defined(__CUDACC__)
#define MEMSAVE_UNROLL _Pragma("unroll")
#else
#define MEMSAVE_UNROLL
#endif

namespace memsave::kernels {
namespace {

constexpr int kThreads = 256;
/// Quantization blocks up to this size are stepped by one warp each (shuffles only, no barrier); larger
/// ones by a whole thread block.
constexpr int kWarpBlock = 256;
/// Elements per thread and unit of work for fp32 state.
constexpr int kPerThread32 = 4;
static_assert(kWarpBlock % 32 == 0 && kMaxBlock % kThreads == 0, "a group's lanes cover its block");
/// What a launch returns for arguments it refuses (the value of cudaErrorInvalidValue).
constexpr int kInvalidValue = 1;

struct LaunchArgs {
  CudaTensorStep tensor[kMaxLaunchTensors];
  std::int64_t first_unit[kMaxLaunchTensors + 1];  // prefix sums of units (blocks or chunks) per tensor
  int count;
  std::int64_t unit_size;
  const CodeBook* signed_book;
  const CodeBook* unsigned_book;
  const float* inv_scale;
  const float* found_inf;
};
static_assert(sizeof(LaunchArgs) <= 4096, "kernel arguments must fit in 4 KiB");

__device__ __forceinline__ int tensor_of(const LaunchArgs& a, std::int64_t unit) {
  int t = 0;
  while (t + 1 < a.count && unit >= a.first_unit[t + 1]) ++t;
  return t;
}

/// The maxima of a and b over a group of kLanes threads (a warp, or the whole thread block), left in every
/// thread of the group. The values are float magnitudes as bits, which order as the floats do.
template <int kLanes>
__device__ __forceinline__ void group_max(std::uint32_t& a, std::uint32_t& b, std::uint32_t* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    a = max(a, __shfl_xor_sync(0xffffffffu, a, offset));
    b = max(b, __shfl_xor_sync(0xffffffffu, b, offset));
  }
  if constexpr (kLanes > 32) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
      shared[2 * warp] = a;
      shared[2 * warp + 1] = b;
    }
    __syncthreads();
    MEMSAVE_UNROLL
    for (int w = 0; w < kLanes / 32; ++w) {
      a = max(a, shared[2 * w]);
      b = max(b, shared[2 * w + 1]);
    }
    __syncthreads();  // the next unit writes `shared` again
  }
}

/// The quantized step (8-bit or 4-bit codes). A group of kLanes threads steps one quantization block (a
/// unit) at a time. Each lane holds kPerLane / kPair code bytes of the block, kLanes bytes apart, and the
/// kPair elements of each (one for 8-bit codes, two neighbours for 4-bit ones), so every load and store of a
/// warp covers contiguous memory and no lane needs another's code. All loads of a unit are issued before any
/// store (parameters, gradients and codes may alias as far as the compiler knows), which keeps the loads in
/// flight.
template <typename T, Rule R, int Bits, int kLanes, int kPerLane>
__global__ void __launch_bounds__(kThreads, kLanes == 32 ? 3 : 2) step_quantized_kernel(const LaunchArgs a) {
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  constexpr bool kSecond = has_second_moment(R);
  constexpr int kGroups = kThreads / kLanes;  // groups per thread block
  constexpr int kPair = 8 / Bits;             // elements per code byte
  constexpr int kBytes = kPerLane / kPair;    // code bytes per lane
  static_assert(Bits == 8 || Bits == 4, "8-bit or 4-bit codes");
  __shared__ std::uint32_t shared[2 * kThreads / 32];
  const float scale = a.inv_scale != nullptr ? *a.inv_scale : 1.0f;
  const CodeBook& sb = *a.signed_book;
  const CodeBook& ub = *a.unsigned_book;
  const int lane = static_cast<int>(threadIdx.x) % kLanes;
  const std::int64_t units = a.first_unit[a.count];
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kGroups;
  // the loop is uniform over each group: its barriers see every thread of the group
  for (std::int64_t unit = static_cast<std::int64_t>(blockIdx.x) * kGroups + threadIdx.x / kLanes;
       unit < units; unit += stride) {
    const int t = tensor_of(a, unit);
    const CudaTensorStep& s = a.tensor[t];
    const std::int64_t block = unit - a.first_unit[t];
    const std::int64_t offset = block * a.unit_size;  // even: a 4-bit block starts at a byte
    const std::int64_t n = min(a.unit_size, s.numel - offset);
    T* param = static_cast<T*>(s.param) + offset;
    const T* grad = static_cast<const T*>(s.grad) + offset;
    std::uint8_t* mq = static_cast<std::uint8_t*>(s.m) + code_bytes(offset, Bits);
    std::uint8_t* vq = kSecond ? static_cast<std::uint8_t*>(s.v) + code_bytes(offset, Bits) : nullptr;
    const float absmax_m = s.absmax_m[block];
    const float absmax_v = kSecond ? s.absmax_v[block] : 0.0f;

    T p[kPerLane], g[kPerLane];
    std::uint8_t mc[kBytes], vc[kBytes];
    MEMSAVE_UNROLL
    for (int k = 0; k < kBytes; ++k) {
      const std::int64_t byte = lane + static_cast<std::int64_t>(k) * kLanes;
      const std::int64_t first = byte * kPair;  // the byte's first element
      if (first < n) {
        mc[k] = mq[byte];
        vc[k] = kSecond ? vq[byte] : std::uint8_t{0};
        MEMSAVE_UNROLL
        for (int h = 0; h < kPair; ++h) {
          if (first + h < n) {
            p[k * kPair + h] = param[first + h];
            g[k * kPair + h] = grad[first + h];
          }
        }
      }
    }
    float m[kPerLane], v[kPerLane];
    std::uint32_t max_m = 0, max_v = 0;
    MEMSAVE_UNROLL
    for (int k = 0; k < kBytes; ++k) {
      const std::int64_t first = (lane + static_cast<std::int64_t>(k) * kLanes) * kPair;  // as above
      MEMSAVE_UNROLL
      for (int h = 0; h < kPair; ++h) {
        const int e = k * kPair + h;
        m[e] = 0.0f;
        v[e] = 0.0f;
        if (first + h < n) {
          const int shift = Bits * (kPair - 1 - h);  // 4-bit: the first element in the high nibble
          float x = to_float(p[e]);
          m[e] = sb.code[(mc[k] >> shift) & ((1 << Bits) - 1)] * absmax_m;
          if (kSecond) v[e] = ub.code[(vc[k] >> shift) & ((1 << Bits) - 1)] * absmax_v;
          update<R>(x, to_float(g[e]) * scale, m[e], v[e], s.scalars);
          param[first + h] = store_param<T>(x, s.scalars, offset + first + h);
          max_m = max(max_m, magnitude_bits(m[e]));
          max_v = max(max_v, magnitude_bits(v[e]));
        }
      }
    }
    group_max<kLanes>(max_m, max_v, shared);
    const float new_max_m = bits_to_float(max_m);
    const float new_max_v = bits_to_float(max_v);
    if (lane == 0) {
      s.absmax_m[block] = new_max_m;
      if (kSecond) s.absmax_v[block] = new_max_v;
    }
    const float scale_m = block_scale(new_max_m);
    const float scale_v = block_scale(new_max_v);
    MEMSAVE_UNROLL
    for (int k = 0; k < kBytes; ++k) {
      const std::int64_t byte = lane + static_cast<std::int64_t>(k) * kLanes;
      const std::int64_t first = byte * kPair;
      if (first < n) {
        std::uint32_t cm = 0, cv = 0;  // an odd block's last byte keeps 0 in its low nibble
        MEMSAVE_UNROLL
        for (int h = 0; h < kPair; ++h) {
          if (first + h < n) {
            const int shift = Bits * (kPair - 1 - h);
            cm |= static_cast<std::uint32_t>(quantize(sb, m[k * kPair + h] * scale_m)) << shift;
            if (kSecond) cv |= static_cast<std::uint32_t>(quantize(ub, v[k * kPair + h] * scale_v)) << shift;
          }
        }
        mq[byte] = static_cast<std::uint8_t>(cm);
        if (kSecond) vq[byte] = static_cast<std::uint8_t>(cv);
      }
    }
  }
}

/// The fp32-state step: a unit is kThreads * kPerThread32 elements, each thread's kPerThread32 of them
/// kThreads apart, all loaded before any is stored.
template <typename T, Rule R>
__global__ void __launch_bounds__(kThreads) step32_kernel(const LaunchArgs a) {
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  constexpr bool kSecond = has_second_moment(R);
  const float scale = a.inv_scale != nullptr ? *a.inv_scale : 1.0f;
  const std::int64_t units = a.first_unit[a.count];
  for (std::int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const int t = tensor_of(a, unit);
    const CudaTensorStep& s = a.tensor[t];
    const std::int64_t offset = (unit - a.first_unit[t]) * a.unit_size;
    const std::int64_t n = min(a.unit_size, s.numel - offset);
    T* param = static_cast<T*>(s.param) + offset;
    const T* grad = static_cast<const T*>(s.grad) + offset;
    float* mp = static_cast<float*>(s.m) + offset;
    float* vp = kSecond ? static_cast<float*>(s.v) + offset : nullptr;
    T p[kPerThread32], g[kPerThread32];
    float m[kPerThread32], v[kPerThread32];
    MEMSAVE_UNROLL
    for (int k = 0; k < kPerThread32; ++k) {
      const std::int64_t i = threadIdx.x + static_cast<std::int64_t>(k) * kThreads;
      if (i < n) {
        p[k] = param[i];
        g[k] = grad[i];
        m[k] = mp[i];
        v[k] = kSecond ? vp[i] : 0.0f;
      }
    }
    MEMSAVE_UNROLL
    for (int k = 0; k < kPerThread32; ++k) {
      const std::int64_t i = threadIdx.x + static_cast<std::int64_t>(k) * kThreads;
      if (i < n) {
        float x = to_float(p[k]);
        update<R>(x, to_float(g[k]) * scale, m[k], v[k], s.scalars);
        param[i] = store_param<T>(x, s.scalars, offset + i);
        mp[i] = m[k];
        if (kSecond) vp[i] = v[k];
      }
    }
  }
}

/// Thread blocks of a launch of `units` units, `groups` of them per block: no more than `resident`, what the
/// device runs at once (the kernels stride over the remaining units).
inline int grid_blocks(std::int64_t units, int groups, std::int64_t resident) {
  const std::int64_t wanted = (units + groups - 1) / groups;
  return static_cast<int>(wanted < resident ? wanted : resident);
}

template <typename T, Rule R, int Bits, typename Launch>
int launch_quantized(const CudaStep& step, const LaunchArgs& args, Launch& launch) {
  const std::int64_t units = args.first_unit[args.count];
  if (step.block_size <= kWarpBlock)
    return launch(step_quantized_kernel<T, R, Bits, 32, kWarpBlock / 32>, units, kThreads / 32, args);
  return launch(step_quantized_kernel<T, R, Bits, kThreads, kMaxBlock / kThreads>, units, 1, args);
}

/// The kernel for one step's storage type, rule and state, handed to `launch(kernel, units, groups, args)`
/// with the number of units and how many of them one thread block steps at a time.
template <typename T, Rule R, typename Launch>
int launch_typed(const CudaStep& step, const LaunchArgs& args, Launch& launch) {
  const std::int64_t units = args.first_unit[args.count];
  if (units == 0) return 0;
  if (!step.quantized) return launch(step32_kernel<T, R>, units, 1, args);
  if (step.bits == 4) return launch_quantized<T, R, 4>(step, args, launch);
  return launch_quantized<T, R, 8>(step, args, launch);
}

/// The one list of instantiations: storage type × rule.
template <typename T, typename Launch>
int launch_rule(const CudaStep& step, const LaunchArgs& args, Launch& launch) {
  switch (step.rule) {
    case Rule::kAdam:
      return launch_typed<T, Rule::kAdam>(step, args, launch);
    case Rule::kAdamW:
      return launch_typed<T, Rule::kAdamW>(step, args, launch);
    case Rule::kLion:
      return launch_typed<T, Rule::kLion>(step, args, launch);
    case Rule::kSgd:
      return launch_typed<T, Rule::kSgd>(step, args, launch);
  }
  return kInvalidValue;
}

/// launch_step_cuda with the launch itself left to `launch`: splits the tensors into launches of at most
/// kMaxLaunchTensors, packs their arguments and picks the kernel. Returns the first error, 0 on success.
template <typename Launch>
int step_with(const CudaStep& step, Launch& launch) {
  if (step.quantized && (step.block_size < kMinBlock || step.block_size > kMaxBlock ||
                         step.block_size % 2 != 0 || (step.bits != 8 && step.bits != 4))) {
    return kInvalidValue;
  }
  for (int first = 0; first < step.count; first += kMaxLaunchTensors) {
    LaunchArgs args{};
    args.count = step.count - first < kMaxLaunchTensors ? step.count - first : kMaxLaunchTensors;
    args.unit_size = step.quantized ? step.block_size : kThreads * kPerThread32;
    args.signed_book = step.signed_book;
    args.unsigned_book = step.unsigned_book;
    args.inv_scale = step.inv_scale;
    args.found_inf = step.found_inf;
    args.first_unit[0] = 0;
    for (int t = 0; t < args.count; ++t) {
      args.tensor[t] = step.tensors[first + t];
      args.first_unit[t + 1] =
          args.first_unit[t] + (args.tensor[t].numel + args.unit_size - 1) / args.unit_size;
    }
    int error = kInvalidValue;
    switch (step.dtype) {
      case DType::kFloat32:
        error = launch_rule<float>(step, args, launch);
        break;
      case DType::kBFloat16:
        error = launch_rule<BFloat16>(step, args, launch);
        break;
      case DType::kFloat16:
        error = launch_rule<Float16>(step, args, launch);
        break;
    }
    if (error != 0) return error;
  }
  return 0;
}

}  // namespace
}  // namespace memsave::kernels
