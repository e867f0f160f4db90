// What src/offload.cpp needs from the CUDA glue (src/offload_cuda.cpp, built with MEMSAVE_WITH_CUDA).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

namespace memsave::detail {

/// A stream of `device` for copies that run beside its compute stream.
c10::Stream side_stream(c10::Device device);
/// Has `stream` wait for the work queued so far on the current stream of `device`.
void wait_for_current_stream(const c10::Stream& stream, c10::Device device);
/// Queues a copy of `source` (on CUDA) into `host` (pinned) on `stream` (which has waited for what wrote
/// `source`); the caching allocator learns that `stream` uses `source`.
void copy_on_side_stream(const c10::Stream& stream, at::Tensor& host, const at::Tensor& source);
/// Queues on `stream` kernels/fingerprint.h's fingerprint of `source` (CUDA; fp32, bf16 or fp16, its
/// elements filling their memory) into element `index` of `prints` (int64, on the same device).
void fingerprint_on_stream(const c10::Stream& stream, const at::Tensor& source, at::Tensor& prints,
                           int64_t index);
/// Waits until the work queued on `stream` is done.
void synchronize_stream(const c10::Stream& stream);

}  // namespace memsave::detail
