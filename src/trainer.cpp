#include "memsave/trainer.h"

#include "archive.h"
#include "memory_internal.h"
#include "memsave/memory.h"
#include "memsave/offload.h"
#include "memsave/optim.h"
#include "optim_internal.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace memsave {
namespace {

std::string dtype_cpp(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kBFloat16:
      return "torch::kBFloat16";
    case c10::kHalf:
      return "torch::kHalf";
    default:
      return std::string("torch::k") + c10::toString(dtype);
  }
}

void check_recipe(const Recipe& r) {
  TORCH_CHECK(r.micro_batch() >= 0, "Recipe: micro_batch must be >= 0 (0: the whole batch), got ",
              r.micro_batch());
  TORCH_CHECK(r.state_bits() == 32 || r.state_bits() == 8 || r.state_bits() == 4,
              "Recipe: state_bits must be 32, 8 or 4, got ", r.state_bits());
  TORCH_CHECK(r.max_grad_norm() >= 0, "Recipe: max_grad_norm must be >= 0 (0: no clipping), got ",
              r.max_grad_norm());
  if (r.amp()) {
    const c10::ScalarType dtype = *r.amp();
    TORCH_CHECK(dtype == c10::kBFloat16 || dtype == c10::kHalf, "Recipe: amp must be BFloat16 or Half, got ",
                dtype);
  }
  TORCH_CHECK(
      !r.offload_activations() || r.checkpoint().kind != Checkpointing::Kind::kNone,
      "Recipe: offload_activations keeps the inputs of checkpointed pieces in host memory; it needs a "
      "checkpoint policy");
  const Checkpointing& c = r.checkpoint();
  TORCH_CHECK(c.kind != Checkpointing::Kind::kSegments || c.count >= 1,
              "Recipe: checkpoint segments must be >= 1, got ", c.count);
  TORCH_CHECK(c.kind != Checkpointing::Kind::kPolicy || c.keep, "Recipe: checkpoint policy is empty");
}

}  // namespace

bool Recipe::scales_gradients() const {
  if (grad_scaling() == GradScaling::kAuto) return amp() && *amp() == c10::kHalf;
  return grad_scaling() == GradScaling::kOn;
}

std::string Recipe::to_cpp() const {
  std::ostringstream out;
  out << "memsave::Recipe()";
  if (micro_batch()) out << ".micro_batch(" << micro_batch() << ")";
  if (amp()) out << ".amp(" << dtype_cpp(*amp()) << ")";
  if (grad_scaling() == GradScaling::kOn) out << ".grad_scaling(memsave::GradScaling::kOn)";
  if (grad_scaling() == GradScaling::kOff) out << ".grad_scaling(memsave::GradScaling::kOff)";
  switch (checkpoint().kind) {
    case Checkpointing::Kind::kNone:
      break;
    case Checkpointing::Kind::kEveryLayer:
      out << ".checkpoint(memsave::Checkpointing::every_layer())";
      break;
    case Checkpointing::Kind::kSegments:
      out << ".checkpoint(memsave::Checkpointing::segments(" << checkpoint().count << "))";
      break;
    case Checkpointing::Kind::kPolicy:
      out << ".checkpoint(memsave::Checkpointing::policy(/* " << checkpoint().name << " */ keep, "
          << checkpoint().max_run << "))";
      break;
  }
  if (state_bits() != 32) out << ".state_bits(" << state_bits() << ")";
  if (offload() == Offload::kOptimizerState) out << ".offload(memsave::Offload::kOptimizerState)";
  if (offload_activations()) out << ".offload_activations(true)";
  if (max_grad_norm() > 0) out << ".max_grad_norm(" << max_grad_norm() << ")";
  if (loss_reduction() == LossReduction::kSum) out << ".loss_reduction(memsave::LossReduction::kSum)";
  return out.str();
}

std::string Recipe::label() const {
  std::vector<std::string> parts;
  if (micro_batch()) parts.push_back("micro " + std::to_string(micro_batch()));
  if (amp()) parts.push_back(*amp() == c10::kHalf ? "fp16" : "bf16");
  switch (checkpoint().kind) {
    case Checkpointing::Kind::kNone:
      break;
    case Checkpointing::Kind::kEveryLayer:
    case Checkpointing::Kind::kSegments:
    case Checkpointing::Kind::kPolicy:
      parts.push_back("ckpt " + checkpoint().name);
      break;
  }
  if (state_bits() != 32) parts.push_back(std::to_string(state_bits()) + "-bit state");
  if (offload() == Offload::kOptimizerState) parts.push_back("offload state");
  if (offload_activations()) parts.push_back("offload activations");
  if (parts.empty()) return "baseline";
  std::string label = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) label += " + " + parts[i];
  return label;
}

OptimizerFactory adamw(double lr, double weight_decay) {
  return [lr, weight_decay](const std::vector<torch::Tensor>& parameters,
                            const Recipe& recipe) -> std::unique_ptr<torch::optim::Optimizer> {
    if (recipe.offload() == Offload::kOptimizerState) {
      // NOTE: not step_during_backward, which a failed backward can leave half-stepped; it is opt-in.
      return std::make_unique<OffloadOptimizer>(parameters, OffloadOptimizerOptions(lr)
                                                                .weight_decay(weight_decay)
                                                                .state_bits(recipe.state_bits())
                                                                .copy_during_backward(true));
    }
    if (recipe.state_bits() == 8)
      return std::make_unique<optim::AdamW8bit>(parameters,
                                                optim::AdamW8bitOptions(lr).weight_decay(weight_decay));
    if (recipe.state_bits() == 4)
      return std::make_unique<optim::AdamW4bit>(parameters,
                                                optim::AdamW4bitOptions(lr).weight_decay(weight_decay));
    return std::make_unique<torch::optim::AdamW>(parameters,
                                                 torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
  };
}

OptimizerFactory sgd(double lr, double momentum) {
  TORCH_CHECK(momentum > 0, "sgd: momentum must be > 0 (SGD without momentum keeps no state), got ",
              momentum);
  return [lr, momentum](const std::vector<torch::Tensor>& parameters,
                        const Recipe& recipe) -> std::unique_ptr<torch::optim::Optimizer> {
    TORCH_CHECK(recipe.offload() == Offload::kNone,
                "sgd: offloading the optimizer state is implemented for AdamW (memsave::adamw) only");
    if (recipe.state_bits() == 8)
      return std::make_unique<optim::SGD8bit>(parameters, optim::SGD8bitOptions(lr).momentum(momentum));
    if (recipe.state_bits() == 4)
      return std::make_unique<optim::SGD4bit>(parameters, optim::SGD4bitOptions(lr).momentum(momentum));
    return std::make_unique<torch::optim::SGD>(parameters, torch::optim::SGDOptions(lr).momentum(momentum));
  };
}

namespace {

std::string type_name(const torch::optim::Optimizer& optimizer) {
  return c10::demangle(typeid(optimizer).name());
}

/// Bits per element of the optimizer state `optimizer` keeps: its state_bits for an OffloadOptimizer, its
/// codes' for memsave's low-bit optimizers, 32 for any other.
int64_t state_bits_of(const torch::optim::Optimizer& optimizer) {
  if (const auto* offload = dynamic_cast<const OffloadOptimizer*>(&optimizer))
    return static_cast<const OffloadOptimizerOptions&>(offload->param_groups().front().options())
        .state_bits();
  if (const auto* low_bit = dynamic_cast<const optim::LowBitOptimizer*>(&optimizer)) return low_bit->bits();
  return 32;
}

/// Why `optimizer` does not keep the state `recipe` asks for (builds_state's rule); empty when it does. With
/// `exact`, 32-bit state also refuses memsave's low-bit optimizers: an optimizer handed over as it is keeps
/// what it keeps, where a factory may build one for fp32 state through its size threshold (Lion, which
/// LibTorch lacks, say).
std::string state_mismatch(const torch::optim::Optimizer& optimizer, const Recipe& recipe, bool exact) {
  const bool offloads = dynamic_cast<const OffloadOptimizer*>(&optimizer) != nullptr;
  const int64_t bits = state_bits_of(optimizer);
  if (offloads != (recipe.offload() == Offload::kOptimizerState)) {
    return c10::str("the recipe ", offloads ? "does not offload" : "offloads", " the optimizer state but ",
                    type_name(optimizer), offloads ? " is" : " is not", " a memsave::OffloadOptimizer");
  }
  if ((exact || recipe.state_bits() != 32) && bits != recipe.state_bits()) {
    return c10::str("the recipe asks for ", recipe.state_bits(), "-bit optimizer state but ",
                    type_name(optimizer), " keeps ", bits, "-bit state");
  }
  return {};
}

}  // namespace

bool builds_state(const OptimizerFactory& optimizer, const Recipe& recipe) {
  TORCH_CHECK(optimizer, "builds_state: the optimizer factory is empty");
  const auto probe = torch::zeros({1}, torch::requires_grad());
  try {
    const auto built = optimizer({probe}, recipe);
    return built != nullptr && state_mismatch(*built, recipe, /*exact=*/false).empty();
  } catch (const c10::Error&) {  // a factory that refuses the recipe (memsave::sgd: offloaded state)
    return false;
  }
}

Trainer::Trainer(torch::nn::Sequential model, const OptimizerFactory& make_optimizer, Recipe recipe)
    : recipe_(std::move(recipe)) {
  TORCH_CHECK(make_optimizer, "Trainer: make_optimizer is empty");
  apply(model);
  this->make_optimizer(make_optimizer);
}

Trainer::Trainer(torch::nn::Sequential model, std::shared_ptr<torch::optim::Optimizer> optimizer,
                 Recipe recipe)
    : recipe_(std::move(recipe)), optimizer_(std::move(optimizer)) {
  check_optimizer();
  apply(model);
  make_accumulator();
}

Trainer::Trainer(std::shared_ptr<torch::nn::Module> model, Forward forward,
                 const OptimizerFactory& make_optimizer, Recipe recipe)
    : recipe_(std::move(recipe)), forward_(std::move(forward)) {
  TORCH_CHECK(make_optimizer, "Trainer: make_optimizer is empty");
  adopt(std::move(model));
  this->make_optimizer(make_optimizer);
  switch_blocks();
}

Trainer::Trainer(std::shared_ptr<torch::nn::Module> model, Forward forward,
                 std::shared_ptr<torch::optim::Optimizer> optimizer, Recipe recipe)
    : recipe_(std::move(recipe)), forward_(std::move(forward)), optimizer_(std::move(optimizer)) {
  check_optimizer();
  adopt(std::move(model));
  make_accumulator();
  switch_blocks();
}

void Trainer::make_optimizer(const OptimizerFactory& make_optimizer) {
  optimizer_ = make_optimizer(unique_parameters(model_->parameters()), recipe_);
  TORCH_CHECK(optimizer_ != nullptr, "Trainer: make_optimizer returned no optimizer");
  const std::string mismatch = state_mismatch(*optimizer_, recipe_, /*exact=*/false);
  TORCH_CHECK(mismatch.empty(), "Trainer: make_optimizer built an optimizer for another recipe: ", mismatch);
  make_accumulator();
}

void Trainer::check_optimizer() {
  TORCH_CHECK(optimizer_ != nullptr, "Trainer: optimizer is null");
  const std::string mismatch = state_mismatch(*optimizer_, recipe_, /*exact=*/true);
  TORCH_CHECK(mismatch.empty(), "Trainer: ", mismatch,
              "; build the optimizer with an OptimizerFactory (memsave::adamw) instead");
}

void Trainer::make_accumulator() {
  // One window per step(): the Trainer closes it itself after the batch's micro-batches.
  accumulator_ = std::make_unique<GradientAccumulator>(*optimizer_,
                                                       AccumulateOptions()
                                                           .window(std::numeric_limits<int64_t>::max())
                                                           .max_grad_norm(recipe_.max_grad_norm())
                                                           .reduction(recipe_.loss_reduction()),
                                                       scaler());
}

void Trainer::adopt(std::shared_ptr<torch::nn::Module> model) {
  TORCH_CHECK(model != nullptr, "Trainer: the model is null");
  const auto parameters = model->parameters();
  TORCH_CHECK(!parameters.empty(), "Trainer: the model has no parameters");
  device_ = parameters.front().device();
  for (const auto& p : parameters)
    TORCH_CHECK(p.device() == device_, "Trainer: the model's parameters are on several devices (", device_,
                " and ", p.device(), ")");
  check_recipe(recipe_);
  if (!sequential_) {
    TORCH_CHECK(forward_, "Trainer: the forward function is empty");
    // The recipe switches the module's own checkpointed blocks: all on, or all off.
    const Checkpointing::Kind kind = recipe_.checkpoint().kind;
    TORCH_CHECK(kind == Checkpointing::Kind::kNone || kind == Checkpointing::Kind::kEveryLayer,
                "Recipe: checkpoint ", recipe_.checkpoint().name,
                " cuts a torch::nn::Sequential, and this Trainer was given a module with a forward function; "
                "Checkpointing::every_layer() turns on the memsave::nn::Checkpoint blocks inside it");
    TORCH_CHECK(
        kind == Checkpointing::Kind::kNone || !nn::checkpoint_blocks(model).empty(),
        "Recipe: checkpoint every layer turns on the memsave::nn::Checkpoint blocks of a module with a "
        "forward function, and this one has none; wrap its blocks in memsave::nn::Checkpoint");
    module_ = model;
  }
  model_ = std::move(model);
  if (recipe_.scales_gradients()) scaler_.emplace();
}

void Trainer::switch_blocks() {
  const bool on = recipe_.checkpoint().kind == Checkpointing::Kind::kEveryLayer;
  for (const auto& block : nn::checkpoint_blocks(model_)) {
    block->enable(on);
    block->options().offload_inputs(recipe_.offload_activations());
  }
}

void Trainer::apply(const torch::nn::Sequential& model) {
  TORCH_CHECK(!model.is_empty() && model->size() > 0, "Trainer: the model is an empty Sequential");
  sequential_ = true;
  adopt(model.ptr());

  const Checkpointing& c = recipe_.checkpoint();
  const auto n = static_cast<int64_t>(model->size());
  nn::CheckpointSequential wrapped{nullptr};
  const CheckpointOptions options = CheckpointOptions().offload_inputs(recipe_.offload_activations());
  switch (c.kind) {
    case Checkpointing::Kind::kNone:
      break;
    case Checkpointing::Kind::kEveryLayer:
      wrapped = nn::checkpoint_sequential(model, n, options);
      break;
    case Checkpointing::Kind::kSegments:
      TORCH_CHECK(c.count <= n, "Recipe: checkpoint segments must be at most the model's ", n,
                  " elements, got ", c.count);
      wrapped = nn::checkpoint_sequential(model, c.count, options);
      break;
    case Checkpointing::Kind::kPolicy:
      wrapped = nn::checkpoint_sequential(model, c.keep, c.max_run, options);
      break;
  }
  if (wrapped) {
    module_ = wrapped.ptr();
    forward_ = [wrapped](const std::vector<torch::Tensor>& x) mutable { return wrapped->forward(x[0]); };
  } else {
    module_ = model.ptr();
    forward_ = [net = model](const std::vector<torch::Tensor>& x) mutable { return net->forward(x[0]); };
  }
}

torch::Tensor Trainer::forward(const std::vector<torch::Tensor>& inputs) {
  if (!recipe_.amp()) return forward_(inputs);
  amp::Autocast autocast(device_.type(), *recipe_.amp());
  return forward_(inputs);
}

void Trainer::check_inputs(const std::vector<torch::Tensor>& inputs, const char* who) const {
  TORCH_CHECK(!inputs.empty(), who, ": no input tensors");
  TORCH_CHECK(!sequential_ || inputs.size() == 1, who, ": a Trainer over a Sequential takes one input, got ",
              inputs.size(), "; build it with a forward function (Trainer(model, forward, ...)) for several");
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), who, ": input ", i, " is not defined");
    TORCH_CHECK(inputs[i].device() == device_, who, ": input ", i, " is on ", inputs[i].device(),
                " but the model is on ", device_);
  }
}

StepStats Trainer::step(const torch::Tensor& input, const torch::Tensor& target, const LossFunction& loss,
                        const torch::Tensor& mask) {
  return step(std::vector<torch::Tensor>{input}, target, loss, mask);
}

StepStats Trainer::step(const std::vector<torch::Tensor>& inputs, const torch::Tensor& target,
                        const LossFunction& loss, const torch::Tensor& mask) {
  TORCH_CHECK(loss, "Trainer::step: loss is empty");
  check_inputs(inputs, "Trainer::step");
  TORCH_CHECK(target.defined(), "Trainer::step: target is not defined");
  const torch::Tensor& input = inputs[0];
  std::vector<torch::Tensor> tensors = inputs;
  tensors.push_back(target);
  if (mask.defined()) tensors.push_back(mask);
  TORCH_CHECK(input.dim() > 0 && input.size(0) > 0, "Trainer::step: the batch is empty");
  const auto check_rows = [&](const torch::Tensor& t, const std::string& name) {
    TORCH_CHECK(t.dim() > 0 && t.size(0) == input.size(0), "Trainer::step: ", name, " has ",
                t.dim() > 0 ? t.size(0) : 0, " rows on dim 0 but input 0 has ", input.size(0));
  };
  for (size_t i = 1; i < inputs.size(); ++i) check_rows(inputs[i], "input " + std::to_string(i));
  check_rows(target, "target");
  if (mask.defined()) check_rows(mask, "mask");
  const int64_t micro = recipe_.micro_batch() == 0 ? input.size(0) : recipe_.micro_batch();
  TORCH_CHECK(micro <= input.size(0), "Trainer::step: micro_batch ", micro, " is larger than the batch of ",
              input.size(0));
  const auto parts = split_micro_batches(tensors, micro);
  const size_t n_inputs = inputs.size();
  std::vector<double> items;
  if (mask.defined()) {  // the micro-batches' tokens in one read (a device sync each would stall the queue)
    std::vector<torch::Tensor> sums;
    for (const auto& part : parts) sums.push_back(part[n_inputs + 1].sum().to(torch::kDouble));
    const torch::Tensor counts = torch::stack(sums).cpu();
    items.assign(counts.data_ptr<double>(), counts.data_ptr<double>() + counts.numel());
  } else {
    for (const auto& part : parts) items.push_back(static_cast<double>(part[0].size(0)));
  }
  double total = 0;
  for (const double n : items) total += n;
  TORCH_CHECK(total > 0, "Trainer::step: the batch has no items to learn from (the mask sums to ", total,
              ")");
  const auto parameters = model_->parameters();
  TORCH_CHECK(std::any_of(parameters.begin(), parameters.end(),
                          [](const torch::Tensor& p) { return p.requires_grad(); }),
              "Trainer::step: no parameter of the model requires grad (all ", parameters.size(),
              " are frozen): there is nothing to train");

  // A model in eval mode (evaluated by hand) is put in train mode, all of it; in a model in train mode the
  // submodules the user put in eval mode (a frozen BatchNorm) stay so.
  if (!module_->is_training() || !model_->is_training()) module_->train();
  PeakScope scope(device_);
  const auto start = std::chrono::steady_clock::now();
  StepStats stats;
  save_buffers();
  try {
    // NOTE: the accumulator defers an offloaded optimizer's gradient copies to the window's last micro-batch.
    accumulator_->begin_window(total);
    for (size_t i = 0; i < parts.size(); ++i) {
      if (items[i] == 0) continue;  // nothing in it counts: skip its forward altogether
      try {
        torch::Tensor value;
        {  // NOTE: the output is not held through the backward (the loss's graph keeps what it needs of it):
           // a decoder's logits can be the largest tensor of the step.
          const torch::Tensor output =
              forward(std::vector<torch::Tensor>(parts[i].begin(), parts[i].begin() + n_inputs));
          std::optional<amp::Autocast> autocast;
          if (recipe_.amp()) autocast.emplace(device_.type(), *recipe_.amp());
          value = loss(output, parts[i][n_inputs]);
        }
        TORCH_CHECK(value.defined() && value.dim() == 0,
                    "Trainer::step: the loss function must return a scalar, got ",
                    value.defined() ? value.sizes() : c10::IntArrayRef{});
        accumulator_->backward(value, items[i]);
      } catch (c10::Error& e) {
        // The micro-batch an error came from: the split is the Trainer's, not the user's (a last micro-batch
        // of one row is what BatchNorm refuses). The error keeps its type (an out-of-memory stays one).
        e.add_context(c10::str("Trainer::step: in micro-batch ", i + 1, " of ", parts.size(), " (",
                               parts[i][0].size(0), " of the batch's ", input.size(0), " rows)"));
        throw;
      }
    }
    const WindowStep window = accumulator_->step();
    stats.loss = window.loss;
    stats.items = window.items;
    stats.stepped = window.stepped;
    stats.micro_batches = window.micro_batches;
    stats.grad_norm = window.grad_norm;
  } catch (...) {
    accumulator_->discard();
    restore_buffers();
    throw;
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats.peak_bytes = scope.peak();
  return stats;
}

void Trainer::save_buffers() {
  // Every buffer, written or not: BatchNorm's kernels update the running statistics without bumping their
  // version counters. But for one whose elements share memory (an expanded view): it cannot be written in
  // place, by a forward either, and a copy would take its expanded size.
  // NOTE: on CUDA the copies into pinned memory are asynchronous: they run on the current stream before the
  // forward that updates the buffers, and a copy back runs after them.
  const auto buffers = model_->buffers();
  saved_buffers_.resize(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    const torch::Tensor& b = buffers[i];
    torch::Tensor& saved = saved_buffers_[i];
    if (at::has_internal_overlap(b) == at::MemOverlap::Yes) {
      saved = torch::Tensor();
      continue;
    }
    if (!saved.defined() || saved.sizes() != b.sizes() || saved.scalar_type() != b.scalar_type())
      saved = host_empty(b.sizes(), b.scalar_type());
    saved.copy_(b, /*non_blocking=*/true);
    detail::record_host_use(saved, b.device());
  }
}

void Trainer::restore_buffers() {
  torch::NoGradGuard no_grad;
  const auto buffers = model_->buffers();
  for (size_t i = 0; i < buffers.size() && i < saved_buffers_.size(); ++i) {
    if (!saved_buffers_[i].defined()) continue;
    torch::Tensor b = buffers[i];
    b.copy_(saved_buffers_[i], /*non_blocking=*/true);
    detail::record_host_use(saved_buffers_[i], b.device());
  }
}

namespace {

/// The version of what Trainer::save writes.
constexpr int64_t kTrainerFileVersion = 1;

/// A model's tensor read from a file, and where it goes.
struct ReadTensor {
  torch::Tensor into;
  torch::Tensor value;
  std::string name;
};

/// Reads the parameters and buffers of `module` and its children from `archive`, laid out as
/// torch::nn::Module::save writes them, into `out`, checking that each is there with its shape and dtype.
/// Changes nothing.
void read_module(const torch::nn::Module& module, torch::serialize::InputArchive& archive,
                 const std::string& prefix, std::vector<ReadTensor>& out) {
  const auto read = [&](const std::string& key, const torch::Tensor& into, bool is_buffer) {
    const std::string name = prefix + key;
    torch::Tensor value;
    TORCH_CHECK(archive.try_read(key, value, is_buffer), "Trainer::load: the file has no ",
                is_buffer ? "buffer " : "parameter ", name);
    TORCH_CHECK(value.sizes() == into.sizes() && value.scalar_type() == into.scalar_type(),
                "Trainer::load: ", name, " is ", value.scalar_type(), " ", value.sizes(), " in the file, ",
                into.scalar_type(), " ", into.sizes(), " in the model");
    out.push_back({into, value, name});
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) read(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(/*recurse=*/false)) read(b.key(), b.value(), true);
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;  // Module::save skips it too
    torch::serialize::InputArchive inner;
    TORCH_CHECK(archive.try_read(child.key(), inner), "Trainer::load: the file has no module ", prefix,
                child.key());
    read_module(*child.value(), inner, prefix + child.key() + ".", out);
  }
}

/// The state of a torch::optim::Optimizer (its groups' options and per-parameter state), put back when a
/// load fails: LibTorch's optimizers may fail half-way through theirs. The copies share the tensors, which a
/// load replaces and never writes into.
class OptimizerSnapshot {
 public:
  explicit OptimizerSnapshot(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {
    for (const auto& group : optimizer.param_groups()) options_.push_back(group.options().clone());
    for (const auto& [key, state] : optimizer.state()) state_[key] = state->clone();
  }
  void restore() {
    for (size_t g = 0; g < options_.size(); ++g)
      optimizer_.param_groups()[g].set_options(std::move(options_[g]));
    optimizer_.state() = std::move(state_);
  }

 private:
  torch::optim::Optimizer& optimizer_;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options_;
  std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())> state_;
};

/// How many parameters each group of the optimizer whose state `state` holds had: from LibTorch's
/// "param_groups", memsave's "group_<g>_size" or OffloadOptimizer's "offload/group_sizes"; one group of all
/// `count` where a file has no groups written (OffloadOptimizer's of one group, memsave's older files).
std::vector<int64_t> file_group_sizes(const std::string& type, torch::serialize::InputArchive& state,
                                      int64_t count) {
  std::vector<int64_t> sizes;
  if (type.rfind("torch::optim::", 0) == 0) {
    torch::serialize::InputArchive groups;
    state.read("param_groups", groups);
    torch::Tensor size;
    groups.read("param_groups/size", size);
    for (int64_t g = 0; g < size.item<int64_t>(); ++g) {
      torch::serialize::InputArchive group;
      groups.read("param_groups/" + std::to_string(g), group);
      torch::Tensor params;
      group.read("params/size", params);
      sizes.push_back(params.item<int64_t>());
    }
  } else if (type == "memsave::OffloadOptimizer") {
    sizes = detail::read_int_list(state, "offload/group_sizes", "Trainer::load");
  } else {
    c10::IValue groups;
    if (state.try_read("groups", groups) && groups.isInt()) {
      for (int64_t g = 0; g < groups.toInt(); ++g)
        sizes.push_back(detail::read_int(state, ("group_" + std::to_string(g) + "_size").c_str()));
    }
  }
  if (sizes.empty()) sizes.push_back(count);
  int64_t total = 0;
  for (const int64_t n : sizes) {
    TORCH_CHECK(n >= 0, "Trainer::load: the file's optimizer has a group of ", n, " parameters");
    total += n;
  }
  TORCH_CHECK(total == count, "Trainer::load: the file's optimizer holds ", total, " parameters, this model ",
              count);
  return sizes;
}

/// An optimizer of the type a Trainer's file names (with its `bits`), over `stand_ins` (CPU tensors shaped as
/// the parameters, in the file's order), to read the file's optimizer state `state` into so that it can be
/// converted; null for a type it does not know.
std::unique_ptr<torch::optim::Optimizer> file_optimizer(const std::string& type, int64_t bits,
                                                        torch::serialize::InputArchive& state,
                                                        const std::vector<torch::Tensor>& stand_ins) {
  // In the file's groups (whose options its load reads).
  std::vector<torch::optim::OptimizerParamGroup> cpu;
  size_t next = 0;
  for (const int64_t n : file_group_sizes(type, state, static_cast<int64_t>(stand_ins.size()))) {
    cpu.emplace_back(std::vector<torch::Tensor>(stand_ins.begin() + next, stand_ins.begin() + next + n));
    next += n;
  }
  // memsave's optimizers check the file's block size against their own: take it from the file.
  const auto block = [&] {
    torch::serialize::InputArchive group;
    state.read("group_0_options", group);
    return detail::read_int(group, "block_size");
  };
  if (type == "torch::optim::AdamW") return std::make_unique<torch::optim::AdamW>(cpu);
  if (type == "torch::optim::Adam") return std::make_unique<torch::optim::Adam>(cpu);
  if (type == "torch::optim::SGD")
    return std::make_unique<torch::optim::SGD>(cpu, torch::optim::SGDOptions(0).momentum(0.9));
  if (type == "memsave::optim::AdamW8bit")
    return std::make_unique<optim::AdamW8bit>(cpu, optim::AdamW8bitOptions().block_size(block()));
  if (type == "memsave::optim::Adam8bit")
    return std::make_unique<optim::Adam8bit>(cpu, optim::Adam8bitOptions().block_size(block()));
  if (type == "memsave::optim::AdamW4bit")
    return std::make_unique<optim::AdamW4bit>(cpu, optim::AdamW4bitOptions().block_size(block()));
  if (type == "memsave::optim::Adam4bit")
    return std::make_unique<optim::Adam4bit>(cpu, optim::Adam4bitOptions().block_size(block()));
  if (type == "memsave::optim::SGD8bit")
    return std::make_unique<optim::SGD8bit>(cpu, optim::SGD8bitOptions(0).block_size(block()));
  if (type == "memsave::optim::Lion8bit")
    return std::make_unique<optim::Lion8bit>(cpu, optim::Lion8bitOptions().block_size(block()));
  if (type == "memsave::optim::SGD4bit")
    return std::make_unique<optim::SGD4bit>(cpu, optim::SGD4bitOptions(0).block_size(block()));
  if (type == "memsave::OffloadOptimizer") {
    // Which parameters it offloaded follows from min_offload_size (files from before it was saved: 0).
    OffloadOptimizerOptions options = OffloadOptimizerOptions().state_bits(bits);
    torch::serialize::InputArchive saved;
    if (state.try_read("offload/options", saved)) options.serialize(saved);
    options.copy_during_backward(false).step_during_backward(false);
    // It offloads the stand-ins that require grad (and are large enough): those the file's did (files from
    // before it said which: all, when it offloaded any).
    const std::vector<int64_t> which = detail::read_int_list(state, "offload/which", "Trainer::load");
    const bool all = which.empty() && detail::read_int(state, "offload/count") > 0;
    for (size_t i = 0; i < stand_ins.size(); ++i)
      stand_ins[i].requires_grad_(all || std::find(which.begin(), which.end(), static_cast<int64_t>(i)) !=
                                             which.end());
    return std::make_unique<OffloadOptimizer>(cpu, options);
  }
  return nullptr;
}

/// The model's name of each parameter in `optimizer`'s groups, group after group, as they list them; empty
/// when one is not the model's (an optimizer built by hand over other tensors), whose file is then read in
/// order.
std::vector<std::string> parameter_names(const torch::nn::Module& model,
                                         const torch::optim::Optimizer& optimizer) {
  std::unordered_map<const c10::TensorImpl*, std::string> name;  // a tied weight: its first name
  for (const auto& p : model.named_parameters()) name.emplace(p.value().unsafeGetTensorImpl(), p.key());
  std::vector<std::string> names;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = name.find(p.unsafeGetTensorImpl());
      if (it == name.end()) return {};
      names.push_back(it->second);
    }
  }
  return names;
}

/// The names Trainer::save wrote for the file's optimizer parameters; empty for a file without them (written
/// before they were, or by a Trainer whose optimizer held tensors of no name).
std::vector<std::string> file_parameter_names(torch::serialize::InputArchive& archive) {
  c10::IValue value;
  if (!archive.try_read("optimizer_parameters", value)) return {};
  TORCH_CHECK(value.isList(), "Trainer::load: the file's optimizer_parameters is not a list of names");
  std::vector<std::string> names;
  for (const c10::IValue& v : value.toListRef()) {
    TORCH_CHECK(v.isString(), "Trainer::load: the file's optimizer_parameters is not a list of names");
    names.push_back(v.toStringRef());
  }
  return names;
}

/// Whether the file's optimizer lists the model's parameters in another order or other groups than this
/// Trainer's (another factory, say), so that its state is paired with them by name.
bool reordered(const std::vector<std::string>& file_names, const std::vector<std::string>& names) {
  return !file_names.empty() && !names.empty() && file_names != names;
}

/// Checks that the file's optimizer and this Trainer's step the same parameters.
void check_same_parameters(const std::vector<std::string>& file_names,
                           const std::vector<std::string>& names) {
  const std::unordered_set<std::string> in_file(file_names.begin(), file_names.end()),
      here(names.begin(), names.end());
  for (const std::string& name : names) {
    TORCH_CHECK(in_file.count(name) != 0, "Trainer::load: the file's optimizer has no state for parameter ",
                name, ", which this Trainer's optimizer steps");
  }
  for (const std::string& name : file_names) {
    TORCH_CHECK(here.count(name) != 0, "Trainer::load: the file's optimizer steps parameter ", name,
                ", which this Trainer's optimizer does not");
  }
}

/// Whether the Trainer file read into `archive` holds the optimizer state of another type or width than
/// `optimizer` with `bits`, which Trainer::load converts (false for a file without those fields, which
/// Trainer::load then refuses).
bool other_state(torch::serialize::InputArchive& archive, const torch::optim::Optimizer& optimizer,
                 int64_t bits) {
  c10::IValue type, file_bits;
  if (!archive.try_read("optimizer_type", type) || !type.isString() ||
      !archive.try_read("state_bits", file_bits) || !file_bits.isInt())
    return false;
  return type.toStringRef() != type_name(optimizer) || file_bits.toInt() != bits;
}

/// Whether Trainer::load converts the file's optimizer state (read into an optimizer of the file's type, then
/// copied): another type or width, or its parameters in another order.
bool converts(torch::serialize::InputArchive& archive, const torch::nn::Module& model,
              const torch::optim::Optimizer& optimizer, int64_t bits) {
  return other_state(archive, optimizer, bits) ||
         reordered(file_parameter_names(archive), parameter_names(model, optimizer));
}

}  // namespace

void Trainer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("memsave_trainer", kTrainerFileVersion);
  archive.write("state_bits", recipe_.state_bits());
  archive.write("grad_scaling", scaler_.has_value());
  archive.write("optimizer_type", type_name(*optimizer_));
  const std::vector<std::string> names = parameter_names(*model_, *optimizer_);
  if (!names.empty()) archive.write("optimizer_parameters", c10::IValue(c10::List<std::string>(names)));
  torch::serialize::OutputArchive model(archive.compilation_unit());
  model_->save(model);
  archive.write("model", model);
  torch::serialize::OutputArchive optimizer(archive.compilation_unit());
  optimizer_->save(optimizer);
  archive.write("optimizer", optimizer);
  if (scaler_) {
    torch::serialize::OutputArchive scaler(archive.compilation_unit());
    scaler_->serialize(scaler);
    archive.write("scaler", scaler);
  }
}

void Trainer::save(const std::string& path) const {
  torch::serialize::OutputArchive archive;
  save(archive);
  const std::string partial = path + ".partial";
  try {
    archive.save_to(partial);
  } catch (const c10::Error& e) {
    std::remove(partial.c_str());
    TORCH_CHECK(false, "Trainer::save: cannot write ", partial, ": ", e.msg());
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0) {
    std::remove(partial.c_str());
    TORCH_CHECK(false, "Trainer::save: cannot rename ", partial, " to ", path);
  }
}

void Trainer::load(torch::serialize::InputArchive& archive) {
  // Everything is read and checked before anything changes; the optimizer's own load (or the copy of a
  // converted state) is the last thing that can fail, and a failed one is undone.
  c10::IValue version;
  TORCH_CHECK(archive.try_read("memsave_trainer", version) && version.isInt(),
              "Trainer::load: the file is not one that Trainer::save wrote");
  TORCH_CHECK(version.toInt() == kTrainerFileVersion, "Trainer::load: file version ", version.toInt(),
              ", this build reads version ", kTrainerFileVersion);
  const int64_t bits = detail::read_int(archive, "state_bits");
  const bool scaled = detail::read_bool(archive, "grad_scaling");
  c10::IValue type_value;
  archive.read("optimizer_type", type_value);
  TORCH_CHECK(type_value.isString(), "Trainer::load: the file names no optimizer type");
  const std::string type = type_value.toStringRef();

  torch::serialize::InputArchive model;
  TORCH_CHECK(archive.try_read("model", model), "Trainer::load: the file has no model");
  std::vector<ReadTensor> tensors;
  read_module(*model_, model, "", tensors);
  // The optimizer's state: converted when it is another's (type, bits) or lists the parameters otherwise.
  const std::vector<std::string> file_names = file_parameter_names(archive);
  const std::vector<std::string> names = parameter_names(*model_, *optimizer_);
  const bool regrouped = reordered(file_names, names);
  if (regrouped) check_same_parameters(file_names, names);
  const bool convert = regrouped || other_state(archive, *optimizer_, recipe_.state_bits());
  // The scaler continues from the file's; a file saved without one starts this Trainer's afresh.
  std::optional<amp::GradScaler> scaler;
  if (scaler_ && scaled) {
    scaler = scaler_;
    torch::serialize::InputArchive inner;
    TORCH_CHECK(archive.try_read("scaler", inner), "Trainer::load: the file has no GradScaler state");
    scaler->serialize(inner);
  } else if (scaler_) {
    scaler.emplace();  // as the constructor makes it
  }
  torch::serialize::InputArchive optimizer;
  TORCH_CHECK(archive.try_read("optimizer", optimizer), "Trainer::load: the file has no optimizer state");
  auto* offload = dynamic_cast<OffloadOptimizer*>(optimizer_.get());
  if (convert) {
    // Another format of state (bits, offload), or the parameters in other groups: read into an optimizer of
    // the file's type, then converted. copy_state changes nothing unless it succeeds.
    std::unique_ptr<torch::optim::Optimizer> file;
    // A CPU stand-in of each parameter, listed in the file's order: by the names the file gives, or else
    // this optimizer's, group after group.
    std::vector<torch::Tensor> params;
    for (const auto& group : optimizer_->param_groups())
      params.insert(params.end(), group.params().begin(), group.params().end());
    std::unordered_map<const c10::TensorImpl*, torch::Tensor> stand_in;
    std::vector<torch::Tensor> stand_ins;
    {
      std::vector<torch::Tensor> in_file_order = params;
      if (regrouped) {
        std::unordered_map<std::string, torch::Tensor> named;
        for (size_t i = 0; i < names.size(); ++i) named.emplace(names[i], params[i]);
        in_file_order.clear();
        for (const std::string& name : file_names) in_file_order.push_back(named.at(name));
      }
      for (const torch::Tensor& p : in_file_order) {
        auto [it, fresh] = stand_in.try_emplace(p.unsafeGetTensorImpl());
        if (fresh) it->second = torch::empty(p.sizes(), torch::kFloat);
        stand_ins.push_back(it->second);
      }
    }
    optim::detail::SourceOf source_of;
    for (const auto& [param, t] : stand_in) source_of.emplace(param, t.unsafeGetTensorImpl());
    try {
      file = file_optimizer(type, bits, optimizer, stand_ins);
      if (file != nullptr) {
        file->load(optimizer);
        optim::detail::copy_state(*file, *optimizer_, &source_of);
      }
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "Trainer::load: the file's ", type, " state (", bits, "-bit) does not convert to ",
                  type_name(*optimizer_), " (", recipe_.state_bits(), "-bit): ", e.msg());
    }
    TORCH_CHECK(file != nullptr, "Trainer::load: the file holds the state of ", type,
                ", which cannot be converted to this Trainer's ", type_name(*optimizer_));
    // The learning rates go on from the file's, for each group that the file's optimizer had too (the same
    // parameters); the other hyper-parameters stay this Trainer's.
    const auto members = [](const std::vector<torch::Tensor>& ps, const auto& map) {
      std::set<const c10::TensorImpl*> out;
      for (const auto& p : ps) out.insert(map(p));
      return out;
    };
    for (auto& group : optimizer_->param_groups()) {
      const auto mine = members(group.params(), [&](const torch::Tensor& p) {
        return stand_in.at(p.unsafeGetTensorImpl()).unsafeGetTensorImpl();
      });
      for (const auto& saved : file->param_groups()) {
        if (members(saved.params(), [](const torch::Tensor& p) { return p.unsafeGetTensorImpl(); }) == mine)
          group.options().set_lr(saved.options().get_lr());
      }
    }
  } else {
    OptimizerSnapshot snapshot(*optimizer_);
    try {
      // NOTE: LibTorch's optimizers keep the state of a parameter that the file has none for; after the load
      // the state is the file's alone.
      optimizer_->state().clear();
      optimizer_->load(optimizer);
    } catch (...) {
      snapshot.restore();
      throw;
    }
  }

  // Commit (copies into tensors of the same shapes: nothing here fails). An offloaded parameter already holds
  // its master weight, which the optimizer's load copied back; after a conversion the masters are the
  // model's.
  torch::NoGradGuard no_grad;
  for (const ReadTensor& t : tensors) {
    if (offload == nullptr || convert || !offload->offloaded(t.into)) t.into.copy_(t.value);
  }
  if (offload != nullptr && convert) offload->refresh_masters();
  if (scaler) *scaler_ = std::move(*scaler);
}

void Trainer::load(const std::string& path) {
  // Tensors go to the model's device, but for an offloading optimizer's, which stay where they were saved:
  // its state in host memory, the small tensors' on the device (a model's host state may not fit its device).
  const bool offloads = recipe_.offload() == Offload::kOptimizerState;
  const std::optional<torch::Device> as_saved =
      offloads ? std::nullopt : std::optional<torch::Device>(device_);
  auto read = [&](std::optional<torch::Device> device) {
    torch::serialize::InputArchive archive;
    try {
      archive.load_from(path, device);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "Trainer::load: cannot read ", path, ": ", e.msg());
    }
    return archive;
  };
  if (device_.is_cpu()) {
    torch::serialize::InputArchive archive = read(as_saved);
    load(archive);
    return;
  }
  // On an accelerator the file is read into host memory first: a state that this Trainer converts (the
  // recipe the rescue recommended after an out-of-memory, say) then reaches the device only converted, never
  // as saved beside the model. A state it keeps as it is is read again, onto the device.
  torch::serialize::InputArchive archive = read(torch::Device(torch::kCPU));
  if (!converts(archive, *model_, *optimizer_, recipe_.state_bits())) archive = read(as_saved);
  load(archive);
}

torch::Tensor Trainer::predict(const torch::Tensor& input) {
  return predict(std::vector<torch::Tensor>{input});
}

torch::Tensor Trainer::predict(const std::vector<torch::Tensor>& inputs) {
  check_inputs(inputs, "Trainer::predict");
  // Each module's mode is put back as it was, also when the forward throws.
  struct EvalModes {
    std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> was;
    explicit EvalModes(torch::nn::Module& root) {
      for (const auto& m : root.modules()) was.emplace_back(m, m->is_training());
      root.eval();
    }
    ~EvalModes() {
      // In pre-order (modules()' order): a module's train(bool) also sets its submodules, set after it.
      for (const auto& [m, training] : was) m->train(training);
    }
  } modes(*module_);
  torch::NoGradGuard no_grad;
  return forward(inputs);
}

}  // namespace memsave
