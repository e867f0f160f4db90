// What the optimizers' step hands to a backend (src/optim.cpp on the CPU, src/optim_cuda.cu on CUDA).
#pragma once

#include "../kernels/update_math.h"
#include "memsave/optim.h"

#include <unordered_map>
#include <vector>

namespace memsave::optim::detail {

// ---- the order of a parameter's state (QuantizedParamState::strides)

/// The order a new state of `param` takes: its memory's when it is dense (no gaps, no shared elements) but
/// not row-major, as a channels_last weight; otherwise row-major (empty).
std::vector<int64_t> state_order(const torch::Tensor& param);
/// Whether `order` is a dense layout of `sizes` (empty: row-major, always): what a loaded file must hold.
bool is_dense_order(c10::IntArrayRef sizes, c10::IntArrayRef order);
/// Whether the elements of `t` lie in memory in `order` (of t's shape), from t's first element on.
bool lies_in(const torch::Tensor& t, c10::IntArrayRef order);
/// Whether orders `a` and `b` of `sizes` place every element at the same offset.
bool same_order(c10::IntArrayRef sizes, c10::IntArrayRef a, c10::IntArrayRef b);
/// A new tensor of `sizes` whose elements lie in `order`.
torch::Tensor empty_in(c10::IntArrayRef sizes, c10::IntArrayRef order, const torch::TensorOptions& options);
/// `t` when it lies in `order`, otherwise a copy that does.
torch::Tensor laid_out(const torch::Tensor& t, c10::IntArrayRef order);
/// The elements of `t`, which lies in some order, as a 1-D tensor in that order (a view of t's memory).
torch::Tensor memory_of(const torch::Tensor& t);
/// `flat` (1-D, in `order`) as a tensor of `sizes`: a view.
torch::Tensor in_shape(const torch::Tensor& flat, c10::IntArrayRef sizes, c10::IntArrayRef order);

struct TensorStep {
  torch::Tensor param;  ///< lies in its state's order (state->strides())
  torch::Tensor grad;   ///< lies in that order too; same dtype and device
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

// ---- copy_state with a pairing of its own

/// Each parameter of the target (its TensorImpl) -> the source's parameter whose state it takes.
using SourceOf = std::unordered_map<const c10::TensorImpl*, const c10::TensorImpl*>;
/// copy_state pairing the parameters as `source_of` says (it must map every one of `to`'s to one of
/// `from`'s); null: as the public copy_state pairs them.
void copy_state(const torch::optim::Optimizer& from, torch::optim::Optimizer& to, const SourceOf* source_of);

}  // namespace memsave::optim::detail
