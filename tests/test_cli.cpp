// The memsave CLI as a user runs it: output, JSON, and exit codes for bad input and out-of-memory.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace {

struct Result {
  int code = -1;
  std::string output;  // stdout and stderr
};

Result invoke(const std::string& args, const char* stderr_to = "2>&1") {
  const std::string command = std::string(MEMSAVE_CLI) + " " + args + " " + stderr_to;
  Result result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer;
  size_t n = 0;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

Result invoke_stdout(const std::string& args) { return invoke(args, "2>/dev/null"); }

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(Cli, ReportPrintsEveryStageAndTheRules) {
  const Result r = invoke("report --model mlp --batch 4");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* stage :
       {"runtime ready", "input batch on the device", "model on the device", "forward under no-grad",
        "forward + backward + optimizer step", "optimizer state", "gradients = parameter bytes", "holds"}) {
    EXPECT_TRUE(contains(r.output, stage)) << stage << "\n" << r.output;
  }
}

TEST(Cli, ReportJsonHasExactBytesThatAddUp) {
  const Result r = invoke_stdout("report --model mlp --batch 4 --optimizer adamw --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  const int64_t params = j["parameters"];
  EXPECT_EQ(params, 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10);
  const auto& b = j["breakdown"];
  EXPECT_EQ(b["parameters"].get<int64_t>(), 4 * params);
  EXPECT_EQ(b["gradients"].get<int64_t>(), 4 * params);
  EXPECT_EQ(b["optimizer_state"].get<int64_t>(), 8 * params);
  EXPECT_EQ(b["parameters"].get<int64_t>() + b["gradients"].get<int64_t>() +
                b["optimizer_state"].get<int64_t>() + b["other"].get<int64_t>(),
            b["total"].get<int64_t>());
  ASSERT_EQ(j["rows"].size(), 5u);
  EXPECT_EQ(j["rows"][1]["change"].get<int64_t>(), 4 * 784 * 4 + 4 * 8);  // float inputs and int64 labels
  EXPECT_EQ(j["rows"][2]["change"].get<int64_t>(), 4 * params);
  EXPECT_EQ(j["rows"][4]["change"].get<int64_t>(), 4 * params + 8 * params);  // gradients and Adam state stay
  EXPECT_EQ(j["rows"][4]["peak"].get<int64_t>(), j["training_peak"].get<int64_t>());
}

TEST(Cli, ReportCountsTheStateOf8BitAdamW) {
  const Result r = invoke_stdout("report --model mlp --batch 4 --optimizer adamw8bit --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  const int64_t params = j["parameters"];
  // mlp's three weights are quantized (1 + 1 bytes per element, 4 + 4 bytes of absmax per 256); its biases
  // (2048, 2048, 10 elements) are under 4096 and keep 8 bytes of fp32 state per element
  const int64_t weights = 784 * 2048 + 2048 * 2048 + 2048 * 10, biases = 2048 + 2048 + 10;
  const int64_t blocks = (784 * 2048) / 256 + (2048 * 2048) / 256 + (2048 * 10) / 256;
  EXPECT_EQ(weights + biases, params);
  EXPECT_EQ(j["breakdown"]["optimizer_state"].get<int64_t>(), 2 * weights + 8 * blocks + 8 * biases);
  EXPECT_TRUE(j["rules"][1]["holds"].get<bool>()) << j["rules"][1].dump();
}

TEST(Cli, ReportCountsTheStateOf4BitAdamW) {
  const Result r = invoke_stdout("report --model mlp --batch 4 --optimizer adamw4bit --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  // the weights' two moments: a byte for two elements each, 4 + 4 bytes of absmax per 128; the biases (under
  // 4096 elements) keep 8 bytes of fp32 state per element
  const int64_t weights = 784 * 2048 + 2048 * 2048 + 2048 * 10, biases = 2048 + 2048 + 10;
  const int64_t blocks = (784 * 2048) / 128 + (2048 * 2048) / 128 + (2048 * 10) / 128;
  EXPECT_EQ(weights + biases, j["parameters"].get<int64_t>());
  EXPECT_EQ(j["breakdown"]["optimizer_state"].get<int64_t>(), weights + 8 * blocks + 8 * biases);
  EXPECT_TRUE(j["rules"][1]["holds"].get<bool>()) << j["rules"][1].dump();
}

TEST(Cli, ReportCountsTheStateOfLowBitMomentum) {
  // SGD and Lion keep one moment: per weight element a byte (8-bit) or half a byte (4-bit) of codes and 4
  // bytes of absmax per block of 256 (128); the biases (under 4096 elements) keep 4 bytes of fp32 state per
  // element
  const int64_t weights = 784 * 2048 + 2048 * 2048 + 2048 * 10, biases = 2048 + 2048 + 10;
  const int64_t blocks256 = (784 * 2048) / 256 + (2048 * 2048) / 256 + (2048 * 10) / 256;
  const int64_t blocks128 = (784 * 2048) / 128 + (2048 * 2048) / 128 + (2048 * 10) / 128;
  const std::vector<std::pair<std::string, int64_t>> cases = {
      {"sgd8bit", weights + 4 * blocks256 + 4 * biases},
      {"lion8bit", weights + 4 * blocks256 + 4 * biases},
      {"sgd4bit", weights / 2 + 4 * blocks128 + 4 * biases},
  };
  for (const auto& [name, bytes] : cases) {
    const Result r = invoke_stdout("report --model mlp --batch 4 --optimizer " + name + " --json");
    ASSERT_EQ(r.code, 0) << name << ": " << r.output;
    const auto j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["breakdown"]["optimizer_state"].get<int64_t>(), bytes) << name;
    EXPECT_TRUE(j["rules"][1]["holds"].get<bool>()) << name << ": " << j["rules"][1].dump();
  }
}

TEST(Cli, UnknownModelListsTheValidOnesWithExitCode2) {
  const Result r = invoke("report --model resnet19");
  EXPECT_EQ(r.code, 2) << r.output;
  for (const char* name : {"mlp", "resnet18", "resnet50", "gpt-tiny", "gpt2-small", "fashion-cnn"}) {
    EXPECT_TRUE(contains(r.output, name)) << r.output;
  }
}

TEST(Cli, BadOptionsExitWith2) {
  EXPECT_EQ(invoke("report --bogus").code, 2);
  EXPECT_EQ(invoke("report --optimizer lamb").code, 2);
  for (const char* batch : {"-3", "0"}) {
    const Result r = invoke(std::string("report --batch ") + batch);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, std::string("--batch must be > 0, got ") + batch)) << r.output;
  }
  EXPECT_EQ(invoke("frobnicate").code, 2);
  EXPECT_EQ(invoke("").code, 2);
  EXPECT_EQ(invoke("--help").code, 0);
}

TEST(Cli, RescueOnTheCpuNeedsABudget) {
  // The simulated device has no size of its own (on CUDA the default is the card's free memory:
  // CudaRescue.DeviceRoomIsTheFreeMemoryAndTheCache).
  const Result r = invoke("rescue --model mlp --batch 8 --steps 2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--budget is required with --device cpu")) << r.output;
  EXPECT_FALSE(contains(r.output, "memsave rescue: model")) << "it ran:\n" << r.output;
}

TEST(Cli, MalformedBudgetsAreParsedOrRejectedClearly) {
  const Result ambiguous = invoke("report --model mlp --budget 12G");
  EXPECT_EQ(ambiguous.code, 2);
  EXPECT_TRUE(contains(ambiguous.output, "ambiguous")) << ambiguous.output;
  const Result negative = invoke("report --model mlp --budget -3");
  EXPECT_EQ(negative.code, 2) << negative.output;
  const Result zero = invoke("report --model mlp --budget 0");
  EXPECT_EQ(zero.code, 2) << zero.output;
  EXPECT_EQ(invoke("report --model mlp --batch 2 --budget 1.5GB").code, 0);
  EXPECT_EQ(invoke("report --model mlp --batch 2 --budget 300MiB").code, 0);
}

TEST(Cli, ABudgetTooSmallIsAnOutOfMemoryWithExitCode3) {
  const Result r = invoke("report --model mlp --batch 4 --budget 12MiB");
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, "out of memory during 'model on the device'")) << r.output;
  EXPECT_TRUE(contains(r.output, "budget of 12.00 MiB (12582912 bytes)")) << r.output;
  const Result j = invoke_stdout("report --model mlp --batch 4 --budget 12MiB --json");
  EXPECT_EQ(j.code, 3);
  const auto parsed = nlohmann::json::parse(j.output);
  EXPECT_EQ(parsed["error"]["kind"], "out of memory");
  EXPECT_EQ(parsed["rows"].size(), 2u);
}

TEST(Cli, OnTheCpuABatchLargerThanTheHostIsAnOutOfMemoryNotAKill) {
  // 10^10 rows of the mlp's 784 floats: 31 TB. Each command stops at the host's bound with an answer.
  const char* huge = "--model mlp --batch 10000000000";
  const Result report = invoke(std::string("report ") + huge);
  EXPECT_EQ(report.code, 3) << report.output;
  EXPECT_TRUE(contains(report.output, "out of memory during 'input batch on the device'")) << report.output;
  EXPECT_TRUE(contains(report.output, "nine tenths of what this machine could provide")) << report.output;
  const auto json = nlohmann::json::parse(invoke_stdout(std::string("report --json ") + huge).output);
  EXPECT_GT(json["host_bound"].get<int64_t>(), 0);
  EXPECT_EQ(json["error"]["kind"], "out of memory");

  const std::string bench = std::string("bench ") + huge + " --recipes baseline,8bit --steps 2";
  const Result table = invoke_stdout(bench);
  EXPECT_EQ(table.code, 0) << table.output;
  EXPECT_TRUE(contains(table.output, "out of mem")) << table.output;
  EXPECT_TRUE(contains(table.output, "2 of 2 recipes ran out of memory and have no measurement (on the CPU"))
      << table.output;
  const Result j = invoke_stdout(bench + " --json");
  ASSERT_EQ(j.code, 0) << j.output;
  const auto parsed = nlohmann::json::parse(j.output);
  for (const auto& row : parsed["recipes"]) {
    EXPECT_TRUE(row["out_of_memory"].get<bool>());
    EXPECT_FALSE(row.contains("peak") || row.contains("seconds") || row.contains("peak_ratio")) << row;
  }
  EXPECT_TRUE(contains(invoke_stdout(bench + " --csv").output, "baseline,\"baseline\",,\n"));

  const Result rescue = invoke("rescue --model mlp --batch 8 --budget 1024TiB");
  EXPECT_EQ(rescue.code, 2) << rescue.output;
  EXPECT_TRUE(contains(rescue.output, "budget 1024.00 TiB is more than the CPU can measure"))
      << rescue.output;
}

TEST(Cli, CudaWithoutADeviceIsBadInput) {
  const Result r = invoke("report --model mlp --device cuda");
  if (r.code == 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "no CUDA device")) << r.output;
}

TEST(Cli, RescueRecommendsARecipeUnderTheBudget) {
  // gpt-tiny at batch 64 needs about 170 MiB: a budget of 80 MiB forces the checklist.
  const Result r = invoke_stdout("rescue --model gpt-tiny --batch 64 --budget 80MiB --steps 2 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  ASSERT_FALSE(j["recommended"].is_null());
  const auto& best = j["candidates"][j["recommended"].get<size_t>()];
  EXPECT_TRUE(best["fits"].get<bool>());
  EXPECT_LE(best["peak"].get<int64_t>(), 80 << 20);
  EXPECT_EQ(j["candidates"][0]["status"], "out of memory");  // the baseline does not fit
  // The fastest that fits, or a recipe earlier on the checklist within the tie (5%) of it.
  ASSERT_FALSE(j["fastest"].is_null());
  EXPECT_EQ(j["tie"].get<double>(), 0.05);
  EXPECT_EQ(j["noise"].get<double>(), 0);  // --steps 2: one timed step per candidate, nothing to spread
  EXPECT_EQ(best["spread"].get<double>(), 0);
  const double fastest = j["candidates"][j["fastest"].get<size_t>()]["seconds"].get<double>();
  EXPECT_LE(j["recommended"].get<size_t>(), j["fastest"].get<size_t>());
  EXPECT_LE(best["seconds"].get<double>(), fastest * 1.05);
  for (const auto& c : j["candidates"])
    if (c["fits"].get<bool>()) {
      EXPECT_GE(c["seconds"].get<double>(), fastest);
    }
  // The lead: how much slower than the fastest the fastest candidate outside the tie ran.
  double next = 0;
  for (const auto& c : j["candidates"])
    if (c["fits"].get<bool>() && c["seconds"].get<double>() > fastest * 1.05 &&
        (next == 0 || c["seconds"].get<double>() < next))
      next = c["seconds"].get<double>();
  if (next == 0) {
    EXPECT_TRUE(j["lead"].is_null());
  } else {
    EXPECT_DOUBLE_EQ(j["lead"].get<double>(), next / fastest - 1);
  }
  EXPECT_TRUE(contains(best["cpp"].get<std::string>(), "memsave::Recipe()"));
}

TEST(Cli, RescueTableEndsWithThePasteableRecipe) {
  const Result r = invoke_stdout("rescue --model mlp --batch 64 --budget 60MiB --steps 2");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "recommended:")) << r.output;
  EXPECT_TRUE(contains(r.output, "memsave::Recipe()")) << r.output;
}

TEST(Cli, RescueWithAWideTieRecommendsTheFirstRecipeThatFits) {
  // Every candidate is within a tie of 100 times the fastest: the first on the checklist that fits wins.
  const Result r =
      invoke_stdout("rescue --model gpt-tiny --batch 64 --budget 80MiB --steps 2 --tie 100 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  size_t first = j["candidates"].size();
  for (size_t i = 0; i < j["candidates"].size() && first == j["candidates"].size(); ++i)
    if (j["candidates"][i]["fits"].get<bool>()) first = i;
  EXPECT_EQ(j["recommended"].get<size_t>(), first);
  EXPECT_EQ(invoke_stdout("rescue --model mlp --batch 8 --budget 60MiB --tie -0.1").code, 2);
}

TEST(Cli, RescueAndEstimateTakeTheMixedPrecisionDtype) {
  // --amp fp16: a recipe for a card without bf16 (V100, T4), planned on the CPU.
  const Result r = invoke_stdout("rescue --model mlp --batch 8 --budget 60MiB --steps 2 --amp fp16 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  int mixed = 0;
  for (const auto& c : j["candidates"]) {
    const std::string cpp = c["cpp"].get<std::string>();
    if (!contains(cpp, ".amp(")) continue;
    ++mixed;
    EXPECT_TRUE(contains(cpp, ".amp(torch::kHalf)")) << cpp;
    EXPECT_TRUE(contains(c["recipe"].get<std::string>(), "fp16")) << c["recipe"];
  }
  EXPECT_GT(mixed, 0);
  const Result bf16 = invoke_stdout("estimate --model mlp --batch 8");  // auto: bf16 on the CPU
  ASSERT_EQ(bf16.code, 0) << bf16.output;
  EXPECT_TRUE(contains(bf16.output, "bf16")) << bf16.output;
  EXPECT_FALSE(contains(bf16.output, "fp16")) << bf16.output;
  EXPECT_EQ(invoke("rescue --model mlp --batch 8 --budget 60MiB --amp fp32").code, 2);
  EXPECT_EQ(invoke("estimate --model mlp --batch 8 --amp fp8").code, 2);
}

TEST(Cli, RescueBelowTheParametersExitsAtOnce) {
  const Result r = invoke_stdout("rescue --model mlp --batch 8 --budget 1MiB");  // 5.3M parameters: 21 MB
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, "nothing can fit: the parameters alone take")) << r.output;
}

TEST(Cli, RescueWhereNothingFitsNamesTheClosestMiss) {
  const Result r =
      invoke_stdout("rescue --model mlp --batch 8 --budget 40MiB --steps 2");  // params 22 MiB, grads 22
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_TRUE(contains(r.output, "nothing fits. Closest:")) << r.output;
}

TEST(Cli, PlanningCommandsRejectBadInput) {
  EXPECT_EQ(invoke("rescue --model gpt-tiny --batch 0 --budget 1GiB").code, 2);
  EXPECT_EQ(invoke("rescue --model gpt-tiny --budget 12G").code, 2);  // ambiguous unit
  EXPECT_EQ(invoke("rescue --model gpt-tiny").code, 2);               // no budget, on the CPU
  EXPECT_EQ(invoke("bench --model gpt-tiny --recipes baseline,warp-drive").code, 2);
  EXPECT_EQ(invoke("bench --model gpt-tiny --batch -1").code, 2);
  const Result cuda = invoke("rescue --model gpt-tiny --budget 1GiB --device cuda");
  if (!contains(cuda.output, "fits")) {  // on a machine without a GPU
    EXPECT_EQ(cuda.code, 2);
    EXPECT_TRUE(contains(cuda.output, "no CUDA device")) << cuda.output;
  }
}

TEST(Cli, BenchJsonHasOneEntryPerRecipeWithTheDocumentedFields) {
  const Result r =
      invoke_stdout("bench --model mlp --batch 16 --recipes baseline,micro4,bf16,8bit,4bit --steps 2 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  ASSERT_EQ(j["recipes"].size(), 5u);
  const char* names[] = {"baseline", "micro4", "bf16", "8bit", "4bit"};
  for (size_t i = 0; i < 5; ++i) {
    const auto& e = j["recipes"][i];
    EXPECT_EQ(e["name"], names[i]);
    for (const char* field : {"recipe", "cpp", "peak", "seconds", "spread", "peak_ratio", "time_ratio"})
      EXPECT_TRUE(e.contains(field)) << field;
    EXPECT_FALSE(e["out_of_memory"].get<bool>());
    EXPECT_EQ(e["spread"].get<double>(), 0);  // --steps 2: one timed step
    EXPECT_GT(e["peak"].get<int64_t>(), 0);
  }
  EXPECT_EQ(j["recipes"][0]["peak_ratio"].get<double>(), 1.0);
  EXPECT_LT(j["recipes"][3]["peak"].get<int64_t>(), j["recipes"][0]["peak"].get<int64_t>());  // 8-bit state
  EXPECT_LT(j["recipes"][4]["peak"].get<int64_t>(), j["recipes"][3]["peak"].get<int64_t>());  // 4-bit state
  EXPECT_FALSE(j["rules"].empty());
  EXPECT_EQ(j["noise"].get<double>(), 0);
}

TEST(Cli, BenchTableKeepsItsColumnsForLabelsLongerThanTheDefaultWidth) {
  // "all" is labelled "micro 2 + bf16 + ckpt every layer + 8-bit state", wider than the default column
  const Result r = invoke_stdout("bench --model mlp --batch 8 --recipes baseline,all --steps 2");
  ASSERT_EQ(r.code, 0) << r.output;
  std::istringstream lines(r.output);
  std::string line;
  size_t end = std::string::npos;  // where the right-aligned peak column ends
  int rows = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("recipe", 0) == 0) end = line.find("peak") + 4;
    if (end == std::string::npos || (line.rfind("baseline", 0) != 0 && line.rfind("all ", 0) != 0)) continue;
    ++rows;
    ASSERT_GT(line.size(), end) << line;
    EXPECT_EQ(line[end - 1], 'B') << "the peak column moved:\n" << r.output;
    EXPECT_EQ(line[end], ' ') << r.output;
  }
  EXPECT_EQ(rows, 2) << r.output;
}

TEST(Cli, BenchRejectsABadRecipeListOrPlotBeforeRunningAnything) {
  const struct {
    const char* args;
    const char* why;
  } cases[] = {
      {"--recipes ''", "--recipes names no recipe"},
      {"--recipes ,,", "unknown recipe ''"},
      {"--recipes baseline,warp-drive", "unknown recipe 'warp-drive'"},
      {"--recipes baseline --plot peaks.txt", "must end in .png or .svg"},
      {"--recipes baseline --plot /nonexistent-memsave-folder/peaks.png",
       "cannot write into the folder '/nonexistent-memsave-folder'"},
  };
  for (const auto& c : cases) {
    const Result r = invoke(std::string("bench --model mlp --batch 8 --steps 2 ") + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, c.why)) << c.args << "\n" << r.output;
    EXPECT_FALSE(contains(r.output, "memsave bench:")) << "a recipe ran:\n" << r.output;
  }
}

TEST(Cli, RescuePlotsTheCandidatesThatFitWithTheBudgetAndTheRecommendation) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) GTEST_SKIP() << "gnuplot is not installed";
  const std::string path = ::testing::TempDir() + "memsave_rescue.svg";
  std::remove(path.c_str());
  const Result r = invoke_stdout("rescue --model mlp --batch 8 --budget 1GiB --steps 2 --plot " + path);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto at = r.output.find("recommended: ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string recommended = r.output.substr(at + 13, r.output.find(" \u2014", at) - at - 13);
  std::ifstream svg(path);
  const std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(contains(text, "<svg")) << text.substr(0, 200);
  // the title, the key's two entries, and the recommended recipe's label
  for (const std::string& what :
       {std::string("memsave rescue: mlp, batch 8, budget 1.00 GiB"), std::string(">budget<"),
        std::string(">recommended<"), ">" + recommended + "<"})
    EXPECT_TRUE(contains(text, what)) << what;
  // Nothing fits: exit 3 and no file. A path it cannot write: exit 2 before anything runs.
  std::remove(path.c_str());
  const Result none = invoke("rescue --model mlp --batch 8 --budget 30MiB --steps 2 --plot " + path);
  EXPECT_EQ(none.code, 3) << none.output;
  EXPECT_TRUE(contains(none.output, "nothing fits, so --plot drew nothing")) << none.output;
  EXPECT_EQ(std::fopen(path.c_str(), "rb"), nullptr);
  const Result bad =
      invoke("rescue --model mlp --batch 8 --budget 1GiB --plot /nonexistent-memsave-folder/a.png");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_FALSE(contains(bad.output, "memsave rescue: model")) << bad.output;
}

TEST(Cli, BenchPlotsValidPngAndSvg) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) GTEST_SKIP() << "gnuplot is not installed";
  const std::string dir = ::testing::TempDir();
  for (const std::string ext : {"png", "svg"}) {
    const std::string path = dir + "memsave_bench." + ext;
    std::remove(path.c_str());
    const Result r =
        invoke_stdout("bench --model mlp --batch 8 --recipes baseline,bf16 --steps 2 --csv --plot " + path);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "name,recipe,peak_bytes,seconds")) << r.output;
    FILE* f = std::fopen(path.c_str(), "rb");
    ASSERT_NE(f, nullptr) << path;
    std::array<char, 8> head{};
    const size_t n = std::fread(head.data(), 1, head.size(), f);
    std::fclose(f);
    if (ext == "png") {
      ASSERT_EQ(n, 8u);
      EXPECT_EQ(std::string(head.data() + 1, 3), "PNG");
    } else {
      std::ifstream svg(path);
      const std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
      EXPECT_TRUE(contains(text, "<svg")) << text.substr(0, 200);
    }
  }
}

}  // namespace
