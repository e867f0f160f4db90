// Per-element optimizer updates, written once for the CPU and the CUDA kernels.
//
// The order of float operations follows PyTorch's single-tensor optimizers (torch.optim.Adam, AdamW and SGD)
// as its vectorized CPU kernels compute them, fused multiply-adds included (lerp, add with alpha, addcmul),
// so the fp32-state path tracks them to rounding. The fused multiply-adds are explicit (fmaf); everything
// else is built with contraction off (-ffp-contract=off, nvcc --fmad=false) and IEEE division and square
// root, so a CPU step and a CUDA step give bit-identical results.
#pragma once

#include "dtypes.h"
#include "host_device.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace memsave::kernels {

enum class Rule : std::int32_t {
  kAdam = 0,   ///< Adam with L2 weight decay added to the gradient (torch.optim.Adam)
  kAdamW = 1,  ///< Adam with decoupled weight decay (torch.optim.AdamW)
  kLion = 2,   ///< Lion (Chen et al., 2023) with decoupled weight decay
  kSgd = 3,    ///< SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD)
};

/// Everything an update needs besides the tensors: computed once per group and step on the host, in double,
/// then rounded to float once.
struct StepScalars {
  float lr = 0;
  float beta1 = 0;            ///< Adam, Lion: beta1; SGD: momentum
  float beta2 = 0;            ///< Adam, Lion: beta2
  float one_minus_beta1 = 0;  ///< Adam, Lion: 1 - beta1; SGD: 1 - dampening
  float one_minus_beta2 = 0;
  float eps = 0;
  float weight_decay = 0;       ///< L2 coefficient (Adam, SGD)
  float decay = 1;              ///< decoupled factor 1 - lr * weight_decay (AdamW, Lion)
  float neg_step_size = 0;      ///< Adam: -lr / (1 - beta1^t); SGD and Lion: -lr
  float bias2_sqrt = 1;         ///< Adam: sqrt(1 - beta2^t)
  std::int32_t nesterov = 0;    ///< SGD
  std::int32_t first_step = 0;  ///< SGD: the momentum buffer starts as the gradient
  /// bf16 parameters: round each new value stochastically (from_float_stochastic) instead of to nearest,
  /// with the random bits rounding_bits(round_seed, element index). Other storage types ignore it.
  std::int32_t stochastic_round = 0;
  std::uint32_t round_seed = 0;
};

/// Computes the scalars of one step (t >= 1).
inline StepScalars make_step_scalars(Rule rule, double lr, double beta1, double beta2, double eps,
                                     double weight_decay, std::int64_t t, bool nesterov = false,
                                     double dampening = 0) {
  StepScalars s;
  s.lr = static_cast<float>(lr);
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(rule == Rule::kSgd ? 1 - dampening : 1 - beta1);
  s.one_minus_beta2 = static_cast<float>(1 - beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.decay = static_cast<float>(1 - lr * weight_decay);
  if (rule == Rule::kAdam || rule == Rule::kAdamW) {
    const double bias1 = 1 - std::pow(beta1, static_cast<double>(t));
    const double bias2 = 1 - std::pow(beta2, static_cast<double>(t));
    s.neg_step_size = static_cast<float>(-(lr / bias1));
    s.bias2_sqrt = static_cast<float>(std::sqrt(bias2));
  } else {
    s.neg_step_size = static_cast<float>(-lr);
  }
  s.nesterov = nesterov ? 1 : 0;
  s.first_step = t == 1 ? 1 : 0;
  return s;
}

/// The key of the stochastic rounding of a tensor's step `step` (its own count, >= 1), for the tensor at
/// `position` in its optimizer: every step and every tensor rounds with other random bits, and a run repeated
/// (or resumed from a saved state) rounds with the same ones.
inline std::uint32_t stochastic_round_seed(std::int64_t step, std::int64_t position) {
  return rounding_bits(rounding_bits(0x9e3779b9u, position), step);
}

/// A new parameter value as storage type T: rounded to nearest, or for bf16 with s.stochastic_round
/// stochastically, with the random bits of element `index` of its tensor.
template <typename T>
MEMSAVE_HD T store_param(float p, const StepScalars& s, std::int64_t index) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (s.stochastic_round != 0) return from_float_stochastic(p, rounding_bits(s.round_seed, index));
  }
  return from_float<T>(p);
}

/// One element: parameter p, gradient g (already unscaled), first moment m, second moment v (Adam only).
template <Rule R>
MEMSAVE_HD void update(float& p, float g, float& m, float& v, const StepScalars& s) {
  if constexpr (R == Rule::kAdam || R == Rule::kAdamW) {
    if constexpr (R == Rule::kAdamW) {
      p = p * s.decay;  // param.mul_(1 - lr * weight_decay)
    } else {
      g = fmaf(p, s.weight_decay, g);  // grad.add(param, alpha=weight_decay)
    }
    m = fmaf(s.one_minus_beta1, g - m, m);  // exp_avg.lerp_(grad, 1 - beta1)
    v = fmaf(s.one_minus_beta2 * g, g,
             v * s.beta2);  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    const float denom = sqrtf(v) / s.bias2_sqrt + s.eps;
    p = p + (s.neg_step_size * m) / denom;  // param.addcdiv_(exp_avg, denom, value=-step_size)
  } else if constexpr (R == Rule::kLion) {
    p = p * s.decay;
    const float c = fmaf(s.one_minus_beta1, g - m, m);  // lerp(m, g, 1 - beta1)
    const float direction = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
    p = fmaf(direction, s.neg_step_size, p);
    m = fmaf(s.one_minus_beta2, g - m, m);  // lerp(m, g, 1 - beta2)
  } else {
    g = fmaf(p, s.weight_decay, g);                                  // grad.add(param, alpha=weight_decay)
    m = s.first_step ? g : fmaf(g, s.one_minus_beta1, m * s.beta1);  // buf.mul_(momentum).add_(grad, 1 - d)
    const float d = s.nesterov ? fmaf(m, s.beta1, g) : m;            // grad.add(buf, alpha=momentum)
    p = fmaf(d, s.neg_step_size, p);                                 // param.add_(grad, alpha=-lr)
  }
}

/// Whether a rule keeps a second moment.
MEMSAVE_HD constexpr bool has_second_moment(Rule rule) { return rule == Rule::kAdam || rule == Rule::kAdamW; }

}  // namespace memsave::kernels
