#include "memsave/offload.h"

#include "../kernels/fingerprint.h"
#include "archive.h"
#include "autograd_graph.h"
#include "compat.h"
#include "kernel_dtype.h"
#include "memory_internal.h"
#include "step_room.h"
#ifdef MEMSAVE_WITH_CUDA
#include "offload_internal.h"
#endif

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
#include <unordered_set>
#include <utility>

namespace memsave {
namespace {

using detail::read_betas;
using detail::read_bool_or;
using detail::read_double;
using detail::read_int;
using detail::write_betas;

void check_options(const OffloadOptimizerOptions& o) {
  TORCH_CHECK(o.lr() >= 0, "OffloadOptimizer: invalid learning rate: ", o.lr());
  TORCH_CHECK(o.eps() >= 0, "OffloadOptimizer: invalid eps: ", o.eps());
  TORCH_CHECK(o.weight_decay() >= 0, "OffloadOptimizer: invalid weight_decay: ", o.weight_decay());
  const auto [beta1, beta2] = o.betas();
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, "OffloadOptimizer: invalid beta1: ", beta1);
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, "OffloadOptimizer: invalid beta2: ", beta2);
  TORCH_CHECK(o.state_bits() == 32 || o.state_bits() == 8 || o.state_bits() == 4,
              "OffloadOptimizer: state_bits must be 32, 8 or 4, got ", o.state_bits());
  TORCH_CHECK(o.min_offload_size() >= 0, "OffloadOptimizer: min_offload_size must be >= 0, got ",
              o.min_offload_size());
}

/// The host-side update is AdamW4bit's for 4-bit state, AdamW8bit's otherwise: 8-bit blockwise state, or
/// fp32 state through the same fused kernels when no tensor is large enough to quantize.
optim::AdamW8bitOptions host_options(const OffloadOptimizerOptions& o) {
  return optim::AdamW8bitOptions(o.lr())
      .betas(o.betas())
      .eps(o.eps())
      .weight_decay(o.weight_decay())
      .min_8bit_size(o.state_bits() == 8 ? optim::AdamW8bitOptions().min_8bit_size()
                                         : std::numeric_limits<int64_t>::max());
}

optim::AdamW4bitOptions host_options_4bit(const OffloadOptimizerOptions& o) {
  return optim::AdamW4bitOptions(o.lr()).betas(o.betas()).eps(o.eps()).weight_decay(o.weight_decay());
}

torch::optim::AdamWOptions device_options(const OffloadOptimizerOptions& o) {
  return torch::optim::AdamWOptions(o.lr()).betas(o.betas()).eps(o.eps()).weight_decay(o.weight_decay());
}

/// The options of the first `count` parameter groups.
std::vector<OffloadOptimizerOptions> options_of(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                                size_t count) {
  std::vector<OffloadOptimizerOptions> out;
  for (size_t g = 0; g < count; ++g)
    out.push_back(static_cast<const OffloadOptimizerOptions&>(groups[g].options()));
  return out;
}

/// Checks the options of parameter group g: this optimizer's kind, valid, and storing state as group 0's do.
void check_group(const std::vector<torch::optim::OptimizerParamGroup>& groups, size_t g) {
  const auto* o = dynamic_cast<const OffloadOptimizerOptions*>(&groups[g].options());
  TORCH_CHECK(o != nullptr, "OffloadOptimizer: parameter group ", g,
              " has the options of another optimizer; memsave::OffloadOptimizerOptions expected");
  check_options(*o);
  const auto& first = static_cast<const OffloadOptimizerOptions&>(groups.front().options());
  TORCH_CHECK(o->state_bits() == first.state_bits() && o->min_offload_size() == first.min_offload_size() &&
                  o->copy_during_backward() == first.copy_during_backward() &&
                  o->step_during_backward() == first.step_during_backward(),
              "OffloadOptimizer: parameter group ", g, " keeps its state otherwise than group 0 (state_bits ",
              o->state_bits(), " and ", first.state_bits(), ", min_offload_size ", o->min_offload_size(),
              " and ", first.min_offload_size(), ", copy_during_backward ", o->copy_during_backward(),
              " and ", first.copy_during_backward(), ", step_during_backward ", o->step_during_backward(),
              " and ", first.step_during_backward(), "); these options must be the same in every group");
}

/// How many parameters each of the first `count` groups holds.
std::vector<int64_t> group_sizes(const std::vector<torch::optim::OptimizerParamGroup>& groups, size_t count) {
  std::vector<int64_t> out;
  for (size_t g = 0; g < count; ++g) out.push_back(static_cast<int64_t>(groups[g].params().size()));
  return out;
}

/// For each group of `by_group`, its index among the groups that hold tensors, or -1 for an empty one.
std::vector<int64_t> index_of_non_empty(const std::vector<std::vector<torch::Tensor>>& by_group) {
  std::vector<int64_t> out;
  int64_t next = 0;
  for (const auto& tensors : by_group) out.push_back(tensors.empty() ? -1 : next++);
  return out;
}

/// The host optimizer over the masters of each parameter group (masters[g], with the hyper-parameters of
/// options[g]; groups without masters are left out): AdamW4bit's update for 4-bit state, AdamW8bit's
/// otherwise (8-bit blockwise state, or fp32 state through the same fused kernels when no tensor is large
/// enough to quantize). Null without masters.
std::unique_ptr<optim::LowBitOptimizer> make_host(const std::vector<std::vector<torch::Tensor>>& masters,
                                                  const std::vector<OffloadOptimizerOptions>& options) {
  const bool four = options.front().state_bits() == 4;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t g = 0; g < masters.size(); ++g) {
    if (masters[g].empty()) continue;
    std::unique_ptr<torch::optim::OptimizerOptions> hyper;
    if (four) {
      hyper = std::make_unique<optim::AdamW4bitOptions>(host_options_4bit(options[g]));
    } else {
      hyper = std::make_unique<optim::AdamW8bitOptions>(host_options(options[g]));
    }
    groups.emplace_back(masters[g], std::move(hyper));
  }
  if (groups.empty()) return nullptr;
  if (four) return std::make_unique<optim::AdamW4bit>(groups, host_options_4bit(options.front()));
  return std::make_unique<optim::AdamW8bit>(groups, host_options(options.front()));
}

/// LibTorch's AdamW over the small tensors of each group (small[g]), likewise; null without any.
std::unique_ptr<torch::optim::AdamW> make_device(const std::vector<std::vector<torch::Tensor>>& small,
                                                 const std::vector<OffloadOptimizerOptions>& options) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t g = 0; g < small.size(); ++g) {
    if (small[g].empty()) continue;
    groups.emplace_back(small[g], std::make_unique<torch::optim::AdamWOptions>(device_options(options[g])));
  }
  if (groups.empty()) return nullptr;
  return std::make_unique<torch::optim::AdamW>(groups, device_options(options.front()));
}

/// Whether kernels/fingerprint.h reads `g`: fp32, bf16 or fp16 elements filling their memory, in any order
/// (the sum does not depend on it). Others are copied again at every step.
bool has_fingerprint(const torch::Tensor& g) {
  return kernel_dtype(g.scalar_type()) && g.is_non_overlapping_and_dense();
}

/// kernels/fingerprint.h's fingerprint of a CPU gradient, on all threads (any split gives the same sum).
uint64_t fingerprint_cpu(const torch::Tensor& g) {
  const void* data = g.data_ptr();
  const kernels::DType dtype = kernel_dtype(g.scalar_type()).value();
  return at::parallel_reduce(
      int64_t{0}, g.numel(), int64_t{1} << 16, uint64_t{0},
      [&](int64_t begin, int64_t end, uint64_t sum) {
        return sum + kernels::fingerprint(data, dtype, begin, end);
      },
      [](uint64_t a, uint64_t b) { return a + b; });
}

}  // namespace

/// What the gradient hooks share with the optimizer. A hook outlives neither the state (it holds it) nor the
/// optimizer's interest: the destructor removes the hooks and `owner_alive` turns any in flight into no-ops.
struct OffloadOptimizer::BackwardCopies {
  struct Slot {
    torch::Tensor param;
    torch::Tensor host;  ///< the host arena buffer (OffloadOptimizer::Offloaded::grad)
    /// The gradient the host buffer holds a copy of (weakly: a gradient set to none is freed), and its
    /// version then.
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> copied;
    uint32_t version = 0;
    /// Whether the backward fingerprinted the gradient before copying it (kernels/fingerprint.h): on the CPU
    /// `print` holds it, on CUDA entry `slot` of `prints`.
    bool printed = false;
    uint64_t print = 0;
    detail::HeldNode accumulator;
    uintptr_t hook_key = 0;
  };
  std::vector<Slot> slots;
  std::mutex mutex;  ///< a CUDA backward runs hooks on the device's thread
  bool deferred = false;
  bool owner_alive = true;
  int64_t made = 0;                        ///< copies since the last step
  std::optional<c10::Stream> side_stream;  ///< CUDA: where the copies run
  /// CUDA: the fingerprints, the backward's of each slot then the step's (2 x slots, made with the optimizer,
  /// so that a backward allocates nothing on the device).
  torch::Tensor prints;

  // step_during_backward: a host thread steps each parameter whose gradient has been copied.
  struct Arrived {
    size_t slot;
    std::optional<c10::Event> copied;  ///< CUDA: the copy to the host is done
  };
  std::function<void(size_t)> step_slot;  ///< null without step_during_backward
  std::vector<char> can_step;             ///< per slot: its master has its state, the backward may step it
  std::vector<char> stepped;              ///< per slot: handed to the host thread since the last step
  bool late_accumulation = false;         ///< a gradient arrived again after its parameter was stepped
  std::deque<Arrived> arrived;
  bool working = false, stopping = false;
  std::exception_ptr failure;
  std::condition_variable changed;
  std::thread worker;
  std::optional<c10::Stream> up_stream;  ///< CUDA: where the host thread copies parameters back

  /// Copies slot `i`'s gradient to the host, if there is one to copy now.
  void copy(size_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!owner_alive || deferred) return;
    if (step_slot && stepped[i]) {  // step() reports it: the parameter has been stepped already
      late_accumulation = true;
      return;
    }
    Slot& s = slots[i];
    const torch::Tensor& g = s.param.grad();
    if (!g.defined() || g.is_sparse() || g.sizes() != s.param.sizes()) return;  // the step says why
    // NOTE: the fingerprint is taken before the copy, so that a copy racing a clip on CUDA's compute stream
    // is caught: when the step finds the same fingerprint, every element the clip changed had its final value
    // when the fingerprint read it, so also when the copy read it after.
    const bool printed = has_fingerprint(g);
    if (g.is_cuda()) {
#ifdef MEMSAVE_WITH_CUDA
      if (!side_stream) side_stream = detail::side_stream(g.device());
      detail::wait_for_current_stream(*side_stream, g.device());
      if (printed) detail::fingerprint_on_stream(*side_stream, g, prints, static_cast<int64_t>(i));
      detail::copy_on_side_stream(*side_stream, s.host, g);
#else
      // a LibTorch with CUDA but memsave without: the step copies
      return;
#endif
    } else {
      if (printed) s.print = fingerprint_cpu(g);
      torch::NoGradGuard no_grad;
      s.host.copy_(g);
    }
    record(i, g, printed);
    ++made;
    if (step_slot && can_step[i] && printed) {  // (the step could not tell a change of the others)
      Arrived a{i, std::nullopt};
      if (g.is_cuda()) {
        a.copied.emplace(c10::DeviceType::CUDA);
        a.copied->record(*side_stream);
      }
      stepped[i] = 1;
      arrived.push_back(std::move(a));
      changed.notify_all();
    }
  }

  /// The host thread of step_during_backward: steps what arrives until told to stop.
  void work() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      changed.wait(lock, [&] { return stopping || !arrived.empty(); });
      if (stopping) return;
      Arrived a = std::move(arrived.front());
      arrived.pop_front();
      if (failure) continue;  // the step after the failure reports it; nothing more is stepped
      working = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        if (a.copied) a.copied->synchronize();
        step_slot(a.slot);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      working = false;
      if (error) failure = error;
      changed.notify_all();
    }
  }

  /// What the backward did since the last step, once the host thread has stepped all it was handed.
  struct SinceStep {
    std::vector<char> stepped;  ///< per slot: handed to the host thread (and stepped, but for a failure)
    int64_t copies = 0;
    std::exception_ptr failure;
    bool late_accumulation = false;
  };
  SinceStep finish_backward() {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return arrived.empty() && !working; });
    SinceStep since;
    since.stepped.assign(slots.size(), 0);
    if (step_slot) since.stepped.swap(stepped);
    since.copies = std::exchange(made, 0);
    since.failure = std::exchange(failure, nullptr);
    since.late_accumulation = std::exchange(late_accumulation, false);
    return since;
  }

  /// Notes that slot `i`'s host buffer now holds `g` as it is (`printed`: with its fingerprint taken).
  void record(size_t i, const torch::Tensor& g, bool printed) {
    slots[i].copied.emplace(g.getIntrusivePtr());
    slots[i].version = g._version();
    slots[i].printed = printed;
  }

  /// Waits for the copies queued on the side streams.
  void wait() {
#ifdef MEMSAVE_WITH_CUDA
    if (side_stream) detail::synchronize_stream(*side_stream);
    if (up_stream) detail::synchronize_stream(*up_stream);
#endif
  }

  /// Per slot: whether its host buffer holds the gradient as it is now: the same tensor, at the same version
  /// (which sees a gradient replaced, unscaled or accumulated) and with the same fingerprint (which also sees
  /// a write through `.data()`, as LibTorch's clip_grad_norm_ writes). Call after `wait()`. On CUDA, one
  /// synchronization of the device's current stream.
  std::vector<char> unchanged() {
    std::vector<char> same(slots.size(), 0);
    std::vector<size_t> on_device;
    for (size_t i = 0; i < slots.size(); ++i) {
      const Slot& s = slots[i];
      const torch::Tensor& g = s.param.grad();
      if (!s.copied || !s.printed || !g.defined()) continue;
      if (s.copied->lock().get() != g.unsafeGetTensorImpl() || s.version != g._version()) continue;
      if (g.is_cuda()) {
        on_device.push_back(i);
      } else {
        same[i] = fingerprint_cpu(g) == s.print;
      }
    }
#ifdef MEMSAVE_WITH_CUDA
    if (!on_device.empty()) {
      const auto n = static_cast<int64_t>(slots.size());
      for (size_t i : on_device) {
        const torch::Tensor& g = slots[i].param.grad();
        detail::fingerprint_on_stream(detail::cuda_current_stream(g.device().index()), g, prints,
                                      n + static_cast<int64_t>(i));
      }
      const torch::Tensor host = prints.cpu();
      const int64_t* print = host.data_ptr<int64_t>();
      for (size_t i : on_device) same[i] = print[i] == print[n + static_cast<int64_t>(i)];
    }
#endif
    return same;
  }
};

namespace {

/// Runs after the backward has accumulated a parameter's gradient.
class CopyWhenAccumulated : public detail::ToleratesNoGradient {
 public:
  CopyWhenAccumulated(std::shared_ptr<OffloadOptimizer::BackwardCopies> copies, size_t slot)
      : copies_(std::move(copies)), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    // None arrives where a checkpointed piece added the gradient in its own backward (which ran this hook
    // then), or where a piece's recomputation did not use the parameter.
    if (!inputs.empty() && inputs[0].defined()) copies_->copy(slot_);
    return outputs;
  }

 private:
  std::shared_ptr<OffloadOptimizer::BackwardCopies> copies_;
  size_t slot_;
};

}  // namespace

void OffloadOptimizerOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", lr());
  write_betas(archive, betas());
  archive.write("eps", eps());
  archive.write("weight_decay", weight_decay());
  archive.write("state_bits", state_bits());
  archive.write("min_offload_size", min_offload_size());
  archive.write("copy_during_backward", copy_during_backward());
  archive.write("step_during_backward", step_during_backward());
}

void OffloadOptimizerOptions::serialize(torch::serialize::InputArchive& archive) {
  lr(read_double(archive, "lr")).betas(read_betas(archive)).eps(read_double(archive, "eps"));
  weight_decay(read_double(archive, "weight_decay")).state_bits(read_int(archive, "state_bits"));
  min_offload_size(read_int(archive, "min_offload_size"));
  copy_during_backward(read_bool_or(archive, "copy_during_backward", false));
  step_during_backward(read_bool_or(archive, "step_during_backward", false));
}

bool operator==(const OffloadOptimizerOptions& a, const OffloadOptimizerOptions& b) {
  return a.lr() == b.lr() && a.betas() == b.betas() && a.eps() == b.eps() &&
         a.weight_decay() == b.weight_decay() && a.state_bits() == b.state_bits() &&
         a.min_offload_size() == b.min_offload_size() &&
         a.copy_during_backward() == b.copy_during_backward() &&
         a.step_during_backward() == b.step_during_backward();
}

OffloadOptimizer::OffloadOptimizer(std::vector<torch::Tensor> params, OffloadOptimizerOptions options)
    : OffloadOptimizer(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                           std::move(params))},
                       std::move(options)) {}

OffloadOptimizer::OffloadOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                   OffloadOptimizerOptions defaults)
    : Optimizer(groups, std::make_unique<OffloadOptimizerOptions>(defaults)) {
  compat::keep_group_options(param_groups_, groups);
  check_options(defaults);
  TORCH_CHECK(!param_groups_.empty(), "OffloadOptimizer: no parameter groups");
  for (size_t g = 0; g < param_groups_.size(); ++g) check_group(param_groups_, g);
  const OffloadOptimizerOptions options = this->options();  // the storage options, the same in every group
  const torch::Tensor* front = nullptr;
  for (const auto& group : param_groups_)
    if (front == nullptr && !group.params().empty()) front = &group.params().front();
  TORCH_CHECK(front != nullptr, "OffloadOptimizer: no parameters");
  const c10::Device device = front->device();
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<std::vector<torch::Tensor>> masters(param_groups_.size()), small(param_groups_.size());
  size_t i = 0;  // the parameter's place over all groups, for the messages
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (const torch::Tensor& p : param_groups_[g].params()) {
      TORCH_CHECK(p.defined() && p.is_leaf(), "OffloadOptimizer: parameter ", i, " is not a leaf tensor");
      TORCH_CHECK(p.device() == device, "OffloadOptimizer: the parameters are on several devices (", device,
                  " and ", p.device(), " for parameter ", i, ")");
      TORCH_CHECK(p.is_floating_point(), "OffloadOptimizer: parameter ", i, " is ", p.scalar_type(),
                  ", not floating point");
      TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "OffloadOptimizer: parameter ", i,
                  " is listed twice (a module used twice appears twice in LibTorch's parameters(): "
                  "memsave::unique_parameters(model->parameters()) lists it once)");
      // A small tensor, or a frozen one (no master or gradient buffer on the host for a parameter no
      // backward reaches), stays on the device: its AdamW makes state only once a gradient comes.
      if (p.numel() < options.min_offload_size() || !p.requires_grad()) {
        small[g].push_back(p);
        ++i;
        continue;
      }
      // Its fp32 master is the weight it gets back: a wider type would lose precision at every step, and an
      // expanded tensor has no room for the copy back.
      TORCH_CHECK(
          kernel_dtype(p.scalar_type()), "OffloadOptimizer: parameter ", i, " is ", p.scalar_type(),
          "; an offloaded parameter must be float32, float16 or bfloat16 (its master weights are fp32)");
      TORCH_CHECK(at::has_internal_overlap(p) != at::MemOverlap::Yes, "OffloadOptimizer: parameter ", i,
                  " has elements that share memory (an expanded tensor, strides ", p.strides(),
                  "); a parameter needs memory of its own");
      Offloaded o;
      o.param = p;
      o.group = g;
      o.index = static_cast<int64_t>(i);
      o.master = detail::host_empty_like(p, torch::kFloat);
      o.grad = detail::host_empty_like(p, torch::kFloat);
      if (p.is_cuda() && p.scalar_type() != torch::kFloat)
        o.staging = detail::host_empty_like(p, p.scalar_type());
      {
        torch::NoGradGuard no_grad;
        o.master.copy_(p);
      }
      masters[g].push_back(o.master);
      offloaded_.push_back(std::move(o));
      ++i;
    }
  }
  const std::vector<OffloadOptimizerOptions> hyper = options_of(param_groups_, param_groups_.size());
  host_group_ = index_of_non_empty(masters);
  device_group_ = index_of_non_empty(small);
  host_ = make_host(masters, hyper);
  device_ = make_device(small, hyper);
  if ((options.copy_during_backward() || options.step_during_backward()) && !offloaded_.empty()) {
    // NOTE: the optimizer holds each parameter's gradient accumulator, so every later graph uses the same
    // node and its hook (a parameter keeps only a weak reference to it).
    copies_ = std::make_shared<BackwardCopies>();
    copies_->slots.resize(offloaded_.size());
#ifdef MEMSAVE_WITH_CUDA
    if (device.is_cuda()) {
      copies_->prints = torch::zeros({2 * static_cast<int64_t>(offloaded_.size())},
                                     torch::dtype(torch::kLong).device(device));
    }
#endif
    for (size_t i = 0; i < offloaded_.size(); ++i) {
      BackwardCopies::Slot& slot = copies_->slots[i];
      slot.param = offloaded_[i].param;
      slot.host = offloaded_[i].landing();
      if (!slot.param.requires_grad()) continue;  // no backward will reach it
      slot.accumulator = detail::HeldNode(torch::autograd::impl::grad_accumulator(slot.param));
      slot.hook_key = slot.accumulator->add_post_hook(std::make_unique<CopyWhenAccumulated>(copies_, i));
    }
    if (options.step_during_backward()) {
      copies_->stepped.assign(offloaded_.size(), 0);
      copies_->can_step.assign(offloaded_.size(), 0);
      copies_->step_slot = [this](size_t i) { step_one(i, /*beside=*/true); };
      copies_->worker = std::thread([copies = copies_.get()] { copies->work(); });
    }
  }
}

OffloadOptimizer::~OffloadOptimizer() {
  if (!copies_) return;
  {
    std::lock_guard<std::mutex> lock(copies_->mutex);
    copies_->owner_alive = false;
    copies_->stopping = true;
    copies_->changed.notify_all();
  }
  if (copies_->worker.joinable()) copies_->worker.join();
  std::lock_guard<std::mutex> lock(copies_->mutex);
  for (BackwardCopies::Slot& slot : copies_->slots)
    if (slot.accumulator) slot.accumulator->del_post_hook(slot.hook_key);
}

void OffloadOptimizer::defer_gradient_copies(bool defer) {
  if (!copies_) return;
  std::lock_guard<std::mutex> lock(copies_->mutex);
  copies_->deferred = defer;
}

void OffloadOptimizer::discard_backward() {
  if (!copies_) return;
  BackwardCopies::SinceStep since = copies_->finish_backward();
  copies_->wait();  // the host thread's copies back too, before the next forward reads the parameters
  if (since.failure) {
    std::lock_guard<std::mutex> lock(copies_->mutex);
    copies_->failure = since.failure;
  }
}

void OffloadOptimizer::refresh_masters() {
  discard_backward();  // and with it the copies back in flight, which would overwrite the parameters
  torch::NoGradGuard no_grad;
  for (const Offloaded& o : offloaded_) {
    // NOTE: through `staging`, as copy_back: a converting copy off the device would take a device buffer.
    o.master.copy_(o.staging.defined() ? o.staging.copy_(o.param) : o.param);
  }
}

const OffloadOptimizerOptions& OffloadOptimizer::options() const {
  return static_cast<const OffloadOptimizerOptions&>(param_groups().front().options());
}

void OffloadOptimizer::sync_hyper_parameters() {
  // (over the groups it was built with; step() refuses groups added since)
  for (size_t g = 0; g < host_group_.size(); ++g) check_group(param_groups_, g);
  if (host_) {
    // The host optimizer's kind is fixed when it is made: state_bits may move between 32 and 8 (which sets
    // the size from which new state is 8-bit), not to or from 4.
    TORCH_CHECK((options().state_bits() == 4) == (host_->bits() == 4), "OffloadOptimizer: state_bits ",
                options().state_bits(), " cannot replace the ", host_->bits() == 4 ? "4" : "8 or 32",
                " the optimizer was made with");
  }
  for (size_t g = 0; g < host_group_.size(); ++g) {
    const auto& o = static_cast<const OffloadOptimizerOptions&>(param_groups_[g].options());
    if (host_group_[g] >= 0) {
      torch::optim::OptimizerOptions& host = host_->param_groups()[host_group_[g]].options();
      if (host_->bits() == 4) {
        static_cast<optim::AdamW4bitOptions&>(host) = host_options_4bit(o);
      } else {
        static_cast<optim::AdamW8bitOptions&>(host) = host_options(o);
      }
    }
    if (device_group_[g] >= 0) {
      static_cast<torch::optim::AdamWOptions&>(device_->param_groups()[device_group_[g]].options()) =
          device_options(o);
    }
  }
}

torch::Tensor OffloadOptimizer::step(LossClosure closure) {
  // Its masters, state and hooks are made for the parameters it was built over.
  TORCH_CHECK(param_groups_.size() == host_group_.size(),
              "OffloadOptimizer: ", param_groups_.size() - host_group_.size(),
              " parameter group(s) added after construction (add_param_group), whose parameters it has no "
              "master weights or state for; build it over all the parameters");
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // 0. What the backward did: the copies it made and the parameters it stepped (step_during_backward, on
  //    the host thread: wait for it). Its failure is this step's error.
  last_copies_ = {};
  std::vector<char> stepped(offloaded_.size(), 0);
  if (copies_) {
    BackwardCopies::SinceStep since = copies_->finish_backward();
    last_copies_.during_backward = since.copies;
    stepped = std::move(since.stepped);
    last_copies_.stepped_during_backward = std::count(stepped.begin(), stepped.end(), 1);
    if (since.failure) std::rethrow_exception(since.failure);
    TORCH_CHECK(!since.late_accumulation,
                "OffloadOptimizer: a gradient was accumulated after the backward had stepped its parameter "
                "(step_during_backward); under accumulation call defer_gradient_copies(true) for every "
                "micro-batch but the window's last");
  }
  sync_hyper_parameters();
  // 1. Gradients to the host (asynchronously into pinned buffers on CUDA, one synchronization).
  //    Checks come first: a rejected step changes nothing (but what the backward stepped, which it reports).
  for (size_t i = 0; i < offloaded_.size(); ++i) {
    const Offloaded& o = offloaded_[i];
    const torch::Tensor& g = o.param.grad();
    TORCH_CHECK(!g.defined() || !g.is_sparse(), "OffloadOptimizer: sparse gradients are not supported");
    TORCH_CHECK(!g.defined() || g.sizes() == o.param.sizes(), "OffloadOptimizer: a gradient of shape ",
                g.sizes(), " for a parameter of shape ", o.param.sizes());
  }
  //    A gradient copied during the backward and unchanged since is not copied again.
  std::vector<char> unchanged(offloaded_.size(), 0);
  if (copies_) {
    copies_->wait();  // before a copy below can write a buffer the side streams write
    unchanged = copies_->unchanged();
  }
  for (size_t i = 0; i < offloaded_.size(); ++i) {
    TORCH_CHECK(
        !stepped[i] || unchanged[i], "OffloadOptimizer: the gradient of offloaded parameter ", i, " (shape ",
        offloaded_[i].param.sizes(),
        ") changed after the backward stepped the parameter (step_during_backward): nothing may change "
        "the gradients between the backward and the step");
  }
  bool on_cuda = false;
  std::vector<size_t> to_step;
  for (size_t i = 0; i < offloaded_.size(); ++i) {
    Offloaded& o = offloaded_[i];
    const torch::Tensor& g = o.param.grad();
    if (!g.defined() || stepped[i]) continue;  // no gradient, or stepped already: the master is not stepped
    if (!unchanged[i]) {
      o.landing().copy_(g, /*non_blocking=*/g.is_cuda());
      // (without a fingerprint: a gradient copied at the step is copied again at the next one; fingerprinting
      // it here would add a pass to every step whose gradients were unscaled or accumulated since the copy)
      if (copies_) copies_->record(i, g, /*printed=*/false);
      ++last_copies_.at_step;
    }
    to_step.push_back(i);
    on_cuda = on_cuda || g.is_cuda();
  }
  // The whole device: the copies on the side stream, those above, and the last step's parameter copies.
  if (on_cuda) torch::cuda::synchronize(offloaded_.front().param.device().index());

  // 2. The CPU step on the masters (its state is created in the host arena), and 3. the parameters back to
  //    the device.
  // LibTorch's AdamW over the small tensors allocates as it steps (its state, its denominators): its room is
  // made before any master is stepped, so that running out of memory there changes nothing.
  if (device_) detail::make_room_for_step(*device_);
  if (host_ && !to_step.empty()) step_masters(to_step);
  if (device_) device_->step();
  update_can_step();
  return loss;
}

void OffloadOptimizer::update_can_step() {
  if (!copies_ || !copies_->step_slot) return;  // the next backward may step the parameters that have state
  std::lock_guard<std::mutex> lock(copies_->mutex);
  for (size_t i = 0; i < offloaded_.size(); ++i)
    copies_->can_step[i] = host_->state().count(offloaded_[i].master.unsafeGetTensorImpl()) > 0;
}

void OffloadOptimizer::step_masters(const std::vector<size_t>& which) {
  // Once every master has its state, one at a time: each parameter's copy back is queued (asynchronously on
  // CUDA) as soon as its master is stepped, so the copies overlap the rest of the CPU step. Until then all
  // at once, so that running out of memory while creating the state changes nothing.
  const bool every_state = std::all_of(which.begin(), which.end(), [&](size_t i) {
    return host_->state().count(offloaded_[i].master.unsafeGetTensorImpl()) > 0;
  });
  if (every_state) {
    for (size_t i : which) step_one(i, /*beside=*/false);
    return;
  }
  HostAllocationScope host;
  // The inner optimizer steps the masters that have a gradient; outside a step none has.
  auto clear = [&] {
    for (size_t i : which) offloaded_[i].master.mutable_grad() = torch::Tensor();
  };
  for (size_t i : which) {
    offloaded_[i].widen_gradient();
    offloaded_[i].master.mutable_grad() = offloaded_[i].grad;
  }
  try {
    host_->step();
  } catch (...) {
    clear();
    throw;
  }
  clear();
  for (size_t i : which) copy_back(offloaded_[i], /*beside=*/false);
}

void OffloadOptimizer::step_one(size_t i, bool beside) {
  torch::NoGradGuard no_grad;  // the host thread's own mode
  HostAllocationScope host;
  const Offloaded& o = offloaded_[i];
  if (beside) sync_hyper_parameters();  // a schedule may have changed them since the last step
  o.widen_gradient();
  o.master.mutable_grad() = o.grad;
  try {
    host_->step();
  } catch (...) {
    o.master.mutable_grad() = torch::Tensor();
    throw;
  }
  o.master.mutable_grad() = torch::Tensor();
  copy_back(o, beside);
}

void OffloadOptimizer::copy_back(const Offloaded& o, bool beside) {
#ifdef MEMSAVE_WITH_CUDA
  if (o.param.is_cuda()) {  // beside the backward: on a stream of its own, which the next step waits for
    if (beside && !copies_->up_stream) copies_->up_stream = detail::side_stream(o.param.device());
    const c10::Stream stream =
        beside ? *copies_->up_stream : detail::cuda_current_stream(o.param.device().index());
    // NOTE: converted on the host (`staging`): an out-of-memory for a conversion buffer on the device would
    // leave this parameter behind its stepped master.
    const torch::Tensor& source = o.staging.defined() ? o.staging.copy_(o.master) : o.master;
    const c10::StreamGuard guard(stream);
    o.param.copy_(source, /*non_blocking=*/true);
    detail::cuda_record_host_use(source, stream);
    return;
  }
#else
  (void)beside;  // without CUDA glue a copy back is the same beside the backward as at the step
#endif
  o.param.copy_(o.master, /*non_blocking=*/o.param.is_cuda());
}

std::vector<torch::Tensor> OffloadOptimizer::state_tensors() const {
  return device_ ? optimizer_state_tensors(*device_) : std::vector<torch::Tensor>{};
}

std::vector<torch::Tensor> OffloadOptimizer::host_state_tensors() const {
  std::vector<torch::Tensor> out;
  for (const Offloaded& o : offloaded_) {
    out.push_back(o.master);
    out.push_back(o.grad);
    if (o.staging.defined()) out.push_back(o.staging);
  }
  if (host_) {
    const auto state = host_->state_tensors();
    out.insert(out.end(), state.begin(), state.end());
  }
  return out;
}

bool OffloadOptimizer::offloaded(const torch::Tensor& param) const {
  for (const Offloaded& o : offloaded_)
    if (o.param.is_same(param)) return true;
  return false;
}

namespace {

/// Where the options of parameter group g are saved ("offload/options" for the first, as in files from before
/// there were groups).
std::string options_key(size_t g) {
  return g == 0 ? "offload/options" : "offload/options" + std::to_string(g);
}

}  // namespace

void OffloadOptimizer::save(torch::serialize::OutputArchive& archive) const {
  for (size_t g = 0; g < host_group_.size(); ++g) {
    torch::serialize::OutputArchive options_archive;
    static_cast<const OffloadOptimizerOptions&>(param_groups_[g].options()).serialize(options_archive);
    archive.write(options_key(g), options_archive);
  }
  // (one group: none written, as in files from before there were groups)
  if (host_group_.size() > 1) {
    archive.write("offload/group_sizes", torch::tensor(group_sizes(param_groups_, host_group_.size())),
                  /*is_buffer=*/true);
  }
  archive.write("offload/count", static_cast<int64_t>(offloaded_.size()));
  // Which parameters are offloaded (not those frozen when it was built): a file read into an optimizer that
  // offloads others would give masters to the wrong parameters.
  std::vector<int64_t> which;
  for (const Offloaded& o : offloaded_) which.push_back(o.index);
  archive.write("offload/which", torch::tensor(which, torch::kLong), /*is_buffer=*/true);
  for (size_t i = 0; i < offloaded_.size(); ++i)
    archive.write("offload/master" + std::to_string(i), offloaded_[i].master);
  if (host_) {
    torch::serialize::OutputArchive inner;
    host_->save(inner);
    archive.write("offload/host", inner);
  }
  if (device_) {
    torch::serialize::OutputArchive inner;
    device_->save(inner);
    archive.write("offload/device", inner);
  }
}

void OffloadOptimizer::load(torch::serialize::InputArchive& archive) {
  // Everything is read and checked into temporaries first; the optimizer changes only when all of it is good.
  const int64_t count = read_int(archive, "offload/count");
  TORCH_CHECK(count == static_cast<int64_t>(offloaded_.size()), "OffloadOptimizer::load: the file has ",
              count, " offloaded parameters, this optimizer ", offloaded_.size(),
              " (a parameter is offloaded when it has min_offload_size elements or more and requires grad "
              "when the optimizer is built)");
  // Files from before it was saved offloaded every parameter of min_offload_size elements or more.
  const std::vector<int64_t> which =
      detail::read_int_list(archive, "offload/which", "OffloadOptimizer::load");
  for (size_t i = 0; i < which.size(); ++i)
    TORCH_CHECK(which[i] == offloaded_[i].index, "OffloadOptimizer::load: the file's offloaded parameter ", i,
                " is parameter ", which[i], ", this optimizer's parameter ", offloaded_[i].index,
                " (a parameter is offloaded when it has min_offload_size elements or more and requires grad "
                "when the optimizer is built): the layers frozen then, or min_offload_size, differ");
  std::vector<torch::Tensor> masters;
  for (int64_t i = 0; i < count; ++i) {
    torch::Tensor master;
    archive.read("offload/master" + std::to_string(i), master);
    TORCH_CHECK(master.sizes() == offloaded_[i].master.sizes() && master.scalar_type() == torch::kFloat,
                "OffloadOptimizer::load: master weight ", i, " is ", master.scalar_type(), " ",
                master.sizes(), ", expected Float ", offloaded_[i].master.sizes());
    masters.push_back(master);
  }
  // The options saved, group by group (files from before they were have none: this optimizer's; files from
  // before groups, one group's).
  const size_t groups = host_group_.size();
  const std::vector<int64_t> sizes = group_sizes(param_groups_, groups);
  std::vector<int64_t> file_sizes =
      detail::read_int_list(archive, "offload/group_sizes", "OffloadOptimizer::load");
  if (file_sizes.empty()) file_sizes = {std::accumulate(sizes.begin(), sizes.end(), int64_t{0})};
  TORCH_CHECK(file_sizes == sizes, "OffloadOptimizer::load: the file's parameter groups hold ",
              c10::IntArrayRef(file_sizes), " parameters, this optimizer's ", c10::IntArrayRef(sizes));
  const std::vector<OffloadOptimizerOptions> current = options_of(param_groups_, groups);
  std::vector<OffloadOptimizerOptions> saved = current;
  for (size_t g = 0; g < groups; ++g) {
    torch::serialize::InputArchive options_archive;
    if (archive.try_read(options_key(g), options_archive)) {
      saved[g].serialize(options_archive);
      check_options(saved[g]);
      TORCH_CHECK(saved[g].state_bits() == saved.front().state_bits(),
                  "OffloadOptimizer::load: the file's group ", g, " has state_bits ", saved[g].state_bits(),
                  ", its group 0 ", saved.front().state_bits());
    } else {
      TORCH_CHECK(g == 0, "OffloadOptimizer::load: the file has no options for parameter group ", g);
    }
  }
  std::vector<std::vector<torch::Tensor>> masters_by_group(groups);
  for (const Offloaded& o : offloaded_) masters_by_group[o.group].push_back(o.master);
  std::unique_ptr<optim::LowBitOptimizer> host;
  if (host_) {
    torch::serialize::InputArchive inner;
    archive.read("offload/host", inner);
    HostAllocationScope in_host;
    // State of another width (state_bits) is read as it was saved, then converted to this optimizer's.
    // NOTE: read into this optimizer's own, 32-bit state would stay fp32 under state_bits 8 and 8-bit state
    // would stay 8-bit under state_bits 32 (the state of a tensor keeps the format it was made with).
    host = make_host(masters_by_group, saved);
    host->load(inner);
    if (saved.front().state_bits() != options().state_bits()) {
      std::unique_ptr<optim::LowBitOptimizer> converted = make_host(masters_by_group, current);
      optim::copy_state(*host, *converted);
      host = std::move(converted);
    }
  }
  std::unique_ptr<torch::optim::AdamW> device;
  if (device_) {
    std::vector<std::vector<torch::Tensor>> small_by_group(groups);
    for (size_t g = 0; g < groups; ++g)
      if (device_group_[g] >= 0) small_by_group[g] = device_->param_groups()[device_group_[g]].params();
    device = make_device(small_by_group, current);
    torch::serialize::InputArchive inner;
    archive.read("offload/device", inner);
    device->load(inner);
  }
  // The hyper-parameters saved; how this optimizer was made stays.
  std::vector<OffloadOptimizerOptions> hyper = current;
  for (size_t g = 0; g < groups; ++g) {
    hyper[g]
        .lr(saved[g].lr())
        .betas(saved[g].betas())
        .eps(saved[g].eps())
        .weight_decay(saved[g].weight_decay());
  }
  // Commit, once the host thread of step_during_backward has stopped reading the state.
  discard_backward();
  for (size_t g = 0; g < groups; ++g)
    static_cast<OffloadOptimizerOptions&>(param_groups_[g].options()) = hyper[g];
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < count; ++i) {
    offloaded_[i].master.copy_(masters[i]);
    copy_back(offloaded_[i], /*beside=*/false);
  }
  if (host) host_ = std::move(host);
  if (device) device_ = std::move(device);
  update_can_step();
}

}  // namespace memsave
