// Errors of the public API: every entry point returns a Status; C++ callers who prefer
// exceptions wrap the call in throw_if_error().
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace flash_dmattn {

enum class StatusCode : int {
  ok = 0,
  invalid_argument,  // the call can never succeed as written: a shape, dtype, stride or value is wrong
  unsupported,       // valid, but no backend built into this library (or usable on this machine) runs it
  backend_error,     // a backend failed while running (a CUDA error, for example)
};

const char* status_code_name(StatusCode code);

class Status {
 public:
  Status() = default;
  static Status success() { return Status(); }
  static Status error(StatusCode code, std::string message) { return Status(code, std::move(message)); }

  bool ok() const { return code_ == StatusCode::ok; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  StatusCode code_ = StatusCode::ok;
  std::string message_;
};

class Error : public std::runtime_error {
 public:
  explicit Error(const Status& status) : std::runtime_error(status.message()), code_(status.code()) {}
  StatusCode code() const { return code_; }

 private:
  StatusCode code_;
};

inline void throw_if_error(const Status& status) {
  if (!status.ok()) throw Error(status);
}

}  // namespace flash_dmattn
