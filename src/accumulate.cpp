#include "memsave/accumulate.h"

#include "memsave/offload.h"

#include "step_room.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <unordered_set>

namespace memsave {

std::vector<std::vector<torch::Tensor>> split_micro_batches(const std::vector<torch::Tensor>& tensors,
                                                            int64_t micro_batch) {
  TORCH_CHECK(!tensors.empty(), "split_micro_batches: no tensors");
  for (size_t i = 0; i < tensors.size(); ++i)
    TORCH_CHECK(tensors[i].defined() && tensors[i].dim() > 0, "split_micro_batches: tensor ", i,
                " must have a dim 0 to split along");
  const int64_t rows = tensors[0].size(0);
  TORCH_CHECK(rows > 0, "split_micro_batches: the batch is empty");
  for (size_t i = 1; i < tensors.size(); ++i)
    TORCH_CHECK(tensors[i].size(0) == rows, "split_micro_batches: tensor ", i, " has ", tensors[i].size(0),
                " rows but tensor 0 has ", rows);
  TORCH_CHECK(micro_batch > 0 && micro_batch <= rows, "split_micro_batches: micro_batch must be in [1, ",
              rows, "] (the batch), got ", micro_batch);
  std::vector<std::vector<torch::Tensor>> micro;
  for (int64_t start = 0; start < rows; start += micro_batch) {
    std::vector<torch::Tensor> parts;
    for (const auto& t : tensors) parts.push_back(t.narrow(0, start, std::min(micro_batch, rows - start)));
    micro.push_back(std::move(parts));
  }
  return micro;
}

GradientAccumulator::GradientAccumulator(torch::optim::Optimizer& optimizer, AccumulateOptions options,
                                         amp::GradScaler* scaler)
    : optimizer_(optimizer), options_(options), scaler_(scaler) {
  TORCH_CHECK(options.window() >= 1, "GradientAccumulator: window must be >= 1, got ", options.window());
  TORCH_CHECK(options.max_grad_norm() >= 0 && std::isfinite(options.max_grad_norm()),
              "GradientAccumulator: max_grad_norm must be >= 0 (0: no clipping), got ",
              options.max_grad_norm());
  auto* offload = dynamic_cast<OffloadOptimizer*>(&optimizer);
  if (offload != nullptr && offload->options().step_during_backward()) {
    TORCH_CHECK(
        scaler == nullptr,
        "GradientAccumulator: an OffloadOptimizer with step_during_backward steps its parameters during "
        "the backward, before a scaler could unscale the gradients; use copy_during_backward with a "
        "scaler");
    TORCH_CHECK(
        options.max_grad_norm() == 0,
        "GradientAccumulator: an OffloadOptimizer with step_during_backward steps its parameters during "
        "the backward, before the gradients could be clipped (max_grad_norm ",
        options.max_grad_norm(), "); use copy_during_backward to clip");
  }
  if (offload != nullptr &&
      (offload->options().copy_during_backward() || offload->options().step_during_backward()))
    offload_ = offload;
}

void GradientAccumulator::begin_window(double items) {
  TORCH_CHECK(micro_batches_ == 0, "GradientAccumulator: begin_window inside an open window (",
              micro_batches_, " micro-batches pending)");
  TORCH_CHECK(items > 0 && std::isfinite(items), "GradientAccumulator: a window needs items > 0, got ",
              items);
  normalizer_ = items;
  announced_ = true;
}

std::optional<WindowStep> GradientAccumulator::backward(const torch::Tensor& loss, double items) {
  TORCH_CHECK(loss.defined() && loss.dim() == 0, "GradientAccumulator: the loss must be a scalar, got sizes ",
              loss.defined() ? loss.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(items > 0 && std::isfinite(items), "GradientAccumulator: a micro-batch needs items > 0, got ",
              items);
  TORCH_CHECK(!stepped_in_backward_, "GradientAccumulator: the window's items (", items_,
              ") are complete and its last backward has stepped the parameters (step_during_backward); call "
              "step() before the next micro-batch");
  try {
    // A window's gradient is its own micro-batches' alone: not what a backward outside it left behind (a loop
    // before this one, an evaluation's backward). After a step or a discard they are zero already.
    if (micro_batches_ == 0) optimizer_.zero_grad();
    if (!normalizer_) normalizer_ = items * static_cast<double>(options_.window());
    // In fp32 at least: an fp16 loss times a window's items overflows (65504), and 1 / (a window's items)
    // falls into fp16's subnormals, which would bend the gradient.
    const bool narrow = loss.is_floating_point() && loss.element_size() < 4;
    const torch::Tensor wide = narrow ? loss.to(torch::kFloat) : loss;
    const torch::Tensor sum = options_.reduction() == LossReduction::kMean ? wide * items : wide;
    const torch::Tensor normalized = sum / *normalizer_;
    // The window's last micro-batch copies (and may step); the ones before it leave the gradients on the
    // device. Exactly complete counts only: then the step's correction is 1 and changes nothing.
    const bool last =
        items_ + items == *normalizer_ && (announced_ || micro_batches_ + 1 == options_.window());
    if (offload_) offload_->defer_gradient_copies(!last);
    (scaler_ ? scaler_->scale(normalized) : normalized).backward();
    stepped_in_backward_ = last && offload_ && offload_->options().step_during_backward();
    const torch::Tensor detached = sum.detach().to(torch::kDouble);
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + detached : detached;
    items_ += items;
    ++micro_batches_;
  } catch (...) {
    discard();
    throw;
  }
  if (micro_batches_ < options_.window()) return std::nullopt;
  return step();
}

WindowStep GradientAccumulator::step() {
  TORCH_CHECK(micro_batches_ > 0, "GradientAccumulator: step without a micro-batch since the last step");
  WindowStep result;
  try {
    if (scaler_) scaler_->unscale_(optimizer_);
    // Each once, though a LibTorch optimizer may list one twice (a module used twice): its gradient is to be
    // corrected and clipped once.
    std::vector<torch::Tensor> parameters;
    std::unordered_set<const c10::TensorImpl*> seen;
    for (const auto& group : optimizer_.param_groups())
      for (const auto& p : group.params())
        if (p.grad().defined() && seen.insert(p.unsafeGetTensorImpl()).second) parameters.push_back(p);
    // Every micro-batch divided its loss by the window's expected items; put the real count in.
    const double correction = *normalizer_ / items_;
    if (correction != 1.0) {
      torch::NoGradGuard no_grad;
      for (auto& p : parameters) p.mutable_grad().mul_(correction);
    }
    if (options_.max_grad_norm() > 0) {
      result.grad_norm = torch::nn::utils::clip_grad_norm_(parameters, options_.max_grad_norm());
      // NOTE: LibTorch clips through .data(), which the gradients' version counters do not see; an
      // OffloadOptimizer that copied them during the backward tells a changed gradient by its version.
      for (auto& p : parameters) torch::autograd::impl::bump_version(p.grad());
    }
    if (scaler_) {
      result.stepped = scaler_->step(optimizer_);  // which makes room for the step (step_room.h)
      scaler_->update();
    } else {
      detail::make_room_for_step(optimizer_);
      optimizer_.step();
      result.stepped = true;
    }
  } catch (...) {
    // The scaler may have unscaled this optimizer: reset its per-step bookkeeping, keeping the scale.
    if (scaler_ && scaler_->is_enabled()) scaler_->update(scaler_->get_scale());
    discard();
    throw;
  }
  result.items = items_;
  result.loss = loss_sum_.item<double>() / items_;
  result.micro_batches = micro_batches_;
  reset();  // the optimizer's step has taken in what the backwards did: nothing of theirs to discard
  return result;
}

void GradientAccumulator::discard() {
  if (offload_) offload_->discard_backward();
  reset();
}

void GradientAccumulator::reset() {
  optimizer_.zero_grad();
  micro_batches_ = 0;
  items_ = 0;
  loss_sum_ = torch::Tensor();
  normalizer_.reset();
  announced_ = false;
  stepped_in_backward_ = false;
  if (offload_) offload_->defer_gradient_copies(false);
}

}  // namespace memsave
