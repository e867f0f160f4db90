// `memsave::rescue` on a model of your own: give it how to build the model, how to make a batch, the loss and
// a budget; it walks the checklist on the real model, measures each candidate under the budget and prints the
// fastest recipe that fits, as C++ to paste into the training code. The model is a Sequential (which the
// checklist's checkpointing can cut), or with `--model two-inputs` a module of one's own with two inputs,
// given with the function that runs it, whose image tower the checklist's checkpointing switches.
//
//   build/examples/rescue_my_model [--model sequential|two-inputs] [--batch 64] [--budget 48MiB]
#include <memsave/memsave.h>

#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

/// The user's own model: a small convolutional classifier for 3×32×32 images.
torch::nn::Sequential my_model() {
  namespace nn = torch::nn;
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 64, 3).padding(1)), nn::BatchNorm2d(64), nn::ReLU(),
                        nn::Conv2d(nn::Conv2dOptions(64, 64, 3).padding(1)), nn::BatchNorm2d(64), nn::ReLU(),
                        nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(64, 128, 3).padding(1)),
                        nn::BatchNorm2d(128), nn::ReLU(), nn::AdaptiveAvgPool2d(1), nn::Flatten(),
                        nn::Linear(128, 10));
}

/// The user's own model that is not a Sequential: an image and a caption's token ids in, class logits out.
/// The two stages of its image tower sit in memsave::nn::Checkpoint wrappers, which the rescue's recipes
/// switch on (checkpointing every layer) or off; a block of several inputs would go through a wrapper's
/// `run`.
struct ImageAndCaptionImpl : torch::nn::Module {
  ImageAndCaptionImpl() {
    namespace nn = torch::nn;
    stage1 = register_module("stage1", memsave::nn::Checkpoint(nn::Sequential(
                                           nn::Conv2d(nn::Conv2dOptions(3, 64, 3).padding(1)), nn::ReLU())));
    stage2 = register_module(
        "stage2", memsave::nn::Checkpoint(nn::Sequential(
                      nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(64, 128, 3).padding(1)), nn::ReLU())));
    words = register_module("words", nn::Embedding(1000, 128));
    head = register_module("head", nn::Linear(256, 10));
  }
  torch::Tensor forward(const torch::Tensor& image, const torch::Tensor& caption) {
    return head(torch::cat({stage2(stage1(image)).mean({2, 3}), words(caption).mean(1)}, 1));
  }
  memsave::nn::Checkpoint stage1{nullptr}, stage2{nullptr};
  torch::nn::Embedding words{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ImageAndCaption);

}  // namespace

int main(int argc, char** argv) {
  memsave::install_meter();
  int64_t batch = 64;
  std::string budget = "48MiB";
  std::string model = "sequential";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--batch") == 0) batch = std::atoll(argv[i + 1]);
    if (std::strcmp(argv[i], "--budget") == 0) budget = argv[i + 1];
    if (std::strcmp(argv[i], "--model") == 0) model = argv[i + 1];
  }
  if (model != "sequential" && model != "two-inputs") {
    std::fprintf(stderr, "rescue_my_model: --model must be sequential or two-inputs, got %s\n",
                 model.c_str());
    return 2;
  }
  try {
    memsave::TrainingSetup setup;
    if (model == "sequential") {
      setup.make_model = my_model;
      setup.make_batch = [](int64_t rows, c10::Device device) {
        const auto on = torch::TensorOptions().device(device);
        return std::make_pair(torch::randn({rows, 3, 32, 32}, on),
                              torch::randint(10, {rows}, on.dtype(torch::kLong)));
      };
    } else {  // the module, and the function that runs it on a micro-batch's inputs
      setup.make_any_model = [] {
        ImageAndCaption net;
        auto forward = [net](const std::vector<torch::Tensor>& in) mutable {
          return net->forward(in[0], in[1]);
        };
        return memsave::AnyModel{net.ptr(), forward};
      };
      setup.make_inputs = [](int64_t rows, c10::Device device) {
        const auto on = torch::TensorOptions().device(device);
        std::vector<torch::Tensor> inputs{torch::randn({rows, 3, 32, 32}, on),
                                          torch::randint(1000, {rows, 16}, on.dtype(torch::kLong))};
        return std::make_pair(inputs, torch::randint(10, {rows}, on.dtype(torch::kLong)));
      };
    }
    setup.loss = [](const torch::Tensor& out, const torch::Tensor& y) {
      return torch::nn::functional::cross_entropy(out, y);
    };
    setup.optimizer = memsave::adamw(1e-3);

    const memsave::RescuePlan plan =
        memsave::rescue(setup, memsave::RescueOptions(batch, memsave::parse_bytes(budget)).steps(2));
    if (plan.below_parameters) {
      std::printf("nothing can fit: the parameters alone take %s\n",
                  memsave::format_bytes(plan.parameter_bytes).c_str());
      return 3;
    }
    for (const memsave::Candidate& c : plan.candidates) {
      if (c.status == memsave::Candidate::Status::kNotNeeded) continue;
      const bool fits = c.status == memsave::Candidate::Status::kFits;
      std::printf("  %-50s predicted %10s  %s\n", c.recipe.label().c_str(),
                  memsave::format_bytes(c.predicted).c_str(),
                  fits ? ("fits, peak " + memsave::format_bytes(c.measured.peak)).c_str()
                  : c.status == memsave::Candidate::Status::kOutOfMemory ? "out of memory"
                  : c.status == memsave::Candidate::Status::kFailed      ? ("failed: " + c.error).c_str()
                                                                         : "cannot fit");
    }
    if (!plan.recommended) {
      std::printf("nothing fits in %s\n", budget.c_str());
      return 3;
    }
    const memsave::Candidate& best = plan.candidates[*plan.recommended];
    std::printf("recommended (peak %s of %s):\n  %s\n", memsave::format_bytes(best.measured.peak).c_str(),
                budget.c_str(), best.recipe.to_cpp().c_str());
    return 0;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "rescue_my_model: %s\n", e.what_without_backtrace());
    return 2;
  }
}
