#include "plan.h"

#include "../zoo/zoo.h"

#include <memsave/memory.h>

#include <c10/util/Exception.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

namespace memsave::cli {
namespace {

std::string status_text(const Candidate& c) {
  switch (c.status) {
    case Candidate::Status::kFits:
      return "fits";
    case Candidate::Status::kOutOfMemory:
      return "out of memory";
    case Candidate::Status::kCannotFit:
      return "cannot fit (static bytes)";  // parameters, gradients, state and batch alone
    case Candidate::Status::kNotNeeded:
      return "not run (adds only work)";
    case Candidate::Status::kFailed:
      return "failed (error below)";
  }
  return "?";
}

std::string cell(const std::string& s, int width) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%-*s", width, s.c_str());
  return buf;
}

std::string rcell(const std::string& s, int width) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%*s", width, s.c_str());
  return buf;
}

/// The width of a column of labels: at least `minimum`, and two spaces wider than the longest.
template <typename Rows, typename Label>
int label_width(const Rows& rows, Label label, int minimum) {
  size_t width = static_cast<size_t>(minimum);
  for (const auto& row : rows) width = std::max(width, label(row).size() + 2);
  return static_cast<int>(width);
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

std::string percent(double fraction) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3g%%", 100 * fraction);
  return buf;
}

/// The note under a table with rows that ran out of memory: where the memory ended.
std::string out_of_memory_where(c10::Device device) {
  if (!device.is_cpu()) return " on " + device.str();
  return " (on the CPU the device is simulated in host memory, and a run stops at nine tenths of what the "
         "host can provide: about " +
         format_bytes(simulated_device_room()) + " now)";
}

/// Timing noise (RescuePlan::noise) above which `bench` says its ratios are uncertain: in `memsave rescue`,
/// this project's machine measures 1-3% quiet on gpt-tiny's steps (a tenth of a second), 18-56% on the mlp's
/// (milliseconds), and 43-72% on gpt-tiny's beside one spinning process (bench/RESULTS-rescue.md).
constexpr double kNoisy = 0.10;

/// The timing noise of a benchmark's rows, as the rescue measures it over its candidates.
double bench_noise(const std::vector<BenchRow>& rows) {
  std::vector<Candidate> measured;
  for (const BenchRow& r : rows) {
    if (r.measured.out_of_memory) continue;
    Candidate c;
    c.status = Candidate::Status::kFits;
    c.measured = r.measured;
    measured.push_back(std::move(c));
  }
  return timing_noise(measured);
}

/// How much slower than the fastest the fastest candidate outside the tie ran, as a fraction; none when every
/// candidate that fits is within the tie. Noise above it can change the recommendation.
std::optional<double> lead(const RescuePlan& plan, double tie) {
  if (!plan.fastest) return std::nullopt;
  const double fastest = plan.candidates[*plan.fastest].measured.seconds;
  std::optional<double> next;
  for (const Candidate& c : plan.candidates)
    if (c.status == Candidate::Status::kFits && c.measured.seconds > fastest * (1 + tie) &&
        (!next || c.measured.seconds < *next))
      next = c.measured.seconds;
  if (!next || fastest <= 0) return std::nullopt;
  return *next / fastest - 1;
}

bool ran(const Candidate& c) {
  return c.status == Candidate::Status::kFits || c.status == Candidate::Status::kOutOfMemory;
}

int64_t elements_of(const std::string& model) {
  torch::manual_seed(0);
  return static_cast<int64_t>(zoo::workload(model).make_model()->size());
}

}  // namespace

std::string format_rescue(const RescuePlan& plan, const RescueOptions& options, const std::string& model) {
  std::ostringstream out;
  out << "memsave rescue: model " << model << ", batch " << options.batch() << ", budget "
      << format_bytes(options.budget()) << " on " << options.device()
      << (options.device().is_cpu() ? " (CPU, simulated device)" : "") << "\n\n";
  if (plan.below_parameters) {
    out << "nothing can fit: the parameters alone take " << format_bytes(plan.parameter_bytes)
        << ", more than the budget of " << format_bytes(options.budget()) << "\n";
    return out.str();
  }
  const int label = label_width(
      plan.candidates, [](const Candidate& c) { return c.recipe.label(); }, 58);
  out << cell("candidate", label) << rcell("predicted", 12) << rcell("peak", 12) << "  " << cell("fits?", 27)
      << rcell("step", 10) << rcell("throughput", 12) << "\n";
  size_t not_needed = 0;
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    const Candidate& c = plan.candidates[i];
    if (c.status == Candidate::Status::kNotNeeded) {
      ++not_needed;
      continue;
    }
    const bool measured = ran(c);
    out << cell(c.recipe.label(), label) << rcell(format_bytes(c.predicted), 12)
        << rcell(measured ? (c.status == Candidate::Status::kOutOfMemory ? "> budget"
                                                                         : format_bytes(c.measured.peak))
                          : "-",
                 12)
        << "  " << cell(status_text(c), 27)
        << rcell(c.status == Candidate::Status::kFits ? fixed(c.measured.seconds, 3) + " s" : "-", 10)
        << rcell(c.status == Candidate::Status::kFits ? fixed(c.relative_throughput, 2) + "x" : "-", 12)
        << (plan.recommended == i ? "  <- recommended" : "") << "\n";
  }
  if (not_needed > 0)
    out << "(" << not_needed
        << " candidates were not run: each only adds steps (a smaller micro-batch) or recomputation (more "
           "checkpointing) to one that fits)\n";
  // Each error once, after the candidates that failed with it.
  std::vector<std::pair<std::string, std::vector<std::string>>> errors;
  for (const Candidate& c : plan.candidates) {
    if (c.status != Candidate::Status::kFailed) continue;
    auto same = std::find_if(errors.begin(), errors.end(), [&](const auto& e) { return e.first == c.error; });
    if (same == errors.end()) same = errors.insert(errors.end(), {c.error, {}});
    same->second.push_back(c.recipe.label());
  }
  for (const auto& [error, labels] : errors) {
    out << "failed:";
    for (size_t k = 0; k < labels.size(); ++k) out << (k == 0 ? " " : ", ") << labels[k];
    out << "\n  " << error << "\n";
  }
  out << "\n";
  if (plan.recommended) {
    const Candidate& c = plan.candidates[*plan.recommended];
    out << "recommended: " << c.recipe.label() << " — peak " << format_bytes(c.measured.peak) << " of "
        << format_bytes(options.budget()) << " (margin " << format_bytes(options.budget() - c.measured.peak)
        << "), " << fixed(c.relative_throughput, 2) << "x the throughput of "
        << (plan.candidates.front().status == Candidate::Status::kFits ? "the baseline"
                                                                       : "the fastest that fits")
        << "\n  " << c.recipe.to_cpp() << "\n";
    if (plan.fastest && *plan.fastest != *plan.recommended) {
      const Candidate& f = plan.candidates[*plan.fastest];
      out << "  (within the " << percent(options.tie()) << " tie of the fastest, " << f.recipe.label()
          << " at " << fixed(f.measured.seconds, 3) << " s, and earlier on the checklist)\n";
    }
    if (c.recipe.state_bits() != 32 || c.recipe.offload() != Offload::kNone)
      out << "  (a run saved by Trainer::save resumes under it: Trainer::load converts the optimizer "
             "state)\n";
  }
  if (const std::optional<double> ahead = lead(plan, options.tie()); ahead && plan.noise >= *ahead) {
    out << "note: the timed steps of one candidate varied by " << percent(plan.noise)
        << " (the median over the candidates), as much as the " << percent(*ahead)
        << " by which the fastest led the next candidate outside the tie: another run may recommend "
           "otherwise (rerun with more --steps, or when the machine is quiet)\n";
  }
  if (!plan.recommended && plan.closest_miss) {
    const Candidate& c = plan.candidates[*plan.closest_miss];
    out << "nothing fits. Closest: " << c.recipe.label() << ", predicted " << format_bytes(c.predicted)
        << " against a budget of " << format_bytes(options.budget()) << "\n";
  }
  return out.str();
}

std::string rescue_json(const RescuePlan& plan, const RescueOptions& options, const std::string& model) {
  nlohmann::json j;
  j["model"] = model;
  j["batch"] = options.batch();
  j["budget"] = options.budget();
  j["device"] = options.device().str();
  j["parameter_bytes"] = plan.parameter_bytes;
  j["below_parameters"] = plan.below_parameters;
  j["candidates"] = nlohmann::json::array();
  for (const Candidate& c : plan.candidates) {
    nlohmann::json row = {{"recipe", c.recipe.label()}, {"cpp", c.recipe.to_cpp()},
                          {"predicted", c.predicted},   {"static_bytes", c.static_bytes},
                          {"status", status_text(c)},   {"fits", c.status == Candidate::Status::kFits}};
    if (ran(c)) row["peak"] = c.measured.peak;
    if (c.status == Candidate::Status::kFailed) row["error"] = c.error;
    if (c.status == Candidate::Status::kFits) {
      row["seconds"] = c.measured.seconds;
      row["spread"] = c.measured.spread;
      row["relative_throughput"] = c.relative_throughput;
    }
    j["candidates"].push_back(row);
  }
  j["tie"] = options.tie();
  j["noise"] = plan.noise;
  const std::optional<double> ahead = lead(plan, options.tie());
  j["lead"] = ahead ? nlohmann::json(*ahead) : nlohmann::json(nullptr);
  j["recommended"] = plan.recommended ? nlohmann::json(*plan.recommended) : nlohmann::json(nullptr);
  j["fastest"] = plan.fastest ? nlohmann::json(*plan.fastest) : nlohmann::json(nullptr);
  j["closest_miss"] = plan.closest_miss ? nlohmann::json(*plan.closest_miss) : nlohmann::json(nullptr);
  return j.dump(2);
}

std::vector<Estimate> run_estimate(const std::string& model, int64_t batch, c10::Device device,
                                   c10::ScalarType amp, int steps, bool progress) {
  const TrainingSetup setup = zoo::training_setup(model);
  if (progress) std::cerr << "\rprofiling " << model << std::flush;
  const MemoryModel memory = MemoryModel::profile(setup, batch, device, amp);
  std::vector<Recipe> recipes;
  for (const Recipe& r : checklist(batch, memory.elements(), amp, setup.optimizer))
    if (r.micro_batch() == 0 || r.micro_batch() * 4 >= batch)
      recipes.push_back(r);  // micro down to a quarter
  std::vector<Estimate> rows;
  for (size_t i = 0; i < recipes.size(); ++i) {
    if (progress)
      std::cerr << "\r" << std::string(24, ' ') << "\rrecipe " << i + 1 << "/" << recipes.size()
                << std::flush;
    Estimate e;
    e.recipe = recipes[i];
    e.predicted = memory.predict(recipes[i]);
    const Measurement m = measure(setup, recipes[i], batch, device, steps);
    e.measured = m.peak;
    e.out_of_memory = m.out_of_memory;
    rows.push_back(e);
  }
  if (progress) std::cerr << "\r" << std::string(24, ' ') << "\r" << std::flush;
  return rows;
}

std::string format_estimate(const std::vector<Estimate>& rows, const std::string& model, int64_t batch,
                            c10::Device device) {
  const int label = label_width(
      rows, [](const Estimate& e) { return e.recipe.label(); }, 46);
  std::ostringstream out;
  out << "memsave estimate: model " << model << ", batch " << batch
      << " (predicted from one profile of the model; measured by running each recipe)\n\n"
      << cell("recipe", label) << rcell("predicted", 12) << rcell("measured", 12) << rcell("error", 9)
      << "\n";
  double worst = 0;
  size_t out_of_memory = 0;
  for (const Estimate& e : rows) {
    out << cell(e.recipe.label(), label) << rcell(format_bytes(e.predicted), 12);
    if (e.out_of_memory) {
      out << rcell("out of mem", 12) << rcell("-", 9) << "\n";
      ++out_of_memory;
      continue;
    }
    out << rcell(format_bytes(e.measured), 12) << rcell(fixed(100 * e.error(), 1) + "%", 9) << "\n";
    worst = std::max(worst, std::abs(e.error()));
  }
  if (out_of_memory < rows.size())
    out << "\nlargest error " << fixed(100 * worst, 1) << "% (target: within 10%)\n";
  if (out_of_memory > 0)
    out << "\n"
        << out_of_memory << " of " << rows.size() << " recipes ran out of memory and have no measurement"
        << out_of_memory_where(device) << "\n";
  return out.str();
}

std::vector<std::pair<std::string, Recipe>> bench_recipes(int64_t batch) {
  const int64_t quarter = std::max<int64_t>(1, batch / 4);
  const Recipe bf16 = Recipe().amp(c10::kBFloat16);
  return {
      {"baseline", Recipe()},
      {"micro4", Recipe().micro_batch(quarter)},
      {"bf16", bf16},
      {"ckpt-sqrt", Recipe().checkpoint(Checkpointing::segments(0))},  // 0: √n, resolved per model
      {"ckpt-every", Recipe().checkpoint(Checkpointing::every_layer())},
      {"8bit", Recipe().state_bits(8)},
      {"4bit", Recipe().state_bits(4)},
      {"offload", Recipe().offload(Offload::kOptimizerState)},
      {"micro4+bf16", Recipe(bf16).micro_batch(quarter)},
      {"bf16+ckpt", Recipe(bf16).checkpoint(Checkpointing::every_layer())},
      {"bf16+8bit", Recipe(bf16).state_bits(8)},
      {"bf16+ckpt+8bit", Recipe(bf16).checkpoint(Checkpointing::every_layer()).state_bits(8)},
      {"bf16+ckpt+4bit", Recipe(bf16).checkpoint(Checkpointing::every_layer()).state_bits(4)},
      {"all", Recipe(bf16).micro_batch(quarter).checkpoint(Checkpointing::every_layer()).state_bits(8)},
  };
}

std::vector<BenchRow> run_bench(const std::string& model, int64_t batch, const std::string& names, int steps,
                                c10::Device device, bool progress) {
  auto known = bench_recipes(batch);
  const auto root = static_cast<int64_t>(std::lround(std::sqrt(static_cast<double>(elements_of(model)))));
  for (auto& [name, recipe] : known)
    if (recipe.checkpoint().kind == Checkpointing::Kind::kSegments)
      recipe.checkpoint(Checkpointing::segments(root));
  std::vector<std::pair<std::string, Recipe>> chosen;
  if (names == "all") {
    chosen = known;
  } else {
    std::string valid;
    for (const auto& k : known) valid += (valid.empty() ? "" : ", ") + k.first;
    std::stringstream list(names);
    std::string name;
    while (std::getline(list, name, ',')) {
      auto it = std::find_if(known.begin(), known.end(), [&](const auto& k) { return k.first == name; });
      TORCH_CHECK(it != known.end(), "--recipes: unknown recipe '", name,
                  "' (--recipes takes all, or a comma-separated list of: ", valid, ")");
      chosen.push_back(*it);
    }
    TORCH_CHECK(!chosen.empty(), "--recipes names no recipe, got '", names,
                "' (--recipes takes all, or a comma-separated list of: ", valid, ")");
  }
  const TrainingSetup setup = zoo::training_setup(model);
  std::vector<BenchRow> rows;
  for (size_t i = 0; i < chosen.size(); ++i) {
    if (progress)
      std::cerr << "\r[" << i + 1 << "/" << chosen.size() << "] " << chosen[i].first << "        "
                << std::flush;
    rows.push_back(
        {chosen[i].first, chosen[i].second, measure(setup, chosen[i].second, batch, device, steps)});
  }
  if (progress) std::cerr << "\r" << std::string(40, ' ') << "\r" << std::flush;
  return rows;
}

namespace {

/// The row of that name, if it ran to the end.
const BenchRow* find(const std::vector<BenchRow>& rows, const std::string& name) {
  for (const BenchRow& r : rows)
    if (r.name == name && !r.measured.out_of_memory) return &r;
  return nullptr;
}

struct RuleRow {
  std::string rule;
  std::string tutorials;
  std::string measured;
};

/// The rules of thumb users find in tutorials, beside what this run measured.
std::vector<RuleRow> rules(const std::vector<BenchRow>& rows, const std::string& model, int64_t batch,
                           c10::Device device) {
  std::vector<RuleRow> out;
  const BenchRow* base = find(rows, "baseline");
  if (!base) return out;
  const TrainingSetup setup = zoo::training_setup(model);
  const MemoryModel memory = MemoryModel::profile(setup, batch, device);
  auto activations = [&](const BenchRow& r) {
    return static_cast<double>(r.measured.peak - memory.static_bytes(r.recipe));
  };
  {
    torch::manual_seed(0);
    const zoo::Workload w = zoo::workload(model);
    auto net = w.make_model();
    net->to(device);
    const zoo::Batch b = w.make_batch(batch, device);
    torch::NoGradGuard no_grad;
    net->eval();
    if (device.is_cuda()) torch::cuda::synchronize();
    const int64_t before = memory_stats(device).current;
    PeakScope scope(device);
    net->forward(b.input);
    const double inference = static_cast<double>(scope.peak() - before + memory.parameter_bytes());
    out.push_back(
        {"training peak / inference peak", "1.5–2.5x", fixed(base->measured.peak / inference, 2) + "x"});
  }
  out.push_back({"Adam state / parameter bytes", "2x",
                 fixed(static_cast<double>(memory.static_bytes(Recipe()) -
                                           memory.static_bytes(Recipe().offload(Offload::kOptimizerState))) /
                           memory.parameter_bytes(),
                       2) +
                     "x"});
  if (const BenchRow* r = find(rows, "bf16"))
    out.push_back({"AMP: peak saved", "35–40%",
                   fixed(100 * (1 - static_cast<double>(r->measured.peak) / base->measured.peak), 0) + "% (" +
                       fixed(100 * (1 - activations(*r) / activations(*base)), 0) + "% of activations)"});
  for (const char* name : {"ckpt-sqrt", "ckpt-every"})
    if (const BenchRow* r = find(rows, name))
      out.push_back({std::string("checkpointing (") + name + "): activations saved, time", "~60% for ~20%",
                     fixed(100 * (1 - activations(*r) / activations(*base)), 0) + "% for " +
                         fixed(100 * (r->measured.seconds / base->measured.seconds - 1), 0) + "%"});
  if (const BenchRow* r = find(rows, "micro4"))
    out.push_back({"4-way accumulation: activations cut", "~75%",
                   fixed(100 * (1 - activations(*r) / activations(*base)), 0) + "%"});
  return out;
}

}  // namespace

std::string format_bench(const std::vector<BenchRow>& rows, const std::string& model, int64_t batch,
                         c10::Device device) {
  const int label = label_width(
      rows, [](const BenchRow& r) { return r.recipe.label(); }, 44);
  std::ostringstream out;
  out << "memsave bench: model " << model << ", batch " << batch << "\n\n"
      << cell("recipe", 16) << cell("what", label) << rcell("peak", 12) << rcell("vs baseline", 13)
      << rcell("step", 10) << rcell("vs baseline", 13) << "\n";
  const BenchRow* base = find(rows, "baseline");
  size_t out_of_memory = 0;
  for (const BenchRow& r : rows) {
    out << cell(r.name, 16) << cell(r.recipe.label(), label);
    if (r.measured.out_of_memory) {
      out << rcell("out of mem", 12) << rcell("-", 13) << rcell("-", 10) << rcell("-", 13) << "\n";
      ++out_of_memory;
      continue;
    }
    out << rcell(format_bytes(r.measured.peak), 12)
        << rcell(base ? fixed(static_cast<double>(r.measured.peak) / base->measured.peak, 2) + "x" : "-", 13)
        << rcell(fixed(r.measured.seconds, 3) + " s", 10)
        << rcell(base ? fixed(r.measured.seconds / base->measured.seconds, 2) + "x" : "-", 13) << "\n";
  }
  if (out_of_memory > 0)
    out << "\n"
        << out_of_memory << " of " << rows.size() << " recipes ran out of memory and have no measurement"
        << out_of_memory_where(device) << "\n";
  const auto rule_rows = rules(rows, model, batch, device);
  if (!rule_rows.empty()) {
    out << "\n" << cell("rule of thumb", 56) << cell("tutorials", 18) << "this run\n";
    for (const RuleRow& r : rule_rows) out << cell(r.rule, 56) << cell(r.tutorials, 18) << r.measured << "\n";
  }
  if (const double noise = bench_noise(rows); noise > kNoisy) {
    out << "\nnote: the timed steps of one recipe varied by " << percent(noise)
        << " (the median over the recipes): the step-time ratios are uncertain by about as much (rerun with "
           "more --steps, or when the machine is quiet)\n";
  }
  return out.str();
}

std::string bench_json(const std::vector<BenchRow>& rows, const std::string& model, int64_t batch,
                       c10::Device device) {
  nlohmann::json j;
  j["model"] = model;
  j["batch"] = batch;
  j["device"] = device.str();
  j["recipes"] = nlohmann::json::array();
  const BenchRow* base = find(rows, "baseline");
  for (const BenchRow& r : rows) {
    nlohmann::json row = {{"name", r.name},
                          {"recipe", r.recipe.label()},
                          {"cpp", r.recipe.to_cpp()},
                          {"out_of_memory", r.measured.out_of_memory}};
    if (r.measured.out_of_memory) {
      j["recipes"].push_back(row);
      continue;
    }
    row["peak"] = r.measured.peak;
    row["seconds"] = r.measured.seconds;
    row["spread"] = r.measured.spread;
    if (base) {
      row["peak_ratio"] = static_cast<double>(r.measured.peak) / base->measured.peak;
      row["time_ratio"] = r.measured.seconds / base->measured.seconds;
    }
    j["recipes"].push_back(row);
  }
  j["noise"] = bench_noise(rows);
  j["rules"] = nlohmann::json::array();
  for (const RuleRow& r : rules(rows, model, batch, device))
    j["rules"].push_back({{"rule", r.rule}, {"tutorials", r.tutorials}, {"measured", r.measured}});
  return j.dump(2);
}

std::string bench_csv(const std::vector<BenchRow>& rows) {
  std::ostringstream out;
  out << "name,recipe,peak_bytes,seconds\n";
  for (const BenchRow& r : rows) {
    out << r.name << ",\"" << r.recipe.label() << "\",";
    if (r.measured.out_of_memory)
      out << ",\n";  // ran out of memory: no peak, no step time
    else
      out << r.measured.peak << "," << fixed(r.measured.seconds, 6) << "\n";
  }
  return out.str();
}

void check_plot(const std::string& path) {
  const bool svg = path.size() > 4 && path.substr(path.size() - 4) == ".svg";
  TORCH_CHECK(svg || (path.size() > 4 && path.substr(path.size() - 4) == ".png"),
              "--plot: the file must end in .png or .svg, got '", path, "'");
  TORCH_CHECK(path.find('\'') == std::string::npos, "--plot: the path must not contain a quote, got '", path,
              "'");
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  TORCH_CHECK(access(dir.c_str(), W_OK | X_OK) == 0, "--plot: cannot write into the folder '", dir, "' of '",
              path, "': ", std::strerror(errno));
  TORCH_CHECK(std::system("command -v gnuplot >/dev/null 2>&1") == 0,
              "--plot needs gnuplot (Debian: apt-get install gnuplot-nox)");
}

namespace {

/// One point of a plot: a run that fit.
struct PlotPoint {
  double seconds = 0;
  int64_t peak = 0;
  std::string label;
  bool highlighted = false;  ///< drawn larger, in another colour, with the key's `highlight` title
};

/// Peak memory against step time, one labelled point each, drawn with gnuplot into `path` (which check_plot
/// accepted); with `budget`, a dashed line at it.
void draw(const std::vector<PlotPoint>& points, const std::string& title, std::optional<int64_t> budget,
          const std::string& highlight, const std::string& path) {
  const bool svg = path.substr(path.size() - 4) == ".svg";
  const std::string data = path + ".dat", script = path + ".gp";
  bool any_highlighted = false;
  {
    std::ofstream d(data);
    for (const PlotPoint& p : points) {
      std::string label = p.label;
      std::replace(label.begin(), label.end(), '"', '\'');
      d << fixed(p.seconds, 6) << " " << fixed(p.peak / 1048576.0, 3) << " \"" << label << "\" "
        << (p.highlighted ? 1 : 0) << "\n";
      any_highlighted = any_highlighted || p.highlighted;
    }
  }
  {
    std::ofstream g(script);
    g << "set terminal " << (svg ? "svg size 900,600" : "pngcairo size 900,600") << "\n"
      << "set output '" << path << "'\n"
      << "set title '" << title << "'\n"
      << "set xlabel 'step time (s)'\nset ylabel 'peak memory (MiB)'\nset grid\nset key top right\n"
      << "set offsets graph 0.05, graph 0.3, graph 0.1, graph 0.05\n";
    // (the budget as an arrow across the whole width, and as a line for the key and the y range)
    if (budget)
      g << "set arrow from graph 0, first " << fixed(*budget / 1048576.0, 3) << " to graph 1, first "
        << fixed(*budget / 1048576.0, 3) << " nohead dt 2 lc rgb '#555555'\n";
    g << "plot '" << data << "' using 1:2 with points pt 7 ps 1.5 lc rgb '#1f77b4' notitle, "
      << "'' using 1:2:3 with labels offset 1,1 left font ',9' notitle";
    if (any_highlighted)
      g << ", '' using 1:($4 == 1 ? $2 : 1/0) with points pt 7 ps 2.5 lc rgb '#d62728' title '" << highlight
        << "'";
    if (budget)
      g << ", " << fixed(*budget / 1048576.0, 3) << " with lines dt 2 lc rgb '#555555' title 'budget'";
    g << "\n";
  }
  const int status = std::system(("gnuplot '" + script + "' 2>&1").c_str());
  std::remove(data.c_str());
  std::remove(script.c_str());
  TORCH_CHECK(status == 0, "--plot: gnuplot could not draw '", path, "' (exit status ",
              WIFEXITED(status) ? WEXITSTATUS(status) : status, ")");
}

}  // namespace

void plot_bench(const std::vector<BenchRow>& rows, const std::string& model, int64_t batch,
                const std::string& path) {
  std::vector<PlotPoint> points;
  for (const BenchRow& r : rows)
    if (!r.measured.out_of_memory) points.push_back({r.measured.seconds, r.measured.peak, r.name});
  TORCH_CHECK(!points.empty(), "--plot: nothing to draw, every recipe ran out of memory");
  draw(points, "memsave bench: " + model + ", batch " + std::to_string(batch), std::nullopt, "", path);
}

bool plot_rescue(const RescuePlan& plan, const RescueOptions& options, const std::string& model,
                 const std::string& path) {
  std::vector<PlotPoint> points;
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    const Candidate& c = plan.candidates[i];
    if (c.status == Candidate::Status::kFits)
      points.push_back({c.measured.seconds, c.measured.peak, c.recipe.label(), plan.recommended == i});
  }
  if (points.empty()) return false;
  draw(points,
       "memsave rescue: " + model + ", batch " + std::to_string(options.batch()) + ", budget " +
           format_bytes(options.budget()),
       options.budget(), "recommended", path);
  return true;
}

}  // namespace memsave::cli
