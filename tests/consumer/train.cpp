// A user's tiny training loop with memsave's meter: fits y = 3x - 1 and checks it learned and was counted.
#include <memsave/memsave.h>

#include <torch/torch.h>

#include <cstdio>

int main() {
  memsave::install_meter();
  torch::manual_seed(0);
  torch::nn::Linear model(1, 1);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.1));
  const torch::Tensor x = torch::linspace(-1, 1, 64).unsqueeze(1);
  const torch::Tensor y = 3 * x - 1;
  memsave::PeakScope scope(torch::kCPU);
  double loss_value = 0;
  for (int step = 0; step < 300; ++step) {
    optimizer.zero_grad();
    const torch::Tensor loss = torch::mse_loss(model(x), y);
    loss.backward();
    optimizer.step();
    loss_value = loss.item<double>();
  }
  const auto parts = memsave::breakdown(scope.peak(), model->parameters(), &optimizer, torch::kCPU);
  std::printf("loss %.6f, peak %lld bytes, optimizer state %lld bytes\n", loss_value,
              static_cast<long long>(parts.total), static_cast<long long>(parts.optimizer_state));
  // weight and bias: 2 floats of parameters, 2 of gradients, 4 of Adam state.
  const bool counted = parts.parameters == 8 && parts.gradients == 8 && parts.optimizer_state == 16;
  return loss_value < 1e-4 && counted ? 0 : 1;
}
