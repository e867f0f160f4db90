#include "report.h"

#include "../zoo/zoo.h"

#include <memsave/optim.h>
#include <memsave/rescue.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <sstream>

namespace memsave::cli {
namespace {

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name,
                                                        const std::vector<torch::Tensor>& params) {
  if (name == "sgd")
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.01).momentum(0.9));
  if (name == "adam") return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
  if (name == "adamw") return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3));
  if (name == "adamw8bit") return std::make_unique<optim::AdamW8bit>(params, optim::AdamW8bitOptions(1e-3));
  if (name == "adamw4bit") return std::make_unique<optim::AdamW4bit>(params, optim::AdamW4bitOptions(1e-3));
  if (name == "sgd8bit") return std::make_unique<optim::SGD8bit>(params, optim::SGD8bitOptions(0.01));
  if (name == "sgd4bit") return std::make_unique<optim::SGD4bit>(params, optim::SGD4bitOptions(0.01));
  if (name == "lion8bit") return std::make_unique<optim::Lion8bit>(params, optim::Lion8bitOptions(1e-4));
  TORCH_CHECK(false, "unknown optimizer '", name, "' (valid: ", join(optimizer_names()), ")");
}

void add_row(Report& report, torch::Device device, int64_t peak_since_ready) {
  const MemoryStats stats = memory_stats(device);
  const int64_t above = report.rows.empty() ? stats.current : report.rows.back().in_use;
  report.rows.push_back({report.stage, stats.current, stats.current - above, peak_since_ready});
}

double ratio(int64_t a, int64_t b) { return b == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(b); }

std::string pad(const std::string& s, size_t width, bool left_align) {
  if (s.size() >= width) return s;
  return left_align ? s + std::string(width - s.size(), ' ') : std::string(width - s.size(), ' ') + s;
}

std::string signed_bytes(int64_t bytes) {
  std::string text = format_bytes(bytes);
  if (bytes >= 0) text.insert(0, 1, '+');
  return text;
}

}  // namespace

std::vector<std::string> optimizer_names() {
  return {"sgd", "adam", "adamw", "adamw8bit", "adamw4bit", "sgd8bit", "sgd4bit", "lion8bit"};
}

void run_report(const ReportOptions& options, Report& report) {
  report.options = options;
  const torch::Device device(options.device);
  TORCH_CHECK(!device.is_cuda() || torch::cuda::is_available(),
              "--device cuda: no CUDA device is available on this machine");
  install_meter();
  torch::manual_seed(0);
  const zoo::Workload workload = zoo::workload(options.model);

  report.stage = "runtime ready";
  reset_peak(device);
  std::optional<ScopedBudget> budget;
  if (device.is_cpu()) {
    // The simulated device is host memory: stop where the host would start to swap, not at the OOM killer.
    const int64_t host = memory_stats(device).current + simulated_device_room();
    if (!options.budget || host < *options.budget) report.host_bound = host;
  }
  if (const auto bound = report.host_bound ? report.host_bound : options.budget)
    budget.emplace(device, *bound);
  PeakScope since_ready(device);
  add_row(report, device, since_ready.peak());

  report.stage = "input batch on the device";
  const zoo::Batch batch = workload.make_batch(options.batch, device);
  add_row(report, device, since_ready.peak());

  report.stage = "model on the device";
  torch::nn::Sequential model = workload.make_model();
  model->to(device);
  report.parameters = zoo::parameter_count(*model);
  add_row(report, device, since_ready.peak());

  report.stage = "forward under no-grad";
  {
    torch::NoGradGuard no_grad;
    model->eval();
    PeakScope forward(device);
    model->forward(batch.input);
    report.inference_peak = forward.peak();
  }
  add_row(report, device, since_ready.peak());

  report.stage = "forward + backward + optimizer step";
  model->train();
  const std::vector<torch::Tensor> params = model->parameters();
  const auto optimizer = make_optimizer(options.optimizer, params);
  {
    PeakScope step(device);
    optimizer->zero_grad();
    const torch::Tensor loss = workload.loss(model->forward(batch.input), batch.target);
    loss.backward();
    optimizer->step();
    report.training_peak = step.peak();
    report.breakdown = breakdown(step.peak(), params, optimizer.get(), device);
  }
  add_row(report, device, since_ready.peak());

  const MemoryBreakdown& parts = *report.breakdown;
  const double state = ratio(parts.optimizer_state, parts.parameters);
  Rule state_rule{"Adam state = 2x parameter bytes", 2.0, 2.0, state};
  if (options.optimizer == "sgd") state_rule = {"momentum = parameter bytes", 1.0, 1.0, state};
  // 2 bytes of codes and 8 of absmax per 256 elements against 4 bytes of fp32 (more where tensors stay fp32)
  if (options.optimizer == "adamw8bit")
    state_rule = {"8-bit Adam state = 0.51x parameter bytes", 0.5, 0.55, state};
  // 1 byte of codes for two elements and 8 of absmax per 128 elements
  if (options.optimizer == "adamw4bit")
    state_rule = {"4-bit Adam state = 0.27x parameter bytes", 0.25, 0.3, state};
  // one moment: 1 byte of codes and 4 of absmax per 256 elements; 4-bit: a byte for two, 4 per 128
  if (options.optimizer == "sgd8bit" || options.optimizer == "lion8bit")
    state_rule = {"8-bit momentum = 0.25x parameter bytes", 0.25, 0.28, state};
  if (options.optimizer == "sgd4bit")
    state_rule = {"4-bit momentum = 0.13x parameter bytes", 0.125, 0.15, state};
  report.rules = {
      {"gradients = parameter bytes", 1.0, 1.0, ratio(parts.gradients, parts.parameters)},
      state_rule,
      {"training peak = 1.5-2.5x inference peak", 1.5, 2.5,
       ratio(report.training_peak, report.inference_peak)},
  };
}

std::string format_table(const Report& report) {
  const ReportOptions& o = report.options;
  std::ostringstream out;
  out << "memsave report: model " << o.model << " (" << report.parameters << " parameters), batch " << o.batch
      << ", optimizer " << o.optimizer << ", device " << o.device;
  if (o.budget) out << ", budget " << format_bytes(*o.budget);
  out << "\n\n"
      << pad("stage", 38, true) << pad("in use", 14, false) << pad("change", 14, false)
      << pad("peak so far", 14, false) << "\n";
  for (const ReportRow& row : report.rows) {
    out << pad(row.stage, 38, true) << pad(format_bytes(row.in_use), 14, false)
        << pad(signed_bytes(row.change), 14, false) << pad(format_bytes(row.peak), 14, false) << "\n";
  }
  if (report.breakdown) {
    const MemoryBreakdown& b = *report.breakdown;
    out << "\ntraining step peak " << format_bytes(b.total) << " (" << b.total << " bytes):\n";
    const std::pair<const char*, int64_t> parts[] = {{"parameters", b.parameters},
                                                     {"gradients", b.gradients},
                                                     {"optimizer state", b.optimizer_state},
                                                     {"activations and other", b.other}};
    for (const auto& [name, bytes] : parts) {
      char share[16];
      std::snprintf(share, sizeof(share), "%5.1f%%", 100.0 * ratio(bytes, b.total));
      out << "  " << pad(name, 36, true) << pad(format_bytes(bytes), 14, false) << "  " << share << "\n";
    }
  }
  if (!report.rules.empty()) {
    out << "\nrules of thumb on this model:\n";
    for (const Rule& rule : report.rules) {
      char line[160];
      std::snprintf(line, sizeof(line), "  %-42s measured %.2fx  %s\n", rule.name.c_str(), rule.measured,
                    rule.holds() ? "holds" : "does not hold");
      out << line;
    }
  }
  return out.str();
}

std::string format_json(const Report& report, const std::string& error, const std::string& message) {
  const ReportOptions& o = report.options;
  nlohmann::json j;
  j["model"] = o.model;
  j["batch"] = o.batch;
  j["optimizer"] = o.optimizer;
  j["device"] = o.device;
  j["budget"] = o.budget ? nlohmann::json(*o.budget) : nlohmann::json(nullptr);
  j["host_bound"] = report.host_bound ? nlohmann::json(*report.host_bound) : nlohmann::json(nullptr);
  j["parameters"] = report.parameters;
  j["rows"] = nlohmann::json::array();
  for (const ReportRow& row : report.rows) {
    j["rows"].push_back(
        {{"stage", row.stage}, {"in_use", row.in_use}, {"change", row.change}, {"peak", row.peak}});
  }
  if (report.breakdown) {
    const MemoryBreakdown& b = *report.breakdown;
    j["inference_peak"] = report.inference_peak;
    j["training_peak"] = report.training_peak;
    j["breakdown"] = {{"parameters", b.parameters},
                      {"gradients", b.gradients},
                      {"optimizer_state", b.optimizer_state},
                      {"other", b.other},
                      {"total", b.total}};
  }
  j["rules"] = nlohmann::json::array();
  for (const Rule& rule : report.rules) {
    j["rules"].push_back({{"rule", rule.name},
                          {"expected_low", rule.expected_low},
                          {"expected_high", rule.expected_high},
                          {"measured", rule.measured},
                          {"holds", rule.holds()}});
  }
  if (!error.empty()) j["error"] = {{"kind", error}, {"stage", report.stage}, {"message", message}};
  return j.dump(2);
}

}  // namespace memsave::cli
