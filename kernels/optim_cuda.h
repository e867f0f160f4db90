// Fused optimizer steps on CUDA: the same update math and code books as the CPU kernels (bit-identical
// results), one launch for many tensors. Torch-free and CUDA-header-free: streams and errors travel as void*
// and int.
#pragma once

#include "dtypes.h"
#include "qmap.h"
#include "update_math.h"

#include <cstdint>

namespace memsave::kernels {

/// One tensor of a multi-tensor step. Pointers are device pointers.
struct CudaTensorStep {
  void* param = nullptr;
  const void* grad = nullptr;
  void* m = nullptr;  ///< uint8 codes (quantized, code_bytes of qmap.h) or float
  void* v = nullptr;  ///< as m; Adam rules only
  float* absmax_m = nullptr;
  float* absmax_v = nullptr;
  std::int64_t numel = 0;
  StepScalars scalars;  ///< per tensor: bias corrections follow each tensor's own step count
};

/// NOTE: kernel arguments are limited to 4 KiB (before CUDA 12.1 and on older cards), so one launch takes at
/// most kMaxLaunchTensors tensors (about 2.9 KiB of arguments); the launcher splits longer lists into several
/// launches on the same stream.
inline constexpr int kMaxLaunchTensors = 24;

struct CudaStep {
  const CudaTensorStep* tensors = nullptr;  ///< host array
  int count = 0;
  bool quantized = true;
  std::int64_t block_size = 256;  ///< a power of two in [kMinBlock, kMaxBlock]
  int bits = 8;                   ///< of the codes: 8 or 4
  Rule rule = Rule::kAdamW;
  DType dtype = DType::kFloat32;
  const CodeBook* signed_book = nullptr;    ///< device copy of signed_code_book(bits)
  const CodeBook* unsigned_book = nullptr;  ///< device copy of unsigned_code_book(bits)
  const float* inv_scale = nullptr;         ///< device, optional: gradients are multiplied by *inv_scale
  const float* found_inf = nullptr;         ///< device, optional: when *found_inf != 0 nothing is changed
};

/// Launches the step on `stream` (a cudaStream_t, of the current device). The grid holds no more thread
/// blocks than the device runs at once. Returns the cudaError_t of the launches (0 on success).
int launch_step_cuda(const CudaStep& step, void* stream);

/// Kernel launches made by launch_step_cuda since the program started (tests check one launch per group).
std::int64_t cuda_step_launches();

}  // namespace memsave::kernels
