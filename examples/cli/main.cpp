// The `memsave` command line. Exit codes: 0 success, 2 bad usage or input, 3 out of memory.
#include "../zoo/zoo.h"
#include "plan.h"
#include "report.h"

#include <CLI/CLI.hpp>

#include <torch/cuda.h>

#include <unistd.h>
#include <cmath>
#include <fstream>
#include <iostream>

namespace {

constexpr int kBadInput = 2;
constexpr int kOutOfMemory = 3;

int report_command(const memsave::cli::ReportOptions& options, bool json) {
  memsave::cli::Report report;
  try {
    memsave::cli::run_report(options, report);
  } catch (const c10::OutOfMemoryError& e) {
    if (json) {
      std::cout << memsave::cli::format_json(report, "out of memory", e.what_without_backtrace()) << "\n";
    } else {
      std::cout << memsave::cli::format_table(report);
      std::cerr << "\nout of memory during '" << report.stage << "':\n" << e.what_without_backtrace() << "\n";
      if (report.host_bound)
        std::cerr << "(the device is simulated in host memory, and its pool was bounded at "
                  << memsave::format_bytes(*report.host_bound)
                  << ": nine tenths of what this machine could provide)\n";
    }
    return kOutOfMemory;
  }
  std::cout << (json ? memsave::cli::format_json(report) : memsave::cli::format_table(report)) << "\n";
  return 0;
}

c10::Device parse_device(const std::string& name) {
  TORCH_CHECK(name != "cuda" || torch::cuda::is_available(), "--device cuda: no CUDA device is available");
  return c10::Device(name);
}

/// --amp: bf16, fp16, or auto (nothing: the device's own, memsave::mixed_precision_dtype).
std::optional<c10::ScalarType> parse_amp(const std::string& name) {
  if (name == "bf16") return c10::kBFloat16;
  if (name == "fp16") return c10::kHalf;
  return std::nullopt;
}

constexpr const char* kAmpHelp =
    "Mixed precision's dtype: bf16, fp16 (with a GradScaler) or auto (bf16 on the CPU and on CUDA devices of "
    "compute capability 8.0 on, fp16 on older ones)";

}  // namespace

int main(int argc, char** argv) {
  memsave::install_meter();
  CLI::App app{"memsave: fit LibTorch training in less memory, and measure what it costs"};
  app.require_subcommand(1);

  memsave::cli::ReportOptions report;
  std::string budget;
  bool json = false;
  CLI::App* report_cmd = app.add_subcommand("report", "Memory of one training step, stage by stage");
  report_cmd->add_option("--model", report.model, "Model from the zoo")
      ->check(CLI::IsMember(memsave::zoo::workload_names()))
      ->capture_default_str();
  report_cmd->add_option("--batch", report.batch, "Batch size")->capture_default_str();
  report_cmd->add_option("--optimizer", report.optimizer, "Optimizer")
      ->check(CLI::IsMember(memsave::cli::optimizer_names()))
      ->capture_default_str();
  report_cmd->add_option("--device", report.device, "Device whose pool is measured")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  report_cmd->add_option("--budget", budget, "Bound on the device pool, e.g. 300MiB or 1.5GB");
  report_cmd->add_flag("--json", json, "Raw bytes as JSON");

  // rescue
  std::string rescue_model = "gpt-tiny", rescue_budget, rescue_device = "cpu", rescue_amp = "auto";
  int64_t rescue_batch = 64;
  int rescue_steps = memsave::RescueOptions(1, 1).steps();
  double rescue_tie = memsave::RescueOptions(1, 1).tie();
  bool rescue_json = false;
  CLI::App* rescue_cmd =
      app.add_subcommand("rescue", "Walk the OOM checklist under a memory budget and recommend a recipe");
  rescue_cmd->add_option("--model", rescue_model, "Model from the zoo")
      ->check(CLI::IsMember(memsave::zoo::workload_names()))
      ->capture_default_str();
  rescue_cmd->add_option("--batch", rescue_batch, "Effective batch (rows per optimizer step)")
      ->capture_default_str();
  rescue_cmd->add_option(
      "--budget", rescue_budget,
      "Device memory the step may use, e.g. 300MiB (required on cpu, whose device is simulated; "
      "on cuda the default is what the card can give now: its free memory)");
  rescue_cmd->add_option("--device", rescue_device, "cpu (simulated device) or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  rescue_cmd->add_option("--amp", rescue_amp, kAmpHelp)
      ->check(CLI::IsMember({"auto", "bf16", "fp16"}))
      ->capture_default_str();
  rescue_cmd->add_option("--steps", rescue_steps, "Steps per candidate (>= 2; the first is not timed)")
      ->capture_default_str();
  rescue_cmd
      ->add_option("--tie", rescue_tie,
                   "Step times within this fraction of the fastest count as equal: of those, the recipe "
                   "earliest on the checklist is recommended")
      ->capture_default_str();
  rescue_cmd->add_flag("--json", rescue_json, "JSON instead of a table");
  std::string rescue_plot;
  rescue_cmd->add_option(
      "--plot", rescue_plot,
      "Write the candidates that fit, peak memory against step time, with the budget and the "
      "recommended one marked, to FILE (.png or .svg)");

  // estimate
  std::string estimate_model = "gpt-tiny", estimate_device = "cpu", estimate_amp = "auto";
  int64_t estimate_batch = 32;
  CLI::App* estimate_cmd =
      app.add_subcommand("estimate", "Predicted against measured peak for each candidate of the checklist");
  estimate_cmd->add_option("--model", estimate_model, "Model from the zoo")
      ->check(CLI::IsMember(memsave::zoo::workload_names()))
      ->capture_default_str();
  estimate_cmd->add_option("--batch", estimate_batch, "Batch")->capture_default_str();
  estimate_cmd->add_option("--device", estimate_device, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  estimate_cmd->add_option("--amp", estimate_amp, kAmpHelp)
      ->check(CLI::IsMember({"auto", "bf16", "fp16"}))
      ->capture_default_str();

  // bench
  std::string bench_model = "gpt-tiny", bench_recipes = "all", bench_device = "cpu", bench_plot;
  int64_t bench_batch = 32;
  int bench_steps = 3;
  bool bench_json = false, bench_csv = false;
  CLI::App* bench_cmd =
      app.add_subcommand("bench", "Peak memory and step time of each technique and combination");
  bench_cmd->add_option("--model", bench_model, "Model from the zoo")
      ->check(CLI::IsMember(memsave::zoo::workload_names()))
      ->capture_default_str();
  bench_cmd->add_option("--batch", bench_batch, "Batch")->capture_default_str();
  bench_cmd->add_option("--recipes", bench_recipes, "all, or a comma-separated list of recipe names")
      ->capture_default_str();
  bench_cmd->add_option("--steps", bench_steps, "Steps per recipe (>= 2)")->capture_default_str();
  bench_cmd->add_option("--device", bench_device, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  bench_cmd->add_flag("--json", bench_json, "JSON instead of a table");
  bench_cmd->add_flag("--csv", bench_csv, "CSV instead of a table");
  bench_cmd->add_option("--plot", bench_plot, "Write peak memory against step time to FILE (.png or .svg)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kBadInput;
  }

  try {
    if (!budget.empty()) {
      report.budget = memsave::parse_bytes(budget);
      TORCH_CHECK(*report.budget > 0, "--budget must be positive, got '", budget, "'");
    }
    if (report_cmd->parsed()) {
      TORCH_CHECK(report.batch > 0, "--batch must be > 0, got ", report.batch);
      return report_command(report, json);
    }
    if (rescue_cmd->parsed()) {
      TORCH_CHECK(rescue_batch > 0, "--batch must be > 0, got ", rescue_batch);
      const c10::Device device = parse_device(rescue_device);
      TORCH_CHECK(!rescue_budget.empty() || device.is_cuda(),
                  "--budget is required with --device cpu: the simulated device has no size of its own (give "
                  "the memory of the card to plan for, e.g. --budget 16GiB)");
      if (!rescue_plot.empty()) memsave::cli::check_plot(rescue_plot);
      const int64_t budget_bytes =
          rescue_budget.empty() ? memsave::device_room(device) : memsave::parse_bytes(rescue_budget);
      TORCH_CHECK(budget_bytes > 0, "--budget must be positive, got '", rescue_budget, "'");
      TORCH_CHECK(rescue_steps >= 2, "--steps must be >= 2, got ", rescue_steps);
      TORCH_CHECK(std::isfinite(rescue_tie) && rescue_tie >= 0, "--tie must be a fraction >= 0, got ",
                  rescue_tie);
      memsave::RescueOptions options(rescue_batch, budget_bytes);
      options.device(device).amp(parse_amp(rescue_amp)).steps(rescue_steps).tie(rescue_tie);
      if (!rescue_json && isatty(STDERR_FILENO)) {
        options.progress([](size_t done, size_t total) {
          std::cerr << "\rcandidate " << done << "/" << total << std::flush;
          if (done == total) std::cerr << "\r" << std::string(24, ' ') << "\r" << std::flush;
        });
      }
      const memsave::RescuePlan plan = memsave::rescue(memsave::zoo::training_setup(rescue_model), options);
      std::cout << (rescue_json ? memsave::cli::rescue_json(plan, options, rescue_model)
                                : memsave::cli::format_rescue(plan, options, rescue_model))
                << "\n";
      if (!rescue_plot.empty() && !memsave::cli::plot_rescue(plan, options, rescue_model, rescue_plot))
        std::cerr << "memsave: nothing fits, so --plot drew nothing\n";
      return plan.recommended ? 0 : kOutOfMemory;
    }
    if (estimate_cmd->parsed()) {
      TORCH_CHECK(estimate_batch > 0, "--batch must be > 0, got ", estimate_batch);
      const c10::Device device = parse_device(estimate_device);
      const c10::ScalarType amp = parse_amp(estimate_amp).value_or(memsave::mixed_precision_dtype(device));
      const auto rows =
          memsave::cli::run_estimate(estimate_model, estimate_batch, device, amp, 2, isatty(STDERR_FILENO));
      std::cout << memsave::cli::format_estimate(rows, estimate_model, estimate_batch, device);
      return 0;
    }
    if (bench_cmd->parsed()) {
      TORCH_CHECK(bench_batch > 0, "--batch must be > 0, got ", bench_batch);
      TORCH_CHECK(bench_steps >= 2, "--steps must be >= 2, got ", bench_steps);
      TORCH_CHECK(!(bench_json && bench_csv), "--json and --csv exclude each other");
      if (!bench_plot.empty()) memsave::cli::check_plot(bench_plot);
      const c10::Device device = parse_device(bench_device);
      const auto rows = memsave::cli::run_bench(bench_model, bench_batch, bench_recipes, bench_steps, device,
                                                !bench_json && !bench_csv && isatty(STDERR_FILENO));
      if (bench_json)
        std::cout << memsave::cli::bench_json(rows, bench_model, bench_batch, device) << "\n";
      else if (bench_csv)
        std::cout << memsave::cli::bench_csv(rows);
      else
        std::cout << memsave::cli::format_bench(rows, bench_model, bench_batch, device);
      if (!bench_plot.empty()) memsave::cli::plot_bench(rows, bench_model, bench_batch, bench_plot);
      return 0;
    }
  } catch (const c10::OutOfMemoryError& e) {
    // What no run of a command could absorb (a model larger than the device, profiled on one row).
    std::cerr << "memsave: " << e.what_without_backtrace() << "\n";
    return kOutOfMemory;
  } catch (const c10::Error& e) {
    std::cerr << "memsave: " << e.what_without_backtrace() << "\n";
    return kBadInput;
  }
  return kBadInput;
}
