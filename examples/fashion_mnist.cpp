// Trains the zoo's small CNN on Fashion-MNIST twice from the same seed, once with LibTorch's AdamW and once
// with memsave's AdamW8bit, and prints both test accuracies and the optimizer state each kept (from the
// meter).
//
//   build/examples/fashion_mnist [--epochs N] [--data DIR]    (DIR: Debian's dataset-fashion-mnist by
//   default)
#include <memsave/memsave.h>

#include "zoo/zoo.h"

#include <torch/torch.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace {

/// Reads a gzipped IDX file (images: uint8 [n, rows, cols]; labels: uint8 [n]).
torch::Tensor read_idx(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw std::runtime_error("cannot open " + path);
  auto read_u32 = [&] {
    unsigned char b[4];
    if (gzread(file, b, 4) != 4) throw std::runtime_error("truncated header in " + path);
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
  };
  const uint32_t magic = read_u32();
  const int dims = static_cast<int>(magic & 0xff);
  if ((magic >> 8) != 0x08 || dims < 1 || dims > 3) throw std::runtime_error("not a uint8 IDX file: " + path);
  std::vector<int64_t> shape;
  for (int d = 0; d < dims; ++d) shape.push_back(read_u32());
  torch::Tensor data = torch::empty(shape, torch::kUInt8);
  const int64_t bytes = data.numel();
  if (gzread(file, data.data_ptr(), static_cast<unsigned>(bytes)) != bytes) {
    throw std::runtime_error("truncated data in " + path);
  }
  gzclose(file);
  return data;
}

struct Split {
  torch::Tensor images;  // float [n, 1, 28, 28], normalized
  torch::Tensor labels;  // int64 [n]
};

Split load(const std::string& dir, const std::string& prefix) {
  const auto images = read_idx(dir + "/" + prefix + "-images-idx3-ubyte.gz").to(torch::kFloat).div_(255);
  const auto labels = read_idx(dir + "/" + prefix + "-labels-idx1-ubyte.gz").to(torch::kLong);
  return {images.sub_(0.2860).div_(0.3530).unsqueeze(1), labels};
}

double accuracy(torch::nn::Sequential& net, const Split& test) {
  torch::NoGradGuard no_grad;
  net->eval();
  int64_t correct = 0;
  for (int64_t i = 0; i < test.images.size(0); i += 1000) {
    const auto logits =
        net->forward(test.images.narrow(0, i, std::min<int64_t>(1000, test.images.size(0) - i)));
    correct += logits.argmax(1).eq(test.labels.narrow(0, i, logits.size(0))).sum().item<int64_t>();
  }
  net->train();
  return 100.0 * static_cast<double>(correct) / static_cast<double>(test.images.size(0));
}

double train(bool eight_bit, bool bf16, const Split& train_set, const Split& test, int epochs,
             int64_t* state_bytes) {
  torch::manual_seed(0);
  auto net = memsave::zoo::fashion_cnn();
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (eight_bit) {
    opt = std::make_unique<memsave::optim::AdamW8bit>(net->parameters(),
                                                      memsave::optim::AdamW8bitOptions(1e-3));
  } else {
    opt = std::make_unique<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-3));
  }
  constexpr int64_t kBatch = 128;
  const int64_t n = train_set.images.size(0);
  for (int epoch = 0; epoch < epochs; ++epoch) {
    const auto order = torch::randperm(n, torch::kLong);
    for (int64_t i = 0; i + kBatch <= n; i += kBatch) {
      const auto index = order.narrow(0, i, kBatch);
      opt->zero_grad();
      torch::Tensor loss;
      {
        memsave::amp::Autocast autocast(torch::kCPU, torch::kBFloat16, /*enabled=*/bf16);
        loss = torch::nn::functional::cross_entropy(net->forward(train_set.images.index_select(0, index)),
                                                    train_set.labels.index_select(0, index));
      }
      loss.backward();
      opt->step();
    }
    std::printf("  %s epoch %d: test accuracy %.2f%%\n",
                eight_bit ? "AdamW8bit  " : (bf16 ? "AdamW, bf16" : "AdamW      "), epoch + 1,
                accuracy(net, test));
    std::fflush(stdout);
  }
  int64_t bytes = 0;
  for (const auto& t : memsave::optimizer_state_tensors(*opt)) bytes += t.numel() * t.element_size();
  *state_bytes = bytes;
  return accuracy(net, test);
}

}  // namespace

int main(int argc, char** argv) {
  int epochs = 3;
  std::string dir = "/usr/share/datasets/fashion-mnist", compare = "8bit";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--epochs") == 0) epochs = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--data") == 0) dir = argv[i + 1];
    if (std::strcmp(argv[i], "--compare") == 0) compare = argv[i + 1];
  }
  if (epochs < 1 || (compare != "8bit" && compare != "bf16")) {
    std::fprintf(stderr, "usage: fashion_mnist [--epochs N >= 1] [--compare 8bit|bf16] [--data DIR]\n");
    return 2;
  }
  const bool eight_bit = compare == "8bit";
  try {
    const Split train_set = load(dir, "train"), test = load(dir, "t10k");
    std::printf("Fashion-MNIST: %lld training and %lld test images, %d epochs, batch 128, lr 1e-3\n",
                static_cast<long long>(train_set.images.size(0)), static_cast<long long>(test.images.size(0)),
                epochs);
    int64_t fp32_state = 0, other_state = 0;
    const double fp32 = train(false, false, train_set, test, epochs, &fp32_state);
    const double other = train(eight_bit, !eight_bit, train_set, test, epochs, &other_state);
    const char* name = eight_bit ? "AdamW8bit" : "AdamW with bf16 autocast";
    std::printf("test accuracy: AdamW %.2f%%, %s %.2f%% (difference %+.2f points)\n", fp32, name, other,
                other - fp32);
    if (eight_bit) {
      std::printf("optimizer state: AdamW %lld bytes, AdamW8bit %lld bytes (%.2fx smaller)\n",
                  static_cast<long long>(fp32_state), static_cast<long long>(other_state),
                  static_cast<double>(fp32_state) / static_cast<double>(other_state));
    }
    return std::abs(other - fp32) <= 0.5 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 2;
  }
}
