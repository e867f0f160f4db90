// The optimizers' CUDA backend: groups the tensors of a step by device, state kind, storage type and rule,
// and launches the fused kernel once per group on the current stream.
#include "kernel_dtype.h"
#include "optim_internal.h"

#include "../kernels/optim_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <tuple>

namespace memsave::optim::detail {
namespace {

namespace k = memsave::kernels;

/// The code books, copied once to each device.
const k::CodeBook* device_book(bool is_signed, int bits, c10::DeviceIndex device) {
  static std::mutex mutex;
  // NOTE: leaked on purpose: freeing device memory during static destruction can outlive the CUDA context.
  static auto* books = new std::map<std::tuple<c10::DeviceIndex, bool, int>, torch::Tensor>();
  std::lock_guard<std::mutex> lock(mutex);
  torch::Tensor& book = (*books)[{device, is_signed, bits}];
  if (!book.defined()) {
    const k::CodeBook& host = is_signed ? k::signed_code_book(bits) : k::unsigned_code_book(bits);
    book = torch::from_blob(const_cast<k::CodeBook*>(&host), {static_cast<int64_t>(sizeof(k::CodeBook))},
                            torch::kUInt8)
               .to(torch::Device(torch::kCUDA, device));
  }
  return reinterpret_cast<const k::CodeBook*>(book.data_ptr());
}

/// (the CPU side has checked the storage types before any launch)
k::DType storage_type(const torch::Tensor& t) { return kernel_dtype(t.scalar_type()).value(); }

}  // namespace

void cuda_books_ready(c10::DeviceIndex device, int bits) {
  device_book(true, bits, device);
  device_book(false, bits, device);
}

void step_cuda(const std::vector<TensorStep>& steps) {
  // device, block size (0: fp32), bits, dtype, rule
  using Key = std::tuple<c10::DeviceIndex, int64_t, int64_t, int32_t, int32_t>;
  struct Group {
    std::vector<k::CudaTensorStep> tensors;
    const float* inv_scale = nullptr;  ///< the device's copy of the scaler's 1/scale, when scaled
  };
  std::map<Key, Group> groups;
  for (const TensorStep& t : steps) {
    const QuantizedParamState& s = *t.state;
    k::CudaTensorStep c;
    c.param = t.param.data_ptr();
    c.grad = t.grad.data_ptr();
    c.m = s.m().data_ptr();
    c.v = s.v().defined() ? s.v().data_ptr() : nullptr;
    c.absmax_m = s.absmax_m().defined() ? s.absmax_m().data_ptr<float>() : nullptr;
    c.absmax_v = s.absmax_v().defined() ? s.absmax_v().data_ptr<float>() : nullptr;
    c.numel = t.param.numel();
    c.scalars = t.scalars;
    Group& group = groups[Key{t.param.device().index(), s.block_size(), s.quantized() ? s.bits() : 0,
                              static_cast<int32_t>(storage_type(t.param)), static_cast<int32_t>(t.rule)}];
    group.tensors.push_back(c);
    if (t.inv_scale.defined()) group.inv_scale = t.inv_scale.data_ptr<float>();
  }
  for (const auto& [key, group] : groups) {
    const std::vector<k::CudaTensorStep>& tensors = group.tensors;
    const auto [device, block_size, bits, dtype, rule] = key;
    const c10::cuda::CUDAGuard guard(device);
    k::CudaStep step;
    step.tensors = tensors.data();
    step.count = static_cast<int>(tensors.size());
    step.quantized = block_size > 0;
    step.block_size = block_size;
    step.bits = block_size > 0 ? static_cast<int>(bits) : 8;
    step.rule = static_cast<k::Rule>(rule);
    step.dtype = static_cast<k::DType>(dtype);
    if (step.quantized) {  // the fp32-state kernel reads no book
      step.signed_book = device_book(true, step.bits, device);
      step.unsigned_book = device_book(false, step.bits, device);
    }
    step.inv_scale = group.inv_scale;
    const int error = k::launch_step_cuda(step, at::cuda::getCurrentCUDAStream(device).stream());
    C10_CUDA_CHECK(static_cast<cudaError_t>(error));
  }
}

}  // namespace memsave::optim::detail
