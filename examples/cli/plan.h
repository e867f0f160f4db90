// `memsave rescue`, `memsave estimate` and `memsave bench`: the OOM rescue, the peak estimator against
// measurement, and the trade-off benchmark, on the zoo's models.
#pragma once

#include <memsave/rescue.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace memsave::cli {

std::string format_rescue(const RescuePlan& plan, const RescueOptions& options, const std::string& model);
std::string rescue_json(const RescuePlan& plan, const RescueOptions& options, const std::string& model);

/// One row of `estimate`: a recipe, its predicted and measured peaks.
struct Estimate {
  Recipe recipe;
  int64_t predicted = 0;
  int64_t measured = 0;
  /// The run ended in an out-of-memory (on the CPU: past nine tenths of the host memory available), so
  /// `measured` is only what it reached.
  bool out_of_memory = false;
  double error() const { return static_cast<double>(predicted - measured) / static_cast<double>(measured); }
};
/// The checklist's candidates (micro-batches down to a quarter of the batch), mixed precision in `amp`.
/// `progress`: a line on stderr saying what runs (for a terminal).
std::vector<Estimate> run_estimate(const std::string& model, int64_t batch, c10::Device device,
                                   c10::ScalarType amp, int steps, bool progress);
std::string format_estimate(const std::vector<Estimate>& rows, const std::string& model, int64_t batch,
                            c10::Device device);

/// The named recipes `bench` knows: each technique alone and the useful combinations.
std::vector<std::pair<std::string, Recipe>> bench_recipes(int64_t batch);
struct BenchRow {
  std::string name;
  Recipe recipe;
  Measurement measured;  ///< out_of_memory: a row without a peak or step time
};
/// Runs the recipes named in `names` ("all" or a comma-separated list); an unknown name is an error before
/// anything runs.
std::vector<BenchRow> run_bench(const std::string& model, int64_t batch, const std::string& names, int steps,
                                c10::Device device, bool progress);
std::string format_bench(const std::vector<BenchRow>& rows, const std::string& model, int64_t batch,
                         c10::Device device);
std::string bench_json(const std::vector<BenchRow>& rows, const std::string& model, int64_t batch,
                       c10::Device device);
std::string bench_csv(const std::vector<BenchRow>& rows);
/// Whether plot_bench can draw into `path`: a .png or .svg name in a folder this process can write, and
/// gnuplot installed; an error saying why not. Call it before run_bench, so that a bad --plot costs no run.
void check_plot(const std::string& path);
/// Peak memory against step time, one point per recipe, drawn with gnuplot into `path`, which check_plot
/// accepted.
void plot_bench(const std::vector<BenchRow>& rows, const std::string& model, int64_t batch,
                const std::string& path);
/// The rescue's candidates that fit, peak memory against step time, the recommended one marked and the budget
/// a dashed line, drawn into `path` (which check_plot accepted). False, and no file, when nothing fits.
bool plot_rescue(const RescuePlan& plan, const RescueOptions& options, const std::string& model,
                 const std::string& path);

}  // namespace memsave::cli
