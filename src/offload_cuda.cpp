// The offload's CUDA side: gradient copies to pinned host memory on a side stream, and gradient fingerprints.
#include "offload_internal.h"

#include "kernel_dtype.h"
#include "memory_internal.h"

#include "../kernels/fingerprint.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/torch.h>

namespace memsave::detail {

c10::Stream side_stream(c10::Device device) {
  return at::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
}

void wait_for_current_stream(const c10::Stream& stream, c10::Device device) {
  at::cuda::CUDAEvent ready;
  ready.record(at::cuda::getCurrentCUDAStream(device.index()));
  ready.block(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream));
}

void copy_on_side_stream(const c10::Stream& stream, at::Tensor& host, const at::Tensor& source) {
  const c10::cuda::CUDAStream side(c10::cuda::CUDAStream::UNCHECKED, stream);
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    torch::NoGradGuard no_grad;
    host.copy_(source, /*non_blocking=*/true);
  }
  cuda_record_host_use(host, side);
  c10::cuda::CUDACachingAllocator::recordStream(source.storage().data_ptr(), side);
}

void fingerprint_on_stream(const c10::Stream& stream, const at::Tensor& source, at::Tensor& prints,
                           int64_t index) {
  const c10::cuda::CUDAStream on(c10::cuda::CUDAStream::UNCHECKED, stream);
  const c10::cuda::CUDAGuard device(source.device());
  kernels::CudaFingerprint f;
  f.data = source.data_ptr();
  f.dtype = kernel_dtype(source.scalar_type()).value();
  f.numel = source.numel();
  f.out = reinterpret_cast<std::uint64_t*>(prints.data_ptr<int64_t>() + index);
  C10_CUDA_CHECK(static_cast<cudaError_t>(kernels::launch_fingerprint_cuda(f, on.stream())));
  c10::cuda::CUDACachingAllocator::recordStream(source.storage().data_ptr(), on);
  c10::cuda::CUDACachingAllocator::recordStream(prints.storage().data_ptr(), on);
}

void synchronize_stream(const c10::Stream& stream) {
  c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).synchronize();
}

}  // namespace memsave::detail
