#include "memsave/memory.h"

#include <c10/util/Exception.h>

#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <utility>

namespace memsave {
namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

/// The units parse_bytes reads, as error messages name them.
constexpr const char* kValidUnits = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB";

}  // namespace

int64_t parse_bytes(const std::string& text) {
  static const std::array<std::pair<const char*, long double>, 9> kUnits{{{"b", 1.0L},
                                                                          {"kb", 1e3L},
                                                                          {"mb", 1e6L},
                                                                          {"gb", 1e9L},
                                                                          {"tb", 1e12L},
                                                                          {"kib", 1024.0L},
                                                                          {"mib", 1048576.0L},
                                                                          {"gib", 1073741824.0L},
                                                                          {"tib", 1099511627776.0L}}};
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  const size_t number_begin = i;
  bool digits = false;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i, digits = true;
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i, digits = true;
  }
  TORCH_CHECK(digits, "invalid size '", text, "': expected a non-negative number with an optional unit (",
              kValidUnits, ")");
  const std::string number = text.substr(number_begin, i - number_begin);
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t unit_end = text.size();
  while (unit_end > i && std::isspace(static_cast<unsigned char>(text[unit_end - 1]))) --unit_end;
  const std::string unit = lower(text.substr(i, unit_end - i));

  long double scale = 0;
  if (unit.empty()) scale = 1;
  for (const auto& [name, factor] : kUnits) {
    if (unit == name) scale = factor;
  }
  if (unit.size() == 1 && std::string("kmgt").find(unit) != std::string::npos) {
    const std::string letter = unit == "k" ? "K" : std::string(1, static_cast<char>(std::toupper(unit[0])));
    TORCH_CHECK(false, "invalid size '", text, "': the unit '", text.substr(i, unit_end - i),
                "' is ambiguous; write ", unit == "k" ? "kB" : letter + "B", " (powers of 1000) or ", letter,
                "iB (powers of 1024)");
  }
  TORCH_CHECK(scale > 0, "invalid size '", text, "': unknown unit '", text.substr(i, unit_end - i),
              "' (valid: ", kValidUnits, ")");

  const long double bytes = std::strtold(number.c_str(), nullptr) * scale;
  // 2^63, exact in every floating type: INT64_MAX itself passes where long double holds it (x86's 64 bits)
  // and a value that rounded up to 2^63 never reaches the cast.
  TORCH_CHECK(bytes < 9223372036854775808.0L, "invalid size '", text, "': too large");
  const long double rounded = std::nearbyint(bytes);
  TORCH_CHECK(std::fabs(bytes - rounded) < 1e-6L * std::max(1.0L, bytes), "invalid size '", text,
              "': not a whole number of bytes");
  return static_cast<int64_t>(rounded);
}

std::string format_bytes(int64_t bytes) {
  static const std::array<const char*, 5> kUnits{"B", "KiB", "MiB", "GiB", "TiB"};
  const bool negative = bytes < 0;
  long double value = std::fabs(static_cast<long double>(bytes));
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < kUnits.size()) value /= 1024, ++unit;
  char buffer[48];
  if (unit == 0) {
    std::snprintf(buffer, sizeof(buffer), "%s%lld B", negative ? "-" : "", static_cast<long long>(value));
  } else {
    std::snprintf(buffer, sizeof(buffer), "%s%.2Lf %s", negative ? "-" : "", value, kUnits[unit]);
  }
  return buffer;
}

}  // namespace memsave
