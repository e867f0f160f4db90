#include "memsave/offload.h"

#include "archive.h"

#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <limits>
#include <unordered_set>

namespace memsave {
namespace {

using detail::read_betas;
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
  TORCH_CHECK(o.state_bits() == 32 || o.state_bits() == 8,
              "OffloadOptimizer: state_bits must be 32 or 8, got ", o.state_bits());
  TORCH_CHECK(o.min_offload_size() >= 0, "OffloadOptimizer: min_offload_size must be >= 0, got ",
              o.min_offload_size());
}

/// The host-side update is AdamW8bit's: 8-bit blockwise state, or fp32 state through the same fused kernels
/// when no tensor is large enough to quantize.
optim::AdamW8bitOptions host_options(const OffloadOptimizerOptions& o) {
  return optim::AdamW8bitOptions(o.lr())
      .betas(o.betas())
      .eps(o.eps())
      .weight_decay(o.weight_decay())
      .min_8bit_size(o.state_bits() == 8 ? optim::AdamW8bitOptions().min_8bit_size()
                                         : std::numeric_limits<int64_t>::max());
}

torch::optim::AdamWOptions device_options(const OffloadOptimizerOptions& o) {
  return torch::optim::AdamWOptions(o.lr()).betas(o.betas()).eps(o.eps()).weight_decay(o.weight_decay());
}

}  // namespace

void OffloadOptimizerOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", lr());
  write_betas(archive, betas());
  archive.write("eps", eps());
  archive.write("weight_decay", weight_decay());
  archive.write("state_bits", state_bits());
  archive.write("min_offload_size", min_offload_size());
}

void OffloadOptimizerOptions::serialize(torch::serialize::InputArchive& archive) {
  lr(read_double(archive, "lr")).betas(read_betas(archive)).eps(read_double(archive, "eps"));
  weight_decay(read_double(archive, "weight_decay")).state_bits(read_int(archive, "state_bits"));
  min_offload_size(read_int(archive, "min_offload_size"));
}

bool operator==(const OffloadOptimizerOptions& a, const OffloadOptimizerOptions& b) {
  return a.lr() == b.lr() && a.betas() == b.betas() && a.eps() == b.eps() &&
         a.weight_decay() == b.weight_decay() && a.state_bits() == b.state_bits() &&
         a.min_offload_size() == b.min_offload_size();
}

OffloadOptimizer::OffloadOptimizer(std::vector<torch::Tensor> params, OffloadOptimizerOptions options)
    : Optimizer({torch::optim::OptimizerParamGroup(params)},
                std::make_unique<OffloadOptimizerOptions>(options)) {
  check_options(options);
  TORCH_CHECK(!params.empty(), "OffloadOptimizer: no parameters");
  const c10::Device device = params.front().device();
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<torch::Tensor> masters, small;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    TORCH_CHECK(p.defined() && p.is_leaf(), "OffloadOptimizer: parameter ", i, " is not a leaf tensor");
    TORCH_CHECK(p.device() == device, "OffloadOptimizer: the parameters are on several devices (", device,
                " and ", p.device(), " for parameter ", i, ")");
    TORCH_CHECK(p.is_floating_point(), "OffloadOptimizer: parameter ", i, " is ", p.scalar_type(),
                ", not floating point");
    TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "OffloadOptimizer: parameter ", i,
                " is listed twice");
    if (p.numel() < options.min_offload_size()) {
      small.push_back(p);
      continue;
    }
    Offloaded o;
    o.param = p;
    o.master = host_empty(p.sizes(), torch::kFloat);
    o.grad = host_empty(p.sizes(), torch::kFloat);
    {
      torch::NoGradGuard no_grad;
      o.master.copy_(p);
    }
    masters.push_back(o.master);
    offloaded_.push_back(std::move(o));
  }
  if (!masters.empty()) host_ = std::make_unique<optim::AdamW8bit>(masters, host_options(options));
  if (!small.empty()) device_ = std::make_unique<torch::optim::AdamW>(small, device_options(options));
}

const OffloadOptimizerOptions& OffloadOptimizer::options() const {
  return static_cast<const OffloadOptimizerOptions&>(param_groups().front().options());
}

void OffloadOptimizer::sync_hyper_parameters() {
  check_options(options());
  if (host_) {
    static_cast<optim::AdamW8bitOptions&>(host_->param_groups().front().options()) = host_options(options());
  }
  if (device_) {
    static_cast<torch::optim::AdamWOptions&>(device_->param_groups().front().options()) =
        device_options(options());
  }
}

torch::Tensor OffloadOptimizer::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable_grad(true);
    loss = closure();
  }
  sync_hyper_parameters();
  // 1. Gradients to the host (asynchronously into pinned buffers on CUDA, one synchronization).
  //    Checks come first: a rejected step changes nothing.
  for (const Offloaded& o : offloaded_) {
    const torch::Tensor& g = o.param.grad();
    TORCH_CHECK(!g.defined() || !g.is_sparse(), "OffloadOptimizer: sparse gradients are not supported");
    TORCH_CHECK(!g.defined() || g.sizes() == o.param.sizes(), "OffloadOptimizer: a gradient of shape ",
                g.sizes(), " for a parameter of shape ", o.param.sizes());
  }
  bool on_cuda = false;
  for (Offloaded& o : offloaded_) {
    const torch::Tensor& g = o.param.grad();
    if (!g.defined()) {
      o.master.mutable_grad() = torch::Tensor();  // no gradient: the master is not stepped
      continue;
    }
    o.grad.copy_(g, /*non_blocking=*/g.is_cuda());
    o.master.mutable_grad() = o.grad;
    on_cuda = on_cuda || g.is_cuda();
  }
  if (on_cuda) torch::cuda::synchronize(offloaded_.front().param.device().index());

  // 2. The CPU step on the masters; its state is created in the host arena.
  if (host_) {
    HostAllocationScope host;
    host_->step();
  }
  if (device_) device_->step();

  // 3. Parameters back to the device.
  for (const Offloaded& o : offloaded_)
    if (o.master.grad().defined()) o.param.copy_(o.master, /*non_blocking=*/o.param.is_cuda());
  return loss;
}

std::vector<torch::Tensor> OffloadOptimizer::state_tensors() const {
  return device_ ? optimizer_state_tensors(*device_) : std::vector<torch::Tensor>{};
}

std::vector<torch::Tensor> OffloadOptimizer::host_state_tensors() const {
  std::vector<torch::Tensor> out;
  for (const Offloaded& o : offloaded_) {
    out.push_back(o.master);
    out.push_back(o.grad);
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

void OffloadOptimizer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("offload/count", static_cast<int64_t>(offloaded_.size()));
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
              count, " offloaded parameters, this optimizer ", offloaded_.size());
  std::vector<torch::Tensor> masters;
  for (int64_t i = 0; i < count; ++i) {
    torch::Tensor master;
    archive.read("offload/master" + std::to_string(i), master);
    TORCH_CHECK(master.sizes() == offloaded_[i].master.sizes() && master.scalar_type() == torch::kFloat,
                "OffloadOptimizer::load: master weight ", i, " is ", master.scalar_type(), " ",
                master.sizes(), ", expected Float ", offloaded_[i].master.sizes());
    masters.push_back(master);
  }
  std::unique_ptr<optim::AdamW8bit> host;
  if (host_) {
    std::vector<torch::Tensor> params;
    for (const Offloaded& o : offloaded_) params.push_back(o.master);
    host = std::make_unique<optim::AdamW8bit>(params, host_options(options()));
    torch::serialize::InputArchive inner;
    archive.read("offload/host", inner);
    HostAllocationScope in_host;
    host->load(inner);
  }
  std::unique_ptr<torch::optim::AdamW> device;
  if (device_) {
    device = std::make_unique<torch::optim::AdamW>(device_->param_groups().front().params(),
                                                   device_options(options()));
    torch::serialize::InputArchive inner;
    archive.read("offload/device", inner);
    device->load(inner);
  }
  // Commit.
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < count; ++i) {
    offloaded_[i].master.copy_(masters[i]);
    offloaded_[i].param.copy_(masters[i]);
  }
  if (host) host_ = std::move(host);
  if (device) device_ = std::move(device);
}

}  // namespace memsave
