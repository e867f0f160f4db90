// One fresh process's first float tanh against its second (pytorch/pytorch#188792): run many at once by
// bench/run_vml_first_call.sh, which counts. With `--warm`, one tanh of one element comes first, as
// tests/settle_cpu_math.cpp does before the tests.
//
// Prints the differing elements of the 32×128 activation (count, first, last) and the largest difference,
// or "0" when the two calls agree bit for bit.
#include <torch/torch.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--warm") == 0) torch::tanh(torch::zeros({1}));
  torch::manual_seed(0);
  const auto w = torch::randn({128, 64}), b = torch::randn({128}), x = torch::randn({32, 64});
  const auto a = torch::addmm(b, x, w.t());
  const auto first = torch::tanh(a).flatten(), second = torch::tanh(a).flatten();
  const auto differ = (first != second).nonzero().flatten();
  if (differ.numel() == 0) {
    std::printf("0\n");
    return 0;
  }
  std::printf("%lld %lld %lld %.3g\n", static_cast<long long>(differ.numel()),
              static_cast<long long>(differ.min().item<int64_t>()),
              static_cast<long long>(differ.max().item<int64_t>()),
              (first - second).abs().max().item<double>());
  return 0;
}
