#include "zoo.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>
#include <unordered_set>

namespace memsave::zoo {
namespace {

namespace nn = torch::nn;

/// A Sequential with a plain forward, so it can sit inside another Sequential.
struct ChainImpl : nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(Chain);

nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride = 1) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

/// conv1x1 + BatchNorm when a residual branch changes shape, otherwise empty.
nn::Sequential shortcut(int64_t in, int64_t out, int64_t stride) {
  if (stride == 1 && in == out) return nn::Sequential(nullptr);
  return nn::Sequential(conv(in, out, 1, stride), nn::BatchNorm2d(out));
}

struct BasicBlockImpl : nn::Module {
  static constexpr int64_t kExpansion = 1;

  BasicBlockImpl(int64_t in, int64_t planes, int64_t stride)
      : conv1(register_module("conv1", conv(in, planes, 3, stride))),
        bn1(register_module("bn1", nn::BatchNorm2d(planes))),
        conv2(register_module("conv2", conv(planes, planes, 3))),
        bn2(register_module("bn2", nn::BatchNorm2d(planes))),
        downsample(shortcut(in, planes, stride)) {
    if (downsample) register_module("downsample", downsample);
  }

  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor out = torch::relu(bn1(conv1(x)));
    out = bn2(conv2(out));
    return torch::relu(out + (downsample ? downsample->forward(x) : x));
  }

  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  nn::Conv2d conv2;
  nn::BatchNorm2d bn2;
  nn::Sequential downsample;
};
TORCH_MODULE(BasicBlock);

struct BottleneckImpl : nn::Module {
  static constexpr int64_t kExpansion = 4;

  BottleneckImpl(int64_t in, int64_t planes, int64_t stride)
      : conv1(register_module("conv1", conv(in, planes, 1))),
        bn1(register_module("bn1", nn::BatchNorm2d(planes))),
        conv2(register_module("conv2", conv(planes, planes, 3, stride))),
        bn2(register_module("bn2", nn::BatchNorm2d(planes))),
        conv3(register_module("conv3", conv(planes, planes * kExpansion, 1))),
        bn3(register_module("bn3", nn::BatchNorm2d(planes * kExpansion))),
        downsample(shortcut(in, planes * kExpansion, stride)) {
    if (downsample) register_module("downsample", downsample);
  }

  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor out = torch::relu(bn1(conv1(x)));
    out = torch::relu(bn2(conv2(out)));
    out = bn3(conv3(out));
    return torch::relu(out + (downsample ? downsample->forward(x) : x));
  }

  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  nn::Conv2d conv2;
  nn::BatchNorm2d bn2;
  nn::Conv2d conv3;
  nn::BatchNorm2d bn3;
  nn::Sequential downsample;
};
TORCH_MODULE(Bottleneck);

template <typename Block>
nn::Sequential resnet(const std::vector<int64_t>& blocks_per_stage, int64_t classes) {
  constexpr int64_t expansion = Block::Impl::kExpansion;
  nn::Sequential net;
  net->push_back("stem", Chain(nn::Conv2d(nn::Conv2dOptions(3, 64, 7).stride(2).padding(3).bias(false)),
                               nn::BatchNorm2d(64), nn::ReLU(),
                               nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1))));
  int64_t in = 64;
  for (size_t stage = 0; stage < blocks_per_stage.size(); ++stage) {
    const int64_t planes = int64_t{64} << stage;
    for (int64_t i = 0; i < blocks_per_stage[stage]; ++i) {
      const int64_t stride = (stage > 0 && i == 0) ? 2 : 1;
      net->push_back("layer" + std::to_string(stage + 1) + "_" + std::to_string(i),
                     Block(in, planes, stride));
      in = planes * expansion;
    }
  }
  net->push_back("head", Chain(nn::AdaptiveAvgPool2d(1), nn::Flatten(), nn::Linear(in, classes)));
  return net;
}

struct TokenEmbeddingImpl : nn::Module {
  explicit TokenEmbeddingImpl(const GPTConfig& c)
      : wte(register_module("wte", nn::Embedding(c.vocab_size(), c.width()))),
        wpe(register_module("wpe", nn::Embedding(c.context(), c.width()))),
        drop(register_module("drop", nn::Dropout(c.dropout()))) {}

  torch::Tensor forward(const torch::Tensor& tokens) {
    TORCH_CHECK(tokens.dim() == 2, "gpt: tokens must be [batch, time], got ", tokens.sizes());
    TORCH_CHECK(tokens.size(1) <= wpe->weight.size(0), "gpt: sequence of ", tokens.size(1),
                " tokens is longer than the context of ", wpe->weight.size(0));
    const auto positions = torch::arange(tokens.size(1), tokens.options());
    return drop(wte(tokens) + wpe(positions));
  }

  nn::Embedding wte;
  nn::Embedding wpe;
  nn::Dropout drop;
};
TORCH_MODULE(TokenEmbedding);

/// The attention half of a pre-norm decoder block: x + drop(proj(attention(ln(x)))).
struct AttentionResidualImpl : nn::Module {
  explicit AttentionResidualImpl(const GPTConfig& c)
      : heads(c.heads()),
        dropout(c.dropout()),
        ln1(register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({c.width()})))),
        c_attn(register_module("c_attn", nn::Linear(c.width(), 3 * c.width()))),
        attn_proj(register_module("attn_proj", nn::Linear(c.width(), c.width()))),
        drop(register_module("drop", nn::Dropout(c.dropout()))) {
    TORCH_CHECK(c.width() % c.heads() == 0, "gpt: width ", c.width(), " is not divisible by heads ",
                c.heads());
  }

  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t batch = x.size(0), time = x.size(1), width = x.size(2);
    auto qkv = c_attn(ln1(x)).view({batch, time, 3, heads, width / heads}).permute({2, 0, 3, 1, 4});
    const double p = is_training() ? dropout : 0.0;
    auto y = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], {}, p, /*is_causal=*/true);
    y = y.transpose(1, 2).reshape({batch, time, width});
    return x + drop(attn_proj(y));
  }

  int64_t heads;
  double dropout;
  nn::LayerNorm ln1;
  nn::Linear c_attn;
  nn::Linear attn_proj;
  nn::Dropout drop;
};
TORCH_MODULE(AttentionResidual);

/// The MLP half of a pre-norm decoder block: x + drop(proj(gelu(fc(ln(x))))), 4× width inside.
struct MLPResidualImpl : nn::Module {
  explicit MLPResidualImpl(const GPTConfig& c)
      : ln2(register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({c.width()})))),
        c_fc(register_module("c_fc", nn::Linear(c.width(), 4 * c.width()))),
        mlp_proj(register_module("mlp_proj", nn::Linear(4 * c.width(), c.width()))),
        gelu(register_module("gelu", nn::GELU(nn::GELUOptions().approximate("tanh")))),
        drop(register_module("drop", nn::Dropout(c.dropout()))) {}

  torch::Tensor forward(const torch::Tensor& x) { return x + drop(mlp_proj(gelu(c_fc(ln2(x))))); }

  nn::LayerNorm ln2;
  nn::Linear c_fc;
  nn::Linear mlp_proj;
  nn::GELU gelu;
  nn::Dropout drop;
};
TORCH_MODULE(MLPResidual);

/// The output projection tied to the token embedding.
/// NOTE: the weight is held, not registered, so parameters() lists it once; it follows `to()` because
/// LibTorch moves parameters in place.
struct TiedHeadImpl : nn::Module {
  explicit TiedHeadImpl(torch::Tensor embedding) : weight(std::move(embedding)) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

Batch classification_batch(std::vector<int64_t> input_shape, int64_t classes, int64_t batch,
                           torch::Device device) {
  input_shape.insert(input_shape.begin(), batch);
  return {torch::randn(input_shape, torch::TensorOptions().device(device)),
          torch::randint(classes, {batch}, torch::TensorOptions().dtype(torch::kLong).device(device))};
}

torch::Tensor classification_loss(const torch::Tensor& output, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

Workload classifier(std::string name, std::function<nn::Sequential()> make, std::vector<int64_t> input_shape,
                    int64_t classes) {
  return {std::move(name), std::move(make),
          [input_shape, classes](int64_t batch, torch::Device device) {
            return classification_batch(input_shape, classes, batch, device);
          },
          classification_loss};
}

Workload decoder(const std::string& name) {
  const GPTConfig config = gpt_config(name);
  return {name, [config] { return gpt(config); },
          [config](int64_t batch, torch::Device device) {
            const auto options = torch::TensorOptions().dtype(torch::kLong).device(device);
            return Batch{torch::randint(config.vocab_size(), {batch, config.context()}, options),
                         torch::randint(config.vocab_size(), {batch, config.context()}, options)};
          },
          [](const torch::Tensor& logits, const torch::Tensor& target) {
            return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                        target.reshape({-1}));
          }};
}

std::string join(const std::vector<std::string>& names) {
  std::ostringstream out;
  for (size_t i = 0; i < names.size(); ++i) out << (i ? ", " : "") << names[i];
  return out.str();
}

}  // namespace

GPTConfig gpt_config(const std::string& name) {
  if (name == "gpt-tiny") return GPTConfig();
  if (name == "gpt-12l") return GPTConfig().layers(12).width(256).context(256);
  if (name == "gpt-1b") return GPTConfig().vocab_size(50257).context(512).layers(24).heads(16).width(1792);
  if (name == "gpt2-small")
    return GPTConfig().vocab_size(50257).context(1024).layers(12).heads(12).width(768);
  TORCH_CHECK(false, "unknown GPT configuration '", name, "' (valid: gpt-tiny, gpt-12l, gpt2-small, gpt-1b)");
}

nn::Sequential mlp(int64_t inputs, int64_t hidden, int64_t classes) {
  return nn::Sequential(nn::Linear(inputs, hidden), nn::ReLU(), nn::Linear(hidden, hidden), nn::ReLU(),
                        nn::Linear(hidden, classes));
}

nn::Sequential resnet18(int64_t classes) { return resnet<BasicBlock>({2, 2, 2, 2}, classes); }
nn::Sequential resnet50(int64_t classes) { return resnet<Bottleneck>({3, 4, 6, 3}, classes); }

nn::Sequential gpt(const GPTConfig& config) {
  nn::Sequential net;
  TokenEmbedding embedding(config);
  net->push_back("embedding", embedding);
  for (int64_t i = 0; i < config.layers(); ++i) {
    net->push_back("attn" + std::to_string(i), AttentionResidual(config));
    net->push_back("mlp" + std::to_string(i), MLPResidual(config));
  }
  net->push_back("ln_f", nn::LayerNorm(nn::LayerNormOptions({config.width()})));
  net->push_back("head", TiedHead(embedding->wte->weight));
  return net;
}

nn::Sequential fashion_cnn(int64_t classes) {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                        nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                        nn::Flatten(), nn::Linear(64 * 7 * 7, 128), nn::ReLU(), nn::Linear(128, classes));
}

std::vector<std::string> workload_names() {
  return {"mlp", "fashion-cnn", "resnet18", "resnet50", "gpt-tiny", "gpt-12l", "gpt2-small", "gpt-1b"};
}

Workload workload(const std::string& name) {
  if (name == "mlp")
    return classifier(
        name, [] { return mlp(); }, {784}, 10);
  if (name == "fashion-cnn")
    return classifier(
        name, [] { return fashion_cnn(); }, {1, 28, 28}, 10);
  if (name == "resnet18")
    return classifier(
        name, [] { return resnet18(); }, {3, 224, 224}, 1000);
  if (name == "resnet50")
    return classifier(
        name, [] { return resnet50(); }, {3, 224, 224}, 1000);
  if (name.rfind("gpt", 0) == 0) return decoder(name);
  TORCH_CHECK(false, "unknown model '", name, "' (valid: ", join(workload_names()), ")");
}

TrainingSetup training_setup(const std::string& name) {
  const Workload w = workload(name);
  TrainingSetup setup;
  setup.make_model = w.make_model;
  setup.make_batch = [w](int64_t rows, c10::Device device) {
    const Batch b = w.make_batch(rows, device);
    return std::make_pair(b.input, b.target);
  };
  setup.loss = w.loss;
  setup.optimizer = adamw(1e-4);
  return setup;
}

int64_t parameter_count(const torch::nn::Module& module) {
  std::unordered_set<const void*> seen;
  int64_t count = 0;
  for (const auto& p : module.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) count += p.numel();
  }
  return count;
}

}  // namespace memsave::zoo
