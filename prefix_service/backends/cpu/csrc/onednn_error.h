// The oneDNN library's failure report across its C boundary (onednn_linear.cpp,
// onednn_attention.cpp): an entry point that fails returns its failure value and leaves the reason
// in last_error, which ps_onednn_last_error() returns.
#pragma once
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace ps_onednn {

extern thread_local std::string last_error;  // defined in onednn_linear.cpp

// fn()'s result; where it throws, `failed`, with "what: the exception's message" in last_error
template <typename R, typename F>
R guarded(const char* what, R failed, F&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    last_error = std::string(what) + ": " + e.what_without_backtrace();
  } catch (const std::exception& e) {
    last_error = std::string(what) + ": " + e.what();
  }
  return failed;
}

}  // namespace ps_onednn
