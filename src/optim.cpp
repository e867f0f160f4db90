#include "memsave/optim.h"

#include "../kernels/optim_cpu.h"
#include "../kernels/qmap.h"
#include "archive.h"
#include "compat.h"
#include "kernel_dtype.h"
#include "optim_internal.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/Type.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <typeinfo>
#include <unordered_map>

namespace memsave {

std::vector<torch::Tensor> unique_parameters(const std::vector<torch::Tensor>& params) {
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<torch::Tensor> unique;
  for (const auto& p : params) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) unique.push_back(p);
  }
  return unique;
}

}  // namespace memsave

namespace memsave::optim {
namespace {

namespace k = memsave::kernels;
using memsave::detail::read_betas;
using memsave::detail::read_bool;
using memsave::detail::read_bool_or;
using memsave::detail::read_double;
using memsave::detail::read_int;
using memsave::detail::write_betas;
using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

const char* kind_name(int32_t kind, int64_t bits) {
  static const char* const kNames8[] = {"Adam8bit", "AdamW8bit", "Lion8bit", "SGD8bit"};
  static const char* const kNames4[] = {"Adam4bit", "AdamW4bit", nullptr, "SGD4bit"};  // no 4-bit Lion
  if (bits == 8 && kind >= 0 && kind < 4) return kNames8[kind];
  if (bits == 4 && kind >= 0 && kind < 4 && kNames4[kind] != nullptr) return kNames4[kind];
  return "an unknown optimizer";
}

k::DType storage_type(const torch::Tensor& t) {
  const std::optional<k::DType> dtype = kernel_dtype(t.scalar_type());
  TORCH_CHECK(dtype, "parameters must be float32, float16 or bfloat16, got ", t.scalar_type());
  return *dtype;
}

/// What every step needs of the parameters themselves: a storage type the kernels step, memory that no two
/// elements share (an expanded tensor: the step would have nowhere to write), and each parameter in one place
/// only (listed twice, it would get two states and be stepped twice; LibTorch's Module::parameters() lists a
/// module used twice twice: memsave::unique_parameters).
void check_parameters(const std::vector<torch::optim::OptimizerParamGroup>& groups, const char* name) {
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, size_t>> seen;  // -> (group, index)
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& params = groups[gi].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& p = params[i];
      TORCH_CHECK(kernel_dtype(p.scalar_type()), name,
                  ": parameters must be float32, float16 or bfloat16, got ", p.scalar_type(), " (group ", gi,
                  ", parameter ", i, ")");
      TORCH_CHECK(at::has_internal_overlap(p) != at::MemOverlap::Yes, name, ": parameter ", i, " of group ",
                  gi, " has elements that share memory (an expanded tensor, strides ", p.strides(),
                  "); a parameter needs memory of its own");
      const auto [it, fresh] = seen.emplace(p.unsafeGetTensorImpl(), std::make_pair(gi, i));
      TORCH_CHECK(fresh, name, ": parameter ", i, " of group ", gi, " is also parameter ", it->second.second,
                  " of group ", it->second.first,
                  "; list each parameter once (a module used twice appears twice in LibTorch's parameters(): "
                  "memsave::unique_parameters(model->parameters()) lists it once)");
    }
  }
}

int64_t blocks_of(int64_t numel, int64_t block) { return (numel + block - 1) / block; }

/// The values of a code book as a float tensor, for reading quantized state back.
torch::Tensor book_tensor(const k::CodeBook& book, torch::Device device) {
  return torch::from_blob(const_cast<float*>(book.code), {book.count}, torch::kFloat)
      .to(device, /*non_blocking=*/false,
          /*copy=*/true);
}

/// One code per element, from codes stored as qmap.h's code_bytes says.
torch::Tensor unpacked_codes(const torch::Tensor& codes, int64_t bits, int64_t numel) {
  const torch::Tensor flat = codes.reshape({-1}).to(torch::kLong);
  if (bits != 4) return flat;
  return torch::stack({flat.bitwise_right_shift(4), flat.bitwise_and(15)}, 1)
      .reshape({-1})
      .narrow(0, 0, numel);
}

/// The `numel` values that `codes` and `absmax` hold, 1-D in the state's order.
torch::Tensor dequantize_state(const k::CodeBook& book, const torch::Tensor& codes, int64_t bits,
                               const torch::Tensor& absmax, int64_t block, int64_t numel) {
  if (codes.is_cpu()) {  // the step kernels' own dequantization, on all threads
    torch::Tensor out = torch::empty({numel}, torch::kFloat);
    const torch::Tensor packed = codes.contiguous(), scales = absmax.contiguous();
    const uint8_t* c = packed.data_ptr<uint8_t>();
    const float* a = scales.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, blocks_of(numel, block), std::max<int64_t>(1, 32768 / block),
                     [&](int64_t b, int64_t e) {
                       k::dequantize_blocks_cpu(book, static_cast<int>(bits), c, a, numel, block, o, b, e);
                     });
    return out;
  }
  const torch::Tensor values = book_tensor(book, codes.device()).index({unpacked_codes(codes, bits, numel)});
  const torch::Tensor scale = absmax.repeat_interleave(block).narrow(0, 0, numel);
  return values * scale;
}

/// A state's moments as new fp32 tensors, 1-D in the state's order: {m} or {m, v}.
std::vector<torch::Tensor> moments_flat(const QuantizedParamState& s, int64_t numel) {
  if (!s.quantized()) {
    std::vector<torch::Tensor> out{s.m().clone()};
    if (s.v().defined()) out.push_back(s.v().clone());
    return out;
  }
  const int bits = static_cast<int>(s.bits());
  std::vector<torch::Tensor> out{
      dequantize_state(k::signed_code_book(bits), s.m(), bits, s.absmax_m(), s.block_size(), numel)};
  if (s.v().defined()) {
    out.push_back(
        dequantize_state(k::unsigned_code_book(bits), s.v(), bits, s.absmax_v(), s.block_size(), numel));
  }
  return out;
}

}  // namespace

namespace detail {

std::vector<int64_t> state_order(const torch::Tensor& param) {
  if (param.is_contiguous() || !param.is_non_overlapping_and_dense()) return {};
  return param.strides().vec();
}

bool is_dense_order(c10::IntArrayRef sizes, c10::IntArrayRef order) {
  if (order.empty()) return true;
  if (order.size() != sizes.size()) return false;
  std::vector<std::pair<int64_t, int64_t>> steps;  // (stride, size) of each dimension longer than 1
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (order[d] < 0) return false;
    if (sizes[d] > 1) steps.emplace_back(order[d], sizes[d]);
  }
  std::sort(steps.begin(), steps.end());
  int64_t next = 1;  // dense: each stride is the product of the sizes of the dimensions inside it
  for (const auto& [stride, size] : steps) {
    if (stride != next) return false;
    next *= size;
  }
  return true;
}

bool lies_in(const torch::Tensor& t, c10::IntArrayRef order) {
  if (order.empty()) return t.is_contiguous();
  if (static_cast<size_t>(t.dim()) != order.size() || !t.is_non_overlapping_and_dense()) return false;
  for (int64_t d = 0; d < t.dim(); ++d) {  // a dimension of size 1 is laid out any way
    if (t.size(d) > 1 && t.stride(d) != order[d]) return false;
  }
  return true;
}

bool same_order(c10::IntArrayRef sizes, c10::IntArrayRef a, c10::IntArrayRef b) {
  std::vector<int64_t> row_major(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    row_major[d] = stride;
    stride *= std::max<int64_t>(sizes[d], 1);
  }
  const c10::IntArrayRef x = a.empty() ? c10::IntArrayRef(row_major) : a;
  const c10::IntArrayRef y = b.empty() ? c10::IntArrayRef(row_major) : b;
  if (x.size() != sizes.size() || y.size() != sizes.size()) return false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1 && x[d] != y[d]) return false;
  }
  return true;
}

torch::Tensor empty_in(c10::IntArrayRef sizes, c10::IntArrayRef order, const torch::TensorOptions& options) {
  return order.empty() ? torch::empty(sizes, options) : torch::empty_strided(sizes, order, options);
}

torch::Tensor laid_out(const torch::Tensor& t, c10::IntArrayRef order) {
  return lies_in(t, order) ? t : empty_in(t.sizes(), order, t.options()).copy_(t);
}

torch::Tensor memory_of(const torch::Tensor& t) { return t.as_strided({t.numel()}, {1}); }

torch::Tensor in_shape(const torch::Tensor& flat, c10::IntArrayRef sizes, c10::IntArrayRef order) {
  return order.empty() ? flat.view(sizes) : flat.as_strided(sizes, order);
}

}  // namespace detail

// ---- options
// -----------------------------------------------------------------------------------------------

// The options of one rule (8-bit and 4-bit; Adam with and without decoupled decay) hold the same fields but
// for the name of the size threshold and some defaults: one body for each rule.
template <typename Options>
constexpr bool kFourBit =
    std::is_same_v<Options, Adam4bitOptions> || std::is_same_v<Options, AdamW4bitOptions> ||
    std::is_same_v<Options, SGD4bitOptions>;

template <typename Options>
constexpr const char* kMinSizeKey = kFourBit<Options> ? "min_4bit_size" : "min_8bit_size";

template <typename Options>
int64_t min_size(const Options& o) {
  if constexpr (kFourBit<Options>) {
    return o.min_4bit_size();
  } else {
    return o.min_8bit_size();
  }
}

template <typename Options>
void read_min_size(InputArchive& archive, Options& o) {
  if constexpr (kFourBit<Options>) {
    o.min_4bit_size(read_int(archive, kMinSizeKey<Options>));
  } else {
    o.min_8bit_size(read_int(archive, kMinSizeKey<Options>));
  }
}

/// Files written before the option existed round to nearest.
bool read_stochastic_round(InputArchive& archive) {
  return read_bool_or(archive, "bf16_stochastic_round", false);
}

template <typename Options>
void write_adam(OutputArchive& archive, const Options& o) {
  archive.write("lr", o.lr());
  write_betas(archive, o.betas());
  archive.write("eps", o.eps());
  archive.write("weight_decay", o.weight_decay());
  archive.write("block_size", o.block_size());
  archive.write(kMinSizeKey<Options>, min_size(o));
  archive.write("bf16_stochastic_round", o.bf16_stochastic_round());
}

template <typename Options>
void read_adam(InputArchive& archive, Options& o) {
  o.lr(read_double(archive, "lr")).betas(read_betas(archive)).eps(read_double(archive, "eps"));
  o.weight_decay(read_double(archive, "weight_decay")).block_size(read_int(archive, "block_size"));
  read_min_size(archive, o);
  o.bf16_stochastic_round(read_stochastic_round(archive));
}

template <typename Options>
bool same_adam(const Options& a, const Options& b) {
  return a.lr() == b.lr() && a.betas() == b.betas() && a.eps() == b.eps() &&
         a.weight_decay() == b.weight_decay() && a.block_size() == b.block_size() &&
         min_size(a) == min_size(b) && a.bf16_stochastic_round() == b.bf16_stochastic_round();
}

/// A group's options as the optimizer's own type. A group given another optimizer's options (LibTorch's
/// AdamWOptions in an AdamW8bit, say, left over from the loop it replaced) would otherwise be read as what it
/// is not.
template <typename Options>
const Options& options_as(const torch::optim::OptimizerOptions& options, const char* name) {
  const auto* own = dynamic_cast<const Options*>(&options);
  TORCH_CHECK(own != nullptr, name, ": a parameter group's options are ",
              c10::demangle(typeid(options).name()), ", not ", c10::demangle(typeid(Options).name()));
  return *own;
}

template <typename Hyper, typename Options>
Hyper adam_hyper(const Options& o) {
  Hyper h;
  h.lr = o.lr(), h.beta1 = std::get<0>(o.betas()), h.beta2 = std::get<1>(o.betas()), h.eps = o.eps();
  h.weight_decay = o.weight_decay(), h.block_size = o.block_size(), h.min_quantized_size = min_size(o);
  h.stochastic_round = o.bf16_stochastic_round();
  return h;
}

void Adam8bitOptions::serialize(OutputArchive& archive) const { write_adam(archive, *this); }
void Adam8bitOptions::serialize(InputArchive& archive) { read_adam(archive, *this); }
bool operator==(const Adam8bitOptions& a, const Adam8bitOptions& b) { return same_adam(a, b); }

void AdamW8bitOptions::serialize(OutputArchive& archive) const { write_adam(archive, *this); }
void AdamW8bitOptions::serialize(InputArchive& archive) { read_adam(archive, *this); }
bool operator==(const AdamW8bitOptions& a, const AdamW8bitOptions& b) { return same_adam(a, b); }

void Adam4bitOptions::serialize(OutputArchive& archive) const { write_adam(archive, *this); }
void Adam4bitOptions::serialize(InputArchive& archive) { read_adam(archive, *this); }
bool operator==(const Adam4bitOptions& a, const Adam4bitOptions& b) { return same_adam(a, b); }

void AdamW4bitOptions::serialize(OutputArchive& archive) const { write_adam(archive, *this); }
void AdamW4bitOptions::serialize(InputArchive& archive) { read_adam(archive, *this); }
bool operator==(const AdamW4bitOptions& a, const AdamW4bitOptions& b) { return same_adam(a, b); }

template <typename Options>
void write_sgd(OutputArchive& archive, const Options& o) {
  archive.write("lr", o.lr());
  archive.write("momentum", o.momentum());
  archive.write("dampening", o.dampening());
  archive.write("weight_decay", o.weight_decay());
  archive.write("nesterov", o.nesterov());
  archive.write("block_size", o.block_size());
  archive.write(kMinSizeKey<Options>, min_size(o));
  archive.write("bf16_stochastic_round", o.bf16_stochastic_round());
}

template <typename Options>
void read_sgd(InputArchive& archive, Options& o) {
  o.lr(read_double(archive, "lr")).momentum(read_double(archive, "momentum"));
  o.dampening(read_double(archive, "dampening")).weight_decay(read_double(archive, "weight_decay"));
  o.nesterov(read_bool(archive, "nesterov")).block_size(read_int(archive, "block_size"));
  read_min_size(archive, o);
  o.bf16_stochastic_round(read_stochastic_round(archive));
}

template <typename Options>
bool same_sgd(const Options& a, const Options& b) {
  return a.lr() == b.lr() && a.momentum() == b.momentum() && a.dampening() == b.dampening() &&
         a.weight_decay() == b.weight_decay() && a.nesterov() == b.nesterov() &&
         a.block_size() == b.block_size() && min_size(a) == min_size(b) &&
         a.bf16_stochastic_round() == b.bf16_stochastic_round();
}

template <typename Hyper, typename Options>
Hyper sgd_hyper(const Options& o) {
  Hyper h;
  h.lr = o.lr(), h.beta1 = o.momentum(), h.dampening = o.dampening(), h.nesterov = o.nesterov();
  h.weight_decay = o.weight_decay(), h.block_size = o.block_size(), h.min_quantized_size = min_size(o);
  h.stochastic_round = o.bf16_stochastic_round();
  return h;
}

void Lion8bitOptions::serialize(OutputArchive& archive) const {
  archive.write("lr", lr());
  write_betas(archive, betas());
  archive.write("weight_decay", weight_decay());
  archive.write("block_size", block_size());
  archive.write("min_8bit_size", min_8bit_size());
  archive.write("bf16_stochastic_round", bf16_stochastic_round());
}
void Lion8bitOptions::serialize(InputArchive& archive) {
  lr(read_double(archive, "lr"))
      .betas(read_betas(archive))
      .weight_decay(read_double(archive, "weight_decay"));
  block_size(read_int(archive, "block_size")).min_8bit_size(read_int(archive, "min_8bit_size"));
  bf16_stochastic_round(read_stochastic_round(archive));
}
bool operator==(const Lion8bitOptions& a, const Lion8bitOptions& b) {
  return a.lr() == b.lr() && a.betas() == b.betas() && a.weight_decay() == b.weight_decay() &&
         a.block_size() == b.block_size() && a.min_8bit_size() == b.min_8bit_size() &&
         a.bf16_stochastic_round() == b.bf16_stochastic_round();
}

void SGD8bitOptions::serialize(OutputArchive& archive) const { write_sgd(archive, *this); }
void SGD8bitOptions::serialize(InputArchive& archive) { read_sgd(archive, *this); }
bool operator==(const SGD8bitOptions& a, const SGD8bitOptions& b) { return same_sgd(a, b); }

void SGD4bitOptions::serialize(OutputArchive& archive) const { write_sgd(archive, *this); }
void SGD4bitOptions::serialize(InputArchive& archive) { read_sgd(archive, *this); }
bool operator==(const SGD4bitOptions& a, const SGD4bitOptions& b) { return same_sgd(a, b); }

// ---- state
// -------------------------------------------------------------------------------------------------

void QuantizedParamState::serialize(OutputArchive& archive) const {
  archive.write("step", step());
  archive.write("block_size", block_size());
  if (bits() != 8) archive.write("bits", bits());  // files from before 4-bit state have no "bits": 8
  if (!strides().empty()) {                        // files from before ordered state have none: row-major
    archive.write("strides", torch::tensor(strides(), torch::kLong), /*is_buffer=*/true);
  }
  archive.write("m", m(), /*is_buffer=*/true);
  if (v().defined()) archive.write("v", v(), /*is_buffer=*/true);
  if (absmax_m().defined()) archive.write("absmax_m", absmax_m(), /*is_buffer=*/true);
  if (absmax_v().defined()) archive.write("absmax_v", absmax_v(), /*is_buffer=*/true);
}

void QuantizedParamState::serialize(InputArchive& archive) {
  auto tensor = [&](const char* key) {  // v and the absmaxes are absent for some states
    torch::Tensor value;
    return archive.try_read(key, value, /*is_buffer=*/true) ? value : torch::Tensor();
  };
  step(read_int(archive, "step"));
  block_size(read_int(archive, "block_size"));
  c10::IValue bits_value;
  bits(archive.try_read("bits", bits_value) && bits_value.isInt() ? bits_value.toInt() : 8);
  const torch::Tensor order = tensor("strides");
  TORCH_CHECK(!order.defined() || (order.dim() == 1 && order.scalar_type() == torch::kLong),
              "QuantizedParamState: the archive's strides are not a list of integers");
  strides(order.defined()
              ? std::vector<int64_t>(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel())
              : std::vector<int64_t>{});
  torch::Tensor codes;
  archive.read("m", codes, /*is_buffer=*/true);
  m(codes).v(tensor("v")).absmax_m(tensor("absmax_m")).absmax_v(tensor("absmax_v"));
}

bool operator==(const QuantizedParamState& a, const QuantizedParamState& b) {
  auto same = [](const torch::Tensor& x, const torch::Tensor& y) {
    return x.defined() == y.defined() && (!x.defined() || (x.sizes() == y.sizes() && x.dtype() == y.dtype() &&
                                                           torch::equal(x.cpu(), y.cpu())));
  };
  return a.step() == b.step() && a.block_size() == b.block_size() && a.bits() == b.bits() &&
         a.strides() == b.strides() && same(a.m(), b.m()) && same(a.v(), b.v()) &&
         same(a.absmax_m(), b.absmax_m()) && same(a.absmax_v(), b.absmax_v());
}

// ---- the optimizer
// -----------------------------------------------------------------------------------------

LowBitOptimizer::LowBitOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                 std::unique_ptr<torch::optim::OptimizerOptions> defaults, Kind kind,
                                 int bits)
    : Optimizer(groups, std::move(defaults)), kind_(kind), bits_(bits) {
  compat::keep_group_options(param_groups_, groups);
  // A misspelt cap would otherwise run the best level without a word (the kernels read it at start-up).
  const char* unknown_isa = k::unknown_cpu_isa_request();
  TORCH_CHECK(unknown_isa == nullptr, kind_name(static_cast<int32_t>(kind_), bits_),
              ": MEMSAVE_CPU_ISA=", unknown_isa,
              " names none of the CPU kernels' instruction sets: ", k::cpu_isa_levels(),
              " (unset or empty: the best the processor has)");
  check_parameters(param_groups_, kind_name(static_cast<int32_t>(kind_), bits_));
}

void LowBitOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& group) {
  Optimizer::add_param_group(group);
  // the options it asked for, as compat::keep_group_options gives a constructor's groups theirs
  if (group.has_options()) param_groups_.back().set_options(group.options().clone());
  try {
    check(hyper(param_groups_.back().options()), kind_);
    check_parameters(param_groups_, kind_name(static_cast<int32_t>(kind_), bits_));
  } catch (...) {
    param_groups_.pop_back();  // a rejected group changes nothing
    throw;
  }
}

void LowBitOptimizer::check_groups() const {
  for (const auto& group : param_groups_) check(hyper(group.options()), kind_);
}

void LowBitOptimizer::check(const Hyper& h, Kind kind) {
  TORCH_CHECK(h.lr >= 0, "Invalid learning rate: ", h.lr);
  TORCH_CHECK(h.weight_decay >= 0, "Invalid weight_decay value: ", h.weight_decay);
  TORCH_CHECK(h.block_size >= k::kMinBlock && h.block_size <= k::kMaxBlock &&
                  (h.block_size & (h.block_size - 1)) == 0,
              "Invalid block_size: ", h.block_size, " (a power of two in [64, 4096])");
  TORCH_CHECK(h.min_quantized_size >= 0, "Invalid minimum size for quantized state: ", h.min_quantized_size);
  if (kind == Kind::kSgd) {
    TORCH_CHECK(h.beta1 > 0 && h.beta1 < 1, "Invalid momentum value: ", h.beta1,
                " (SGD8bit needs 0 < momentum < 1)");
    TORCH_CHECK(h.dampening >= 0 && h.dampening <= 1, "Invalid dampening value: ", h.dampening);
    TORCH_CHECK(!h.nesterov || h.dampening == 0, "Nesterov momentum requires zero dampening");
    return;
  }
  TORCH_CHECK(h.beta1 >= 0 && h.beta1 < 1, "Invalid beta parameter at index 0: ", h.beta1);
  TORCH_CHECK(h.beta2 >= 0 && h.beta2 < 1, "Invalid beta parameter at index 1: ", h.beta2);
  if (kind != Kind::kLion) TORCH_CHECK(h.eps > 0, "Invalid epsilon value: ", h.eps);
}

namespace {

struct Work {
  torch::Tensor param;  // in its state's order: the parameter itself or a copy written back after the step
  torch::Tensor grad;   // in its state's order
  torch::Tensor original;
  QuantizedParamState* state = nullptr;
  std::unique_ptr<QuantizedParamState> fresh;
  size_t group = 0;
  int64_t position = 0;  // in the optimizer's parameters, over all groups: keys its stochastic rounding
};

}  // namespace

torch::Tensor LowBitOptimizer::step(LossClosure closure) { return step_impl(std::move(closure), {}); }

torch::Tensor LowBitOptimizer::step_scaled(const torch::Tensor& inv_scale) {
  TORCH_CHECK(inv_scale.defined() && inv_scale.numel() == 1 && inv_scale.scalar_type() == torch::kFloat,
              kind_name(static_cast<int32_t>(kind_), bits_), ": inv_scale must be a float scalar tensor");
  return step_impl(nullptr, inv_scale);
}

torch::Tensor LowBitOptimizer::step_impl(LossClosure closure, const torch::Tensor& inv_scale) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  const char* name = kind_name(static_cast<int32_t>(kind_), bits_);
  const bool second = kind_ == Kind::kAdam || kind_ == Kind::kAdamW;

  // 1. Check everything; nothing changes before the kernels run.
  check_parameters(param_groups_, name);  // again: add_param_group may have added to them since
  std::vector<Hyper> hypers;
  std::vector<Work> work;
  int64_t position = -1;  // of the parameter in the optimizer, over all groups
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const auto& group = param_groups_[gi];
    hypers.push_back(hyper(group.options()));
    check(hypers.back(), kind_);
    std::optional<torch::Device> device;
    for (const auto& p : group.params()) {
      ++position;
      const torch::Tensor& g = p.grad();
      if (!g.defined()) continue;
      TORCH_CHECK(!g.is_sparse(), name, ": sparse gradients are not supported");
      TORCH_CHECK(g.scalar_type() == p.scalar_type(), name, ": the gradient's dtype ", g.scalar_type(),
                  " differs from its parameter's ", p.scalar_type());
      TORCH_CHECK(g.sizes() == p.sizes(), name, ": gradient of shape ", g.sizes(),
                  " for a parameter of shape ", p.sizes());
      TORCH_CHECK(g.device() == p.device(), name, ": gradient on ", g.device(), " for a parameter on ",
                  p.device());
      TORCH_CHECK(p.device().is_cpu() || p.device().is_cuda(), name, ": parameters on ", p.device(),
                  " are not supported (cpu, cuda)");
      TORCH_CHECK(!device || *device == p.device(), name,
                  ": the parameters of a group must be on one device, found ", *device, " and ", p.device());
      device = p.device();
      Work w;
      w.original = p;
      w.group = gi;
      w.position = position;
      const auto it = state_.find(p.unsafeGetTensorImpl());
      if (it != state_.end()) {
        w.state = static_cast<QuantizedParamState*>(it->second.get());
        const int64_t codes =
            w.state->quantized() ? k::code_bytes(p.numel(), static_cast<int>(w.state->bits())) : p.numel();
        TORCH_CHECK(w.state->m().numel() == codes && w.state->m().device() == p.device() &&
                        detail::is_dense_order(p.sizes(), w.state->strides()),
                    name, ": the state of a parameter of shape ", p.sizes(), " does not match it");
      }
      work.push_back(std::move(w));
    }
  }
#ifndef MEMSAVE_WITH_CUDA
  for (const Work& w : work) {
    TORCH_CHECK(!w.original.is_cuda(), name,
                ": this build of memsave has no CUDA kernels (MEMSAVE_WITH_CUDA=OFF)");
  }
#endif

  // 2. Allocate: new state (created lazily, the first time a parameter has a gradient, in the parameter's
  //    memory order when it has one) and copies of parameters and gradients laid out otherwise than their
  //    state (none in the usual case). An out-of-memory here leaves the parameters and the committed state as
  //    they were.
  for (Work& w : work) {
    const Hyper& h = hypers[w.group];
    const torch::Tensor& p = w.original;
    if (w.state == nullptr) {
      w.fresh = std::make_unique<QuantizedParamState>();
      w.fresh->strides(detail::state_order(p));
      const bool quantized =
          p.numel() >= h.min_quantized_size && !forced_32bit_.count(p.unsafeGetTensorImpl());
      const auto on = torch::TensorOptions().device(p.device());
      if (quantized) {
        const int64_t blocks = blocks_of(p.numel(), h.block_size);
        const int64_t bytes = k::code_bytes(p.numel(), bits_);
        const int zero = k::signed_code_book(bits_).mirror / 2;  // the signed book's 0, in every nibble
        w.fresh->block_size(h.block_size).bits(bits_);
        w.fresh->m(torch::full({bytes}, bits_ == 4 ? zero * 17 : zero, on.dtype(torch::kUInt8)));
        w.fresh->absmax_m(torch::zeros({blocks}, on.dtype(torch::kFloat)));
        if (second) {
          // code 0: the unsigned book's lowest (0, or 1/16 for 4 bits), times an absmax of 0
          w.fresh->v(torch::zeros({bytes}, on.dtype(torch::kUInt8)));
          w.fresh->absmax_v(torch::zeros({blocks}, on.dtype(torch::kFloat)));
        }
      } else {
        w.fresh->m(torch::zeros({p.numel()}, on.dtype(torch::kFloat)));
        if (second) w.fresh->v(torch::zeros({p.numel()}, on.dtype(torch::kFloat)));
      }
      w.state = w.fresh.get();
    }
    w.param = detail::laid_out(p, w.state->strides());
    w.grad = detail::laid_out(p.grad(), w.state->strides());
  }
  //    The scaler's 1/scale on each device, and the code books on each CUDA device.
  std::unordered_map<c10::Device, torch::Tensor> inv_scales;
  for (const Work& w : work) {
    const c10::Device device = w.param.device();
    if (inv_scale.defined() && !inv_scales.count(device))
      inv_scales[device] = inv_scale.to(device).reshape({});
#ifdef MEMSAVE_WITH_CUDA
    if (device.is_cuda()) detail::cuda_books_ready(device.index(), bits_);
#endif
  }

  // 3. Commit new state, then update.
  for (Work& w : work) {
    if (w.fresh) state_[w.original.unsafeGetTensorImpl()] = std::move(w.fresh);
  }
  std::vector<detail::TensorStep> cuda_steps;
  for (Work& w : work) {
    const Hyper& h = hypers[w.group];
    QuantizedParamState& s = *w.state;
    s.step(s.step() + 1);
    const k::Rule rule = static_cast<k::Rule>(kind_);
    k::StepScalars scalars = k::make_step_scalars(rule, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
                                                  s.step(), h.nesterov, h.dampening);
    if (h.stochastic_round && w.param.scalar_type() == torch::kBFloat16) {
      scalars.stochastic_round = 1;
      scalars.round_seed = k::stochastic_round_seed(s.step(), w.position);
    }
    detail::TensorStep t{w.param, w.grad, &s, rule, scalars, {}};
    if (inv_scale.defined()) t.inv_scale = inv_scales.at(w.param.device());
    if (w.param.is_cuda()) {
      cuda_steps.push_back(t);
    } else {
      detail::step_cpu(t);
    }
  }
#ifdef MEMSAVE_WITH_CUDA
  if (!cuda_steps.empty()) detail::step_cuda(cuda_steps);
#endif
  for (Work& w : work) {
    if (!w.param.is_same(w.original)) w.original.copy_(w.param);
  }
  return loss;
}

namespace detail {

void step_cpu(const TensorStep& t) {
  const QuantizedParamState& s = *t.state;
  const int64_t numel = t.param.numel();
  if (s.quantized()) {
    k::StepQuantized step;
    step.param = t.param.data_ptr();
    step.grad = t.grad.data_ptr();
    step.dtype = storage_type(t.param);
    step.m = s.m().data_ptr<uint8_t>();
    step.v = s.v().defined() ? s.v().data_ptr<uint8_t>() : nullptr;
    step.absmax_m = s.absmax_m().data_ptr<float>();
    step.absmax_v = s.absmax_v().defined() ? s.absmax_v().data_ptr<float>() : nullptr;
    step.numel = numel;
    step.block_size = s.block_size();
    step.bits = static_cast<int>(s.bits());
    step.rule = t.rule;
    step.scalars = t.scalars;
    if (t.inv_scale.defined()) step.grad_scale = t.inv_scale.item<float>();
    const int64_t blocks = blocks_of(numel, s.block_size());
    at::parallel_for(0, blocks, std::max<int64_t>(1, 32768 / s.block_size()),
                     [&](int64_t begin, int64_t end) { k::step_quantized_cpu(step, begin, end); });
  } else {
    k::Step32 step;
    step.param = t.param.data_ptr();
    step.grad = t.grad.data_ptr();
    step.dtype = storage_type(t.param);
    step.m = s.m().data_ptr<float>();
    step.v = s.v().defined() ? s.v().data_ptr<float>() : nullptr;
    step.numel = numel;
    step.rule = t.rule;
    step.scalars = t.scalars;
    if (t.inv_scale.defined()) step.grad_scale = t.inv_scale.item<float>();
    at::parallel_for(0, numel, 32768, [&](int64_t begin, int64_t end) { k::step32_cpu(step, begin, end); });
  }
}

}  // namespace detail

void LowBitOptimizer::check_holds(const torch::Tensor& param, const char* method) const {
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      if (p.is_same(param)) return;
    }
  }
  TORCH_CHECK(false, kind_name(static_cast<int32_t>(kind_), bits_), "::", method,
              ": the tensor given (shape ", param.sizes(), ") is not a parameter of this optimizer");
}

void LowBitOptimizer::force_32bit(const torch::Tensor& param) {
  check_holds(param, "force_32bit");
  const auto it = state_.find(param.unsafeGetTensorImpl());
  if (it != state_.end() && static_cast<QuantizedParamState&>(*it->second).quantized()) {
    // Built before anything changes: running out of memory here, or in the insert, leaves the quantized
    // state in place; the move that replaces it cannot throw.
    const auto& old = static_cast<const QuantizedParamState&>(*it->second);
    const std::vector<torch::Tensor> fp32 = moments_flat(old, param.numel());
    auto fresh = std::make_unique<QuantizedParamState>();
    fresh->step(old.step()).strides(old.strides());
    fresh->m(fp32[0]);
    if (fp32.size() > 1) fresh->v(fp32[1]);
    forced_32bit_.insert(param.unsafeGetTensorImpl());
    it->second = std::move(fresh);
    return;
  }
  forced_32bit_.insert(param.unsafeGetTensorImpl());
}

std::vector<torch::Tensor> LowBitOptimizer::state_fp32(const torch::Tensor& param) const {
  const auto it = state_.find(param.unsafeGetTensorImpl());
  if (it == state_.end()) {
    check_holds(param, "state_fp32");  // only here: state is kept for parameters only
    return {};
  }
  const auto& s = static_cast<const QuantizedParamState&>(*it->second);
  std::vector<torch::Tensor> out = moments_flat(s, param.numel());
  for (torch::Tensor& t : out) t = detail::in_shape(t, param.sizes(), s.strides());
  return out;
}

std::vector<torch::Tensor> LowBitOptimizer::state_tensors() const {
  std::vector<torch::Tensor> out;
  for (const auto& entry : state_) {
    const auto& s = static_cast<const QuantizedParamState&>(*entry.second);
    for (const torch::Tensor& t : {s.m(), s.v(), s.absmax_m(), s.absmax_v()}) {
      if (t.defined()) out.push_back(t);
    }
  }
  return out;
}

void LowBitOptimizer::save(OutputArchive& archive) const {
  archive.write("memsave_kind", static_cast<int64_t>(kind_));
  if (bits_ != 8) archive.write("memsave_bits", static_cast<int64_t>(bits_));  // absent: 8 (older files)
  archive.write("memsave_code_book_version", k::kCodeBookVersion);
  archive.write("groups", static_cast<int64_t>(param_groups_.size()));
  int64_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    OutputArchive options(archive.compilation_unit());
    param_groups_[g].options().serialize(options);
    archive.write("group_" + std::to_string(g) + "_options", options);
    archive.write("group_" + std::to_string(g) + "_size",
                  static_cast<int64_t>(param_groups_[g].params().size()));
    for (const auto& p : param_groups_[g].params()) {
      const auto it = state_.find(p.unsafeGetTensorImpl());
      if (it != state_.end()) {
        OutputArchive state(archive.compilation_unit());
        it->second->serialize(state);
        archive.write("state_" + std::to_string(index), state);
      }
      ++index;
    }
  }
}

void LowBitOptimizer::load(InputArchive& archive) {
  const char* name = kind_name(static_cast<int32_t>(kind_), bits_);
  // Read and check everything into temporaries; commit only when all of it fits this optimizer.
  c10::IValue kind_value;
  TORCH_CHECK(archive.try_read("memsave_kind", kind_value) && kind_value.isInt(), name,
              ": the archive holds no memsave optimizer state");
  const int64_t kind = kind_value.toInt();
  c10::IValue bits_value;
  const int64_t bits =
      archive.try_read("memsave_bits", bits_value) && bits_value.isInt() ? bits_value.toInt() : 8;
  TORCH_CHECK(kind == static_cast<int64_t>(kind_) && bits == bits_, name, ": the archive holds the state of ",
              kind_name(static_cast<int32_t>(kind), bits));
  const int64_t version = read_int(archive, "memsave_code_book_version");
  TORCH_CHECK(version == k::kCodeBookVersion, name, ": the archive's code book version ", version,
              " is not this build's ", k::kCodeBookVersion);
  const int64_t groups = read_int(archive, "groups");
  TORCH_CHECK(groups == static_cast<int64_t>(param_groups_.size()), name, ": the archive has ", groups,
              " parameter groups, this optimizer ", param_groups_.size());
  const bool second = kind_ == Kind::kAdam || kind_ == Kind::kAdamW;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options;
  std::vector<std::pair<const void*, std::unique_ptr<QuantizedParamState>>> states;
  int64_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    const int64_t size = read_int(archive, ("group_" + std::to_string(g) + "_size").c_str());
    TORCH_CHECK(size == static_cast<int64_t>(params.size()), name, ": group ", g, " has ", size,
                " parameters in the archive, ", params.size(), " here");
    InputArchive options_archive;
    archive.read("group_" + std::to_string(g) + "_options", options_archive);
    options.push_back(param_groups_[g].options().clone());
    options.back()->serialize(options_archive);
    const Hyper h = hyper(*options.back());
    check(h, kind_);
    const int64_t here = hyper(param_groups_[g].options()).block_size;
    TORCH_CHECK(h.block_size == here, name, ": the archive's block size ", h.block_size,
                " differs from this optimizer's ", here);
    for (const auto& p : params) {
      InputArchive state_archive;
      if (archive.try_read("state_" + std::to_string(index++), state_archive)) {
        auto s = std::make_unique<QuantizedParamState>();
        s->serialize(state_archive);
        const int64_t numel = p.numel();
        const bool quantized = s->quantized();
        const auto codes = quantized ? torch::kUInt8 : torch::kFloat;
        auto fits = [&](const torch::Tensor& t, int64_t n, torch::ScalarType type) {
          return t.defined() && t.dim() == 1 && t.numel() == n && t.scalar_type() == type;
        };
        TORCH_CHECK(s->step() >= 0, name, ": negative step count in the archive");
        if (quantized) {
          TORCH_CHECK(s->block_size() == h.block_size, name, ": the archive's block size ", s->block_size(),
                      " differs from this optimizer's ", h.block_size);
          TORCH_CHECK(s->bits() == bits_, name, ": the archive's state has ", s->bits(),
                      "-bit codes, this optimizer ", bits_, "-bit");
          const int64_t blocks = blocks_of(numel, s->block_size());
          TORCH_CHECK(fits(s->absmax_m(), blocks, torch::kFloat) &&
                          (!second || fits(s->absmax_v(), blocks, torch::kFloat)),
                      name, ": the archive's block scales do not fit a parameter of shape ", p.sizes());
        }
        TORCH_CHECK(detail::is_dense_order(p.sizes(), s->strides()), name,
                    ": the archive's state order (strides ", c10::IntArrayRef(s->strides()),
                    ") is not a layout of a parameter of shape ", p.sizes());
        const int64_t entries = quantized ? k::code_bytes(numel, bits_) : numel;
        TORCH_CHECK(
            fits(s->m(), entries, codes) && (second ? fits(s->v(), entries, codes) : !s->v().defined()), name,
            ": the archive's state does not fit a parameter of shape ", p.sizes());
        for (auto* t : {&s->m(), &s->v(), &s->absmax_m(), &s->absmax_v()}) {
          if (t->defined()) *t = t->to(p.device());
        }
        states.emplace_back(p.unsafeGetTensorImpl(), std::move(s));
      }
    }
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) param_groups_[g].set_options(std::move(options[g]));
  state_.clear();
  for (auto& [key, s] : states) state_[const_cast<void*>(key)] = std::move(s);
}

// ---- the optimizers
// -----------------------------------------------------------------------------------

Adam8bit::Adam8bit(const std::vector<torch::optim::OptimizerParamGroup>& groups, Adam8bitOptions defaults)
    : LowBitOptimizer(groups, std::make_unique<Adam8bitOptions>(defaults), Kind::kAdam) {
  check(hyper(defaults), Kind::kAdam);
  check_groups();
}
LowBitOptimizer::Hyper Adam8bit::hyper(const torch::optim::OptimizerOptions& options) const {
  return adam_hyper<Hyper>(options_as<Adam8bitOptions>(options, "Adam8bit"));
}

AdamW8bit::AdamW8bit(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdamW8bitOptions defaults)
    : LowBitOptimizer(groups, std::make_unique<AdamW8bitOptions>(defaults), Kind::kAdamW) {
  check(hyper(defaults), Kind::kAdamW);
  check_groups();
}
LowBitOptimizer::Hyper AdamW8bit::hyper(const torch::optim::OptimizerOptions& options) const {
  return adam_hyper<Hyper>(options_as<AdamW8bitOptions>(options, "AdamW8bit"));
}

Lion8bit::Lion8bit(const std::vector<torch::optim::OptimizerParamGroup>& groups, Lion8bitOptions defaults)
    : LowBitOptimizer(groups, std::make_unique<Lion8bitOptions>(defaults), Kind::kLion) {
  check(hyper(defaults), Kind::kLion);
  check_groups();
}
LowBitOptimizer::Hyper Lion8bit::hyper(const torch::optim::OptimizerOptions& options) const {
  const auto& o = options_as<Lion8bitOptions>(options, "Lion8bit");
  Hyper h;
  h.lr = o.lr(), h.beta1 = std::get<0>(o.betas()), h.beta2 = std::get<1>(o.betas());
  h.weight_decay = o.weight_decay(), h.block_size = o.block_size(), h.min_quantized_size = o.min_8bit_size();
  h.stochastic_round = o.bf16_stochastic_round();
  return h;
}

SGD8bit::SGD8bit(const std::vector<torch::optim::OptimizerParamGroup>& groups, SGD8bitOptions defaults)
    : LowBitOptimizer(groups, std::make_unique<SGD8bitOptions>(defaults), Kind::kSgd) {
  check(hyper(defaults), Kind::kSgd);
  check_groups();
}
LowBitOptimizer::Hyper SGD8bit::hyper(const torch::optim::OptimizerOptions& options) const {
  return sgd_hyper<Hyper>(options_as<SGD8bitOptions>(options, "SGD8bit"));
}

Adam4bit::Adam4bit(const std::vector<torch::optim::OptimizerParamGroup>& groups, Adam4bitOptions defaults)
    : LowBitOptimizer(groups, std::make_unique<Adam4bitOptions>(defaults), Kind::kAdam, /*bits=*/4) {
  check(hyper(defaults), Kind::kAdam);
  check_groups();
}
LowBitOptimizer::Hyper Adam4bit::hyper(const torch::optim::OptimizerOptions& options) const {
  return adam_hyper<Hyper>(options_as<Adam4bitOptions>(options, "Adam4bit"));
}

AdamW4bit::AdamW4bit(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdamW4bitOptions defaults)
    : LowBitOptimizer(groups, std::make_unique<AdamW4bitOptions>(defaults), Kind::kAdamW, /*bits=*/4) {
  check(hyper(defaults), Kind::kAdamW);
  check_groups();
}
LowBitOptimizer::Hyper AdamW4bit::hyper(const torch::optim::OptimizerOptions& options) const {
  return adam_hyper<Hyper>(options_as<AdamW4bitOptions>(options, "AdamW4bit"));
}

SGD4bit::SGD4bit(const std::vector<torch::optim::OptimizerParamGroup>& groups, SGD4bitOptions defaults)
    : LowBitOptimizer(groups, std::make_unique<SGD4bitOptions>(defaults), Kind::kSgd, /*bits=*/4) {
  check(hyper(defaults), Kind::kSgd);
  check_groups();
}
LowBitOptimizer::Hyper SGD4bit::hyper(const torch::optim::OptimizerOptions& options) const {
  return sgd_hyper<Hyper>(options_as<SGD4bitOptions>(options, "SGD4bit"));
}

}  // namespace memsave::optim
