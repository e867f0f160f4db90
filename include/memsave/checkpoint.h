// Activation checkpointing for LibTorch: run a piece of the forward pass without keeping its graph, and
// recompute it during backward.
//
//   auto net = memsave::nn::checkpoint_sequential(make_layers(), /*segments=*/4);   // a whole model
//   auto layer = memsave::nn::Checkpoint(torch::nn::Linear(1024, 1024));          // one module
//   auto y = memsave::checkpoint(*block, [&](at::TensorList x) {                   // any callable, here a
//     return std::vector<torch::Tensor>{block->forward(x[0], x[1])};              // user module taking two
//   }, {x, mask});                                                                 // tensors
//
// Gradients are bit-identical to running without checkpointing: the recomputation replays the forward's RNG
// state (dropout masks) and autocast state, and the parameters used are inputs of the autograd node, so they
// receive gradients even when no input requires grad, through `backward()` and `torch::autograd::grad` alike.
// Under `create_graph` the gradients stay differentiable in the inputs and the parameters (a double backward
// matches the plain graph's to rounding), except through offloaded inputs (`offload_inputs`), an error there.
// Buffers the module updates in place (BatchNorm running statistics) change once per forward, not again in
// the recomputation. Without grad mode (and, for the module wrappers, in eval()) nothing is checkpointed.
// Under autocast a piece runs with autocast's cache of cast weights off, so its casts go with the piece
// instead of staying until the autocast region ends (torch.utils.checkpoint keeps them there: 2 bytes per
// element of each cast weight, through the rest of the forward); a weight used twice inside one piece is
// cast twice.
//
// Memory in the backward: a recomputed piece lets go of its recomputed outputs and of their gradients as the
// backward without checkpointing does, once its graph no longer needs them (not at the end of the piece).
// Under a plain `backward()` it also adds its parameters' gradients to `.grad` as they arrive, so a later
// micro-batch's gradients are added one by one. Where that could change the result or a hook's calls it hands
// them back together at the end of the piece instead, to be added there (at most one piece's parameter
// gradients held at once): when a graph node outside the piece also uses a parameter (a tied weight), under
// `torch::autograd::grad` or `create_graph`, when a parameter or its gradient accumulator has a hook, or when
// something other than memsave holds the accumulator (DistributedDataParallel does).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace memsave {

struct CheckpointOptions {
  /// Save the CPU generator and the CUDA generators of the devices involved, and replay them in the
  /// recomputation, so random operations (dropout) give the same result twice.
  TORCH_ARG(bool, preserve_rng_state) = true;
  /// Check that the recomputation returns as many tensors as the forward, with the same shapes, dtypes and
  /// devices; an error names the first difference.
  TORCH_ARG(bool, check_recompute) = true;
  /// Keep the saved inputs in host memory (memsave's host arena, pinned with asynchronous copies on CUDA)
  /// instead of on their device, and copy them back for the recomputation.
  TORCH_ARG(bool, offload_inputs) = false;
};

/// What a checkpointed callable computes: tensors in, at least one tensor out. Non-tensor arguments are bound
/// in the callable.
using CheckpointFunction = std::function<std::vector<torch::Tensor>(at::TensorList inputs)>;

/// Runs `fn(inputs)` without keeping its graph and recomputes it in backward. The parameters `fn` uses are
/// found in the graph of its forward (which lives only while `fn` runs) and become inputs of the autograd
/// node, so they receive gradients even when no input requires grad, tied or not. `owner` is the module whose
/// buffers `fn` updates in place (they are restored after the recomputation) and whose device the inputs must
/// be on. A tensor that requires grad and was computed outside `fn` must be passed in `inputs`: capturing it
/// is an error.
std::vector<torch::Tensor> checkpoint(const torch::nn::Module& owner, const CheckpointFunction& fn,
                                      at::TensorList inputs, const CheckpointOptions& options = {});
/// As above, for a callable that updates no buffers.
std::vector<torch::Tensor> checkpoint(const CheckpointFunction& fn, at::TensorList inputs,
                                      const CheckpointOptions& options = {});

namespace nn {

/// Wraps a module so that its forward is checkpointed. The wrapped module is a registered child ("module"):
/// parameters(), to(), train()/eval() and serialization see through. A module whose forward takes one tensor
/// runs through `forward`; any other (a block taking its input and a mask) through `run`, in the forward of
/// the module that holds the wrapper:
///
///   x = block_ckpt->run([&](at::TensorList in) { return std::vector{block->forward(in[0], in[1])}; },
///                       {x, mask})[0];
///
/// A wrapper can be switched off (`enable(false)`): it then runs the module as it is. A memsave::Trainer
/// over a model of any shape switches every wrapper inside it per its recipe (Checkpointing::every_layer()
/// on, none() off), so that the OOM rescue can weigh checkpointing a model it cannot cut.
class CheckpointImpl : public torch::nn::Module {
  /// Whether `M::forward` takes one tensor and returns one.
  template <typename M, typename = void>
  struct takes_one_tensor : std::false_type {};
  template <typename M>
  struct takes_one_tensor<M, std::void_t<decltype(std::declval<M&>().forward(std::declval<torch::Tensor>()))>>
      : std::is_convertible<decltype(std::declval<M&>().forward(std::declval<torch::Tensor>())),
                            torch::Tensor> {};

 public:
  template <typename ModuleType>
  explicit CheckpointImpl(std::shared_ptr<ModuleType> module, CheckpointOptions options = {})
      : options_(options) {
    TORCH_CHECK(module != nullptr, "Checkpoint: module is empty");
    register_module("module", module);
    if constexpr (takes_one_tensor<ModuleType>::value)
      forward_ = [module](const torch::Tensor& x) -> torch::Tensor { return module->forward(x); };
  }
  template <typename ModuleType>
  explicit CheckpointImpl(torch::nn::ModuleHolder<ModuleType> module, CheckpointOptions options = {})
      : CheckpointImpl(module.is_empty() ? nullptr : module.ptr(), options) {}

  /// The wrapped module's forward of one tensor (an error for a module whose forward takes other arguments:
  /// use `run`).
  torch::Tensor forward(const torch::Tensor& input);
  /// Runs `fn` (a computation with the wrapped module) on `inputs`, checkpointed with the wrapped module as
  /// the owner of the buffers it updates, when the wrapper is on, in train mode and under grad mode;
  /// otherwise as it is.
  std::vector<torch::Tensor> run(const CheckpointFunction& fn, at::TensorList inputs);
  void pretty_print(std::ostream& stream) const override;

  /// Turns checkpointing on or off (on when built).
  void enable(bool on = true) { enabled_ = on; }
  bool enabled() const { return enabled_; }
  const CheckpointOptions& options() const { return options_; }
  CheckpointOptions& options() { return options_; }

 private:
  std::function<torch::Tensor(const torch::Tensor&)> forward_;
  CheckpointOptions options_;
  bool enabled_ = true;
};
TORCH_MODULE(Checkpoint);

/// The memsave::nn::Checkpoint wrappers in `module` (itself included), in the order of its modules().
std::vector<std::shared_ptr<CheckpointImpl>> checkpoint_blocks(
    const std::shared_ptr<torch::nn::Module>& module);

/// Decides, for each element of a Sequential, whether its activations are kept (true) or recomputed (false).
using KeepPolicy = std::function<bool(const std::string& name, const torch::nn::Module& layer)>;

/// A Sequential whose elements are run in segments; each segment is either stored (run normally) or
/// recomputed (checkpointed as one piece).
/// NOTE: the layers are shared with the Sequential it was built from, so parameters are the same tensors and
/// saving either module saves the same values (the names here carry the prefix "sequential.").
class CheckpointSequentialImpl : public torch::nn::Module {
 public:
  /// Half-open range of element indices and whether it is recomputed.
  struct Segment {
    size_t begin;
    size_t end;
    bool recompute;
  };

  /// A recomputed segment that begins where piece_may_begin says no is an error.
  CheckpointSequentialImpl(torch::nn::Sequential sequential, std::vector<Segment> segments,
                           CheckpointOptions options = {});

  torch::Tensor forward(torch::Tensor input);
  void pretty_print(std::ostream& stream) const override;

  const std::vector<Segment>& segments() const { return segments_; }
  const torch::nn::Sequential& sequential() const { return sequential_; }

 private:
  torch::nn::Sequential sequential_;
  std::vector<Segment> segments_;
  CheckpointOptions options_;
};
TORCH_MODULE(CheckpointSequential);

/// Per element of `sequential`, whether a piece may begin there. Not at an element that modifies its input in
/// place (LibTorch's activations and dropouts built with `inplace(true)`: ReLU, ReLU6, LeakyReLU, ELU, SELU,
/// CELU, RReLU, Hardtanh, Threshold, Dropout, Dropout2d, Dropout3d, AlphaDropout, FeatureAlphaDropout), nor
/// at one that hands its input on as it is (Identity, Flatten, Unflatten) before such an element: a piece
/// keeps its input for the recomputation, which the operation would change (LibTorch refuses it: inside the
/// piece the input is a leaf). The first element always may. A module of your own that works in place is
/// not recognized; checkpointing it at the start of a piece is the error that names the piece's input.
std::vector<bool> piece_may_begin(const torch::nn::Sequential& sequential);

/// `segments` contiguous pieces of near-equal length over `elements`, all but the last recomputed: the plan
/// of checkpoint_sequential(sequential, segments). With `may_begin` (piece_may_begin), a cut before an
/// element where no piece may begin moves after it (the piece before grows; one left empty goes, so there
/// may be fewer pieces).
std::vector<CheckpointSequentialImpl::Segment> even_segments(size_t elements, int64_t segments,
                                                             const std::vector<bool>& may_begin = {});

/// Cuts `sequential` into `segments` contiguous pieces of near-equal length: piece i holds elements
/// [i*n/segments, (i+1)*n/segments). Every piece but the last is recomputed; the last is stored, since
/// backward needs its activations at once (as torch.utils.checkpoint's checkpoint_sequential, which cuts
/// elsewhere: n/segments elements in each piece but the last, which takes the rest; 27 elements in 5 pieces
/// are 5,5,6,5,6 here and 5,5,5,5,7 there). `segments` equal to the number of elements recomputes every
/// layer. No piece begins where piece_may_begin says no: an in-place ReLU joins the piece before it.
CheckpointSequential checkpoint_sequential(torch::nn::Sequential sequential, int64_t segments,
                                           CheckpointOptions options = {});
/// Keeps the elements for which `keep` is true, and recomputes each run of consecutive other elements as one
/// piece, or as pieces of at most `max_run` elements when it is > 0 (backward holds one piece at a time).
/// No piece begins where piece_may_begin says no: such an element joins the piece before it.
CheckpointSequential checkpoint_sequential(torch::nn::Sequential sequential, const KeepPolicy& keep,
                                           int64_t max_run = 0, CheckpointOptions options = {});

/// The usual per-layer policy: keep the outputs of the layers that are expensive to recompute (Linear,
/// convolutions, Embedding, MultiheadAttention, and any element whose name contains one of `also_keep`);
/// recompute the rest (normalizations, activations, pooling, dropout, and composite blocks).
KeepPolicy keep_compute_heavy(std::vector<std::string> also_keep = {});

}  // namespace nn
}  // namespace memsave
