// The model zoo behind the CLI, the examples, the benchmarks and the tests (not part of the memsave
// library). Every model is a torch::nn::Sequential of coarse layers (a stem, one element per residual block
// or per half of a transformer block, a head), so sequential checkpointing can cut it anywhere between them.
#pragma once

#include <memsave/rescue.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace memsave::zoo {

/// A GPT-2 style decoder: learned positions, pre-norm blocks, GELU MLP of 4× width, tied embeddings. Each
/// block is two elements of the Sequential, "attn<i>" and "mlp<i>" (residual halves).
struct GPTConfig {
  TORCH_ARG(int64_t, vocab_size) = 512;
  TORCH_ARG(int64_t, context) = 64;
  TORCH_ARG(int64_t, layers) = 4;
  TORCH_ARG(int64_t, heads) = 4;
  TORCH_ARG(int64_t, width) = 128;
  TORCH_ARG(double, dropout) = 0.0;
};

/// The named decoder configurations: "gpt-tiny" (seconds on two CPU cores), "gpt-12l" (12 layers of width 256
/// over 256 tokens: activations dominate), "gpt2-small" (124,439,808 parameters, as GPT-2 small) and "gpt-1b"
/// (about 10^9 parameters, for the GPU offload benchmark).
GPTConfig gpt_config(const std::string& name);

torch::nn::Sequential mlp(int64_t inputs = 784, int64_t hidden = 2048, int64_t classes = 10);
/// torchvision's resnet18 / resnet50 architecture (V1.5: the stride sits in the 3×3 convolution).
torch::nn::Sequential resnet18(int64_t classes = 1000);
torch::nn::Sequential resnet50(int64_t classes = 1000);
torch::nn::Sequential gpt(const GPTConfig& config);
/// A small CNN for 28×28 grey images (Fashion-MNIST).
torch::nn::Sequential fashion_cnn(int64_t classes = 10);

struct Batch {
  torch::Tensor input;
  torch::Tensor target;
};

/// A model with what it takes to train it: a factory, random batches of the right shape, and its loss.
struct Workload {
  std::string name;
  std::function<torch::nn::Sequential()> make_model;
  std::function<Batch(int64_t batch_size, torch::Device device)> make_batch;
  std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)> loss;
};

/// The names `workload` accepts.
std::vector<std::string> workload_names();
/// The workload called `name`; an unknown name is an error that lists the valid ones.
Workload workload(const std::string& name);

/// The workload called `name` as a memsave::TrainingSetup (AdamW, lr 1e-4), for the rescue and its tools.
TrainingSetup training_setup(const std::string& name);

/// Number of parameter elements (tied weights counted once).
int64_t parameter_count(const torch::nn::Module& module);

}  // namespace memsave::zoo
