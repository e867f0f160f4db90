// Before any test: one call of each of LibTorch's CPU math functions that oneMKL's VML computes, on one
// element, so on this thread alone.
//
// Why: LibTorch hands a float tensor's tanh (exp, sqrt, ...) to VML chunk by chunk from its intra-op threads.
// The oneMKL of the pip wheels (2024.2) chooses a VML function's kernel on its first call; when that first
// call runs on several threads at once, one thread can compute its whole chunk with a low-accuracy kernel
// (pytorch/pytorch#188792; bench/RESULTS-vml.md: tanh off by up to 9e-5 on elements 2048-4095 of a 32×128
// activation in 2-7 of 480 fresh processes, none after one call on one element). A test that compares two
// models bit for bit then fails although memsave did nothing wrong.
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

class SettleCpuMath : public testing::Environment {
 public:
  void SetUp() override {
    torch::NoGradGuard no_grad;
    for (const auto dtype : {torch::kFloat, torch::kDouble}) {
      const torch::Tensor x = torch::full({1}, 0.5, dtype);  // in every function's domain
      for (auto* f : {&torch::acos, &torch::asin, &torch::atan, &torch::cos, &torch::erf, &torch::erfc,
                      &torch::erfinv, &torch::exp, &torch::log, &torch::log10, &torch::log2, &torch::sin,
                      &torch::sqrt, &torch::tan, &torch::tanh, &torch::trunc})
        f(x);
    }
  }
};

const testing::Environment* const kSettleCpuMath = testing::AddGlobalTestEnvironment(new SettleCpuMath);

}  // namespace
