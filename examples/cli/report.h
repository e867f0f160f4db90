// `memsave report`: a training step's memory, stage by stage, from the meter.
#pragma once

#include <memsave/memory.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace memsave::cli {

struct ReportOptions {
  std::string model = "gpt-tiny";
  int64_t batch = 8;
  std::string optimizer = "adam";
  std::string device = "cpu";
  std::optional<int64_t> budget;
};

struct ReportRow {
  std::string stage;
  int64_t in_use = 0;  ///< bytes in the device pool after the stage
  int64_t change = 0;  ///< in_use minus the row above
  int64_t peak = 0;    ///< the pool's peak since "runtime ready"
};

/// A rule of thumb, its expected range (as a multiple) and what this model measured.
struct Rule {
  std::string name;
  double expected_low = 0;
  double expected_high = 0;
  double measured = 0;
  bool holds() const { return measured >= expected_low && measured <= expected_high; }
};

struct Report {
  ReportOptions options;
  std::string stage;       ///< the stage running, or the last one run
  int64_t parameters = 0;  ///< parameter elements
  std::vector<ReportRow> rows;
  int64_t inference_peak = 0;  ///< the pool's peak during the no-grad forward
  int64_t training_peak = 0;   ///< the pool's peak during the training step
  std::optional<MemoryBreakdown> breakdown;
  std::vector<Rule> rules;
  /// On the CPU, the bound on the pool when it is the host's (nine tenths of the memory available at the
  /// start, tighter than --budget or without one) rather than --budget's.
  std::optional<int64_t> host_bound;
};

/// The optimizers `report` knows.
std::vector<std::string> optimizer_names();

/// Runs the stages and fills `report` as it goes, so after an out-of-memory (c10::OutOfMemoryError, thrown
/// on) it holds the stages that completed.
void run_report(const ReportOptions& options, Report& report);

std::string format_table(const Report& report);
std::string format_json(const Report& report, const std::string& error = {}, const std::string& message = {});

}  // namespace memsave::cli
