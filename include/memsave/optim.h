// Optimizers with 8-bit state (Adam8bit, AdamW8bit, Lion8bit, SGD8bit) and 4-bit state (Adam4bit, AdamW4bit,
// SGD4bit).
//
//   memsave::optim::AdamW8bit opt(net->parameters(),
//   memsave::optim::AdamW8bitOptions(1e-3).weight_decay(0.01));
//   ... loss.backward(); opt.step();
//
// They derive from torch::optim::Optimizer and drop into any LibTorch loop. Each moment is stored as one byte
// per element (dynamic-exponent code books, blockwise absmax scaling) and updated by one fused pass per
// block: dequantize, update, new block absmax, requantize. Adam keeps about 2 bytes of state per parameter
// instead of 8. Tensors under `min_8bit_size` elements keep fp32 state, as does any parameter passed to
// `force_32bit`. For bf16 weights kept without an fp32 copy, `bf16_stochastic_round(true)` rounds each new
// weight stochastically, so that updates under half a bf16 step add up instead of vanishing.
//
// The 4-bit optimizers (torchao's AdamW4bit, after Li et al., "Memory Efficient Optimizers with 4-bit
// States", 2023, with blockwise scaling for both moments) pack two codes to a byte, in blocks of 128 by
// default: a 16-value dynamic-exponent book for the first moment and the linear book k/16 (k = 1...16, no
// zero) for the second, so that a small second moment never dequantizes to 0 and blows up its update. Adam
// keeps about 1.06 bytes of state per parameter; SGD, whose momentum takes the first moment's book, 0.53.
// (Lion has no 4-bit state: its running average, beta2 0.99 by default, moves each step by 1% of the
// gradient's distance from it, far less than half the 16-value book's gaps, so nearest rounding keeps most of
// it where it was and its signs go stale: on Fashion-MNIST it lost 1.35 points against fp32 Lion where 8-bit
// lost none, bench/RESULTS-fashion-mnist.md.)
#pragma once

#include <memsave/memory.h>

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <tuple>
#include <unordered_set>
#include <vector>

namespace memsave {

/// `params` with each tensor once, in the order of their first appearance. LibTorch's Module::parameters()
/// lists the parameters of a module used twice (layers sharing weights) twice; LibTorch's optimizers then
/// step them twice per step and clip_grad_norm_ counts them twice. memsave's optimizers refuse such a list;
/// the Trainer and the rescue pass their optimizers this one.
std::vector<torch::Tensor> unique_parameters(const std::vector<torch::Tensor>& params);

}  // namespace memsave

namespace memsave::optim {

namespace detail {
struct StateAccess;  ///< what copy_state reads and writes of memsave's optimizers (src/copy_state.cpp)
}  // namespace detail

using betas_t = std::tuple<double, double>;

struct Adam8bitOptions : torch::optim::OptimizerCloneableOptions<Adam8bitOptions> {
  Adam8bitOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT: implicit, as LibTorch's options
  /// Learning rate.
  TORCH_ARG(double, lr) = 1e-3;
  /// Coefficients of the running averages of the gradient and of its square.
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to the denominator.
  TORCH_ARG(double, eps) = 1e-8;
  /// L2 penalty added to the gradient.
  TORCH_ARG(double, weight_decay) = 0;
  /// Elements per quantization block: a power of two in [64, 4096].
  TORCH_ARG(int64_t, block_size) = 256;
  /// Tensors with fewer elements keep fp32 state.
  TORCH_ARG(int64_t, min_8bit_size) = 4096;
  /// bf16 parameters: round each updated value to bf16 stochastically (up or down with the probabilities
  /// that make its expected value the fp32 result) instead of to nearest, so that updates smaller than half a
  /// bf16 step add up instead of vanishing. Deterministic: the random bits are a hash of the step count, the
  /// parameter's place in the optimizer and the element's index, the same on the CPU and on CUDA. Parameters
  /// of other dtypes round as they do without it.
  TORCH_ARG(bool, bf16_stochastic_round) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  friend bool operator==(const Adam8bitOptions& a, const Adam8bitOptions& b);
};

struct AdamW8bitOptions : torch::optim::OptimizerCloneableOptions<AdamW8bitOptions> {
  AdamW8bitOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT
  /// Learning rate.
  TORCH_ARG(double, lr) = 1e-3;
  /// Coefficients of the running averages of the gradient and of its square.
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to the denominator.
  TORCH_ARG(double, eps) = 1e-8;
  /// Decoupled weight decay: each step multiplies the parameters by 1 - lr * weight_decay.
  TORCH_ARG(double, weight_decay) = 1e-2;
  /// Elements per quantization block: a power of two in [64, 4096].
  TORCH_ARG(int64_t, block_size) = 256;
  /// Tensors with fewer elements keep fp32 state.
  TORCH_ARG(int64_t, min_8bit_size) = 4096;
  /// bf16 parameters: round each updated value stochastically (Adam8bitOptions::bf16_stochastic_round).
  TORCH_ARG(bool, bf16_stochastic_round) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  friend bool operator==(const AdamW8bitOptions& a, const AdamW8bitOptions& b);
};

struct Lion8bitOptions : torch::optim::OptimizerCloneableOptions<Lion8bitOptions> {
  Lion8bitOptions(double lr = 1e-4) : lr_(lr) {}  // NOLINT
  /// Learning rate.
  TORCH_ARG(double, lr) = 1e-4;
  /// Interpolation of the update direction (beta1) and of the running average (beta2).
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.99);
  /// Decoupled weight decay.
  TORCH_ARG(double, weight_decay) = 0;
  /// Elements per quantization block: a power of two in [64, 4096].
  TORCH_ARG(int64_t, block_size) = 256;
  /// Tensors with fewer elements keep fp32 state.
  TORCH_ARG(int64_t, min_8bit_size) = 4096;
  /// bf16 parameters: round each updated value stochastically (Adam8bitOptions::bf16_stochastic_round).
  TORCH_ARG(bool, bf16_stochastic_round) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  friend bool operator==(const Lion8bitOptions& a, const Lion8bitOptions& b);
};

struct SGD8bitOptions : torch::optim::OptimizerCloneableOptions<SGD8bitOptions> {
  SGD8bitOptions(double lr) : lr_(lr) {}  // NOLINT
  /// Learning rate.
  TORCH_ARG(double, lr);
  /// Momentum factor, > 0 (without momentum SGD keeps no state: use torch::optim::SGD).
  TORCH_ARG(double, momentum) = 0.9;
  /// Dampening of the momentum.
  TORCH_ARG(double, dampening) = 0;
  /// L2 penalty added to the gradient.
  TORCH_ARG(double, weight_decay) = 0;
  /// Nesterov momentum (needs zero dampening).
  TORCH_ARG(bool, nesterov) = false;
  /// Elements per quantization block: a power of two in [64, 4096].
  TORCH_ARG(int64_t, block_size) = 256;
  /// Tensors with fewer elements keep fp32 state.
  TORCH_ARG(int64_t, min_8bit_size) = 4096;
  /// bf16 parameters: round each updated value stochastically (Adam8bitOptions::bf16_stochastic_round).
  TORCH_ARG(bool, bf16_stochastic_round) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  friend bool operator==(const SGD8bitOptions& a, const SGD8bitOptions& b);
};

struct Adam4bitOptions : torch::optim::OptimizerCloneableOptions<Adam4bitOptions> {
  Adam4bitOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT
  /// Learning rate.
  TORCH_ARG(double, lr) = 1e-3;
  /// Coefficients of the running averages of the gradient and of its square.
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to the denominator.
  TORCH_ARG(double, eps) = 1e-8;
  /// L2 penalty added to the gradient.
  TORCH_ARG(double, weight_decay) = 0;
  /// Elements per quantization block: a power of two in [64, 4096].
  TORCH_ARG(int64_t, block_size) = 128;
  /// Tensors with fewer elements keep fp32 state.
  TORCH_ARG(int64_t, min_4bit_size) = 4096;
  /// bf16 parameters: round each updated value stochastically (Adam8bitOptions::bf16_stochastic_round).
  TORCH_ARG(bool, bf16_stochastic_round) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  friend bool operator==(const Adam4bitOptions& a, const Adam4bitOptions& b);
};

struct AdamW4bitOptions : torch::optim::OptimizerCloneableOptions<AdamW4bitOptions> {
  AdamW4bitOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT
  /// Learning rate.
  TORCH_ARG(double, lr) = 1e-3;
  /// Coefficients of the running averages of the gradient and of its square.
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to the denominator.
  TORCH_ARG(double, eps) = 1e-8;
  /// Decoupled weight decay: each step multiplies the parameters by 1 - lr * weight_decay.
  TORCH_ARG(double, weight_decay) = 1e-2;
  /// Elements per quantization block: a power of two in [64, 4096].
  TORCH_ARG(int64_t, block_size) = 128;
  /// Tensors with fewer elements keep fp32 state.
  TORCH_ARG(int64_t, min_4bit_size) = 4096;
  /// bf16 parameters: round each updated value stochastically (Adam8bitOptions::bf16_stochastic_round).
  TORCH_ARG(bool, bf16_stochastic_round) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  friend bool operator==(const AdamW4bitOptions& a, const AdamW4bitOptions& b);
};

struct SGD4bitOptions : torch::optim::OptimizerCloneableOptions<SGD4bitOptions> {
  SGD4bitOptions(double lr) : lr_(lr) {}  // NOLINT
  /// Learning rate.
  TORCH_ARG(double, lr);
  /// Momentum factor, > 0 (without momentum SGD keeps no state: use torch::optim::SGD).
  TORCH_ARG(double, momentum) = 0.9;
  /// Dampening of the momentum.
  TORCH_ARG(double, dampening) = 0;
  /// L2 penalty added to the gradient.
  TORCH_ARG(double, weight_decay) = 0;
  /// Nesterov momentum (needs zero dampening).
  TORCH_ARG(bool, nesterov) = false;
  /// Elements per quantization block: a power of two in [64, 4096].
  TORCH_ARG(int64_t, block_size) = 128;
  /// Tensors with fewer elements keep fp32 state.
  TORCH_ARG(int64_t, min_4bit_size) = 4096;
  /// bf16 parameters: round each updated value stochastically (Adam8bitOptions::bf16_stochastic_round).
  TORCH_ARG(bool, bf16_stochastic_round) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  friend bool operator==(const SGD4bitOptions& a, const SGD4bitOptions& b);
};

/// One parameter's state: 8-bit or 4-bit codes with one absmax per block, or fp32 tensors (block_size 0).
struct QuantizedParamState : torch::optim::OptimizerCloneableParamState<QuantizedParamState> {
  /// Steps taken.
  TORCH_ARG(int64_t, step) = 0;
  /// First moment (SGD: momentum buffer): codes of the signed book (uint8, one per element, or for 4-bit
  /// state two per byte: element 2i in the high nibble), or float32.
  TORCH_ARG(torch::Tensor, m);
  /// Second moment (Adam rules): codes of the unsigned book as `m`, or float32; undefined otherwise.
  TORCH_ARG(torch::Tensor, v);
  /// float32, one per block of `m` (8-bit state only).
  TORCH_ARG(torch::Tensor, absmax_m);
  /// float32, one per block of `v` (8-bit state only).
  TORCH_ARG(torch::Tensor, absmax_v);
  /// Elements per block; 0 for fp32 state.
  TORCH_ARG(int64_t, block_size) = 0;
  /// Bits per code of quantized state: 8 or 4.
  TORCH_ARG(int64_t, bits) = 8;
  /// The order of the elements in `m` and `v` (and so in the blocks): entry k holds the element at offset k
  /// of a tensor of the parameter's shape with these strides; empty: row-major. A parameter laid out densely
  /// but not row-major (channels_last, a transpose) has state in its own memory order, so each step runs over
  /// the parameter and its gradient as they lie, without copies.
  TORCH_ARG(std::vector<int64_t>, strides);

 public:
  bool quantized() const { return block_size() > 0; }
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const QuantizedParamState& a, const QuantizedParamState& b);
};

/// What the optimizers share: state, the fused step, save and load. Use one of the classes below.
class LowBitOptimizer : public torch::optim::Optimizer, public StateTensors {
 public:
  /// NOTE: copying would duplicate or alias the optimizer state; move the optimizer or hold it by pointer.
  LowBitOptimizer(const LowBitOptimizer&) = delete;
  LowBitOptimizer& operator=(const LowBitOptimizer&) = delete;

  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Steps with every gradient multiplied by `inv_scale` (a float scalar tensor, a GradScaler's 1/scale)
  /// inside the update kernels: unscaling without a pass of its own. The gradients themselves are left as
  /// they are. memsave::amp::GradScaler::step calls it when `unscale_` was not called.
  torch::Tensor step_scaled(const torch::Tensor& inv_scale);
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Loads what `save` wrote. A file from another optimizer, with other shapes or block sizes, or corrupt, is
  /// an error that leaves this optimizer unchanged.
  void load(torch::serialize::InputArchive& archive) override;

  /// LibTorch's add_param_group, but the group keeps its own options (LibTorch 2.15's replaces them with the
  /// defaults for optimizers other than its own), and a group with bad options or a parameter already held is
  /// an error that adds nothing. NOTE: it hides the base's, which is not virtual: called through a
  /// torch::optim::Optimizer reference, LibTorch's runs (the group gets the defaults, a bad one fails at
  /// step).
  void add_param_group(const torch::optim::OptimizerParamGroup& group);
  /// Keeps `param`'s state in fp32 whatever its size; converts existing 8-bit state. A tensor that is not one
  /// of this optimizer's parameters is an error.
  void force_32bit(const torch::Tensor& param);
  /// `param`'s state as fp32 tensors of its shape: {m} or {m, v} (laid out in memory as the state is: see
  /// QuantizedParamState::strides); empty before its first step. A tensor that is not one of this optimizer's
  /// parameters is an error.
  std::vector<torch::Tensor> state_fp32(const torch::Tensor& param) const;
  /// Every state tensor (codes, absmaxes, fp32 moments), for the memory meter.
  std::vector<torch::Tensor> state_tensors() const override;
  /// Bits per code of the quantized state: 8 or 4.
  int bits() const { return bits_; }

 protected:
  /// One group's hyper-parameters in a common form.
  struct Hyper {
    double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, dampening = 0;
    bool nesterov = false, stochastic_round = false;
    int64_t block_size = 256, min_quantized_size = 4096;
  };
  enum class Kind : int32_t { kAdam = 0, kAdamW = 1, kLion = 2, kSgd = 3 };

  LowBitOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                  std::unique_ptr<torch::optim::OptimizerOptions> defaults, Kind kind, int bits = 8);
  virtual Hyper hyper(const torch::optim::OptimizerOptions& options) const = 0;
  /// Checks a group's hyper-parameters (constructor and every step), naming the bad one.
  static void check(const Hyper& h, Kind kind);
  /// check() of every group's options (the derived constructors: a bad group is an error at construction).
  void check_groups() const;

 private:
  friend struct detail::StateAccess;
  /// An error naming `method` unless `param` is one of this optimizer's parameters.
  void check_holds(const torch::Tensor& param, const char* method) const;
  torch::Tensor step_impl(LossClosure closure, const torch::Tensor& inv_scale);
  Kind kind_;
  int bits_;  ///< of quantized state: 8 or 4
  std::unordered_set<const void*> forced_32bit_;
};

class Adam8bit : public LowBitOptimizer {
 public:
  explicit Adam8bit(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                    Adam8bitOptions defaults = {});
  explicit Adam8bit(std::vector<torch::Tensor> params, Adam8bitOptions defaults = {})
      : Adam8bit({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

 protected:
  Hyper hyper(const torch::optim::OptimizerOptions& options) const override;
};

class AdamW8bit : public LowBitOptimizer {
 public:
  explicit AdamW8bit(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                     AdamW8bitOptions defaults = {});
  explicit AdamW8bit(std::vector<torch::Tensor> params, AdamW8bitOptions defaults = {})
      : AdamW8bit({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

 protected:
  Hyper hyper(const torch::optim::OptimizerOptions& options) const override;
};

class Lion8bit : public LowBitOptimizer {
 public:
  explicit Lion8bit(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                    Lion8bitOptions defaults = {});
  explicit Lion8bit(std::vector<torch::Tensor> params, Lion8bitOptions defaults = {})
      : Lion8bit({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

 protected:
  Hyper hyper(const torch::optim::OptimizerOptions& options) const override;
};

class SGD8bit : public LowBitOptimizer {
 public:
  explicit SGD8bit(const std::vector<torch::optim::OptimizerParamGroup>& groups, SGD8bitOptions defaults);
  explicit SGD8bit(std::vector<torch::Tensor> params, SGD8bitOptions defaults)
      : SGD8bit({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

 protected:
  Hyper hyper(const torch::optim::OptimizerOptions& options) const override;
};

/// Adam with 4-bit state (about 1.06 bytes per parameter against Adam8bit's 2.03 and Adam's 8).
class Adam4bit : public LowBitOptimizer {
 public:
  explicit Adam4bit(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                    Adam4bitOptions defaults = {});
  explicit Adam4bit(std::vector<torch::Tensor> params, Adam4bitOptions defaults = {})
      : Adam4bit({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

 protected:
  Hyper hyper(const torch::optim::OptimizerOptions& options) const override;
};

/// AdamW with 4-bit state.
class AdamW4bit : public LowBitOptimizer {
 public:
  explicit AdamW4bit(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                     AdamW4bitOptions defaults = {});
  explicit AdamW4bit(std::vector<torch::Tensor> params, AdamW4bitOptions defaults = {})
      : AdamW4bit({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

 protected:
  Hyper hyper(const torch::optim::OptimizerOptions& options) const override;
};

/// SGD with momentum, its buffer in 4-bit state.
class SGD4bit : public LowBitOptimizer {
 public:
  explicit SGD4bit(const std::vector<torch::optim::OptimizerParamGroup>& groups, SGD4bitOptions defaults);
  explicit SGD4bit(std::vector<torch::Tensor> params, SGD4bitOptions defaults)
      : SGD4bit({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

 protected:
  Hyper hyper(const torch::optim::OptimizerOptions& options) const override;
};

/// Copies `from`'s optimizer state into `to`, converting it to what `to` keeps: fp32, 8-bit or 4-bit, on the
/// device or offloaded (a run resumed with less memory, or moved back to fp32 state). Each parameter of `to`
/// takes the moments and step count of the same tensor in `from` when `to`'s parameters are all `from`'s
/// (however either groups or orders them; `from` may hold more); otherwise (optimizers over two copies of a
/// model) the i-th parameter of `from`'s groups gives its state to the i-th of `to`'s, and a `to` over some
/// of `from`'s parameters and other tensors is an error. Shapes must agree, devices and dtypes need not. Both
/// optimizers must follow one rule: Adam and AdamW (whose moments mean the same), among torch::optim::Adam,
/// torch::optim::AdamW, memsave's Adam and AdamW with 8- or 4-bit state and memsave::OffloadOptimizer; SGD
/// with momentum (torch::optim::SGD, SGD8bit, SGD4bit); Lion (Lion8bit). `to` quantizes each tensor as its
/// own step would (its block size and size thresholds) to the nearest codes; state already in `to`'s format
/// (fp32 into fp32, codes into codes of the same bits and block size) is copied exactly. What `to` held
/// before is replaced: a parameter without state in `from` has none after. Hyper-parameters (learning rate
/// included) and an OffloadOptimizer's master weights stay `to`'s. A torch::optim::SGD buffer becomes state
/// of step 1 (SGD's update does not depend on the count). Anything that does not fit (other shapes or rules,
/// AMSGrad's extra moment, SGD without momentum into which nothing can go) is an error before `to` changes,
/// and so is running out of memory: the new state is built before the old is released.
void copy_state(const torch::optim::Optimizer& from, torch::optim::Optimizer& to);

}  // namespace memsave::optim
