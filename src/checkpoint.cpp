#include "memsave/checkpoint.h"

#include "autograd_graph.h"
#include "compat.h"
#include "memory_internal.h"
#include "memsave/memory.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/custom_class.h>
#include <torch/nn/modules.h>

#include <algorithm>
#include <iterator>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <unordered_set>
#include <utility>

namespace memsave {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// The autocast state of one device type, as the forward saw it.
struct AutocastState {
  c10::DeviceType device;
  bool enabled;
  c10::ScalarType dtype;

  static AutocastState of(c10::DeviceType device) {
    return {device, compat::autocast_enabled(device), compat::autocast_dtype(device)};
  }
  void apply() const {
    compat::set_autocast_enabled(device, enabled);
    compat::set_autocast_dtype(device, dtype);
  }
};

/// Replays the forward's autocast state for its lifetime (CPU and CUDA), with the same cache rule as the
/// Autocast guard: the outermost level clears the cache of casted weights when it ends.
class ReplayAutocast {
 public:
  explicit ReplayAutocast(const std::vector<AutocastState>& forward) {
    for (const AutocastState& state : forward) {
      previous_.push_back(AutocastState::of(state.device));
      state.apply();
    }
    at::autocast::increment_nesting();
  }
  ~ReplayAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    for (const AutocastState& state : previous_) state.apply();
  }
  ReplayAutocast(const ReplayAutocast&) = delete;
  ReplayAutocast& operator=(const ReplayAutocast&) = delete;

 private:
  std::vector<AutocastState> previous_;
};

/// Turns autocast's cache of cast weights off for its lifetime (the flag is per thread), then puts the flag
/// back. A checkpointed piece's graph holds the casts it needs while the piece runs; the cache would hold
/// them until the outermost autocast ends: through the rest of the forward, beside the later pieces (and, for
/// a backward run inside autocast, through the rest of the backward), 2 bytes per cast fp32 weight under bf16
/// or fp16. Without it a weight used twice inside one piece is cast twice.
class NoCastCache {
 public:
  NoCastCache() : previous_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~NoCastCache() { at::autocast::set_autocast_cache_enabled(previous_); }
  NoCastCache(const NoCastCache&) = delete;
  NoCastCache& operator=(const NoCastCache&) = delete;

 private:
  bool previous_;
};

/// The state of the default generators of some devices (the CPU's and the CUDA devices').
struct RngState {
  std::vector<std::pair<at::Generator, at::Tensor>> states;

  static RngState capture(const std::vector<c10::Device>& cuda_devices) {
    RngState saved;
    saved.add(at::detail::getDefaultCPUGenerator());
    for (const c10::Device& device : cuda_devices) saved.add(at::globalContext().defaultGenerator(device));
    return saved;
  }
  void restore() const {
    for (auto [generator, state] : states) {  // a Generator is a handle: the copy is the same generator
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    }
  }

 private:
  void add(at::Generator generator) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.emplace_back(generator, generator.get_state());
  }
};

/// Sets the generators to the forward's state for its lifetime and then puts back what they had.
class ReplayRng {
 public:
  ReplayRng(const RngState* forward, const std::vector<c10::Device>& cuda_devices) {
    if (forward == nullptr) return;
    current_ = RngState::capture(cuda_devices);
    forward->restore();
  }
  ~ReplayRng() { current_.restore(); }
  ReplayRng(const ReplayRng&) = delete;
  ReplayRng& operator=(const ReplayRng&) = delete;

 private:
  RngState current_;
};

/// Puts buffers back to their values at construction when it ends: a recomputation must not update BatchNorm
/// running statistics a second time.
class RestoreBuffers {
 public:
  explicit RestoreBuffers(const std::vector<at::Tensor>& buffers) : buffers_(buffers) {
    torch::NoGradGuard no_grad;
    for (const at::Tensor& buffer : buffers_) saved_.push_back(buffer.clone());
  }
  ~RestoreBuffers() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(saved_[i]);
  }
  RestoreBuffers(const RestoreBuffers&) = delete;
  RestoreBuffers& operator=(const RestoreBuffers&) = delete;

 private:
  const std::vector<at::Tensor>& buffers_;
  std::vector<at::Tensor> saved_;
};

struct TensorMeta {
  std::vector<int64_t> sizes;
  c10::ScalarType dtype;
  c10::Device device;
};

/// Everything the backward needs to recompute the forward, shared by the autograd node.
struct Recompute : torch::CustomClassHolder {
  CheckpointFunction fn;
  CheckpointOptions options;
  size_t num_inputs = 0;
  std::vector<bool> input_requires_grad;
  std::vector<at::Tensor> parameters;
  std::vector<at::Tensor> buffers;
  std::vector<c10::Device> cuda_devices;
  std::vector<AutocastState> autocast;
  std::optional<RngState> rng;
  std::vector<TensorMeta> outputs;
  /// What the forward computed, handed to the autograd node.
  std::vector<at::Tensor> forward_outputs;
  /// The inputs in host memory, with the devices they came from (offload_inputs).
  std::vector<at::Tensor> host_inputs;
  std::vector<c10::Device> input_devices;
};

std::vector<at::Tensor> run(const CheckpointFunction& fn, at::TensorList inputs) {
  std::vector<at::Tensor> outputs = fn(inputs);
  TORCH_CHECK(!outputs.empty(), "checkpoint: the function returned no tensor");
  for (size_t i = 0; i < outputs.size(); ++i)
    TORCH_CHECK(outputs[i].defined(), "checkpoint: output ", i, " of the function is an undefined tensor");
  return outputs;
}

void check_recompute(const Recompute& r, const std::vector<at::Tensor>& outputs) {
  TORCH_CHECK(outputs.size() == r.outputs.size(), "checkpoint: the recomputation returned ", outputs.size(),
              " tensors but the forward returned ", r.outputs.size(),
              " (the function must compute the same thing twice)");
  for (size_t i = 0; i < outputs.size(); ++i) {
    const TensorMeta& forward = r.outputs[i];
    TORCH_CHECK(outputs[i].sizes().vec() == forward.sizes && outputs[i].scalar_type() == forward.dtype &&
                    outputs[i].device() == forward.device,
                "checkpoint: output ", i, " of the recomputation is ", outputs[i].scalar_type(), " ",
                outputs[i].sizes(), " on ", outputs[i].device(), " but the forward gave ", forward.dtype, " ",
                c10::IntArrayRef(forward.sizes), " on ", forward.device,
                " (the function must compute the same thing twice)");
  }
}

/// The leaves that require grad in a piece's graph, other than `inputs`: the parameters the function used,
/// each once, whether or not the module that registers them is known. A graph node made before the piece (a
/// tensor computed outside the function and captured by it) is an error: its gradient would be lost, and the
/// recomputation would differentiate through the caller's graph.
std::vector<at::Tensor> leaves_behind(const detail::GraphSince& graph,
                                      const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(graph.outside == nullptr, "checkpoint: the function uses a tensor that requires grad and ",
              "was computed outside it (by ", graph.outside ? graph.outside->name() : std::string(),
              "); its gradient would be lost. Pass it as one of the inputs");
  std::unordered_set<const c10::TensorImpl*> known;
  for (const at::Tensor& t : inputs) known.insert(t.unsafeGetTensorImpl());
  std::vector<at::Tensor> leaves;
  for (const at::Tensor& leaf : graph.leaves)
    if (!known.count(leaf.unsafeGetTensorImpl())) leaves.push_back(leaf);
  return leaves;
}

/// Whether the backward running now adds the piece's parameter gradients to `.grad` (a `backward()` without
/// `inputs`, which runs every gradient accumulator it reaches) and receives each of them from this piece
/// alone: then the recomputation may add them as they arrive, as the backward without checkpointing does,
/// instead of handing them back together at the end of the piece (which holds a piece's parameter gradients
/// at once while earlier gradients accumulate). A parameter's accumulator is referenced by one edge of every
/// graph node that uses the parameter, alive until that backward ends: counting those of the recomputed graph
/// (`graph`), the piece's own edge and the references memsave holds (detail::HeldNode) must give all of them.
/// Any other use (a weight shared with another piece, or outside any) keeps the gradients handed back, so
/// that they are summed in the order the backward without checkpointing sums them.
bool accumulates_here(const std::vector<at::Tensor>& parameters, const detail::GraphSince& graph) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (parameters.empty() || exec_info == nullptr || !exec_info->empty()) return false;
  for (const at::Tensor& p : parameters) {
    const compat::NodeRef accumulator = torch::autograd::impl::try_get_grad_accumulator(p);
    // NOTE: the outer backward still runs the accumulator, with no gradient: a hook on the parameter, or on
    // the accumulator, would run a second time (DistributedDataParallel's would count the gradient twice).
    if (!accumulator || !accumulator->pre_hooks().empty() || !accumulator->tensor_pre_hooks().empty())
      return false;
    for (const auto& hook : accumulator->post_hooks())
      if (!dynamic_cast<const detail::ToleratesNoGradient*>(hook.get())) return false;
    const auto it = graph.edges_into.find(accumulator.get());
    const int64_t explained = 1 + 1 + (it == graph.edges_into.end() ? 0 : it->second) +
                              detail::times_held(accumulator.get());  // this, the piece
    if (static_cast<int64_t>(accumulator.use_count()) != explained) return false;
  }
  return true;
}

/// Takes the hooks registered on the parameters off them (their accumulators' tensor pre-hooks) while it
/// lives: torch::autograd::grad runs them on the gradients it captures, and the outer backward runs them
/// again on the gradients handed back to it. Puts them back before any registered meanwhile.
class ParameterHooksAside {
 public:
  explicit ParameterHooksAside(const std::vector<at::Tensor>& parameters) {
    for (const at::Tensor& p : parameters) {
      compat::NodeRef accumulator = torch::autograd::impl::try_get_grad_accumulator(p);
      if (!accumulator || accumulator->tensor_pre_hooks().empty()) continue;
      Hooks hooks = std::move(accumulator->tensor_pre_hooks());
      accumulator->tensor_pre_hooks().clear();
      aside_.emplace_back(std::move(accumulator), std::move(hooks));
    }
  }
  ~ParameterHooksAside() {
    for (auto& [accumulator, hooks] : aside_) {
      Hooks& now = accumulator->tensor_pre_hooks();
      hooks.insert(hooks.end(), std::make_move_iterator(now.begin()), std::make_move_iterator(now.end()));
      now = std::move(hooks);
    }
  }
  ParameterHooksAside(const ParameterHooksAside&) = delete;
  ParameterHooksAside& operator=(const ParameterHooksAside&) = delete;

 private:
  using Hooks = std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>>;
  std::vector<std::pair<compat::NodeRef, Hooks>> aside_;
};

/// A pre-hook on a node that a recomputation's backward starts from: once that node has received its
/// gradients, lets go of the references the caller kept to hand them to the engine.
class ReleaseSeeds : public torch::autograd::FunctionPreHook {
 public:
  explicit ReleaseSeeds(std::shared_ptr<std::vector<at::Tensor>> seeds) : seeds_(std::move(seeds)) {}
  variable_list operator()(const variable_list& inputs) override {
    for (at::Tensor& seed : *seeds_) seed.reset();
    return inputs;
  }

 private:
  std::shared_ptr<std::vector<at::Tensor>> seeds_;
};

class CheckpointNode : public torch::autograd::Function<CheckpointNode> {
 public:
  /// Returns the outputs the caller computed (`r->forward_outputs`, without their graph) and saves what the
  /// recomputation needs.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Recompute> r,
                               at::TensorList tensors) {
    const at::TensorList inputs = tensors.slice(0, r->num_inputs);
    std::vector<at::Tensor> outputs = std::move(r->forward_outputs);
    for (const at::Tensor& out : outputs) {
      r->outputs.push_back({out.sizes().vec(), out.scalar_type(), out.device()});
      if (!at::isFloatingType(out.scalar_type()) && !at::isComplexType(out.scalar_type()))
        ctx->mark_non_differentiable({out});
    }
    if (r->options.offload_inputs()) {
      for (const at::Tensor& x : inputs) {
        at::Tensor host = detail::host_empty_like(x, x.scalar_type());
        host.copy_(x, /*non_blocking=*/x.is_cuda());
        detail::record_host_use(host, x.device());
        r->host_inputs.push_back(std::move(host));
        r->input_devices.push_back(x.device());
      }
    } else {
      ctx->save_for_backward(inputs.vec());
    }
    ctx->set_materialize_grads(false);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(std::move(r));
    return outputs;
  }

  /// NOTE: `grad_outputs` by reference: LibTorch passes the vector it holds through this call, and the seeds
  /// are moved out of it so that they can go before the call ends.
  static variable_list backward(AutogradContext* ctx, variable_list& grad_outputs) {
    const auto r = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const bool create_graph = at::GradMode::is_enabled();

    std::vector<at::Tensor> inputs;
    if (r->options.offload_inputs()) {
      for (size_t i = 0; i < r->host_inputs.size(); ++i) {
        inputs.push_back(r->host_inputs[i].to(r->input_devices[i], /*non_blocking=*/true));
        detail::record_host_use(r->host_inputs[i], r->input_devices[i]);
      }
    } else {
      inputs = ctx->get_saved_variables();
    }
    // Under create_graph the gradients must stay differentiable in the inputs (a double backward, a gradient
    // penalty): the recomputation then runs on views of the inputs that require grad, through which its graph
    // joins the caller's, and the walk of its graph stops there. Otherwise it runs on detached inputs.
    std::unordered_set<const torch::autograd::Node*> joins;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (create_graph && r->input_requires_grad[i]) {
        TORCH_CHECK(
            !r->options.offload_inputs(), "checkpoint: a backward with create_graph through a piece ",
            "whose inputs were offloaded (offload_inputs) would lose the gradients' dependence on input ", i,
            "; checkpoint it with offload_inputs off");
        inputs[i] = inputs[i].view_as(inputs[i]);
        joins.insert(inputs[i].grad_fn().get());
      } else {
        inputs[i] = inputs[i].detach().requires_grad_(r->input_requires_grad[i]);
      }
    }

    // NOTE: the buffers are put back only after the gradients are computed: BatchNorm's backward checks the
    // version of the running statistics it saved.
    RestoreBuffers buffers(r->buffers);
    std::vector<at::Tensor> outputs;
    const uint64_t first_node = at::sequence_number::peek();
    {
      torch::AutoGradMode grad_mode(true);
      ReplayRng rng(r->rng ? &*r->rng : nullptr, r->cuda_devices);
      ReplayAutocast autocast(r->autocast);
      NoCastCache no_cache;
      outputs = run(r->fn, inputs);
    }
    if (r->options.check_recompute()) check_recompute(*r, outputs);

    std::vector<at::Tensor> differentiated, seeds;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (grad_outputs[i].defined() && outputs[i].requires_grad()) {
        differentiated.push_back(outputs[i]);
        seeds.push_back(std::move(grad_outputs[i]));
      }
    }
    std::vector<at::Tensor> targets;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (r->input_requires_grad[i]) targets.push_back(inputs[i]);
    const detail::GraphSince graph = detail::graph_since(outputs, first_node, joins);
    const std::vector<at::Tensor> extra = leaves_behind(graph, inputs);
    std::unordered_set<const c10::TensorImpl*> parameters;
    for (const at::Tensor& p : r->parameters) parameters.insert(p.unsafeGetTensorImpl());
    for (const at::Tensor& leaf : extra)
      TORCH_CHECK(parameters.count(leaf.unsafeGetTensorImpl()),
                  "checkpoint: the recomputation uses a tensor of ", "shape ", leaf.sizes(),
                  " that requires grad but the forward did not use (the function must ",
                  "compute the same thing twice)");
    targets.insert(targets.end(), r->parameters.begin(), r->parameters.end());
    const bool accumulate =
        !create_graph && !differentiated.empty() && accumulates_here(r->parameters, graph);

    // The recomputed backward starts from the outputs' gradient edges. The outputs and their gradients (the
    // seeds) then go as the backward lets go of them, as without checkpointing, instead of staying to the end
    // of the piece: the outputs now (the graph keeps what it saved of them), the seeds once the nodes the
    // backward starts from have received them.
    torch::autograd::edge_list roots;
    for (const at::Tensor& out : differentiated) roots.push_back(torch::autograd::impl::gradient_edge(out));
    outputs.clear();
    differentiated.clear();
    const auto handed = std::make_shared<std::vector<at::Tensor>>(std::move(seeds));
    for (const torch::autograd::Edge& root : roots)
      if (!dynamic_cast<const torch::autograd::AccumulateGrad*>(root.function.get()) &&
          root.function->sequence_nr() >= first_node)  // a node of the recomputation
        root.function->add_pre_hook(std::make_unique<ReleaseSeeds>(handed));
    torch::autograd::Engine& engine = torch::autograd::Engine::get_default_engine();

    // One gradient per forward argument: none for the Recompute, then the inputs, then the parameters.
    variable_list result{at::Tensor()};
    if (accumulate) {
      // The recomputed graph's leaves are the inputs that require grad and the parameters (leaves_behind
      // checked it): its backward adds the parameters' gradients to .grad and leaves the inputs' in theirs.
      engine.execute(roots, *handed, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true);
      for (at::Tensor& x : inputs) result.push_back(std::exchange(x.mutable_grad(), at::Tensor()));
      result.resize(1 + inputs.size() + r->parameters.size());  // none: they are in .grad
      return result;
    }
    // The gradients of the targets the recomputed graph reaches (torch::autograd::grad with allow_unused).
    std::vector<at::Tensor> grads(targets.size());
    torch::autograd::edge_list wanted;
    std::vector<size_t> reached;
    for (size_t i = 0; i < targets.size(); ++i) {
      if (targets[i].grad_fn()) {  // an input's view (create_graph)
        wanted.push_back(torch::autograd::impl::gradient_edge(targets[i]));
        reached.push_back(i);
      } else if (compat::NodeRef accumulator = torch::autograd::impl::try_get_grad_accumulator(targets[i])) {
        wanted.emplace_back(std::move(accumulator), 0);
        reached.push_back(i);
      }
    }
    if (!roots.empty() && !wanted.empty()) {
      const ParameterHooksAside aside(r->parameters);
      variable_list captured = engine.execute(roots, *handed, /*keep_graph=*/create_graph, create_graph,
                                              /*accumulate_grad=*/false, wanted);
      for (size_t k = 0; k < reached.size(); ++k) grads[reached[k]] = std::move(captured[k]);
    }
    size_t next = 0;
    for (size_t i = 0; i < inputs.size(); ++i)
      result.push_back(r->input_requires_grad[i] ? std::move(grads[next++]) : at::Tensor());
    // Moved, not copied: AccumulateGrad can then take a gradient as .grad without copying it.
    for (size_t i = 0; i < r->parameters.size(); ++i) result.push_back(std::move(grads[next++]));
    return result;
  }
};

void add_device(std::vector<c10::Device>& cuda_devices, const at::Tensor& t) {
  if (t.is_cuda() && std::find(cuda_devices.begin(), cuda_devices.end(), t.device()) == cuda_devices.end())
    cuda_devices.push_back(t.device());
}

/// Runs `fn` once with its graph to learn which parameters it uses (they become inputs of the autograd node,
/// so their gradients flow through it), keeps the values and drops the graph. The graph of one piece lives
/// only while that piece runs: no longer than the recomputation will hold it in backward.
std::vector<at::Tensor> checkpoint_impl(const std::vector<at::Tensor>& owner_parameters,
                                        std::vector<at::Tensor> buffers, const CheckpointFunction& fn,
                                        at::TensorList inputs, const CheckpointOptions& options) {
  TORCH_CHECK(fn, "checkpoint: fn is empty");
  for (size_t i = 0; i < inputs.size(); ++i)
    TORCH_CHECK(inputs[i].defined(), "checkpoint: input ", i, " is an undefined tensor");
  if (!owner_parameters.empty()) {
    const c10::Device device = owner_parameters.front().device();
    for (size_t i = 0; i < inputs.size(); ++i)
      TORCH_CHECK(inputs[i].device() == device, "checkpoint: input ", i, " is on ", inputs[i].device(),
                  " but the module's parameters are on ", device);
  }
  // Without grad mode nothing will be differentiated: no graph to save, nothing to recompute.
  if (!at::GradMode::is_enabled()) return run(fn, inputs);

  auto r = c10::make_intrusive<Recompute>();
  r->fn = fn;
  r->options = options;
  r->num_inputs = inputs.size();
  r->buffers = std::move(buffers);
  std::vector<at::Tensor> leaves;
  std::vector<int64_t> versions;  // an input the function modifies would be recomputed from its new value
  for (const at::Tensor& x : inputs) {
    versions.push_back(x.is_inference() ? 0 : x._version());  // an inference tensor has no version
    r->input_requires_grad.push_back(x.requires_grad());
    leaves.push_back(x.detach().requires_grad_(x.requires_grad()));
    add_device(r->cuda_devices, x);
  }
  for (const at::Tensor& p : owner_parameters) add_device(r->cuda_devices, p);
  if (options.preserve_rng_state()) r->rng = RngState::capture(r->cuda_devices);
  r->autocast = {AutocastState::of(c10::kCPU), AutocastState::of(c10::kCUDA)};

  const uint64_t first_node = at::sequence_number::peek();
  std::vector<at::Tensor> outputs;
  try {
    NoCastCache no_cache;
    outputs = run(fn, leaves);
  } catch (c10::Error& e) {
    // The function's inputs are leaves here: LibTorch's own error for an in-place operation on one of them
    // (a ReLU(inplace) at the start of a piece) does not say where the leaf came from.
    if (std::string(e.what()).find("leaf Variable that requires grad is being used in an in-place") !=
        std::string::npos)
      e.add_context(
          "checkpoint: inside a checkpointed piece its inputs are leaves. If the operation modifies an input "
          "in place (a ReLU(inplace) at the start of the piece), make it out of place or start the piece "
          "after it: the recomputation would start from the modified value");
    throw;
  }
  r->parameters = leaves_behind(detail::graph_since(outputs, first_node), leaves);
  for (const at::Tensor& p : r->parameters)
    TORCH_CHECK(
        !r->rng || !p.is_cuda() ||
            std::find(r->cuda_devices.begin(), r->cuda_devices.end(), p.device()) != r->cuda_devices.end(),
        "checkpoint: the function uses a parameter on ", p.device(),
        " but none of its inputs is there; pass the module as owner so its generator state is saved");
  const bool needs_grad =
      !r->parameters.empty() ||
      std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& x) { return x.requires_grad(); });
  if (!needs_grad) return outputs;
  for (size_t i = 0; i < inputs.size(); ++i)
    TORCH_CHECK(inputs[i].is_inference() || inputs[i]._version() == versions[i],
                "checkpoint: the function modified input ", i, " (shape ", inputs[i].sizes(),
                ") in place; the recomputation would start from the modified value and ",
                "give other gradients. Make that operation out of place, or start the piece after it");
  for (at::Tensor& out : outputs) out = out.detach();  // drops the graph: only the values are kept
  r->forward_outputs = std::move(outputs);

  std::vector<at::Tensor> tensors(inputs.begin(), inputs.end());
  tensors.insert(tensors.end(), r->parameters.begin(), r->parameters.end());
  return CheckpointNode::apply(std::move(r), at::TensorList(tensors));
}

}  // namespace

std::vector<at::Tensor> checkpoint(const torch::nn::Module& owner, const CheckpointFunction& fn,
                                   at::TensorList inputs, const CheckpointOptions& options) {
  return checkpoint_impl(owner.parameters(), owner.buffers(), fn, inputs, options);
}

std::vector<at::Tensor> checkpoint(const CheckpointFunction& fn, at::TensorList inputs,
                                   const CheckpointOptions& options) {
  return checkpoint_impl({}, {}, fn, inputs, options);
}

namespace nn {

torch::Tensor CheckpointImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(forward_,
              "Checkpoint: the wrapped module's forward does not take one tensor; call "
              "Checkpoint::run with a function that calls it");
  if (!is_training() || !enabled_) return forward_(input);
  auto fn = [this](at::TensorList x) { return std::vector<at::Tensor>{forward_(x[0])}; };
  return checkpoint(*this, fn, {input}, options_)[0];
}

std::vector<torch::Tensor> CheckpointImpl::run(const CheckpointFunction& fn, at::TensorList inputs) {
  TORCH_CHECK(fn, "Checkpoint::run: the function is empty");
  if (!is_training() || !enabled_) return fn(inputs);
  return checkpoint(*this, fn, inputs, options_);
}

void CheckpointImpl::pretty_print(std::ostream& stream) const { stream << "memsave::nn::Checkpoint"; }

std::vector<std::shared_ptr<CheckpointImpl>> checkpoint_blocks(
    const std::shared_ptr<torch::nn::Module>& module) {
  TORCH_CHECK(module != nullptr, "checkpoint_blocks: module is null");
  std::vector<std::shared_ptr<CheckpointImpl>> blocks;
  for (const auto& m : module->modules())
    if (auto block = std::dynamic_pointer_cast<CheckpointImpl>(m)) blocks.push_back(std::move(block));
  return blocks;
}

CheckpointSequentialImpl::CheckpointSequentialImpl(torch::nn::Sequential sequential,
                                                   std::vector<Segment> segments, CheckpointOptions options)
    : sequential_(std::move(sequential)), segments_(std::move(segments)), options_(options) {
  TORCH_CHECK(!sequential_.is_empty() && sequential_->size() > 0,
              "checkpoint_sequential: sequential is empty");
  size_t next = 0;
  for (const Segment& s : segments_) {
    TORCH_CHECK(s.begin == next && s.end > s.begin && s.end <= sequential_->size(),
                "CheckpointSequential: segment [", s.begin, ", ", s.end, ") does not continue at ", next,
                " inside the ", sequential_->size(), " elements");
    next = s.end;
  }
  TORCH_CHECK(next == sequential_->size(), "CheckpointSequential: the segments cover ", next, " of ",
              sequential_->size(), " elements");
  const std::vector<bool> may_begin = piece_may_begin(sequential_);
  for (const Segment& s : segments_)
    TORCH_CHECK(!s.recompute || may_begin[s.begin], "CheckpointSequential: the recomputed segment [", s.begin,
                ", ", s.end, ") begins at element ", s.begin, " (", sequential_->ptr(s.begin)->name(),
                "), which modifies its input in place (or hands it on to one that does): the recomputation "
                "would start from the modified input. Begin the segment after it");
  register_module("sequential", sequential_);
}

torch::Tensor CheckpointSequentialImpl::forward(torch::Tensor x) {
  const bool checkpointing = is_training() && at::GradMode::is_enabled();
  const std::vector<at::Tensor> parameters = checkpointing ? this->parameters() : std::vector<at::Tensor>{};
  for (const Segment& s : segments_) {
    auto run_segment = [this, s](at::TensorList in) {
      at::Tensor y = in[0];
      for (size_t i = s.begin; i < s.end; ++i) y = sequential_->begin()[i].forward(y);
      return std::vector<at::Tensor>{y};
    };
    if (!checkpointing || !s.recompute) {
      x = run_segment({x})[0];
      continue;
    }
    std::vector<at::Tensor> buffers;
    for (size_t i = s.begin; i < s.end; ++i) {
      const auto own = sequential_->ptr(i)->buffers();
      buffers.insert(buffers.end(), own.begin(), own.end());
    }
    x = checkpoint_impl(parameters, std::move(buffers), run_segment, {x}, options_)[0];
  }
  return x;
}

void CheckpointSequentialImpl::pretty_print(std::ostream& stream) const {
  stream << "memsave::nn::CheckpointSequential(";
  for (size_t i = 0; i < segments_.size(); ++i)
    stream << (i ? ", " : "") << (segments_[i].recompute ? "recompute [" : "keep [") << segments_[i].begin
           << ", " << segments_[i].end << ")";
  stream << ")";
}

namespace {

/// Whether `layer` modifies its input in place: LibTorch's modules with an `inplace` option set.
bool works_in_place(const torch::nn::Module& layer) {
  namespace tnn = torch::nn;
  if (const auto* m = layer.as<tnn::ReLU>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::ReLU6>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::LeakyReLU>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::ELU>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::SELU>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::CELU>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::RReLU>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::Hardtanh>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::Threshold>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::Dropout>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::Dropout2d>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::Dropout3d>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::AlphaDropout>()) return m->options.inplace();
  if (const auto* m = layer.as<tnn::FeatureAlphaDropout>()) return m->options.inplace();
  return false;
}

/// Whether `layer` returns its input or a view of it.
bool passes_input_on(const torch::nn::Module& layer) {
  namespace tnn = torch::nn;
  return layer.as<tnn::Identity>() || layer.as<tnn::Flatten>() || layer.as<tnn::Unflatten>();
}

/// Moves each cut of `plan` that falls before an element where no piece may begin to after it: the segment
/// before grows, and one left empty goes.
std::vector<CheckpointSequentialImpl::Segment> respect_starts(
    std::vector<CheckpointSequentialImpl::Segment> plan, const std::vector<bool>& may_begin) {
  if (may_begin.empty()) return plan;
  std::vector<CheckpointSequentialImpl::Segment> out;
  for (CheckpointSequentialImpl::Segment s : plan) {
    while (!out.empty() && s.begin < s.end && !may_begin[s.begin]) {
      ++out.back().end;
      ++s.begin;
    }
    if (s.begin < s.end) out.push_back(s);
  }
  return out;
}

}  // namespace

std::vector<bool> piece_may_begin(const torch::nn::Sequential& sequential) {
  TORCH_CHECK(!sequential.is_empty(), "piece_may_begin: sequential is empty");
  const size_t n = sequential->size();
  std::vector<bool> may(n, true);
  for (size_t i = n; i-- > 1;) {
    const torch::nn::Module& layer = *sequential->ptr(i);
    may[i] = !works_in_place(layer) && !(passes_input_on(layer) && i + 1 < n && !may[i + 1]);
  }
  return may;
}

std::vector<CheckpointSequentialImpl::Segment> even_segments(size_t elements, int64_t segments,
                                                             const std::vector<bool>& may_begin) {
  TORCH_CHECK(may_begin.empty() || may_begin.size() == elements, "even_segments: may_begin has ",
              may_begin.size(), " entries for ", elements, " elements");
  const auto n = static_cast<int64_t>(elements);
  std::vector<CheckpointSequentialImpl::Segment> plan;
  for (int64_t k = 0; k < segments; ++k) {
    const auto begin = static_cast<size_t>(k * n / segments),
               end = static_cast<size_t>((k + 1) * n / segments);
    plan.push_back({begin, end, /*recompute=*/k + 1 < segments});
  }
  return respect_starts(std::move(plan), may_begin);
}

CheckpointSequential checkpoint_sequential(torch::nn::Sequential sequential, int64_t segments,
                                           CheckpointOptions options) {
  TORCH_CHECK(!sequential.is_empty() && sequential->size() > 0, "checkpoint_sequential: sequential is empty");
  const auto n = static_cast<int64_t>(sequential->size());
  TORCH_CHECK(segments >= 1 && segments <= n, "checkpoint_sequential: segments must be in [1, ", n,
              "] (the number of elements), got ", segments);
  auto plan = even_segments(sequential->size(), segments, piece_may_begin(sequential));
  return CheckpointSequential(std::move(sequential), std::move(plan), options);
}

CheckpointSequential checkpoint_sequential(torch::nn::Sequential sequential, const KeepPolicy& keep,
                                           int64_t max_run, CheckpointOptions options) {
  TORCH_CHECK(!sequential.is_empty() && sequential->size() > 0, "checkpoint_sequential: sequential is empty");
  TORCH_CHECK(keep, "checkpoint_sequential: the keep policy is empty");
  TORCH_CHECK(max_run >= 0, "checkpoint_sequential: max_run must be >= 0 (0: no limit), got ", max_run);
  std::vector<CheckpointSequentialImpl::Segment> plan;
  const auto children = sequential->named_children();
  for (size_t i = 0; i < children.size(); ++i) {
    const bool recompute = !keep(children[i].key(), *children[i].value());
    if (!plan.empty() && plan.back().recompute && recompute &&
        (max_run == 0 || plan.back().end - plan.back().begin < static_cast<size_t>(max_run)))
      plan.back().end = i + 1;
    else
      plan.push_back({i, i + 1, recompute});
  }
  plan = respect_starts(std::move(plan), piece_may_begin(sequential));
  return CheckpointSequential(std::move(sequential), std::move(plan), options);
}

KeepPolicy keep_compute_heavy(std::vector<std::string> also_keep) {
  return [also_keep = std::move(also_keep)](const std::string& name, const torch::nn::Module& layer) {
    for (const std::string& part : also_keep)
      if (name.find(part) != std::string::npos) return true;
    namespace tnn = torch::nn;
    return layer.as<tnn::Linear>() || layer.as<tnn::Bilinear>() || layer.as<tnn::Conv1d>() ||
           layer.as<tnn::Conv2d>() || layer.as<tnn::Conv3d>() || layer.as<tnn::ConvTranspose1d>() ||
           layer.as<tnn::ConvTranspose2d>() || layer.as<tnn::ConvTranspose3d>() ||
           layer.as<tnn::Embedding>() || layer.as<tnn::MultiheadAttention>();
  };
}

}  // namespace nn
}  // namespace memsave
