// Error messages of the torch-facing api.cpp files, assembled with std::to_string (no
// iostreams): with torch 2.11 + CUDA 13 builds, a TORCH_CHECK whose message streams an integer
// can crash the process instead of raising. HSTU_RAISE_IF_NOT(kind, cond, parts...) throws
// c10::kind (Error, ValueError, TypeError, ...) with the parts concatenated.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace hstu_errors {

inline void append(std::string& s, const char* x) { s += x; }
inline void append(std::string& s, const std::string& x) { s += x; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T x) {
  s += std::to_string(x);
}
inline void append(std::string& s, double x) { s += std::to_string(x); }
inline void append(std::string& s, const c10::Device& d) { s += d.str(); }
inline void append(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
inline void append(std::string& s, c10::IntArrayRef a) {
  s += "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  s += "]";
}

template <typename... A>
std::string cat(const A&... a) {
  std::string s;
  (append(s, a), ...);
  return s;
}

}  // namespace hstu_errors

#define HSTU_RAISE_IF_NOT(kind, cond, ...)                                               \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      throw ::c10::kind({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},          \
                        ::hstu_errors::cat(__VA_ARGS__));                               \
    }                                                                                   \
  } while (0)
