#include "memsave/rescue.h"

#include "memsave/amp.h"
#include "memsave/checkpoint.h"
#include "memsave/memory.h"
#include "memsave/optim.h"

#include "autograd_graph.h"
#include "memory_internal.h"
#include "step_room.h"

#include <ATen/SequenceNumber.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace memsave {
namespace {

int64_t bytes_of(const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

/// The pieces of a checkpoint plan over `n` elements, as checkpoint_sequential cuts them (`may_begin`:
/// nn::piece_may_begin of the model).
std::vector<nn::CheckpointSequentialImpl::Segment> pieces(const Checkpointing& c, size_t n,
                                                          const std::vector<bool>& may_begin) {
  int64_t k = 1;
  if (c.kind == Checkpointing::Kind::kSegments) k = std::min<int64_t>(c.count, static_cast<int64_t>(n));
  if (c.kind == Checkpointing::Kind::kEveryLayer) k = static_cast<int64_t>(n);
  return nn::even_segments(n, k, may_begin);
}

/// The bound of a measuring run on `device`: simulated_device_room() on the CPU, none on other devices
/// (their pools have their own end).
std::optional<int64_t> host_room(c10::Device device) {
  if (!device.is_cpu()) return std::nullopt;
  return simulated_device_room();
}

/// Bounds `device`'s pool at `current + room` while open, unless a tighter budget is already in force.
class BoundedRun {
 public:
  BoundedRun(c10::Device device, std::optional<int64_t> room) {
    if (!room) return;
    const int64_t limit = memory_stats(device).current + *room;
    if (const auto outer = get_budget(device); !outer || limit < *outer) bound_.emplace(device, limit);
  }

 private:
  std::optional<ScopedBudget> bound_;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// The fitting candidate with the shortest step time (the earliest of equals).
std::optional<size_t> fastest(const std::vector<Candidate>& candidates) {
  std::optional<size_t> best;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    if (c.status != Candidate::Status::kFits) continue;
    if (!best || c.measured.seconds < candidates[*best].measured.seconds) best = i;
  }
  return best;
}

/// Checks that `setup` gives one model, a Sequential or one of any shape, with its batches, a loss and an
/// optimizer factory.
void check_setup(const TrainingSetup& setup, const char* who) {
  const bool sequential = setup.make_model || setup.make_batch;
  const bool any_shape = setup.make_any_model || setup.make_inputs;
  TORCH_CHECK(sequential != any_shape, who, ": the training setup gives ",
              sequential
                  ? "both a Sequential (make_model, make_batch) and a model of any shape (make_any_model, "
                    "make_inputs)"
                  : "no model (make_model and make_batch, or make_any_model and make_inputs)");
  TORCH_CHECK(sequential ? setup.make_model && setup.make_batch : setup.make_any_model && setup.make_inputs,
              who, ": the training setup gives ",
              sequential ? "one of make_model and make_batch without the other"
                         : "one of make_any_model and make_inputs without the other");
  TORCH_CHECK(setup.loss && setup.optimizer, who, ": the training setup has no ",
              setup.loss ? "optimizer factory" : "loss");
}

/// A setup's model, built on a device: a Sequential, run element by element, or a model of any shape, run as
/// one element.
struct BuiltModel {
  BuiltModel(const TrainingSetup& setup, c10::Device device) {
    if (setup.make_model) {
      sequential = setup.make_model();
      TORCH_CHECK(!sequential.is_empty(), "TrainingSetup: make_model returned no model");
    } else {
      any = setup.make_any_model();
      TORCH_CHECK(any.module != nullptr && any.forward,
                  "TrainingSetup: make_any_model returned no module or no forward function");
    }
    module()->to(device);
  }
  std::shared_ptr<torch::nn::Module> module() const { return sequential ? sequential.ptr() : any.module; }
  size_t elements() const { return sequential ? sequential->size() : 1; }
  /// The first element's forward, on the batch's inputs.
  torch::Tensor first(const std::vector<torch::Tensor>& inputs) {
    return sequential ? sequential->begin()[0].forward(inputs[0]) : any.forward(inputs);
  }
  /// Element i's (> 0) forward, on the output of the one before.
  torch::Tensor element(size_t i, const torch::Tensor& x) { return sequential->begin()[i].forward(x); }
  std::unique_ptr<Trainer> trainer(const OptimizerFactory& optimizer, const Recipe& recipe) const {
    if (sequential) return std::make_unique<Trainer>(sequential, optimizer, recipe);
    return std::make_unique<Trainer>(any.module, any.forward, optimizer, recipe);
  }

  torch::nn::Sequential sequential{nullptr};
  AnyModel any;
};

/// A batch of a setup: its inputs (one for a Sequential) and the target.
struct SetupBatch {
  std::vector<torch::Tensor> inputs;
  torch::Tensor target;

  int64_t bytes() const {
    int64_t total = bytes_of(target);
    for (const auto& x : inputs) total += bytes_of(x);
    return total;
  }
};

SetupBatch batch_of(const TrainingSetup& setup, int64_t rows, c10::Device device) {
  if (setup.make_batch) {
    auto [input, target] = setup.make_batch(rows, device);
    return {{std::move(input)}, std::move(target)};
  }
  auto [inputs, target] = setup.make_inputs(rows, device);
  return {std::move(inputs), std::move(target)};
}

}  // namespace

Measurement measure(const TrainingSetup& setup, const Recipe& recipe, int64_t batch, c10::Device device,
                    int steps, std::optional<int64_t> budget) {
  check_setup(setup, "measure");
  TORCH_CHECK(steps >= 2, "measure: steps must be >= 2 (the first is not timed), got ", steps);
  TORCH_CHECK(batch > 0, "measure: batch must be > 0, got ", batch);
  Measurement m;
  std::vector<double> times;
  if (device.is_cuda()) torch::cuda::synchronize();
  const int64_t before = memory_stats(device).current;
  {
    std::optional<ScopedBudget> bound;
    if (budget) bound.emplace(device, before + *budget);
    const BoundedRun host(device, host_room(device));
    PeakScope scope(device);
    try {
      torch::manual_seed(0);
      const BuiltModel model(setup, device);
      const std::unique_ptr<Trainer> trainer = model.trainer(setup.optimizer, recipe);
      const SetupBatch data = batch_of(setup, batch, device);
      for (int s = 0; s < steps; ++s) {
        const StepStats stats = trainer->step(data.inputs, data.target, setup.loss);
        if (device.is_cuda()) torch::cuda::synchronize();
        if (s > 0) times.push_back(stats.seconds);
      }
    } catch (const c10::OutOfMemoryError&) {
      m.out_of_memory = true;
    }
    m.peak = scope.peak() - before;
  }
  m.seconds = median(times);
  if (!times.empty()) {
    const auto [fastest, slowest] = std::minmax_element(times.begin(), times.end());
    if (*fastest > 0) m.spread = (*slowest - *fastest) / *fastest;
  }
  return m;
}

MemoryModel MemoryModel::profile(const TrainingSetup& setup, int64_t batch, c10::Device device,
                                 c10::ScalarType amp) {
  check_setup(setup, "MemoryModel");
  TORCH_CHECK(batch > 0, "MemoryModel: batch must be > 0, got ", batch);
  TORCH_CHECK(amp == c10::kBFloat16 || amp == c10::kHalf, "MemoryModel: amp must be BFloat16 or Half, got ",
              amp);
  // The whole batch when the device holds it; otherwise halves, scaled up linearly.
  const BoundedRun host(device, host_room(device));
  for (int64_t rows = batch;; rows = (rows + 1) / 2) {
    try {
      return profile_rows(setup, batch, rows, device, amp);
    } catch (const c10::OutOfMemoryError&) {
      if (rows == 1) throw;
    }
  }
}

MemoryModel MemoryModel::profile_rows(const TrainingSetup& setup, int64_t batch, int64_t rows_,
                                      c10::Device device, c10::ScalarType amp_dtype) {
  MemoryModel model;
  model.batch_ = batch;
  model.rows_ = rows_;
  model.amp_dtype_ = amp_dtype;

  torch::manual_seed(0);
  BuiltModel net(setup, device);
  net.module()->train();
  std::vector<torch::Tensor> params;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : net.module()->parameters()) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    params.push_back(p);
    model.param_bytes_ += bytes_of(p);
  }
  const size_t n = net.elements();
  model.may_begin_ = net.sequential ? nn::piece_may_begin(net.sequential) : std::vector<bool>{true};
  const SetupBatch large_batch = batch_of(setup, model.rows_, device);
  model.batch_bytes_per_row_ = large_batch.bytes() / model.rows_;
  // The profile's sizes: its rows, then halved (rounding up) down to one row, the micro-batches of the
  // checklist. What grows with the rows need not be linear in them (a library's kernels choose another
  // algorithm, with another workspace, past some rows), so each figure is measured at each size.
  for (int64_t rows = model.rows_;; rows = (rows + 1) / 2) {
    model.sizes_.push_back(rows);
    if (rows == 1) break;
  }
  auto optimizer = setup.optimizer(params, Recipe());

  // One training pass run element by element. What each element's forward leaves in the pool is what the
  // graph keeps of it; a hook on each element's output marks when its gradient is ready, i.e. when that
  // element's backward begins, so each element's backward gets its own peak window. Gradients of the
  // parameters are taken out of the windows (the model counts them whole).
  struct Pass {
    std::vector<double> stored, freed, output, forward, backward, carried, grads;  // per element, bytes
    std::vector<bool> output_kept;
    double loss = 0;  // the loss's backward window: its own graph, the logits' gradient
  };
  auto grad_bytes = [&] {
    int64_t bytes = 0;
    for (const auto& p : params) bytes += bytes_of(p.grad());
    return bytes;
  };
  // The parameters an element's forward used (a tied weight: in two elements), from its graph.
  std::vector<std::vector<const c10::TensorImpl*>> used;
  auto parameters_used = [](const torch::Tensor& out, uint64_t first_node) {
    std::vector<const c10::TensorImpl*> leaves;
    for (const at::Tensor& leaf : detail::graph_since({out}, first_node).leaves)
      leaves.push_back(leaf.unsafeGetTensorImpl());
    return leaves;
  };
  auto run_pass = [&](bool amp, const SetupBatch& data, bool accumulate = false) {
    if (!accumulate) optimizer->zero_grad();
    Pass pass;
    for (auto* v : {&pass.stored, &pass.freed, &pass.output, &pass.forward, &pass.backward, &pass.carried})
      v->resize(n);
    pass.grads.assign(n + 1, 0);
    pass.output_kept.assign(n, false);
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> outputs;
    const int64_t start = memory_stats(device).current, start_grads = grad_bytes();
    std::vector<double> held(n + 1, 0);  // held[k]: what elements before k keep
    torch::Tensor loss;
    // The window of element k's backward (k == n: the loss's).
    std::optional<PeakScope> window;
    size_t open = n;
    auto close = [&](size_t next) {
      const int64_t grads = grad_bytes() - start_grads;
      const double peak = static_cast<double>(window->peak() - start - grads) - held[open];
      (open == n ? pass.loss : pass.backward[open]) = peak;
      pass.grads[open] = static_cast<double>(grads);
      window.reset();
      open = next;
      if (next != SIZE_MAX) {
        // Whether the element's output outlived the backward of the elements after it (its own graph keeps
        // it).
        pass.output_kept[next] = !outputs[next].expired();
        // What the backward so far leaves beside the elements' graphs and the gradients: the gradient of
        // this element's output, and a shared weight's gradient waiting for its other uses.
        pass.carried[next] =
            static_cast<double>(memory_stats(device).current - start - grads) - held[next + 1];
        window.emplace(device);
      }
    };
    {
      std::optional<amp::Autocast> autocast;
      if (amp) autocast.emplace(device.type(), amp_dtype);
      torch::Tensor x;
      int64_t in_use = start;
      for (size_t i = 0; i < n; ++i) {
        int64_t forward_peak = 0;
        // The output of the element before; the first takes the batch's inputs, which the batch keeps.
        torch::Tensor input = std::move(x);
        const uint64_t first_node = at::sequence_number::peek();
        {
          PeakScope scope(device);
          x = i == 0 ? net.first(data.inputs) : net.element(i, input);
          forward_peak = scope.peak();
        }
        if (used.size() == i) used.push_back(parameters_used(x, first_node));  // in the first pass
        // What the element lets go of its input once the caller does (what its graph does not keep).
        const int64_t with_input = memory_stats(device).current;
        input.reset();
        const int64_t now = memory_stats(device).current;
        pass.freed[i] = static_cast<double>(with_input - now);
        pass.forward[i] = static_cast<double>(forward_peak - now);
        pass.stored[i] = static_cast<double>(now - in_use);
        pass.output[i] = static_cast<double>(bytes_of(x));
        outputs.push_back(x.has_storage() ? x.storage().getWeakStorageImpl()
                                          : c10::weak_intrusive_ptr<c10::StorageImpl>(
                                                c10::intrusive_ptr<c10::StorageImpl>()));
        held[i + 1] = held[i] + pass.stored[i];
        in_use = now;
        if (model.needs_grad_.size() == i) model.needs_grad_.push_back(x.requires_grad());
        if (x.requires_grad()) {
          x.register_hook([&, i](const torch::Tensor&) { close(i); });
        }
      }
      loss = setup.loss(x, data.target);
    }
    window.emplace(device);
    loss.backward();
    close(SIZE_MAX);
    return pass;
  };
  run_pass(false, large_batch);
  // The parameters the backward reached: only they get gradients and optimizer state. A frozen one
  // (requires_grad false) or one the forward never uses gets neither.
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    model.trained_numel_.push_back(p.numel());
    model.grad_bytes_ += bytes_of(p.grad());
  }
  optimizer->step();  // creates the state
  {                   // the first and the last element that use a parameter of each element
    std::unordered_map<const c10::TensorImpl*, std::pair<size_t, size_t>> span;
    for (size_t i = 0; i < n; ++i)
      for (const c10::TensorImpl* p : used[i]) span.try_emplace(p, i, i).first->second.second = i;
    model.shares_from_.resize(n);
    model.shares_to_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      model.shares_from_[i] = model.shares_to_[i] = i;
      for (const c10::TensorImpl* p : used[i]) {
        model.shares_from_[i] = std::min(model.shares_from_[i], span[p].first);
        model.shares_to_[i] = std::max(model.shares_to_[i], span[p].second);
      }
    }
  }
  {  // what a checkpointed piece keeps beside its input and output (the generators' state, where the device
     // pool holds it: on the CPU)
    const torch::Tensor probe = torch::zeros({1}, torch::TensorOptions().device(device).requires_grad(true));
    const int64_t before = memory_stats(device).current;
    const torch::Tensor out =
        checkpoint([](at::TensorList x) { return std::vector<torch::Tensor>{x[0] * 2}; }, {probe})[0];
    model.piece_state_ = memory_stats(device).current - before - bytes_of(out);
  }
  // A model of any shape is profiled with its checkpointed blocks off, and again with them on.
  const auto blocks = net.sequential ? std::vector<std::shared_ptr<nn::CheckpointImpl>>{}
                                     : nn::checkpoint_blocks(net.module());
  model.blocks_ = blocks.size();
  model.any_shape_ = !net.sequential;
  auto switch_blocks = [&](bool on) {
    for (const auto& block : blocks) {
      block->enable(on);
      block->options().offload_inputs(false);
    }
  };
  switch_blocks(false);
  for (int variant = 0; variant < (blocks.empty() ? 2 : 4); ++variant) {
    const bool amp = variant % 2 == 1;
    if (variant == 2) switch_blocks(true);
    Activations& a =
        variant < 2 ? (amp ? model.amp_ : model.fp32_) : (amp ? model.amp_blocks_ : model.fp32_blocks_);
    std::vector<Pass> passes{run_pass(amp, large_batch)};
    Pass accumulated;
    for (size_t k = 1; k < model.sizes_.size(); ++k) {
      try {
        passes.push_back(run_pass(amp, batch_of(setup, model.sizes_[k], device)));
      } catch (const c10::OutOfMemoryError&) {
        throw;
      } catch (const c10::Error&) {
        // A model that cannot take so few rows (BatchNorm1d in train mode, one row): the sizes end before,
        // at the batch itself when it cannot take half of it (its figures then read proportionally to the
        // rows). Every variant runs the first's sizes.
        if (variant > 0) throw;
        model.sizes_.resize(k);
        break;
      }
      if (k == 1)  // once more onto the gradients it left: what a later micro-batch's gradients add
        accumulated = run_pass(amp, batch_of(setup, model.sizes_[k], device), /*accumulate=*/true);
    }
    if (model.sizes_.size() == 1) accumulated = run_pass(amp, large_batch, /*accumulate=*/true);
    const Pass& second = passes[std::min<size_t>(1, passes.size() - 1)];
    const size_t sizes = model.sizes_.size();
    for (auto* v : {&a.stored, &a.freed, &a.carried, &a.forward, &a.backward})
      v->assign(n, std::vector<double>(sizes));
    a.loss.assign(sizes, 0);
    a.output.resize(n);
    a.incoming.resize(n);
    a.grads = passes[0].grads;
    a.output_kept = passes[0].output_kept;
    for (size_t k = 0; k < sizes; ++k) {
      for (size_t i = 0; i < n; ++i) {
        a.stored[i][k] = passes[k].stored[i];
        a.freed[i][k] = passes[k].freed[i];
        a.carried[i][k] = passes[k].carried[i];
        a.forward[i][k] = passes[k].forward[i];
        a.backward[i][k] = passes[k].backward[i];
      }
      a.loss[k] = passes[k].loss;
    }
    for (size_t i = 0; i < n; ++i) {
      a.output[i] = passes[0].output[i] / static_cast<double>(model.rows_);
      a.incoming[i] = std::max(0.0, accumulated.backward[i] - second.backward[i]);
    }
  }
  {  // the optimizer step's temporaries beyond its state
    const int64_t before_step = memory_stats(device).current;
    PeakScope step(device);
    detail::make_room_for_step(*optimizer);  // as the Trainer's step does
    optimizer->step();
    model.step_extra_ = std::max<int64_t>(0, step.peak() - before_step);
  }
  optimizer->zero_grad();
  int64_t state = 0;
  for (const auto& t : optimizer_state_tensors(*optimizer)) state += bytes_of(t);
  if (model.grad_bytes_ > 0)
    model.moments_ = static_cast<int64_t>(std::llround(static_cast<double>(state) / model.grad_bytes_));
  return model;
}

int64_t MemoryModel::optimizer_state(const Recipe& recipe) const {
  if (recipe.offload() == Offload::kOptimizerState) return 0;
  // The setup's optimizer keeps `moments` fp32 tensors per parameter (measured: Adam 2, SGD with momentum 1).
  const int64_t moments = moments_;
  // Quantized state: `bits` per element and a float per block of the optimizers' default size.
  const auto quantized = [&](int64_t n, int64_t bits, int64_t block) {
    return moments * ((n * bits + 7) / 8 + 4 * ((n + block - 1) / block));
  };
  const optim::AdamW8bitOptions eight;
  const optim::AdamW4bitOptions four;
  int64_t bytes = 0;
  for (int64_t n : trained_numel_) {
    if (recipe.state_bits() == 8 && n >= eight.min_8bit_size())
      bytes += quantized(n, 8, eight.block_size());
    else if (recipe.state_bits() == 4 && n >= four.min_4bit_size())
      bytes += quantized(n, 4, four.block_size());
    else
      bytes += moments * 4 * n;
  }
  return bytes;
}

int64_t MemoryModel::static_bytes(const Recipe& recipe) const {
  return param_bytes_ + grad_bytes_ + optimizer_state(recipe) + batch_bytes_per_row_ * batch_;
}

double MemoryModel::pass_peak(const Activations& a, const Recipe& recipe, double rows,
                              bool accumulating) const {
  auto plan = pieces(
      recipe.checkpoint().kind == Checkpointing::Kind::kPolicy ? Checkpointing::none() : recipe.checkpoint(),
      a.stored.size(), may_begin_);
  // A piece whose output needs no gradient (frozen elements at the start) keeps no graph to recompute: the
  // checkpoint runs it as it is.
  for (auto& piece : plan)
    if (!needs_grad_[piece.end - 1]) piece.recompute = false;
  auto stored = [&](size_t i) { return at(a.stored[i], rows); };
  auto freed = [&](size_t i) { return at(a.freed[i], rows); };
  auto forward = [&](size_t i) { return at(a.forward[i], rows); };
  auto backward = [&](size_t i) { return at(a.backward[i], rows); };
  auto output = [&](size_t i) { return a.output[i] * rows; };
  auto carried = [&](size_t i) { return at(a.carried[i], rows); };
  // A recomputed piece adds its parameters' gradients to the existing ones as they arrive, as the backward
  // without checkpointing does, where no element outside it uses them; otherwise it hands them back together
  // at its end.
  auto hands_back = [&](const nn::CheckpointSequentialImpl::Segment& piece) {
    for (size_t i = piece.begin; i < piece.end; ++i)
      if (shares_from_[i] < piece.begin || shares_to_[i] >= piece.end) return true;
    return false;
  };
  // Parameter gradients present while element i's backward runs (a.grads, measured: the elements' from i
  // on, and those of weights they share with earlier ones). The first micro-batch of a window: those. Later
  // ones: all of them, and beside them the gradients arriving to be added: what the profile measured for
  // the element, or in a recomputed piece that hands them back those of its elements from i on, which it
  // holds until its end.
  const double all_grads = static_cast<double>(grad_bytes_);
  auto grads_in = [&](size_t i, const nn::CheckpointSequentialImpl::Segment& piece) {
    if (!accumulating) return a.grads[i];
    if (piece.recompute && hands_back(piece)) return all_grads + a.grads[i] - a.grads[piece.end];
    return all_grads + a.incoming[i];
  };
  // A piece's input is the output of the piece before it. The profile counted an element's output in that
  // element's graph; the output of a recomputed piece, which keeps no graph, is counted with the next piece.
  // Every recomputed piece also keeps a state (the generators') until the pass's graph goes.
  const double piece_state = static_cast<double>(piece_state_);
  auto input = [&](size_t p) { return p > 0 && plan[p - 1].recompute ? output(plan[p].begin - 1) : 0.0; };
  double peak = 0;

  // The first forward (it matters beside the gradients of earlier micro-batches): the pieces before keep
  // what the backward will find of them; the piece keeps its input and its graph so far.
  double kept_before = 0;
  for (size_t p = 0; p < plan.size(); ++p) {
    const auto& piece = plan[p];
    if (piece.recompute) kept_before += piece_state;
    double graph = input(p);
    for (size_t i = piece.begin; i < piece.end; ++i) {
      peak = std::max(peak, kept_before + graph + stored(i) + forward(i) + (accumulating ? all_grads : 0.0));
      graph += stored(i);
    }
    kept_before += piece.recompute ? input(p) : graph;
  }

  // The backward walks the pieces from the last to the first; while it is in element i of a piece, the
  // pieces before keep what the forward left (a recomputed piece its input and state only), the piece keeps
  // its input and the graph of its elements before i (recomputed or kept), and element i's backward adds
  // its window.
  kept_before = 0;
  for (const auto& piece : plan) kept_before += piece.recompute ? piece_state : 0.0;
  for (size_t p = 0; p < plan.size(); ++p) {
    const auto& piece = plan[p];
    const size_t b = piece.begin, e = piece.end;
    double inside = input(p);
    if (piece.recompute) {
      // The recomputation runs the piece's forward again beside what the backward after it left (the
      // gradient of its output, the seed, and a shared weight's pending gradient: what the profile measured
      // when that element's backward began, less the output it had let go of by then), the gradients of the
      // elements after it, and another state.
      const double seed = output(e - 1);
      const double arrived = carried(e - 1) + (a.output_kept[e - 1] ? 0.0 : seed) + piece_state;
      const double grads = accumulating ? all_grads : a.grads[e];
      // The recomputation holds its input, which the profile's first element may have let go of.
      const double unfreed = b > 0 ? freed(b) : 0.0;
      double graph = inside;
      for (size_t i = b; i < e; ++i) {
        peak = std::max(peak, kept_before + arrived + graph + stored(i) + forward(i) + grads);
        graph += stored(i) + (i == b ? unfreed : 0.0);
      }
      inside += unfreed;
    }
    // A recomputed piece lets go of its seed and recomputed output as the backward without checkpointing
    // does: each element's backward is the profile's window.
    for (size_t i = b; i < e; ++i) {
      peak = std::max(peak, kept_before + inside + backward(i) + grads_in(i, piece));
      inside += stored(i);
    }
    if (piece.recompute) {
      // The piece's backward ends beside its input's gradient; one that hands its gradients back returns
      // them together, and onto existing gradients they are then added one by one.
      const double handed =
          !accumulating ? a.grads[b] : all_grads + (hands_back(piece) ? a.grads[b] - a.grads[e] : 0.0);
      peak = std::max(peak, kept_before + input(p) + (b > 0 ? output(b - 1) : 0.0) + handed);
    }
    kept_before += piece.recompute ? input(p) : inside;
  }
  const double loss_grads = accumulating ? all_grads : 0.0;
  return std::max(peak, kept_before + at(a.loss, rows) + loss_grads);
}

double MemoryModel::at(const std::vector<double>& samples, double rows) const {
  if (sizes_.size() == 1) return samples[0] * rows / static_cast<double>(sizes_[0]);
  // The two sizes around the rows (sizes_ go down), or the nearest two.
  size_t k = 0;
  while (k + 2 < sizes_.size() && rows < static_cast<double>(sizes_[k + 1])) ++k;
  const double low = static_cast<double>(sizes_[k + 1]), high = static_cast<double>(sizes_[k]);
  return samples[k + 1] + (samples[k] - samples[k + 1]) * (rows - low) / (high - low);
}

int64_t MemoryModel::predict(const Recipe& recipe) const {
  TORCH_CHECK(!recipe.amp() || *recipe.amp() == amp_dtype_,
              "MemoryModel::predict: the recipe's mixed precision is ", recipe.amp().value_or(amp_dtype_),
              " but the profile ran under ", amp_dtype_, " autocast (MemoryModel::profile's amp)");
  const Checkpointing::Kind kind = recipe.checkpoint().kind;
  TORCH_CHECK(!any_shape_ || kind == Checkpointing::Kind::kNone ||
                  (kind == Checkpointing::Kind::kEveryLayer && blocks_ > 0),
              "MemoryModel::predict: the recipe's checkpoint is ", recipe.checkpoint().name,
              " but the model of any shape has ",
              blocks_ > 0 ? "memsave::nn::Checkpoint blocks, all on (every layer) or all off (none)"
                          : "no memsave::nn::Checkpoint blocks to turn on");
  const int64_t rows = recipe.micro_batch() == 0 ? batch_ : std::min(recipe.micro_batch(), batch_);
  // A model of any shape checkpoints inside its one element: the profile with its blocks on, run whole.
  const bool blocks_on = any_shape_ && kind == Checkpointing::Kind::kEveryLayer;
  const Activations& a =
      blocks_on ? (recipe.amp() ? amp_blocks_ : fp32_blocks_) : (recipe.amp() ? amp_ : fp32_);
  const double held =
      static_cast<double>(param_bytes_ + optimizer_state(recipe) + batch_bytes_per_row_ * batch_);
  const double pass =
      held + pass_peak(a, blocks_on ? Recipe(recipe).checkpoint(Checkpointing::none()) : recipe,
                       static_cast<double>(rows), rows < batch_);
  const bool own_kernels = recipe.state_bits() != 32 || recipe.offload() == Offload::kOptimizerState;
  const double step =
      static_cast<double>(static_bytes(recipe)) + (own_kernels ? 0 : static_cast<double>(step_extra_));
  return static_cast<int64_t>(std::llround(std::max(pass, step)));
}

c10::ScalarType mixed_precision_dtype(c10::Device device) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "mixed_precision_dtype: device must be cpu or cuda, got ",
              device);
  if (device.is_cpu()) return c10::kBFloat16;
#ifdef MEMSAVE_WITH_CUDA
  TORCH_CHECK(torch::cuda::is_available(), "mixed_precision_dtype: device ", device,
              " requested but no CUDA device is available");
  const c10::DeviceIndex index = device.has_index() ? device.index() : detail::cuda_current_device();
  return detail::cuda_compute_capability(index).first >= 8 ? c10::kBFloat16 : c10::kHalf;
#else
  TORCH_CHECK(false, "memsave: this build has no CUDA support (configure with -DMEMSAVE_WITH_CUDA=ON)");
#endif
}

std::vector<Recipe> checklist(int64_t batch, size_t elements, c10::ScalarType amp,
                              const OptimizerFactory& optimizer, size_t blocks) {
  TORCH_CHECK(amp == c10::kBFloat16 || amp == c10::kHalf, "checklist: amp must be BFloat16 or Half, got ",
              amp);
  std::vector<Recipe> levels;  // fp16 (Recipe's kAuto) scales the gradients, bf16 does not
  levels.push_back(Recipe());
  levels.push_back(Recipe().amp(amp));
  const auto root = static_cast<int64_t>(std::lround(std::sqrt(static_cast<double>(elements))));
  if (root >= 2 && root < static_cast<int64_t>(elements))
    levels.push_back(Recipe().amp(amp).checkpoint(Checkpointing::segments(root)));
  const bool every_layer = elements >= 2 || blocks > 0;
  if (every_layer) levels.push_back(Recipe().amp(amp).checkpoint(Checkpointing::every_layer()));
  // Offloaded state costs the device nothing whatever its width: the offload level keeps 8 bits.
  const Recipe states[] = {Recipe().state_bits(8), Recipe().state_bits(4),
                           Recipe().state_bits(8).offload(Offload::kOptimizerState)};
  for (const Recipe& state : states) {
    levels.push_back(state);
    levels.push_back(Recipe(state).amp(amp));
    if (every_layer) levels.push_back(Recipe(state).amp(amp).checkpoint(Checkpointing::every_layer()));
  }
  levels.erase(std::remove_if(levels.begin(), levels.end(),
                              [&](const Recipe& r) { return !builds_state(optimizer, r); }),
               levels.end());
  std::vector<int64_t> micro;
  for (int64_t m = batch; m >= 1; m = (m + 1) / 2) {
    micro.push_back(m);
    if (m == 1) break;
  }
  std::vector<Recipe> out;
  for (const Recipe& level : levels)
    for (int64_t m : micro) out.push_back(Recipe(level).micro_batch(m == batch ? 0 : m));
  return out;
}

bool adds_only_work(const Recipe& recipe, const Recipe& fitted, int64_t batch) {
  TORCH_CHECK(batch > 0, "adds_only_work: batch must be > 0, got ", batch);
  auto rows = [batch](const Recipe& r) {
    return r.micro_batch() > 0 ? std::min(r.micro_batch(), batch) : batch;
  };
  using Kind = Checkpointing::Kind;
  // How much a plan recomputes, where plans compare: none, then segments, then every layer.
  auto recomputes = [](const Checkpointing& c) {
    return c.kind == Kind::kNone ? 0 : c.kind == Kind::kSegments ? 1 : c.kind == Kind::kEveryLayer ? 2 : -1;
  };
  const Checkpointing &mine = recipe.checkpoint(), &theirs = fitted.checkpoint();
  const bool same_plan = mine.kind == theirs.kind && mine.count == theirs.count &&
                         mine.max_run == theirs.max_run && mine.name == theirs.name;
  const bool more_recomputation =
      same_plan || (recomputes(theirs) >= 0 && recomputes(mine) > recomputes(theirs));
  // Everything else the same: compared through the C++ that builds each recipe without those two.
  auto rest = [](const Recipe& r) {
    const Recipe bare = Recipe(r).micro_batch(0).checkpoint(Checkpointing::none());
    return bare.to_cpp();
  };
  return rows(recipe) <= rows(fitted) && more_recomputation && rest(recipe) == rest(fitted);
}

std::optional<size_t> recommend(const std::vector<Candidate>& candidates, double tie) {
  TORCH_CHECK(std::isfinite(tie) && tie >= 0, "recommend: tie must be a finite fraction >= 0, got ", tie);
  const std::optional<size_t> best = fastest(candidates);
  if (!best) return std::nullopt;
  const double bound = candidates[*best].measured.seconds * (1 + tie);
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    if (c.status == Candidate::Status::kFits && c.measured.seconds <= bound) return i;
  }
  return best;  // not reached: the fastest is within its own bound
}

double timing_noise(const std::vector<Candidate>& candidates) {
  std::vector<double> spreads;
  for (const Candidate& c : candidates)
    if (c.status == Candidate::Status::kFits) spreads.push_back(c.measured.spread);
  return median(spreads);
}

int64_t simulated_device_room() { return host_memory_available() / 10 * 9; }

int64_t device_room(c10::Device device) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "device_room: device must be cpu or cuda, got ", device);
  if (device.is_cpu()) return simulated_device_room();
#ifdef MEMSAVE_WITH_CUDA
  TORCH_CHECK(torch::cuda::is_available(), "device_room: device ", device,
              " requested but no CUDA device is available");
  return detail::cuda_room(device.has_index() ? device.index() : detail::cuda_current_device());
#else
  TORCH_CHECK(false, "memsave: this build has no CUDA support (configure with -DMEMSAVE_WITH_CUDA=ON)");
#endif
}

RescuePlan rescue(const TrainingSetup& setup, const RescueOptions& options) {
  TORCH_CHECK(options.batch() > 0, "rescue: batch must be > 0, got ", options.batch());
  TORCH_CHECK(options.budget() > 0, "rescue: budget must be > 0, got ", options.budget());
  TORCH_CHECK(options.steps() >= 2, "rescue: steps must be >= 2 (the first is not timed), got ",
              options.steps());
  TORCH_CHECK(std::isfinite(options.tie()) && options.tie() >= 0,
              "rescue: tie must be a finite fraction >= 0, got ", options.tie());
  TORCH_CHECK(!options.device().is_cuda() || torch::cuda::is_available(), "rescue: device ", options.device(),
              " requested but no CUDA device is available");
  if (const auto room = host_room(options.device()))
    TORCH_CHECK(options.budget() <= *room, "rescue: budget ", format_bytes(options.budget()),
                " is more than the CPU can measure: on the CPU the device is simulated in host memory, of "
                "which this machine can provide ",
                format_bytes(*room),
                " now (nine tenths of what it has available); give a budget of at most "
                "that, or run on a CUDA device");
  const c10::ScalarType amp = options.amp() ? *options.amp() : mixed_precision_dtype(options.device());
  RescuePlan plan;
  const MemoryModel model = MemoryModel::profile(setup, options.batch(), options.device(), amp);
  plan.parameter_bytes = model.parameter_bytes();
  if (options.budget() < plan.parameter_bytes) {
    plan.below_parameters = true;
    return plan;
  }

  const std::vector<Recipe> recipes =
      checklist(options.batch(), model.elements(), amp, setup.optimizer, model.checkpoint_blocks());
  TORCH_CHECK(!recipes.empty(),
              "rescue: the optimizer factory builds the optimizer of no level of the checklist (fp32, 8-bit, "
              "4-bit or offloaded state): called with each level's recipe on one probe tensor of one "
              "element (memsave::builds_state), it failed or built other state");
  for (const Recipe& r : recipes) {
    Candidate c;
    c.recipe = r;
    c.predicted = model.predict(r);
    c.static_bytes = model.static_bytes(r);
    plan.candidates.push_back(std::move(c));
  }
  // Within a level the micro-batches go from large to small, and a level with more checkpointing comes after
  // the one with less: a candidate that only adds steps or recomputation to one that fits is not run.
  std::vector<const Recipe*> fitted;
  std::exception_ptr first_error;
  bool ran = false;  // a candidate ran to its end or out of memory
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    Candidate& c = plan.candidates[i];
    const bool dominated = std::any_of(fitted.begin(), fitted.end(), [&](const Recipe* f) {
      return adds_only_work(c.recipe, *f, options.batch());
    });
    if (c.static_bytes > options.budget()) {
      c.status = Candidate::Status::kCannotFit;
    } else if (dominated) {
      c.status = Candidate::Status::kNotNeeded;
    } else {
      try {
        c.measured =
            measure(setup, c.recipe, options.batch(), options.device(), options.steps(), options.budget());
        c.status = c.measured.out_of_memory ? Candidate::Status::kOutOfMemory : Candidate::Status::kFits;
        if (c.status == Candidate::Status::kFits) fitted.push_back(&c.recipe);
        ran = true;
      } catch (const c10::Error& e) {
        // A recipe the model cannot run (a BatchNorm1d in train mode on a micro-batch of one row): its error
        // is the candidate's, and the walk goes on.
        c.status = Candidate::Status::kFailed;
        c.error = e.what_without_backtrace();
        if (!first_error) first_error = std::current_exception();
      }
    }
    if (options.progress()) options.progress()(i + 1, plan.candidates.size());
  }
  // A model that runs under no recipe: the first error, as a run of it would throw.
  if (first_error && !ran) std::rethrow_exception(first_error);

  plan.fastest = fastest(plan.candidates);
  plan.recommended = recommend(plan.candidates, options.tie());
  plan.noise = timing_noise(plan.candidates);
  double reference = 0;
  const Candidate& baseline = plan.candidates.front();
  if (baseline.status == Candidate::Status::kFits) reference = baseline.measured.seconds;
  if (reference == 0 && plan.fastest) reference = plan.candidates[*plan.fastest].measured.seconds;
  for (Candidate& c : plan.candidates)
    if (c.status == Candidate::Status::kFits && c.measured.seconds > 0)
      c.relative_throughput = reference / c.measured.seconds;
  if (!plan.recommended) {
    for (size_t i = 0; i < plan.candidates.size(); ++i)
      if (plan.candidates[i].status != Candidate::Status::kFailed &&
          (!plan.closest_miss ||
           plan.candidates[i].predicted < plan.candidates[*plan.closest_miss].predicted))
        plan.closest_miss = i;
  }
  return plan;
}

}  // namespace memsave
