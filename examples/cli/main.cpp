// The `memsave` command line. Exit codes: 0 success, 2 bad usage or input, 3 out of memory.
#include "../zoo/zoo.h"
#include "report.h"

#include <CLI/CLI.hpp>

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
    }
    return kOutOfMemory;
  }
  std::cout << (json ? memsave::cli::format_json(report) : memsave::cli::format_table(report)) << "\n";
  return 0;
}

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
  report_cmd->add_option("--batch", report.batch, "Batch size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  report_cmd->add_option("--optimizer", report.optimizer, "Optimizer")
      ->check(CLI::IsMember(memsave::cli::optimizer_names()))
      ->capture_default_str();
  report_cmd->add_option("--device", report.device, "Device whose pool is measured")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  report_cmd->add_option("--budget", budget, "Bound on the device pool, e.g. 300MiB or 1.5GB");
  report_cmd->add_flag("--json", json, "Raw bytes as JSON");

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
    if (report_cmd->parsed()) return report_command(report, json);
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {
    std::cerr << "memsave: " << e.what_without_backtrace() << "\n";
    return kBadInput;
  }
  return kBadInput;
}
