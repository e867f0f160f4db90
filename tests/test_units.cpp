#include <memsave/memory.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

namespace memsave {
namespace {

TEST(ParseBytes, ReadsDecimalAndBinaryUnits) {
  EXPECT_EQ(parse_bytes("4096"), 4096);
  EXPECT_EQ(parse_bytes("0"), 0);
  EXPECT_EQ(parse_bytes("512B"), 512);
  EXPECT_EQ(parse_bytes("1.5GiB"), 1610612736);
  EXPECT_EQ(parse_bytes("1.5GB"), 1500000000);
  EXPECT_EQ(parse_bytes("12MiB"), 12582912);
  EXPECT_EQ(parse_bytes("300 MB"), 300000000);
  EXPECT_EQ(parse_bytes(" 2kib "), 2048);
  EXPECT_EQ(parse_bytes("2kB"), 2000);
  EXPECT_EQ(parse_bytes("0.1GB"), 100000000);
  EXPECT_EQ(parse_bytes(".5KiB"), 512);
  EXPECT_EQ(parse_bytes("1TiB"), int64_t{1} << 40);
}

void expect_rejected(const std::string& text, const std::string& why) {
  try {
    parse_bytes(text);
    ADD_FAILURE() << "'" << text << "' was accepted";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find(why), std::string::npos) << message;
    EXPECT_NE(message.find("'" + text + "'"), std::string::npos) << message;
  }
}

TEST(ParseBytes, RejectsMalformedSizesWithAReason) {
  expect_rejected("-3", "non-negative number with an optional unit (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)");
  expect_rejected("", "non-negative number");
  expect_rejected("abc", "non-negative number");
  expect_rejected("12G", "ambiguous");
  expect_rejected("3k", "ambiguous");
  expect_rejected("12 parsecs", "unknown unit 'parsecs' (valid: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)");
  expect_rejected("1e9", "unknown unit");
  expect_rejected("0.3B", "whole number");
  expect_rejected("99999999999TB", "too large");
  expect_rejected("9223372036854775808", "too large");  // INT64_MAX + 1
  expect_rejected("8EiB", "unknown unit");
}

TEST(ParseBytes, ReadsTheLargestSize) {
  if constexpr (std::numeric_limits<long double>::digits >= 63) {  // where long double holds INT64_MAX
    EXPECT_EQ(parse_bytes("9223372036854775807"), std::numeric_limits<int64_t>::max());
    EXPECT_EQ(parse_bytes("9223372036854775807 B"), std::numeric_limits<int64_t>::max());
  }
  EXPECT_EQ(parse_bytes("8388607TiB"), int64_t{8388607} << 40);  // the largest whole TiB count
  expect_rejected("8388608TiB", "too large");                    // 2^63
}

TEST(FormatBytes, UsesBinaryUnits) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(1610612736), "1.50 GiB");
  EXPECT_EQ(format_bytes(-2048), "-2.00 KiB");
}

}  // namespace
}  // namespace memsave
