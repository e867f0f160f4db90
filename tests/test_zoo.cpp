#include "zoo/zoo.h"

#include <gtest/gtest.h>

namespace memsave::zoo {
namespace {

// Reference counts: torchvision's resnet18/resnet50 and GPT-2 small as published.
TEST(Zoo, ResNetsHaveTorchvisionsParameterCounts) {
  EXPECT_EQ(parameter_count(*resnet18()), 11689512);
  EXPECT_EQ(parameter_count(*resnet50()), 25557032);
}

TEST(Zoo, Gpt2SmallHasItsPublishedParameterCount) {
  EXPECT_EQ(parameter_count(*gpt(gpt_config("gpt2-small"))), 124439808);
}

// Independent count for a GPT-2 style decoder with tied embeddings.
int64_t gpt_parameters(int64_t vocab, int64_t context, int64_t layers, int64_t width) {
  const int64_t block = 2 * 2 * width + (width * 3 * width + 3 * width) + (width * width + width) +
                        (width * 4 * width + 4 * width) + (4 * width * width + width);
  return vocab * width + context * width + layers * block + 2 * width;
}

TEST(Zoo, SmallModelsHaveTheirFormulaCounts) {
  EXPECT_EQ(parameter_count(*gpt(gpt_config("gpt-tiny"))), gpt_parameters(512, 64, 4, 128));
  EXPECT_EQ(parameter_count(*mlp()), 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10);
  EXPECT_EQ(parameter_count(*fashion_cnn()),
            (9 * 32 + 32) + (9 * 32 * 64 + 64) + (3136 * 128 + 128) + (1280 + 10));
}

TEST(Zoo, TiedHeadSharesTheTokenEmbedding) {
  auto net = gpt(gpt_config("gpt-tiny"));
  const auto params = net->named_parameters();
  ASSERT_TRUE(params.contains("embedding.wte.weight"));
  int64_t listed = 0;
  for (const auto& p : net->parameters()) listed += p.numel();
  EXPECT_EQ(listed, parameter_count(*net)) << "a tied weight is listed twice";
  const auto tokens = torch::randint(512, {2, 16}, torch::kLong);
  net->forward(tokens).sum().backward();
  EXPECT_TRUE(params["embedding.wte.weight"].grad().defined());
}

TEST(Zoo, EveryWorkloadTrainsOneStep) {
  torch::manual_seed(0);
  for (const std::string& name : workload_names()) {
    if (name == "gpt2-small" || name == "gpt-1b" || name == "resnet50")
      continue;  // covered by the counts; too slow for a step here
    SCOPED_TRACE(name);
    const Workload w = workload(name);
    auto model = w.make_model();
    const Batch batch = w.make_batch(2, torch::kCPU);
    const torch::Tensor loss = w.loss(model->forward(batch.input), batch.target);
    EXPECT_EQ(loss.dim(), 0);
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
    loss.backward();
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
  }
}

TEST(Zoo, UnknownNamesListTheValidOnes) {
  try {
    workload("resnet19");
    FAIL() << "an unknown model was accepted";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const std::string& name : workload_names())
      EXPECT_NE(message.find(name), std::string::npos) << message;
  }
  EXPECT_THROW(gpt_config("gpt3"), c10::Error);
}

}  // namespace
}  // namespace memsave::zoo
