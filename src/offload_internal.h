// What src/offload.cpp needs from the CUDA glue (src/offload_cuda.cpp, built with MEMSAVE_WITH_CUDA).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

namespace memsave::detail {

/// A stream of `device` for copies that run beside its compute stream.
c10::Stream side_stream(c10::Device device);
/// Queues a copy of `source` (on CUDA) into `host` (pinned) on `stream`, after the work queued so far on
/// the current stream of `source`'s device; the caching allocator learns that `stream` uses `source`.
void copy_on_side_stream(const c10::Stream& stream, at::Tensor& host, const at::Tensor& source);
/// Waits until the work queued on `stream` is done.
void synchronize_stream(const c10::Stream& stream);

}  // namespace memsave::detail
