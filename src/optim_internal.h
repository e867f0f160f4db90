// What the optimizers' step hands to a backend (src/optim.cpp on the CPU, src/optim_cuda.cu on CUDA).
#pragma once

#include "../kernels/update_math.h"
#include "memsave/optim.h"

#include <vector>

namespace memsave::optim::detail {

struct TensorStep {
  torch::Tensor param;  ///< contiguous
  torch::Tensor grad;   ///< contiguous, same dtype and device
  QuantizedParamState* state;
  kernels::Rule rule;
  kernels::StepScalars scalars;
  /// A GradScaler's 1/scale, multiplied into the gradient inside the kernel: a float scalar on the
  /// parameter's device, or undefined for none.
  torch::Tensor inv_scale;
};

void step_cpu(const TensorStep& step);
/// Copies the code books of `bits`-bit state to CUDA device `device` if they are not there yet: the one
/// allocation of a CUDA step besides the state, made before anything is stepped.
void cuda_books_ready(c10::DeviceIndex device, int bits);
/// One launch per group of tensors of one device, state kind, storage type and rule; allocates nothing.
void step_cuda(const std::vector<TensorStep>& steps);

}  // namespace memsave::optim::detail
