#include "optim_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

namespace memsave::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPerThread = kMaxBlock / kThreads;  // elements of one quantization block per thread
constexpr std::int64_t kChunk = 4096;                // elements per unit of work for fp32 state

std::atomic<std::int64_t> launches{0};

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

__device__ __forceinline__ std::uint32_t block_max(std::uint32_t value, std::uint32_t* shared) {
  for (int offset = 16; offset > 0; offset /= 2)
    value = max(value, __shfl_xor_sync(0xffffffffu, value, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kThreads / 32 ? shared[lane] : 0u;
    for (int offset = 16; offset > 0; offset /= 2)
      value = max(value, __shfl_xor_sync(0xffffffffu, value, offset));
    if (lane == 0) shared[0] = value;
  }
  __syncthreads();
  const std::uint32_t result = shared[0];
  __syncthreads();
  return result;
}

template <typename T, Rule R>
__global__ void __launch_bounds__(kThreads) step8_kernel(const LaunchArgs a) {
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  constexpr bool kSecond = has_second_moment(R);
  __shared__ std::uint32_t shared[kThreads / 32];
  const float scale = a.inv_scale != nullptr ? *a.inv_scale : 1.0f;
  const CodeBook& sb = *a.signed_book;
  const CodeBook& ub = *a.unsigned_book;
  const std::int64_t units = a.first_unit[a.count];
  for (std::int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const int t = tensor_of(a, unit);
    const CudaTensorStep& s = a.tensor[t];
    const std::int64_t block = unit - a.first_unit[t];
    const std::int64_t offset = block * a.unit_size;
    const std::int64_t n = min(a.unit_size, s.numel - offset);
    T* param = static_cast<T*>(s.param) + offset;
    const T* grad = static_cast<const T*>(s.grad) + offset;
    std::uint8_t* mq = static_cast<std::uint8_t*>(s.m) + offset;
    std::uint8_t* vq = kSecond ? static_cast<std::uint8_t*>(s.v) + offset : nullptr;
    const float absmax_m = s.absmax_m[block];
    const float absmax_v = kSecond ? s.absmax_v[block] : 0.0f;
    float m[kMaxPerThread], v[kMaxPerThread];
    std::uint32_t max_m = 0, max_v = 0;
#pragma unroll
    for (int k = 0; k < kMaxPerThread; ++k) {
      const std::int64_t i = threadIdx.x + static_cast<std::int64_t>(k) * kThreads;
      m[k] = 0.0f;
      v[k] = 0.0f;
      if (i < n) {
        float p = to_float(param[i]);
        m[k] = sb.code[mq[i]] * absmax_m;
        if (kSecond) v[k] = ub.code[vq[i]] * absmax_v;
        update<R>(p, to_float(grad[i]) * scale, m[k], v[k], s.scalars);
        param[i] = from_float<T>(p);
        max_m = max(max_m, to_bits(m[k]) & 0x7fffffffu);
        max_v = max(max_v, to_bits(v[k]) & 0x7fffffffu);
      }
    }
    const float new_max_m = bits_to_float(block_max(max_m, shared));
    const float new_max_v = kSecond ? bits_to_float(block_max(max_v, shared)) : 0.0f;
    if (threadIdx.x == 0) {
      s.absmax_m[block] = new_max_m;
      if (kSecond) s.absmax_v[block] = new_max_v;
    }
    const float scale_m = block_scale(new_max_m);
    const float scale_v = block_scale(new_max_v);
#pragma unroll
    for (int k = 0; k < kMaxPerThread; ++k) {
      const std::int64_t i = threadIdx.x + static_cast<std::int64_t>(k) * kThreads;
      if (i < n) {
        mq[i] = quantize(sb, m[k] * scale_m);
        if (kSecond) vq[i] = quantize(ub, v[k] * scale_v);
      }
    }
  }
}

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
    const std::int64_t end = min(offset + a.unit_size, s.numel);
    T* param = static_cast<T*>(s.param);
    const T* grad = static_cast<const T*>(s.grad);
    float* m = static_cast<float*>(s.m);
    float* v = static_cast<float*>(s.v);
    for (std::int64_t i = offset + threadIdx.x; i < end; i += kThreads) {
      float p = to_float(param[i]);
      float mi = m[i];
      float vi = kSecond ? v[i] : 0.0f;
      update<R>(p, to_float(grad[i]) * scale, mi, vi, s.scalars);
      param[i] = from_float<T>(p);
      m[i] = mi;
      if (kSecond) v[i] = vi;
    }
  }
}

template <typename T, Rule R>
void launch_typed(const CudaStep& step, const LaunchArgs& args, cudaStream_t stream) {
  const std::int64_t units = args.first_unit[args.count];
  if (units == 0) return;
  const int grid = static_cast<int>(std::min<std::int64_t>(units, step.max_blocks));
  launches.fetch_add(1, std::memory_order_relaxed);
  if (step.quantized) {
    step8_kernel<T, R><<<grid, kThreads, 0, stream>>>(args);
  } else {
    step32_kernel<T, R><<<grid, kThreads, 0, stream>>>(args);
  }
}

/// The one list of instantiations: storage type × rule.
template <typename T>
void launch_rule(const CudaStep& step, const LaunchArgs& args, cudaStream_t stream) {
  switch (step.rule) {
    case Rule::kAdam:
      return launch_typed<T, Rule::kAdam>(step, args, stream);
    case Rule::kAdamW:
      return launch_typed<T, Rule::kAdamW>(step, args, stream);
    case Rule::kLion:
      return launch_typed<T, Rule::kLion>(step, args, stream);
    case Rule::kSgd:
      return launch_typed<T, Rule::kSgd>(step, args, stream);
  }
}

}  // namespace

std::int64_t cuda_step_launches() { return launches.load(std::memory_order_relaxed); }

int launch_step_cuda(const CudaStep& step, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  for (int first = 0; first < step.count; first += kMaxLaunchTensors) {
    LaunchArgs args{};
    args.count = std::min(kMaxLaunchTensors, step.count - first);
    args.unit_size = step.quantized ? step.block_size : kChunk;
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
    switch (step.dtype) {
      case DType::kFloat32:
        launch_rule<float>(step, args, cuda_stream);
        break;
      case DType::kBFloat16:
        launch_rule<BFloat16>(step, args, cuda_stream);
        break;
      case DType::kFloat16:
        launch_rule<Float16>(step, args, cuda_stream);
        break;
    }
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return static_cast<int>(error);
  }
  return 0;
}

}  // namespace memsave::kernels
