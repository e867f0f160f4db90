// Gradient accumulation with the loss normalized over the whole window.
//
//   memsave::GradientAccumulator acc(opt, memsave::AccumulateOptions().window(4).max_grad_norm(1.0));
//   for (auto& micro : loader) {                       // micro-batches of any sizes
//     auto loss = loss_fn(net->forward(micro.data), micro.target);    // mean over the micro-batch's items
//     acc.backward(loss, micro.data.size(0));          // steps after every 4th micro-batch
//   }
//   acc.step();                                        // the last, shorter window
//
// The gradient of a window is the gradient of (sum of per-item losses over the window) / (items in the
// window): a micro-batch of 3 items weighs 3/8 of a window of 8 items, not 1/4 as "average the
// per-micro-batch means" would make it. Items can be tokens (count the unmasked ones). One unscale, clip and
// optimizer step per window. The normalization runs in fp32 also for an fp16 or bf16 loss (in fp16 a loss
// times a window's tokens overflows, and 1 / tokens loses precision).
//
// With an OffloadOptimizer that copies gradients during the backward, the accumulator defers the copies to
// the window's last micro-batch: the one whose items complete the count given to begin_window, or (without
// it) the window()-th, when its items complete the expected count. When the optimizer also steps during the
// backward (`step_during_backward`: no scaler, no clipping), that last backward steps the parameters; a
// window that ends otherwise (shorter, or with other counts) is stepped at `step()`, after its correction.
#pragma once

#include <memsave/amp.h>

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace memsave {

class OffloadOptimizer;

/// What a micro-batch's scalar loss is: the mean over its items, or their sum.
enum class LossReduction { kMean, kSum };

struct AccumulateOptions {
  /// Micro-batches per optimizer step; `backward` steps when a window is full.
  TORCH_ARG(int64_t, window) = 1;
  /// When > 0, the gradients' global L2 norm is clipped to this (after unscaling, before the step).
  TORCH_ARG(double, max_grad_norm) = 0;
  /// What the losses passed to `backward` are.
  TORCH_ARG(LossReduction, reduction) = LossReduction::kMean;
};

/// Splits every tensor along dim 0 into micro-batches of `micro_batch` rows (the last may be shorter). All
/// tensors must have the same, non-zero dim-0 size, at least `micro_batch`.
std::vector<std::vector<torch::Tensor>> split_micro_batches(const std::vector<torch::Tensor>& tensors,
                                                            int64_t micro_batch);

/// The outcome of closing a window.
struct WindowStep {
  bool stepped = false;  ///< false when the GradScaler found inf/NaN gradients and skipped the step
  double items = 0;      ///< items (or tokens) the window was normalized by
  double loss = 0;       ///< the window's loss: sum of per-item losses / items
  int64_t micro_batches = 0;
  /// With clipping (max_grad_norm > 0): the gradients' global L2 norm before clipping, after unscaling (inf
  /// or NaN in a window the scaler skips); 0 without clipping.
  double grad_norm = 0;
};

class GradientAccumulator {
 public:
  /// `optimizer` (and `scaler`, when given) must outlive the accumulator.
  GradientAccumulator(torch::optim::Optimizer& optimizer, AccumulateOptions options = {},
                      amp::GradScaler* scaler = nullptr);
  /// NOTE: holds references and the state of an open window; not copyable.
  GradientAccumulator(const GradientAccumulator&) = delete;
  GradientAccumulator& operator=(const GradientAccumulator&) = delete;

  /// Optional: announces the items of the coming window, so every micro-batch's loss is scaled by the right
  /// factor as it goes backward (otherwise the first micro-batch's count times the window is assumed and the
  /// gradients are corrected once at the step).
  void begin_window(double items);
  /// Back-propagates one micro-batch's scalar `loss` over `items` items (> 0). Steps when the window is full
  /// and returns that step's outcome. An error (a bad argument, an out-of-memory in backward) drops the open
  /// window (gradients zeroed, nothing stepped) before it propagates.
  std::optional<WindowStep> backward(const torch::Tensor& loss, double items);
  /// Closes the open window (a shorter last one): unscale, normalize, clip and step once. An error without an
  /// open window.
  WindowStep step();
  /// Drops the open window: gradients are zeroed, nothing is stepped.
  void discard();

  /// Micro-batches in the open window.
  int64_t pending() const { return micro_batches_; }
  const AccumulateOptions& options() const { return options_; }

 private:
  /// Forgets the window (gradients, counts, normalizer) after its step or its discard.
  void reset();

  torch::optim::Optimizer& optimizer_;
  AccumulateOptions options_;
  amp::GradScaler* scaler_;
  OffloadOptimizer* offload_ = nullptr;  ///< the optimizer, when it copies gradients during the backward
  int64_t micro_batches_ = 0;
  double items_ = 0;
  torch::Tensor
      loss_sum_;  ///< sum of per-item losses of the window, on the loss's device (no sync per micro)
  std::optional<double> normalizer_;  ///< what every backward divided its loss sum by
  bool announced_ = false;            ///< normalizer_ came from begin_window
  bool stepped_in_backward_ = false;  ///< the window's last backward stepped the parameters (offload_)
};

}  // namespace memsave
