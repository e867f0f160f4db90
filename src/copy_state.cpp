// copy_state: one optimizer's state into another's format (fp32, 8-bit, 4-bit; on the device or offloaded).
//
// Every optimizer it knows is seen as a list of slots, one per parameter in group order: where that
// parameter's state sits (which optimizer's state map, under which tensor) and in what form. A copy reads
// each slot of `from` as fp32 moments (or as codes, when they can be copied as they are), builds all of
// `to`'s new states, and only then swaps them in.
#include "memsave/offload.h"
#include "memsave/optim.h"
#include "optim_internal.h"

#include "../kernels/optim_cpu.h"
#include "../kernels/qmap.h"

#include <ATen/Parallel.h>
#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <optional>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace memsave::optim {
namespace detail {

namespace k = memsave::kernels;

/// The update a state belongs to: what its moments mean.
enum class StateRule { kAdam, kSgd, kLion };

const char* rule_name(StateRule rule) {
  switch (rule) {
    case StateRule::kAdam:
      return "Adam/AdamW";
    case StateRule::kSgd:
      return "SGD with momentum";
    case StateRule::kLion:
      return "Lion";
  }
  return "?";
}

/// How a slot's state is kept.
enum class Form { kTorchAdam, kTorchAdamW, kTorchSgd, kLowBit };

struct Slot {
  torch::Tensor param;  ///< the parameter, as the optimizer's groups list it
  torch::Tensor key;    ///< what its state is keyed by: the parameter, or an offloaded one's master
  torch::optim::Optimizer* owner = nullptr;  ///< whose state map holds it
  Form form = Form::kLowBit;
  size_t group = 0;         ///< in `owner`
  bool host_arena = false;  ///< an OffloadOptimizer's host state: allocated in memsave's host arena
};

/// One parameter's state as read: fp32 moments of the parameter's shape, or for quantized state its codes,
/// which a target of the same format takes as they are and any other dequantizes (`moments`).
struct Read {
  int64_t step = 0;
  torch::Tensor m, v;  ///< undefined for quantized state until `moments` is called
  const QuantizedParamState* quantized = nullptr;
  const LowBitOptimizer* source = nullptr;  ///< holding `quantized`, under `source_key`
  torch::Tensor source_key;
  bool fresh = false;  ///< m and v are new tensors (not the source's), which the target may keep
};

struct StateAccess {
  static std::string type_name(const torch::optim::Optimizer& o) { return c10::demangle(typeid(o).name()); }

  static void update_can_step(OffloadOptimizer& o) { o.update_can_step(); }

  static StateRule rule_of(const LowBitOptimizer& o) {
    switch (o.kind_) {
      case LowBitOptimizer::Kind::kAdam:
      case LowBitOptimizer::Kind::kAdamW:
        return StateRule::kAdam;
      case LowBitOptimizer::Kind::kLion:
        return StateRule::kLion;
      case LowBitOptimizer::Kind::kSgd:
        return StateRule::kSgd;
    }
    return StateRule::kAdam;
  }

  /// The slots of one optimizer that keeps its own state (not an OffloadOptimizer), appended to `out`.
  static StateRule own_slots(torch::optim::Optimizer& o, bool host_arena, const char* role,
                             std::vector<Slot>& out) {
    std::optional<Form> form;
    std::optional<StateRule> rule;
    auto* low_bit = dynamic_cast<LowBitOptimizer*>(&o);
    if (low_bit != nullptr) {
      form = Form::kLowBit, rule = rule_of(*low_bit);
    } else if (dynamic_cast<torch::optim::AdamW*>(&o) != nullptr) {
      form = Form::kTorchAdamW, rule = StateRule::kAdam;
      for (const auto& g : o.param_groups()) {
        TORCH_CHECK(!static_cast<const torch::optim::AdamWOptions&>(g.options()).amsgrad(),
                    "copy_state: ", role, " uses AMSGrad, whose running maximum no other optimizer keeps");
      }
    } else if (dynamic_cast<torch::optim::Adam*>(&o) != nullptr) {
      form = Form::kTorchAdam, rule = StateRule::kAdam;
      for (const auto& g : o.param_groups()) {
        TORCH_CHECK(!static_cast<const torch::optim::AdamOptions&>(g.options()).amsgrad(),
                    "copy_state: ", role, " uses AMSGrad, whose running maximum no other optimizer keeps");
      }
    } else if (dynamic_cast<torch::optim::SGD*>(&o) != nullptr) {
      form = Form::kTorchSgd, rule = StateRule::kSgd;
    }
    TORCH_CHECK(form.has_value(), "copy_state: ", role, " is a ", type_name(o),
                "; the state copied is that of torch::optim::Adam, AdamW or SGD, of memsave's optimizers "
                "with 8- or 4-bit state and of memsave::OffloadOptimizer");
    // Each parameter once: a LibTorch optimizer over a module used twice lists its parameters twice (with one
    // state), where memsave's optimizers, the Trainer's included, list them once.
    std::unordered_set<const c10::TensorImpl*> seen;
    for (size_t g = 0; g < o.param_groups().size(); ++g) {
      for (const auto& p : o.param_groups()[g].params()) {
        if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back({p, p, &o, *form, g, host_arena});
      }
    }
    return *rule;
  }

  /// The slots of `o` in its groups' parameter order, and the rule its state follows.
  static StateRule slots(torch::optim::Optimizer& o, const char* role, std::vector<Slot>& out) {
    auto* offload = dynamic_cast<OffloadOptimizer*>(&o);
    if (offload == nullptr) return own_slots(o, /*host_arena=*/false, role, out);
    // Each parameter's state is in the host optimizer (under its master) or in the device one.
    std::vector<Slot> host, device;
    if (offload->host_) own_slots(*offload->host_, /*host_arena=*/true, role, host);
    if (offload->device_) own_slots(*offload->device_, /*host_arena=*/false, role, device);
    size_t next_host = 0, next_device = 0;
    TORCH_CHECK(o.param_groups().size() == offload->host_group_.size(), "copy_state: ", role, " has ",
                o.param_groups().size() - offload->host_group_.size(),
                " parameter group(s) added after construction, which it keeps no state for");
    for (const auto& group : o.param_groups()) {
      for (const auto& p : group.params()) {
        if (next_host < offload->offloaded_.size() && offload->offloaded_[next_host].param.is_same(p)) {
          Slot slot = host[next_host++];
          slot.param = p;  // keyed by the master, shaped as the parameter
          out.push_back(slot);
        } else {
          TORCH_INTERNAL_ASSERT(next_device < device.size() && device[next_device].param.is_same(p));
          out.push_back(device[next_device++]);
        }
      }
    }
    return StateRule::kAdam;
  }

  static std::optional<Read> read(const Slot& s) {
    const auto it = s.owner->state().find(s.key.unsafeGetTensorImpl());
    if (it == s.owner->state().end()) return std::nullopt;
    Read r;
    const auto fp32 = [&](const torch::Tensor& t) { return t.to(torch::kFloat).reshape(s.param.sizes()); };
    switch (s.form) {
      case Form::kTorchAdamW: {
        const auto& state = static_cast<const torch::optim::AdamWParamState&>(*it->second);
        r.step = state.step(), r.m = fp32(state.exp_avg()), r.v = fp32(state.exp_avg_sq());
        break;
      }
      case Form::kTorchAdam: {
        const auto& state = static_cast<const torch::optim::AdamParamState&>(*it->second);
        r.step = state.step(), r.m = fp32(state.exp_avg()), r.v = fp32(state.exp_avg_sq());
        break;
      }
      case Form::kTorchSgd: {
        const auto& state = static_cast<const torch::optim::SGDParamState&>(*it->second);
        if (!state.momentum_buffer().defined()) return std::nullopt;
        r.step = 1, r.m = fp32(state.momentum_buffer());
        break;
      }
      case Form::kLowBit: {
        const auto& state = static_cast<const QuantizedParamState&>(*it->second);
        r.step = state.step();
        if (state.quantized()) {
          r.quantized = &state, r.source = &static_cast<const LowBitOptimizer&>(*s.owner),
          r.source_key = s.key;
        } else {  // 1-D in the state's order
          r.m = in_shape(state.m(), s.param.sizes(), state.strides());
          if (state.v().defined()) r.v = in_shape(state.v(), s.param.sizes(), state.strides());
        }
        break;
      }
    }
    return r;
  }

  /// Dequantizes a quantized state that was read, the first time a target needs its fp32 moments.
  static void moments(Read& r, const torch::Tensor& param) {
    if (r.m.defined()) return;
    const std::vector<torch::Tensor> fp32 = r.source->state_fp32(r.source_key);
    r.m = fp32.at(0).reshape(param.sizes());
    if (fp32.size() > 1) r.v = fp32[1].reshape(param.sizes());
    r.fresh = true;  // state_fp32 returns new tensors
  }

  /// `values` (fp32) as blockwise codes of `bits` in `order` and their absmaxes, computed on the CPU and
  /// placed on `on`.
  static std::pair<torch::Tensor, torch::Tensor> quantize(const torch::Tensor& values, c10::IntArrayRef order,
                                                          const k::CodeBook& book, int bits, int64_t block,
                                                          const torch::TensorOptions& on) {
    const torch::Tensor flat = memory_of(laid_out(values.to(torch::kCPU), order));
    const int64_t n = flat.numel();
    const int64_t blocks = (n + block - 1) / block;
    const bool cpu = on.device().is_cpu();
    const auto host = torch::TensorOptions().device(torch::kCPU);
    torch::Tensor codes = torch::empty({k::code_bytes(n, bits)}, (cpu ? on : host).dtype(torch::kUInt8));
    torch::Tensor absmax = torch::empty({blocks}, (cpu ? on : host).dtype(torch::kFloat));
    const float* x = flat.data_ptr<float>();
    uint8_t* c = codes.data_ptr<uint8_t>();
    float* a = absmax.data_ptr<float>();
    at::parallel_for(0, blocks, std::max<int64_t>(1, 32768 / block), [&](int64_t begin, int64_t end) {
      k::quantize_blocks_cpu(book, bits, x, n, block, c, a, begin, end);
    });
    if (cpu) return {codes, absmax};
    return {codes.to(on.device()), absmax.to(on.device())};
  }

  /// `to`'s state for slot `s` from what was read: as `to`'s own step would create it, but holding `r`.
  static std::unique_ptr<torch::optim::OptimizerParamState> build(const Slot& s, Read& r, StateRule rule) {
    const torch::Tensor& p = s.param;
    // Tensors of `to`'s own: a copy never aliases `from`'s state, but fresh moments where they fit are kept.
    const auto keep = [&](const torch::Tensor& t, torch::ScalarType dtype) {
      return r.fresh && !s.host_arena && t.device() == s.key.device() && t.scalar_type() == dtype;
    };
    // The order `to`'s own step would give a new state: LibTorch's optimizers make their moments like the
    // weight (a channels_last weight's are channels_last), memsave's follow state_order too.
    const std::vector<int64_t> order = state_order(s.key);
    const auto like = [&](const torch::Tensor& t) {
      if (keep(t, p.scalar_type()) && lies_in(t, order)) return t;
      return empty_in(p.sizes(), order, p.options()).copy_(t);
    };
    if (s.form != Form::kLowBit) moments(r, p);
    switch (s.form) {
      case Form::kTorchAdamW: {
        auto state = std::make_unique<torch::optim::AdamWParamState>();
        state->step(r.step).exp_avg(like(r.m)).exp_avg_sq(like(r.v));
        return state;
      }
      case Form::kTorchAdam: {
        auto state = std::make_unique<torch::optim::AdamParamState>();
        state->step(r.step).exp_avg(like(r.m)).exp_avg_sq(like(r.v));
        return state;
      }
      case Form::kTorchSgd: {
        auto state = std::make_unique<torch::optim::SGDParamState>();
        state->momentum_buffer(like(r.m));
        return state;
      }
      case Form::kLowBit:
        break;
    }
    const auto& o = static_cast<const LowBitOptimizer&>(*s.owner);
    const LowBitOptimizer::Hyper h = o.hyper(o.param_groups()[s.group].options());
    const bool quantized =
        p.numel() >= h.min_quantized_size && !o.forced_32bit_.count(s.key.unsafeGetTensorImpl());
    const auto on = torch::TensorOptions().device(s.key.device());
    const bool second = rule == StateRule::kAdam;
    auto state = std::make_unique<QuantizedParamState>();
    state->step(r.step).strides(order);
    const QuantizedParamState* q = r.quantized;
    if (quantized && q != nullptr && q->bits() == o.bits() && q->block_size() == h.block_size &&
        same_order(p.sizes(), q->strides(), order)) {
      const auto copy = [&](const torch::Tensor& t) {  // the codes as they are
        return t.to(on.device(), /*non_blocking=*/false, /*copy=*/true);
      };
      state->block_size(h.block_size).bits(o.bits());
      state->m(copy(q->m())).absmax_m(copy(q->absmax_m()));
      if (second) state->v(copy(q->v())).absmax_v(copy(q->absmax_v()));
      return state;
    }
    moments(r, p);
    if (!quantized) {
      const auto flat = [&](const torch::Tensor& t) {  // 1-D in `order`
        if (keep(t, torch::kFloat) && lies_in(t, order)) return memory_of(t);
        return memory_of(empty_in(p.sizes(), order, on.dtype(torch::kFloat)).copy_(t));
      };
      state->m(flat(r.m));
      if (second) state->v(flat(r.v));
      return state;
    }
    state->block_size(h.block_size).bits(o.bits());
    const int bits = o.bits();
    auto [m, absmax_m] = quantize(r.m, order, k::signed_code_book(bits), bits, h.block_size, on);
    state->m(m).absmax_m(absmax_m);
    if (second) {
      auto [v, absmax_v] = quantize(r.v, order, k::unsigned_code_book(bits), bits, h.block_size, on);
      state->v(v).absmax_v(absmax_v);
    }
    return state;
  }
};

/// copy_state with `to`'s i-th slot taking the state of `from`'s slot pair(i), where `pair` maps the slots'
/// parameters (TensorImpls) to their source's: `source_of` when given, else each parameter itself when `to`'s
/// are all `from`'s, else by position.
void copy_state(const torch::optim::Optimizer& from, torch::optim::Optimizer& to, const SourceOf* source_of) {
  // 1. Check: both known, one rule, each parameter of `to` paired with one of `from` of its shape.
  std::vector<Slot> source, target;
  // NOTE: `from` is only read; its slots name it as a state map to look up.
  const StateRule from_rule =
      StateAccess::slots(const_cast<torch::optim::Optimizer&>(from), "the source (from)", source);
  const StateRule to_rule = StateAccess::slots(to, "the target (to)", target);
  TORCH_CHECK(from_rule == to_rule, "copy_state: the source (", StateAccess::type_name(from), ") keeps ",
              rule_name(from_rule), " state, the target (", StateAccess::type_name(to), ") ",
              rule_name(to_rule), " state");
  std::unordered_map<const c10::TensorImpl*, size_t> index;  // of `from`'s slots, by parameter
  for (size_t i = 0; i < source.size(); ++i) index.emplace(source[i].param.unsafeGetTensorImpl(), i);
  std::vector<size_t> pair(target.size());
  if (source_of != nullptr) {
    for (size_t i = 0; i < target.size(); ++i) {
      const auto mapped = source_of->find(target[i].param.unsafeGetTensorImpl());
      TORCH_INTERNAL_ASSERT(mapped != source_of->end() && index.count(mapped->second) != 0);
      pair[i] = index.at(mapped->second);
    }
  } else {
    size_t shared = 0;
    for (const Slot& s : target) shared += index.count(s.param.unsafeGetTensorImpl());
    TORCH_CHECK(
        shared == 0 || shared == target.size(), "copy_state: ", shared, " of the target's ", target.size(),
        " parameters are the source's and the others are not; optimizers over the "
        "same parameters are paired tensor by tensor, over other ones (a copy of the model) in order");
    TORCH_CHECK(shared != 0 || source.size() == target.size(), "copy_state: the source has ", source.size(),
                " parameters, the target ", target.size());
    for (size_t i = 0; i < target.size(); ++i)
      pair[i] = shared != 0 ? index.at(target[i].param.unsafeGetTensorImpl()) : i;
  }
  for (size_t i = 0; i < target.size(); ++i) {
    const Slot& s = source[pair[i]];
    TORCH_CHECK(s.param.sizes() == target[i].param.sizes(), "copy_state: parameter ", i, " of the target is ",
                target[i].param.sizes(), ", its source's (parameter ", pair[i], " of the source) ",
                s.param.sizes());
  }
  for (const auto& g : to.param_groups()) {
    const auto* sgd = dynamic_cast<const torch::optim::SGDOptions*>(&g.options());
    TORCH_CHECK(sgd == nullptr || sgd->momentum() > 0,
                "copy_state: the target is SGD without momentum, which keeps no state");
  }

  // 2. Build every new state; an error (out of memory) here leaves `to` as it was.
  struct Built {
    torch::optim::Optimizer* owner;
    void* key;
    std::unique_ptr<torch::optim::OptimizerParamState> state;
  };
  std::vector<Built> built;
  for (size_t i = 0; i < target.size(); ++i) {
    std::optional<Read> read = StateAccess::read(source[pair[i]]);
    if (!read) continue;
    std::optional<HostAllocationScope> in_host;
    if (target[i].host_arena) in_host.emplace();
    built.push_back({target[i].owner, target[i].key.unsafeGetTensorImpl(),
                     StateAccess::build(target[i], *read, to_rule)});
  }

  // 3. Commit: `to`'s state is the source's alone. An OffloadOptimizer's host thread (step_during_backward)
  //    must have stopped reading it first, and learns afterwards which masters have their state.
  auto* offload = dynamic_cast<OffloadOptimizer*>(&to);
  if (offload != nullptr) offload->discard_backward();
  std::vector<torch::optim::Optimizer*> owners;  // one or, for an OffloadOptimizer, two state maps
  for (const Slot& s : target) {
    if (std::find(owners.begin(), owners.end(), s.owner) == owners.end()) owners.push_back(s.owner);
  }
  for (torch::optim::Optimizer* owner : owners) owner->state().clear();
  for (Built& b : built) b.owner->state()[b.key] = std::move(b.state);
  if (offload != nullptr) StateAccess::update_can_step(*offload);
}

}  // namespace detail

void copy_state(const torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
  detail::copy_state(from, to, nullptr);
}

}  // namespace memsave::optim
