#include "memsave/amp.h"

#include "memsave/offload.h"
#include "memsave/optim.h"

#include "../kernels/finite.h"
#include "archive.h"
#include "compat.h"
#include "kernel_dtype.h"
#include "step_room.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>
#include <unordered_set>
#include <vector>

namespace memsave::amp {
namespace {

/// The read-only inf/NaN check of kernels/finite.h over a CPU gradient, on all threads: over its memory as
/// it lies when that is dense (a channels_last gradient needs no copy).
bool all_finite_cpu(const torch::Tensor& grad) {
  const torch::Tensor g = grad.is_non_overlapping_and_dense() ? grad : grad.contiguous();
  const std::optional<kernels::DType> dtype = kernel_dtype(g.scalar_type());
  if (!dtype) return g.isfinite().all().item<bool>();
  std::atomic<bool> finite{true};
  at::parallel_for(0, g.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    if (!kernels::all_finite(g.data_ptr(), *dtype, begin, end)) finite = false;
  });
  return finite;
}

/// The defined gradients of `optimizer`, checked before anything touches them (not fp16, not sparse), each
/// once: a LibTorch optimizer over a module used twice lists its parameters twice, and unscaling a gradient
/// twice would be wrong.
std::vector<torch::Tensor> checked_gradients(const torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> grads;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const torch::Tensor& g = p.grad();
      if (!g.defined() || !seen.insert(g.unsafeGetTensorImpl()).second) continue;
      TORCH_CHECK(
          g.scalar_type() != torch::kHalf,
          "GradScaler: attempting to unscale fp16 gradients; the parameters (master weights) must be fp32");
      TORCH_CHECK(!g.is_sparse(), "GradScaler: sparse gradients are not supported");
      grads.push_back(g);
    }
  }
  return grads;
}

}  // namespace

Autocast::Autocast(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled)
    : device_type_(device_type),
      dtype_(dtype),
      previous_enabled_(compat::autocast_enabled(device_type)),
      previous_dtype_(compat::autocast_dtype(device_type)) {
  TORCH_CHECK(device_type == c10::kCPU || device_type == c10::kCUDA,
              "Autocast: device_type must be cpu or cuda, got ", device_type);
  TORCH_CHECK(dtype == c10::kHalf || dtype == c10::kBFloat16,
              "Autocast: dtype must be Half or BFloat16, got ", dtype);
  compat::set_autocast_enabled(device_type, enabled);
  compat::set_autocast_dtype(device_type, dtype);
  if (dtype != previous_dtype_) at::autocast::clear_cache();
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  if (at::autocast::decrement_nesting() == 0 || dtype_ != previous_dtype_) at::autocast::clear_cache();
  compat::set_autocast_enabled(device_type_, previous_enabled_);
  compat::set_autocast_dtype(device_type_, previous_dtype_);
}

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  TORCH_CHECK(options.init_scale() > 0, "GradScaler: init_scale must be > 0, got ", options.init_scale());
  TORCH_CHECK(options.growth_factor() > 1.0, "GradScaler: growth_factor must be > 1, got ",
              options.growth_factor());
  TORCH_CHECK(options.backoff_factor() > 0.0 && options.backoff_factor() < 1.0,
              "GradScaler: backoff_factor must be in (0, 1), got ", options.backoff_factor());
  TORCH_CHECK(options.growth_interval() > 0, "GradScaler: growth_interval must be > 0, got ",
              options.growth_interval());
}

void GradScaler::check_scaled(const char* call) const {
  TORCH_CHECK(
      scale_.defined(), "GradScaler: ", call,
      " before any scale(): the gradients were never scaled (call scaler.scale(loss).backward() first)");
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) {
  if (!options_.enabled()) return loss;
  if (!scale_.defined()) {
    const auto on = torch::TensorOptions().device(loss.device());
    scale_ = torch::full({}, options_.init_scale(), on.dtype(torch::kFloat));
    growth_tracker_ = torch::zeros({}, on.dtype(torch::kInt));
  }
  return loss * scale_.to(loss.device(), /*non_blocking=*/true);
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  check_scaled("unscale_()");
  // NOTE: the first backward never steps (the state is created at the first step), so this refuses the
  // combination before any parameter was stepped with scaled gradients.
  const auto* offload = dynamic_cast<const OffloadOptimizer*>(&optimizer);
  TORCH_CHECK(offload == nullptr || !offload->options().step_during_backward(),
              "GradScaler: an OffloadOptimizer with step_during_backward steps its parameters during the "
              "backward, before the gradients can be unscaled; use copy_during_backward with a scaler");
  OptimizerState& state = optimizers_[&optimizer];
  TORCH_CHECK(state.stage != Stage::kUnscaled,
              "GradScaler: unscale_() has already been called on this optimizer since the last update()");
  TORCH_CHECK(state.stage != Stage::kStepped, "GradScaler: unscale_() is being called after step()");
  // Check every gradient before touching any.
  std::map<std::tuple<int, int, int>, std::vector<torch::Tensor>> groups;  // device type, index, dtype
  for (const torch::Tensor& g : checked_gradients(optimizer))
    groups[{static_cast<int>(g.device().type()), g.device().index(), static_cast<int>(g.scalar_type())}]
        .push_back(g);
  torch::NoGradGuard no_grad;
  const torch::Tensor inv_scale = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat);
  torch::Tensor found_inf = torch::zeros({}, scale_.options().dtype(torch::kFloat));
  for (auto& entry : groups) {
    std::vector<torch::Tensor>& grads = entry.second;
    const torch::Device device = grads.front().device();
    torch::Tensor found_here = torch::zeros({}, torch::TensorOptions().device(device).dtype(torch::kFloat));
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv_scale.to(device));
    // NOTE: this kernel does not count as a write in the gradients' version counters; it is one, and an
    // OffloadOptimizer that copied them during the backward tells a changed gradient by its version.
    for (const torch::Tensor& g : grads) torch::autograd::impl::bump_version(g);
    found_inf.add_(found_here.to(found_inf.device()));
  }
  state.found_inf = found_inf;
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  // LibTorch's optimizers allocate between their in-place updates: room first, so that running out of
  // memory changes no parameter (step_room.h).
  if (!options_.enabled()) {
    detail::make_room_for_step(optimizer);
    optimizer.step();
    return true;
  }
  check_scaled("step()");
  TORCH_CHECK(optimizers_[&optimizer].stage != Stage::kStepped,
              "GradScaler: step() has already been called since the last update()");
  if (optimizers_[&optimizer].stage == Stage::kReady) {
    auto* fused = dynamic_cast<optim::LowBitOptimizer*>(&optimizer);
    if (fused != nullptr && fuses(*fused)) return step_fused(*fused);
    unscale_(optimizer);
  }
  OptimizerState& state = optimizers_[&optimizer];
  const bool clean = state.found_inf.item<float>() == 0.0f;
  if (clean) {
    detail::make_room_for_step(optimizer);
    optimizer.step();
  }
  state.stage = Stage::kStepped;
  return clean;
}

bool GradScaler::fuses(const optim::LowBitOptimizer& optimizer) const {
  if (options_.fuse_unscale() == FuseUnscale::kNever) return false;
  if (options_.fuse_unscale() == FuseUnscale::kAlways) return true;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (p.grad().defined() && !p.grad().is_cuda()) return false;
  return true;
}

bool GradScaler::step_fused(optim::LowBitOptimizer& optimizer) {
  // The inf/NaN check reads the gradients once and writes nothing (kernels/finite.h on the CPU, max-abs norms
  // in one multi-tensor launch on CUDA); the unscale happens inside the optimizer's kernels. The gradients
  // stay scaled.
  std::map<std::pair<int, int>, std::vector<torch::Tensor>> groups;  // device type, index
  for (const torch::Tensor& g : checked_gradients(optimizer))
    groups[{static_cast<int>(g.device().type()), g.device().index()}].push_back(g);
  torch::NoGradGuard no_grad;
  torch::Tensor found_inf = torch::zeros({}, scale_.options().dtype(torch::kFloat));
  for (const auto& entry : groups) {
    std::vector<torch::Tensor> checks;
    if (entry.first.first == static_cast<int>(c10::kCPU)) {
      bool finite = true;
      for (const auto& g : entry.second) finite = finite && all_finite_cpu(g);
      checks.push_back(torch::full({}, finite ? 0.0 : INFINITY, scale_.options().dtype(torch::kFloat)));
    } else {
      checks = at::_foreach_norm(entry.second, std::numeric_limits<double>::infinity());  // one launch
    }
    const torch::Tensor bad = torch::stack(checks).isfinite().logical_not().any().to(torch::kFloat);
    found_inf.add_(bad.to(found_inf.device()));
  }
  const bool clean = found_inf.item<float>() == 0.0f;
  // NOTE: the stage changes once the optimizer has stepped, as after an unscale: a step it refuses (or one
  // that runs out of memory, which changes no parameter) can be tried again.
  if (clean) optimizer.step_scaled(scale_.to(torch::kDouble).reciprocal().to(torch::kFloat));
  OptimizerState& state = optimizers_[&optimizer];
  state.found_inf = found_inf;
  state.stage = Stage::kStepped;
  return clean;
}

void GradScaler::update() {
  if (!options_.enabled()) return;
  check_scaled("update()");
  torch::Tensor found_inf;
  for (const auto& entry : optimizers_) {
    if (!entry.second.found_inf.defined()) continue;
    found_inf = found_inf.defined() ? found_inf + entry.second.found_inf : entry.second.found_inf.clone();
  }
  TORCH_CHECK(found_inf.defined(),
              "GradScaler: update() without any unscale_() or step() since the last update()");
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf, options_.growth_factor(),
                         options_.backoff_factor(), options_.growth_interval());
  optimizers_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled()) return;
  check_scaled("update()");
  TORCH_CHECK(new_scale > 0 && std::isfinite(new_scale), "GradScaler: new_scale must be finite and > 0, got ",
              new_scale);
  scale_.fill_(new_scale);
  optimizers_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) return 1.0;
  return scale_.defined() ? scale_.item<double>() : options_.init_scale();
}

int64_t GradScaler::growth_tracker() const {
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : 0;
}

void GradScaler::serialize(torch::serialize::OutputArchive& archive) const {
  // A disabled scaler has no state (torch's state_dict is empty); its file says so, so that an enabled one
  // does not take a scale of 1 from it.
  archive.write("enabled", options_.enabled());
  if (!options_.enabled()) return;
  archive.write("scale", get_scale());
  archive.write("growth_factor", options_.growth_factor());
  archive.write("backoff_factor", options_.backoff_factor());
  archive.write("growth_interval", options_.growth_interval());
  archive.write("growth_tracker", growth_tracker());
}

void GradScaler::serialize(torch::serialize::InputArchive& archive) {
  // As torch's load_state_dict: a disabled scaler reads nothing.
  if (!options_.enabled()) return;
  TORCH_CHECK(detail::read_bool_or(archive, "enabled", true),
              "GradScaler: the archive was saved by a disabled GradScaler and holds no scale; an enabled one "
              "starts from its own init_scale");
  auto read = [&](const char* key) {
    c10::IValue value;
    archive.read(key, value);
    return value;
  };
  // Read and check everything first; a rejected archive changes nothing.
  const double scale = read("scale").to<double>();
  GradScalerOptions options = options_;
  options.growth_factor(read("growth_factor").to<double>())
      .backoff_factor(read("backoff_factor").to<double>());
  options.growth_interval(read("growth_interval").to<int64_t>());
  const int64_t tracker = read("growth_tracker").to<int64_t>();
  GradScaler check(options.init_scale(scale));
  TORCH_CHECK(tracker >= 0 && tracker < options.growth_interval(), "GradScaler: growth tracker ", tracker,
              " out of range for growth_interval ", options.growth_interval());
  options_ = options;
  const auto on = scale_.defined() ? scale_.options() : torch::TensorOptions().dtype(torch::kFloat);
  scale_ = torch::full({}, scale, on.dtype(torch::kFloat));
  growth_tracker_ = torch::full({}, tracker, on.dtype(torch::kInt));
  optimizers_.clear();
}

}  // namespace memsave::amp
