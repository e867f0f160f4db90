// The offload's CUDA side: gradient copies to pinned host memory on a side stream.
#include "offload_internal.h"

#include "memory_internal.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/torch.h>

namespace memsave::detail {

c10::Stream side_stream(c10::Device device) {
  return at::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
}

void copy_on_side_stream(const c10::Stream& stream, at::Tensor& host, const at::Tensor& source) {
  const c10::cuda::CUDAStream side(c10::cuda::CUDAStream::UNCHECKED, stream);
  at::cuda::CUDAEvent ready;
  ready.record(at::cuda::getCurrentCUDAStream(source.device().index()));
  ready.block(side);
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    torch::NoGradGuard no_grad;
    host.copy_(source, /*non_blocking=*/true);
  }
  cuda_record_host_use(host, side);
  c10::cuda::CUDACachingAllocator::recordStream(source.storage().data_ptr(), side);
}

void synchronize_stream(const c10::Stream& stream) {
  c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).synchronize();
}

}  // namespace memsave::detail
