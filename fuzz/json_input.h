// The input side shared by the JSON config fuzz targets (fuzz_config, fuzz_lora_config): the bytes parsed as JSON
// (a parse error rejects the input, as the readers report it as invalid JSON), then `accept(json)`, which either
// checks an accepted value or throws ds::Error for a rejected one. Any other exception is a bug: printed, abort().
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include <nlohmann/json.hpp>

#include "core/error.h"

template <typename F>
int fuzz_json_input(const uint8_t* data, size_t size, const char* target, F accept) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size);
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
  try {
    accept(j);
  } catch (const ds::Error&) {
    // Rejected input: expected.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s invariant violated: non-ds::Error exception escaped: %s\n", target, e.what());
    std::abort();
  }
  return 0;
}
