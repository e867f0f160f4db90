// CPU offload of optimizer state: fp32 master weights and the AdamW state (fp32 or 8-bit) live in host memory
// (memsave's host arena, pinned when CUDA is present) and are stepped there by memsave's fused CPU kernels on
// all threads; the device keeps only the parameters and their gradients.
//
//   memsave::OffloadOptimizer opt(net->parameters(), memsave::OffloadOptimizerOptions(1e-3).state_bits(8));
//   ... loss.backward(); opt.step();          // gradients → host, CPU step, parameters → device
//
// It is a torch::optim::Optimizer over the device parameters, so a GradScaler (unscale_, the inf check, the
// skipped step), gradient clipping and accumulation (gradients accumulate on the device) work unchanged.
// With `copy_during_backward`, each gradient is copied to the host as soon as the backward has accumulated
// it (a post-hook on the parameter's gradient accumulator; on CUDA on a side stream, so the copies overlap
// the rest of the backward), and the step copies again only what changed since (a gradient replaced, or
// modified in place: unscaled, accumulated by a later micro-batch, clipped by LibTorch's clip_grad_norm_).
// Under accumulation, `defer_gradient_copies(true)` skips the copies of the micro-batches before the last
// (memsave's GradientAccumulator, so the Trainer, does it): the gradients are copied once per window.
//
// On a machine without a GPU the "device" is the CPU device pool, and the state in the host arena is what a
// GPU would not have to hold: the meter shows the saving ("CPU, simulated device").
#pragma once

#include <memsave/memory.h>
#include <memsave/optim.h>

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <vector>

namespace memsave {

struct OffloadOptimizerOptions : torch::optim::OptimizerCloneableOptions<OffloadOptimizerOptions> {
  OffloadOptimizerOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT: implicit, as LibTorch's options
  /// Learning rate.
  TORCH_ARG(double, lr) = 1e-3;
  /// Coefficients of the running averages of the gradient and of its square.
  TORCH_ARG(optim::betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to the denominator.
  TORCH_ARG(double, eps) = 1e-8;
  /// Decoupled weight decay (AdamW).
  TORCH_ARG(double, weight_decay) = 1e-2;
  /// Bits per element of the host-side state: 32, 8 (blockwise, as AdamW8bit) or 4 (as AdamW4bit).
  TORCH_ARG(int64_t, state_bits) = 32;
  /// Tensors with fewer elements stay on the device with an on-device AdamW (0: offload everything).
  TORCH_ARG(int64_t, min_offload_size) = 0;
  /// Copy each gradient to the host during the backward, as soon as it is accumulated (false: at the step).
  /// The step copies again a gradient that was replaced or changed since: its version counter shows a change
  /// in place, and a fingerprint of its bits taken before the copy (kernels/fingerprint.h, one read of the
  /// gradient on the device at the copy and one at the step) a write through `.data()` that the counter
  /// misses, as LibTorch's `clip_grad_norm_` and `clip_grad_value_` write: any clip, scale or zeroing is
  /// seen. Gradients other than fp32, bf16 or fp16 are copied again at every step.
  TORCH_ARG(bool, copy_during_backward) = false;
  /// Also step each parameter during the backward (implies `copy_during_backward`): as soon as its gradient
  /// is on the host, a host thread steps its master and copies it back while the backward goes on, so the CPU
  /// step overlaps the device's work; `step()` waits for those and steps the rest. From the second step on
  /// (the first creates the state, all at once). Nothing may change the gradients between the backward and
  /// the step: memsave's GradScaler refuses such an optimizer, and so do a GradientAccumulator (and a
  /// Trainer) that clips or scales; a gradient changed afterwards (in place, or through `.data()` as
  /// LibTorch's clip_grad_norm_ writes) is an error at `step()`, when its parameter has already been stepped;
  /// gradients other than fp32, bf16 or fp16 are stepped at the step. memsave's GradientAccumulator (so the
  /// Trainer) defers the copies to a window's last micro-batch itself; to accumulate by hand,
  /// `defer_gradient_copies(true)` for every micro-batch but the window's last: a gradient accumulated after
  /// its parameter was stepped is an error at `step()`. A parameter must not be read by the backward after
  /// its gradient is complete (a `.detach()`ed use would be). NOTE: not all-or-nothing as the other ways are:
  /// a backward that fails halfway (an out-of-memory) leaves the parameters it had stepped stepped, a step
  /// ahead of the rest (call `discard_backward()` before the next backward). So it is opt-in, also for the
  /// Trainer (give it such an optimizer).
  TORCH_ARG(bool, step_during_backward) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  friend bool operator==(const OffloadOptimizerOptions& a, const OffloadOptimizerOptions& b);
};

class OffloadOptimizer : public torch::optim::Optimizer, public StateTensors {
 public:
  /// `params`: leaf tensors on one device, each listed once (memsave::unique_parameters); those offloaded
  /// (min_offload_size) float32, float16 or bfloat16 with memory of their own (not expanded). A parameter
  /// that does not require grad when the optimizer is built (a frozen layer of a fine-tune) is not offloaded:
  /// it takes no host memory and stays with the small tensors, whose on-device AdamW makes state only for a
  /// parameter that gets a gradient (one unfrozen later is stepped there, its moments on the device).
  explicit OffloadOptimizer(std::vector<torch::Tensor> params, OffloadOptimizerOptions options = {});
  /// Parameter groups, as LibTorch's optimizers take them (no weight decay for biases and norms, say): a
  /// group without options gets `defaults`; each group's lr, betas, eps and weight_decay are its own, while
  /// state_bits, min_offload_size, copy_during_backward and step_during_backward, which decide where state
  /// lives and when it is stepped, must be the same in every group.
  explicit OffloadOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                            OffloadOptimizerOptions defaults = {});
  ~OffloadOptimizer() override;
  /// NOTE: copying would duplicate or alias the host state; move the optimizer or hold it by pointer.
  OffloadOptimizer(const OffloadOptimizer&) = delete;
  OffloadOptimizer& operator=(const OffloadOptimizer&) = delete;

  /// Copies the gradients to the host, steps the master weights there (parameters without a gradient are
  /// skipped), and copies them back into the parameters, each as soon as its master is stepped (on CUDA the
  /// copies back overlap the rest of the CPU step). An error before the copy back, such as running out of
  /// memory while the first step creates the state, leaves parameters and state as they were.
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Loads what `save` wrote: master weights, state and the hyper-parameters (lr, betas, eps, weight_decay;
  /// the other options stay this optimizer's). State saved with other `state_bits` is converted to this
  /// optimizer's as memsave::optim::copy_state converts (a run resumed with less memory, or back to fp32
  /// state). A file for other parameters, or one that offloaded others (other layers frozen when it was
  /// built), is an error that changes nothing.
  void load(torch::serialize::InputArchive& archive) override;

  /// Copies the parameters into the fp32 master weights, for parameters set outside the optimizer (weights
  /// loaded into the model), which the next step would otherwise overwrite with the masters. Forgets the
  /// backwards since the last step, as `discard_backward` does.
  void refresh_masters();

  /// The state kept on the device (the small tensors' on-device AdamW), for the meter; the host-side state is
  /// in `host_state_tensors`.
  std::vector<torch::Tensor> state_tensors() const override;
  /// Master weights, gradient buffers and optimizer state in the host arena.
  std::vector<torch::Tensor> host_state_tensors() const;
  /// The options in force in the first parameter group (state_bits and the other storage options: in all).
  const OffloadOptimizerOptions& options() const;
  /// Whether `param`'s state lives in host memory.
  bool offloaded(const torch::Tensor& param) const;
  /// While true, backwards do not copy gradients to the host (more micro-batches of the window follow; the
  /// copies of the last one, or the step, count). Off by default.
  void defer_gradient_copies(bool defer);
  /// Forgets what the backwards did since the last step, for a window given up after a failed backward
  /// (memsave's GradientAccumulator, so the Trainer, calls it): waits for the copies and, with
  /// `step_during_backward`, for the host thread, so that the next backward starts afresh. Parameters that
  /// the host thread has stepped stay stepped; a failure of the host thread is reported by the next step.
  void discard_backward();
  /// The gradient copies to the host behind the last step: those the backward made since the step before
  /// (one per offloaded gradient per backward that was not deferred), and those the step made because a
  /// gradient had no copy made by a backward or had changed since its copy.
  struct CopyCounts {
    int64_t during_backward = 0;
    int64_t at_step = 0;
    int64_t stepped_during_backward = 0;  ///< parameters the backward stepped (`step_during_backward`)
  };
  CopyCounts last_step_copies() const { return last_copies_; }

  struct BackwardCopies;  ///< the hooks' shared state (src/offload.cpp)

 private:
  friend struct optim::detail::StateAccess;
  struct Offloaded {
    torch::Tensor param;   ///< on the device
    size_t group = 0;      ///< its parameter group
    int64_t index = 0;     ///< its place among the parameters of all groups
    torch::Tensor master;  ///< fp32, host arena; the inner optimizer's parameter
    torch::Tensor grad;    ///< fp32, host arena: the gradient the master is stepped with
    /// A CUDA parameter that is not fp32: a host arena buffer of its dtype, which the gradient is copied into
    /// and the stepped master converted into before its copy back: conversions run on the host, since a
    /// converting copy between host and device takes a conversion buffer on the device.
    torch::Tensor staging;
    /// Where the gradient's copy from the device lands.
    const torch::Tensor& landing() const { return staging.defined() ? staging : grad; }
    /// Makes `grad` hold the gradient that landed (converted, where it landed in `staging`).
    void widen_gradient() const {
      if (staging.defined()) grad.copy_(staging);
    }
  };
  void sync_hyper_parameters();
  /// Records which masters have their state, so that the next backward may step them
  /// (`step_during_backward`): after a step and whenever the state is replaced.
  void update_can_step();
  /// Steps the masters of `which` (indices into offloaded_) and copies them back into their parameters.
  void step_masters(const std::vector<size_t>& which);
  /// Steps master `i` alone and copies it back; `beside`: on the host thread of `step_during_backward`.
  void step_one(size_t i, bool beside);
  /// Copies a stepped master into its parameter (asynchronously on CUDA; `beside`: on the host thread's own
  /// stream, which the next step waits for).
  void copy_back(const Offloaded& o, bool beside);

  std::vector<Offloaded> offloaded_;
  std::unique_ptr<optim::LowBitOptimizer> host_;  ///< over the masters; state in the host arena
  std::unique_ptr<torch::optim::AdamW> device_;   ///< over the small tensors, on the device
  /// For each parameter group, the index of its group in host_ and in device_ (-1: none of its tensors
  /// there).
  std::vector<int64_t> host_group_, device_group_;
  std::shared_ptr<BackwardCopies> copies_;  ///< null without copy_during_backward
  CopyCounts last_copies_;
};

}  // namespace memsave
