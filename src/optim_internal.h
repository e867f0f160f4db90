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
/// All tensors on one CUDA device; one launch per group of tensors of one state kind and dtype.
void step_cuda(const std::vector<TensorStep>& steps);

}  // namespace memsave::optim::detail
