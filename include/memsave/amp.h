// Automatic mixed precision for LibTorch: an RAII autocast guard and a gradient scaler with the semantics of
// torch.amp.GradScaler.
//
//   memsave::amp::GradScaler scaler;                       // fp16: scale the loss so small gradients survive
//   {
//     memsave::amp::Autocast autocast(torch::kCUDA, torch::kHalf);
//     loss = loss_fn(net->forward(x), y);
//   }
//   scaler.scale(loss).backward();
//   scaler.unscale_(opt);                                  // gradients are true gradients from here on:
//   torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0);   // clip after unscale_, never before
//   bool stepped = scaler.step(opt);                       // skipped when a gradient is inf or NaN
//   scaler.update();
//   if (stepped) scheduler.step();                         // keeps a learning-rate schedule aligned
//
// bf16 needs no scaler: Autocast alone.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <unordered_map>

namespace memsave::optim {
class LowBitOptimizer;
}

namespace memsave::amp {

/// Enables autocast for one device type (CPU or CUDA) with one dtype (fp16 or bf16) for its lifetime, and
/// restores the previous state. Guards nest; the outermost one clears the autocast cache when it exits, and
/// one that changes the dtype clears it when it starts and exits (the cache keeps one cast per weight, so a
/// weight cast to fp16 outside would otherwise reach a bf16 region inside).
class Autocast {
 public:
  Autocast(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled = true);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_type_;
  c10::ScalarType dtype_;
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
};

/// Where GradScaler::step folds the unscale into memsave's optimizer kernels instead of a pass of its own.
enum class FuseUnscale {
  kNever,
  /// When the gradients are on CUDA (the default: on the CPU the separate pass measured faster,
  /// bench/RESULTS-amp.md).
  kCuda,
  kAlways,
};

struct GradScalerOptions {
  /// The first scale.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The scale is multiplied by this after `growth_interval` steps in a row without inf or NaN; > 1.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// The scale is multiplied by this after a step with inf or NaN gradients; in (0, 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Clean steps between growths; > 0.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// When false every call passes through: scale returns its input, step steps, update does nothing.
  TORCH_ARG(bool, enabled) = true;
  /// With memsave's optimizers and no prior unscale_: where step() unscales inside their kernels.
  TORCH_ARG(FuseUnscale, fuse_unscale) = FuseUnscale::kCuda;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// `loss` times the current scale (the scale lives on the loss's device from the first call on).
  torch::Tensor scale(const torch::Tensor& loss);
  /// Divides the optimizer's gradients by the scale in place and records whether any is inf or NaN. Once per
  /// optimizer between updates; an error after `step`, for fp16 gradients, or before any `scale`.
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Unscales (unless `unscale_` was called) and steps the optimizer unless a gradient was inf or NaN.
  /// Returns whether it stepped. Once per optimizer between updates. For memsave's own optimizers without a
  /// prior `unscale_`, the unscale happens inside their kernels (the gradients are read once for the inf
  /// check and never rewritten; they stay scaled).
  bool step(torch::optim::Optimizer& optimizer);
  /// Backs the scale off after an inf or NaN in any optimizer stepped since the last update, or grows it
  /// after `growth_interval` clean updates in a row (never to inf).
  void update();
  /// Sets the scale, and resets the per-step bookkeeping as `update()` does.
  void update(double new_scale);

  double get_scale() const;
  int64_t growth_tracker() const;
  bool is_enabled() const { return options_.enabled(); }
  const GradScalerOptions& options() const { return options_; }

  /// scale, growth factor, backoff factor, growth interval and growth tracker, as torch's state_dict. A
  /// disabled scaler writes only that it is disabled, and reads nothing; an enabled one refuses the archive
  /// of a disabled one (it has no scale), changing nothing.
  void serialize(torch::serialize::OutputArchive& archive) const;
  void serialize(torch::serialize::InputArchive& archive);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    torch::Tensor found_inf;  ///< float [] on the scale's device: non-zero when a gradient was inf or NaN
  };
  void check_scaled(const char* call) const;
  /// step() for memsave's own optimizers when unscale_ was not called: the unscale is fused into their
  /// kernels.
  bool step_fused(optim::LowBitOptimizer& optimizer);
  bool fuses(const optim::LowBitOptimizer& optimizer) const;

  GradScalerOptions options_;
  torch::Tensor scale_;           ///< float32 [], created by the first scale()
  torch::Tensor growth_tracker_;  ///< int32 []
  std::unordered_map<const torch::optim::Optimizer*, OptimizerState> optimizers_;
};

}  // namespace memsave::amp
