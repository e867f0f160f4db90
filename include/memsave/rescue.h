// The OOM rescue: "my step does not fit — what should I do, and what will it cost?"
//
//   memsave::TrainingSetup setup{make_model, make_batch, loss_fn};        // the user's own model
//   auto plan = memsave::rescue(setup, memsave::RescueOptions(/*batch=*/64, memsave::parse_bytes("300MiB")));
//   if (plan.recommended) std::cout << plan.candidates[*plan.recommended].recipe.to_cpp();
//
// A model that is not a Sequential gives its module and forward function, and batches of several inputs;
// the blocks it holds in memsave::nn::Checkpoint wrappers are what the checklist's checkpointing switches on:
//
//   setup.make_any_model = [] {
//     MyNet net;
//     auto forward = [net](const auto& in) mutable { return net->forward(in[0], in[1]); };
//     return memsave::AnyModel{net.ptr(), forward};
//   };
//   setup.make_inputs = [](int64_t rows, c10::Device d) {
//     return std::pair{std::vector{ids(rows, d), mask(rows, d)}, target(rows, d)};
//   };
//
// It walks the usual checklist on the real model — smaller micro-batches with accumulation (same effective
// batch), mixed precision, checkpointing (coarse, then every layer), 8-bit optimizer state, 4-bit optimizer
// state (when the setup's optimizer has it: memsave::adamw), offloaded state —
// measures each candidate's peak (memsave's meter, under the budget) and step time, and recommends the
// fastest candidate that fits — of those within `tie` of the fastest, the one earliest on the checklist. A
// MemoryModel built from one profile of the model predicts every candidate's peak; a candidate whose static
// bytes (parameters, gradients, state, batch) already exceed the budget is never run.
#pragma once

#include <memsave/trainer.h>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace memsave {

/// A model of any shape: the module, and the function that runs it on a micro-batch's inputs (as a Trainer
/// takes it).
struct AnyModel {
  std::shared_ptr<torch::nn::Module> module;
  Forward forward;
};

/// The user's training step: a model factory (a Sequential, so checkpointing can cut it), batches of any
/// number of rows on a device, a loss, and an optimizer factory.
struct TrainingSetup {
  std::function<torch::nn::Sequential()> make_model;
  std::function<std::pair<torch::Tensor, torch::Tensor>(int64_t rows, c10::Device device)> make_batch;
  LossFunction loss;
  OptimizerFactory optimizer = adamw();
  /// Instead of make_model and make_batch, a model of any shape (a module of your own, several inputs) and
  /// its batches: the inputs, each with `rows` rows on dim 0, and the target. Such a model is measured and
  /// profiled whole, as one element. Its checkpointing levels are those of every layer, when it has
  /// memsave::nn::Checkpoint blocks inside: profiled with them off and on, and switched by the recipe (see
  /// Trainer); without such blocks it has none (checkpointing done otherwise inside the module stays, and
  /// the rescue measures what that leaves). The rest of the checklist is the same.
  std::function<AnyModel()> make_any_model;
  std::function<std::pair<std::vector<torch::Tensor>, torch::Tensor>(int64_t rows, c10::Device device)>
      make_inputs;
};

/// One candidate's run: the device pool's peak over what was in use before it (model, state, batch and step
/// included) and the median step time after the first step.
struct Measurement {
  int64_t peak = 0;
  double seconds = 0;
  /// How far the timed steps' times spread: (slowest - fastest) / fastest (0 with one timed step). On a busy
  /// machine it grows, and step times say little.
  double spread = 0;
  bool out_of_memory = false;
};

/// On the CPU, where the device is simulated in host memory, what a measuring run (measure,
/// MemoryModel::profile, rescue) may add to the pool before an allocation ends it as an out-of-memory: nine
/// tenths of `host_memory_available()`, the rest left for what LibTorch allocates outside the pool.
int64_t simulated_device_room();

/// What `device` can give a training step now, the CLI's budget of `memsave rescue` when none is given: on
/// CUDA the card's free memory (the driver's count) and what LibTorch's caching allocator holds but does not
/// use; on the CPU, where the device is simulated in host memory, `simulated_device_room()`.
int64_t device_room(c10::Device device);

/// Builds a fresh model and Trainer for `recipe` and runs `steps` (>= 2) training steps on a batch of `batch`
/// rows; with a budget, what the run allocates is bounded by it and an allocation past it ends the run as
/// out_of_memory. On the CPU the run is also bounded by `simulated_device_room()`.
Measurement measure(const TrainingSetup& setup, const Recipe& recipe, int64_t batch, c10::Device device,
                    int steps, std::optional<int64_t> budget = std::nullopt);

/// Predicts the peak of a recipe from one profile of the model: the bytes of parameters, gradients, optimizer
/// state (by optimizer and bits) of the parameters that get gradients, and batch; and from training passes
/// run element by element (fp32 and under autocast, at the batch and at each micro-batch size of the
/// checklist, halving down to one row; from half of the batch and so on when the device cannot hold it, on
/// the CPU `simulated_device_room()`) each element's stored activations, forward peak, backward peak and,
/// onto existing gradients, what its arriving gradients add; and the optimizer step's temporaries. A recipe's
/// pass is simulated by walking the backward through its checkpoint plan with the figures measured at its
/// micro-batch's rows (at other rows, on the line through the two sizes around them).
class MemoryModel {
 public:
  /// `amp`: the autocast dtype of the mixed-precision passes, the one a recipe with mixed precision must ask
  /// for (kBFloat16 or kHalf).
  static MemoryModel profile(const TrainingSetup& setup, int64_t batch, c10::Device device,
                             c10::ScalarType amp = c10::kBFloat16);

  /// A recipe's peak; an error for a recipe whose mixed precision is not the profile's dtype.
  int64_t predict(const Recipe& recipe) const;
  /// What a recipe holds whatever its activations: parameters, the gradients and optimizer state of those the
  /// backward reaches (not a frozen or unused one), and the batch. A budget below it cannot be met.
  int64_t static_bytes(const Recipe& recipe) const;
  int64_t batch() const { return batch_; }
  int64_t parameter_bytes() const { return param_bytes_; }
  size_t elements() const { return fp32_.stored.size(); }
  /// The memsave::nn::Checkpoint blocks of a model of any shape (0 for a Sequential): with some, it was
  /// profiled with them off and on, and a recipe checkpointing every layer turns them on.
  size_t checkpoint_blocks() const { return blocks_; }

 private:
  /// Bytes per element, each measured at each of the profile's sizes (`sizes_`); at other rows, read on the
  /// line through the two sizes around them (`at`).
  struct Activations {
    std::vector<std::vector<double>> stored;  ///< what an element's forward leaves behind
    /// what of its input an element's forward lets go of (what its graph does not keep)
    std::vector<std::vector<double>> freed;
    /// what the backward of the elements after it leaves when an element's backward begins, beyond their
    /// graphs and the parameter gradients (the gradient of its output, a shared weight's pending gradient)
    std::vector<std::vector<double>> carried;
    std::vector<double> output;                ///< its output, per row
    std::vector<std::vector<double>> forward;  ///< its forward's peak beyond what it leaves behind
    /// the peak of an element's backward beyond what the elements before it keep (its own graph, the
    /// gradient arriving, the one it hands on, temporaries; parameter gradients are counted apart)
    std::vector<std::vector<double>> backward;
    /// with the gradients already there (a later micro-batch): what an element's backward adds beside them
    std::vector<double> incoming;
    /// bytes of parameter gradients present once element i's backward has run (i = elements: none)
    std::vector<double> grads;
    /// whether an element's output is still there when its backward begins (its own graph keeps it)
    std::vector<bool> output_kept;
    std::vector<double> loss;  ///< the same for the loss's backward, beyond every element's graph
  };
  static MemoryModel profile_rows(const TrainingSetup& setup, int64_t batch, int64_t rows, c10::Device device,
                                  c10::ScalarType amp);
  int64_t optimizer_state(const Recipe& recipe) const;
  /// The peak of a forward and backward pass beyond parameters, optimizer state and batch: activations
  /// and parameter gradients, as the backward walks the checkpoint plan.
  double pass_peak(const Activations& a, const Recipe& recipe, double rows, bool accumulating) const;
  /// A figure measured at each size, at `rows`.
  double at(const std::vector<double>& samples, double rows) const;

  int64_t batch_ = 0;
  int64_t rows_ = 0;  ///< rows of the profile
  /// the sizes its passes ran at: rows_, then halved (rounding up) down to one row, or to the fewest the
  /// model takes
  std::vector<int64_t> sizes_;
  c10::ScalarType amp_dtype_ = c10::kBFloat16;
  int64_t param_bytes_ = 0;
  /// the parameters that get gradients (and optimizer state): elements of each, and their gradients' bytes
  std::vector<int64_t> trained_numel_;
  int64_t grad_bytes_ = 0;
  int64_t batch_bytes_per_row_ = 0;
  Activations fp32_, amp_;
  Activations fp32_blocks_, amp_blocks_;  ///< a model of any shape with its checkpointed blocks on
  bool any_shape_ = false;
  size_t blocks_ = 0;
  int64_t step_extra_ = 0;   ///< the optimizer step's temporaries beyond its state
  int64_t piece_state_ = 0;  ///< what a checkpointed piece keeps beside its input and output
  /// per element: the first and the last element that use one of its parameters (itself, for a parameter of
  /// its own or none)
  std::vector<size_t> shares_from_, shares_to_;
  int64_t moments_ = 2;           ///< fp32 state tensors per trained parameter of the setup's optimizer
  std::vector<bool> may_begin_;   ///< per element: whether a checkpointed piece may begin there
  std::vector<bool> needs_grad_;  ///< per element: whether its output needs a gradient (not a frozen one's)
};

struct RescueOptions {
  RescueOptions(int64_t batch, int64_t budget) : batch_(batch), budget_(budget) {}
  /// The effective batch (rows per optimizer step), kept by every candidate.
  TORCH_ARG(int64_t, batch);
  /// Bytes the training step may use in the device pool. On the CPU, where the device is simulated in host
  /// memory, at most `simulated_device_room()`.
  TORCH_ARG(int64_t, budget);
  TORCH_ARG(c10::Device, device) = c10::kCPU;
  /// The autocast dtype of the mixed-precision candidates: kBFloat16, or kHalf (with a GradScaler); none:
  /// `mixed_precision_dtype(device)`.
  TORCH_ARG(std::optional<c10::ScalarType>, amp) = std::nullopt;
  /// Steps per candidate (>= 2; the first creates the optimizer state and is not timed, the median of the
  /// others is the candidate's step time).
  TORCH_ARG(int, steps) = 4;
  /// Step times within this fraction of the fastest fitting candidate's count as equal (>= 0): of those the
  /// rescue recommends the one earliest on the checklist, which changes the least about the training (the
  /// optimizer's state last, then fewer techniques, then the larger micro-batch). A timing's noise then does
  /// not decide between near-equals.
  TORCH_ARG(double, tie) = 0.05;
  /// Called after each candidate (progress lines).
  TORCH_ARG(std::function<void(size_t done, size_t total)>, progress) = nullptr;
};

struct Candidate {
  enum class Status {
    kFits,
    kOutOfMemory,
    kCannotFit,  ///< not run: its static bytes exceed the budget
    kNotNeeded,  ///< not run: a recipe it only adds work to already fits (adds_only_work)
    kFailed,     ///< its run ended in an error other than out of memory (`error`)
  };
  Recipe recipe;
  int64_t predicted = 0;
  int64_t static_bytes = 0;
  Status status = Status::kCannotFit;
  Measurement measured;
  /// Why its run failed (kFailed): LibTorch's or the Trainer's message, such as a BatchNorm1d's in train mode
  /// on a micro-batch of one row.
  std::string error;
  /// Step time of the reference (the baseline, or when it does not fit the fastest candidate that does)
  /// divided by this one's: throughput relative to it.
  double relative_throughput = 0;
};

struct RescuePlan {
  std::vector<Candidate> candidates;
  /// The candidate that fits to recommend: of those whose step time is within the tie of the fastest, the
  /// earliest on the checklist (`recommend`).
  std::optional<size_t> recommended;
  /// The fastest candidate that fits.
  std::optional<size_t> fastest;
  /// How noisy the step times were: `timing_noise` of the candidates. A few percent on a quiet machine;
  /// beside a busy process, or for steps of milliseconds, tens of percent, and then a ranking by step time
  /// closer than that may not hold.
  double noise = 0;
  /// When nothing fits: the run whose peak came closest to the budget (or the smallest static bytes).
  std::optional<size_t> closest_miss;
  /// The budget is below the parameters alone: nothing was run.
  bool below_parameters = false;
  int64_t parameter_bytes = 0;
};

/// The autocast dtype of mixed precision on `device`: bf16 on the CPU and on CUDA devices of compute
/// capability 8.0 or more (Ampere on: bf16 tensor cores; fp32's range, so no GradScaler); fp16, with a
/// GradScaler, on older CUDA devices (V100, T4), whose tensor cores take fp16 but not bf16.
c10::ScalarType mixed_precision_dtype(c10::Device device);

/// The candidates of the checklist, in order: levels fp32, +mixed precision (autocast to `amp`: kBFloat16,
/// or kHalf with a GradScaler), +checkpointing √n segments, +checkpointing every layer; then for each of
/// 8-bit state, 4-bit state and 8-bit state offloaded, that state alone, with mixed precision, and with mixed
/// precision and checkpointing every layer (where the optimizer's state outweighs the activations, low-bit
/// state alone fits and runs faster than with checkpointing, and without autocast's half-precision copies of
/// the weights); each level with micro-batches batch, batch/2, ... 1. The levels whose state `optimizer` does
/// not build are left out (builds_state: memsave::sgd has no offloaded state, a factory that returns
/// LibTorch's optimizer whatever the recipe no low-bit state). A model of any shape is one element; with
/// `blocks` > 0 memsave::nn::Checkpoint blocks inside it, its levels checkpointing every layer (every block
/// on) are there too.
std::vector<Recipe> checklist(int64_t batch, size_t elements, c10::ScalarType amp,
                              const OptimizerFactory& optimizer = adamw(), size_t blocks = 0);

/// Whether `recipe` only adds work to `fitted` for the same effective `batch`, so that it cannot run faster
/// where `fitted` fits: the same recipe but for micro-batches no larger (more steps) and checkpointing that
/// recomputes no less (none, then √n segments, then every layer; a policy only as itself). The rescue does
/// not run such a candidate once `fitted` fits.
bool adds_only_work(const Recipe& recipe, const Recipe& fitted, int64_t batch);

/// The rescue's choice among measured candidates (in checklist order): the first that fits whose step time is
/// at most (1 + tie) times the fastest fitting one's; none when nothing fits.
std::optional<size_t> recommend(const std::vector<Candidate>& candidates, double tie);

/// The median, over the candidates that fit, of their timed steps' spread (Measurement::spread); 0 when none
/// fits.
double timing_noise(const std::vector<Candidate>& candidates);

/// Profiles the model, then walks the checklist: a candidate whose static bytes exceed the budget is not run
/// (kCannotFit), nor one that only adds work to one that fits (kNotNeeded); the others are measured under the
/// budget. One whose run fails with an error other than out of memory is kFailed, with the error, and the
/// walk goes on; when no candidate runs (each fails), the first error is thrown.
RescuePlan rescue(const TrainingSetup& setup, const RescueOptions& options);

}  // namespace memsave
