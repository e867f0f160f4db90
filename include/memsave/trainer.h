// One object that composes every technique: a Recipe names a point in the memory/speed trade-off space, and a
// Trainer applies it to a model and an optimizer.
//
//   auto recipe = memsave::Recipe().micro_batch(8).amp(torch::kBFloat16)
//                     .checkpoint(memsave::Checkpointing::segments(4)).state_bits(8).max_grad_norm(1.0);
//   memsave::Trainer trainer(net, memsave::adamw(1e-3), recipe);
//   for (auto& batch : loader) {
//     auto stats = trainer.step(batch.data, batch.target, loss_fn);  // loss, items, norm, peak, time, ...
//   }
//
// A model that is not a Sequential goes with a function that runs it on a micro-batch's inputs:
//
//   memsave::Trainer trainer(net.ptr(), [net](const std::vector<torch::Tensor>& in) mutable {
//     return net->forward(in[0], in[1]);
//   }, memsave::adamw(1e-3), recipe);
//   trainer.step({tokens, padding}, targets, loss_fn);
//
// Its recipe's checkpointing (every_layer() or none) switches the memsave::nn::Checkpoint blocks inside it.
#pragma once

#include <memsave/accumulate.h>
#include <memsave/amp.h>
#include <memsave/checkpoint.h>

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace memsave {

/// How a Trainer checkpoints its model: a Sequential it cuts into pieces; a model of any shape it checkpoints
/// by switching the memsave::nn::Checkpoint blocks inside it (none: all off, every_layer: all on).
struct Checkpointing {
  enum class Kind { kNone, kEveryLayer, kSegments, kPolicy };

  static Checkpointing none() { return {}; }
  /// Every element recomputed on its own (but the last, which backward needs at once); in a model of any
  /// shape, every memsave::nn::Checkpoint block.
  static Checkpointing every_layer() { return {Kind::kEveryLayer, 0, {}, 0, "every layer"}; }
  /// `n` segments of near-equal length, all but the last recomputed.
  static Checkpointing segments(int64_t n) {
    return {Kind::kSegments, n, {}, 0, std::to_string(n) + " segments"};
  }
  /// The elements for which `keep` is false are recomputed, in pieces of at most `max_run` (0: no limit).
  /// `name` is how the Recipe describes the policy.
  static Checkpointing policy(nn::KeepPolicy keep, int64_t max_run = 0, std::string name = "policy") {
    return {Kind::kPolicy, 0, std::move(keep), max_run, std::move(name)};
  }

  Kind kind = Kind::kNone;
  int64_t count = 0;
  nn::KeepPolicy keep;
  int64_t max_run = 0;
  std::string name;
};

enum class GradScaling { kAuto, kOn, kOff };

/// What a Trainer keeps in host memory instead of on the device.
enum class Offload {
  kNone,
  /// fp32 master weights and optimizer state, stepped on the CPU (memsave::OffloadOptimizer; AdamW only).
  kOptimizerState,
};

/// A point in the trade-off space.
struct Recipe {
  /// Whether a GradScaler is used (resolves kAuto).
  bool scales_gradients() const;
  /// The recipe as C++ that builds it, e.g. `memsave::Recipe().micro_batch(8).amp(torch::kBFloat16)`.
  std::string to_cpp() const;
  /// A short name, e.g. "micro 8 + bf16 + ckpt every layer + 8-bit".
  std::string label() const;

  /// Rows per micro-batch; the batch is split and its gradients accumulated into one step. 0: the whole
  /// batch.
  TORCH_ARG(int64_t, micro_batch) = 0;
  /// Autocast dtype (kBFloat16 or kHalf, on the CPU as on CUDA); none: fp32.
  TORCH_ARG(std::optional<c10::ScalarType>, amp) = std::nullopt;
  /// Dynamic loss scaling; kAuto: on exactly for fp16.
  TORCH_ARG(GradScaling, grad_scaling) = GradScaling::kAuto;
  /// Activation checkpointing of the model.
  TORCH_ARG(Checkpointing, checkpoint) = Checkpointing::none();
  /// Optimizer state: 32 (fp32), 8 (memsave's 8-bit optimizers) or 4 (its 4-bit AdamW).
  TORCH_ARG(int64_t, state_bits) = 32;
  /// Optimizer state in host memory.
  TORCH_ARG(Offload, offload) = Offload::kNone;
  /// Inputs of the recomputed checkpoint pieces in host memory (needs checkpointing).
  TORCH_ARG(bool, offload_activations) = false;
  /// When > 0, the global gradient norm is clipped to this after unscaling, before each step.
  TORCH_ARG(double, max_grad_norm) = 0;
  /// What the loss function returns for a micro-batch: the mean over its items (default) or their sum.
  TORCH_ARG(LossReduction, loss_reduction) = LossReduction::kMean;
};

/// Builds the optimizer a recipe asks for, over `parameters`.
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
    const std::vector<torch::Tensor>& parameters, const Recipe& recipe)>;

/// AdamW: LibTorch's torch::optim::AdamW for 32-bit state, memsave::optim::AdamW8bit for 8-bit, AdamW4bit for
/// 4-bit, memsave::OffloadOptimizer (with the recipe's bits, copying gradients during the backward) when the
/// recipe offloads the optimizer state. (A Trainer given an OffloadOptimizer with `step_during_backward`
/// steps during the backward when its recipe neither clips nor scales.)
OptimizerFactory adamw(double lr = 1e-3, double weight_decay = 1e-2);
/// SGD with momentum: LibTorch's for 32-bit state, memsave::optim::SGD8bit for 8-bit, SGD4bit for 4-bit; no
/// offload.
OptimizerFactory sgd(double lr, double momentum = 0.9);

/// Whether `optimizer`, asked for the state `recipe` keeps, builds it: a memsave::OffloadOptimizer exactly
/// when the recipe offloads the optimizer state, and for 8-bit or 4-bit state an optimizer with codes of
/// those bits (memsave::optim's, or an OffloadOptimizer of that state_bits). False when it throws.
/// memsave::adamw builds every recipe's state, memsave::sgd all but offloaded state, a factory returning
/// LibTorch's optimizer whatever the recipe only fp32 state. A Trainer refuses an optimizer that does not;
/// the rescue's checklist leaves such levels out.
bool builds_state(const OptimizerFactory& optimizer, const Recipe& recipe);

struct StepStats {
  double loss = 0;       ///< the window's loss: sum of per-item losses / items
  double items = 0;      ///< items (or tokens, from the mask) the step was normalized by
  bool stepped = false;  ///< false when the GradScaler skipped the step (inf/NaN gradients)
  int64_t micro_batches = 0;
  /// With the recipe's max_grad_norm: the gradients' global L2 norm before clipping (0 without clipping).
  double grad_norm = 0;
  int64_t peak_bytes = 0;  ///< the step's peak in the model's device pool (memsave's meter)
  double seconds = 0;      ///< wall time of the step
};

/// A loss of one micro-batch: a scalar, the mean over its items (or their sum, per the recipe).
using LossFunction = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

/// A model's forward over one micro-batch's inputs: the step's input tensors, each cut to the micro-batch's
/// rows on dim 0.
using Forward = std::function<torch::Tensor(const std::vector<torch::Tensor>& inputs)>;

class Trainer {
 public:
  /// Applies `recipe` to `model` (checkpointing wrapper) and builds the optimizer over its parameters.
  /// A combination that cannot work is an error here, not at the first step.
  Trainer(torch::nn::Sequential model, const OptimizerFactory& make_optimizer, Recipe recipe = {});
  /// As above with an optimizer the caller built; its state must be what the recipe says (8-bit or not).
  Trainer(torch::nn::Sequential model, std::shared_ptr<torch::optim::Optimizer> optimizer,
          Recipe recipe = {});
  /// A model of any shape (a module of your own, several inputs: token ids and their padding mask, say),
  /// run by `forward` on each micro-batch's inputs; tensors that are not cut into micro-batches (a causal
  /// mask shared by every row) belong in the function. The Trainer cannot cut such a model; the recipe's
  /// checkpointing switches the memsave::nn::Checkpoint blocks inside it instead:
  /// Checkpointing::every_layer() turns them all on (an error when there are none), none() all off (so a
  /// recipe without checkpointing runs them plainly), and offload_activations sets their offload_inputs;
  /// segments and policies are errors. Checkpointing the module does otherwise (memsave::checkpoint calls)
  /// stays as it is. The rest of the recipe applies as for a Sequential; save and load name the tensors as
  /// the module does.
  Trainer(std::shared_ptr<torch::nn::Module> model, Forward forward, const OptimizerFactory& make_optimizer,
          Recipe recipe = {});
  Trainer(std::shared_ptr<torch::nn::Module> model, Forward forward,
          std::shared_ptr<torch::optim::Optimizer> optimizer, Recipe recipe = {});
  /// NOTE: owns the optimizer state and an open accumulation window; not copyable.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// One optimizer step over the batch: split into micro-batches, forward under autocast, backward (scaled),
  /// then unscale, clip and step once. `mask`, when given, has the batch's rows on dim 0, and the items of a
  /// micro-batch are its sum (tokens that count). Bad input is an error before anything runs; an error during
  /// the step (out of memory) leaves parameters, buffers and optimizer state as they were. For the buffers
  /// (BatchNorm's running statistics, which every forward updates) each step first copies them into the host
  /// arena (`host_memory_stats()`: their bytes, kept from step to step); a step that fails copies them back.
  /// A model in eval mode is put in train mode, all of it; in a model in train mode the submodules put in
  /// eval mode (a frozen BatchNorm, whose running statistics are to stay) stay in it.
  StepStats step(const torch::Tensor& input, const torch::Tensor& target, const LossFunction& loss,
                 const torch::Tensor& mask = {});
  /// The same with several inputs (a Trainer given a forward function), each with the batch's rows on dim 0,
  /// every one split into the same micro-batches. A Trainer over a Sequential takes one.
  StepStats step(const std::vector<torch::Tensor>& inputs, const torch::Tensor& target,
                 const LossFunction& loss, const torch::Tensor& mask = {});
  /// The model's output in eval mode without grad (and under the recipe's autocast). Each module's mode is
  /// put back as it was.
  torch::Tensor predict(const torch::Tensor& input);
  torch::Tensor predict(const std::vector<torch::Tensor>& inputs);

  /// Writes what resuming needs, as a LibTorch archive: the model's parameters and buffers (under the names
  /// of the model given, whatever the checkpointing), the optimizer's state (with the name of each of
  /// its parameters) and the GradScaler's. The file is written beside `path` and renamed over it, so a save
  /// that fails leaves an older file as it was.
  void save(const std::string& path) const;
  void save(torch::serialize::OutputArchive& archive) const;
  /// Reads what `save` wrote; the steps that follow are those the saving Trainer would have taken. The recipe
  /// may differ in what does not touch that state (micro-batches, checkpointing, autocast, clipping); the
  /// model must have the same parameters and buffers. A recipe with other optimizer state (its bits, its
  /// offload) converts the file's as memsave::optim::copy_state does (fp32 moments to the nearest 8- or 4-bit
  /// codes, codes to fp32, the step counts kept, the file's learning rate), so a run resumes under a recipe
  /// that needs less memory without restarting its moments (then its steps are no longer those the saving
  /// Trainer would have taken, only near them); the rule must agree (AdamW and Adam, SGD). An optimizer that
  /// groups or orders the parameters otherwise than the saving one gets each state by the parameter's name
  /// (which the file records), converted the same way; a group keeps the file's learning rate when the file
  /// had a group of the same parameters. A GradScaler continues from the file's, or starts afresh when the
  /// file has none. A file that does not fit, or is missing or corrupt, is an error that leaves model,
  /// optimizer and scaler as they were. Tensors are read onto the model's device (with an offloading
  /// optimizer, where they were saved: its host state stays in host memory). On a CUDA device, a file whose
  /// state converts is read into host memory, and only the converted state goes to the device (a file it
  /// keeps as it is is read a second time, onto the device): the state as saved need not fit there. An
  /// archive passed in is read where it was opened: open it on the CPU (`archive.load_from(path,
  /// torch::kCPU)`) for the same.
  void load(const std::string& path);
  void load(torch::serialize::InputArchive& archive);

  /// The model as trained: the checkpointing wrapper when there is one.
  std::shared_ptr<torch::nn::Module> model() const { return module_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  /// The GradScaler, when the recipe scales gradients.
  amp::GradScaler* scaler() { return scaler_ ? &*scaler_ : nullptr; }
  const Recipe& recipe() const { return recipe_; }

 private:
  /// Wraps a Sequential as the recipe checkpoints it.
  void apply(const torch::nn::Sequential& model);
  /// Takes the model: checks its parameters and the recipe.
  void adopt(std::shared_ptr<torch::nn::Module> model);
  /// Turns a model of any shape's memsave::nn::Checkpoint blocks on or off as the recipe says, once the
  /// Trainer is built.
  void switch_blocks();
  void make_optimizer(const OptimizerFactory& make_optimizer);
  void check_optimizer();
  void make_accumulator();
  /// Checks a step's or a prediction's inputs: some, one for a Sequential, defined, on the model's device.
  void check_inputs(const std::vector<torch::Tensor>& inputs, const char* who) const;
  torch::Tensor forward(const std::vector<torch::Tensor>& inputs);
  /// Copies the model's buffers into `saved_buffers_`, before a step.
  void save_buffers();
  /// Copies them back, after a step that failed.
  void restore_buffers();

  Recipe recipe_;
  std::shared_ptr<torch::nn::Module> model_;  ///< as given: what save and load name
  std::shared_ptr<torch::nn::Module> module_;
  Forward forward_;
  bool sequential_ = false;  ///< model_ is a Sequential, which takes one input
  c10::Device device_ = c10::kCPU;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::optional<amp::GradScaler> scaler_;
  std::unique_ptr<GradientAccumulator> accumulator_;
  /// host arena copies of the model's buffers (undefined for one whose elements share memory)
  std::vector<torch::Tensor> saved_buffers_;
};

}  // namespace memsave
