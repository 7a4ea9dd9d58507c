// Argument checks for entry points. Every failure raises the error kind DSV4JITArgumentError (bad
// shape, value, layout) or DSV4JITArgumentTypeError (bad dtype or device), which reach Python as
// dsv4jit.errors.ArgumentError (a ValueError) and ArgumentTypeError (a TypeError), both RuntimeErrors
// too, naming the op, the argument, the expectation and what was received. Constraints only
// narrow: a symbolic size or device, once bound by one argument, must be matched by every later
// one. Host-only code: usable without CUDA headers.
#pragma once

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/optional.h>

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <type_traits>

#include "dtypes.h"

namespace dsv4 {

inline std::string device_str(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(d.device_id);
    case kDLCUDAHost: return "cpu(pinned)";
    default: return "device(" + std::to_string(d.device_type) + "):" + std::to_string(d.device_id);
  }
}

inline bool is_host_memory(DLDevice d) { return d.device_type == kDLCPU || d.device_type == kDLCUDAHost; }

/// A named dimension (e.g. "batch_size") whose value is fixed by the first argument that uses it.
struct Size {
  explicit Size(const char* name) : name(name) {}
  const char* name;
  int64_t value = -1;
  const char* bound_by = "";
  bool bound() const { return value >= 0; }
};

/// The device shared by several arguments, fixed by the first one checked.
struct Device {
  bool bound = false;
  DLDevice dev{};
  const char* bound_by = "";
};

/// One expected dimension: a literal, a symbolic Size, or anything.
class Dim {
 public:
  Dim(int64_t fixed) : fixed_(fixed) {}  // NOLINT: literals read naturally in shape lists
  Dim(int fixed) : fixed_(fixed) {}      // NOLINT
  Dim(Size& sym) : sym_(&sym) {}         // NOLINT
  static Dim any() { return Dim(int64_t{-1}); }
  int64_t fixed() const { return fixed_; }
  Size* sym() const { return sym_; }

 private:
  int64_t fixed_ = -1;
  Size* sym_ = nullptr;
};

class Check {
 public:
  Check(const char* op, const char* arg, const tvm::ffi::TensorView& t) : op_(op), arg_(arg), t_(t) {
    if (t_.byte_offset() != 0) fail_value("must have byte_offset 0 (pass a plain torch tensor or view)");
  }

  Check& shape(std::initializer_list<Dim> dims) {
    if (t_.ndim() != static_cast<int>(dims.size())) {
      fail_value("must have " + std::to_string(dims.size()) + " dimensions, got " + std::to_string(t_.ndim()));
    }
    int i = 0;
    for (const Dim& d : dims) {
      const int64_t got = t_.size(i);
      if (Size* s = d.sym()) {
        if (!s->bound()) {
          s->value = got;
          s->bound_by = arg_;
        } else if (s->value != got) {
          fail_value("dim " + std::to_string(i) + " ('" + s->name + "') must be " + std::to_string(s->value) +
                     " (as in '" + s->bound_by + "'), got " + std::to_string(got));
        }
      } else if (d.fixed() >= 0 && d.fixed() != got) {
        fail_value("dim " + std::to_string(i) + " must be " + std::to_string(d.fixed()) + ", got " +
                   std::to_string(got));
      }
      ++i;
    }
    return *this;
  }

  /// A pool of `rows_per_page`-row pages of `width` values: [pages, rows_per_page, width], or flat
  /// [rows, width] with rows a multiple of rows_per_page (the pool as a serving stack allocates it);
  /// binds `pages`.
  Check& pool(Size& pages, int64_t rows_per_page, int64_t width) {
    if (t_.ndim() == 2) {
      if (t_.size(1) != width || t_.size(0) % rows_per_page != 0) {
        fail_value("must be [pages, " + std::to_string(rows_per_page) + ", " + std::to_string(width) + "] or flat [rows, " +
                   std::to_string(width) + "] with rows a multiple of " + std::to_string(rows_per_page));
      }
      Size rows{"rows"};
      shape({rows, width});
      return bind(pages, rows.value / rows_per_page);
    }
    return shape({pages, rows_per_page, width});
  }

  Check& dtype(DLDataType expected) {
    if (!same_dtype(t_.dtype(), expected)) fail_type("dtype must be " + dtype_str(expected) + ", got " + dtype_str(t_.dtype()));
    return *this;
  }

  Check& dtype_in(std::initializer_list<DLDataType> allowed) {
    std::string names;
    for (DLDataType a : allowed) {
      if (same_dtype(t_.dtype(), a)) return *this;
      names += (names.empty() ? "" : " or ") + dtype_str(a);
    }
    fail_type("dtype must be " + names + ", got " + dtype_str(t_.dtype()));
  }

  /// On a CUDA device, the same one as every other argument checked against `dev`.
  Check& cuda(Device& dev) {
    if (t_.device().device_type != kDLCUDA) fail_type("must be a CUDA tensor, got device " + device_str(t_.device()));
    return same_device(dev);
  }

  /// Binds `size` to `value` (a size derived from this argument's shape), or checks it against its binding.
  Check& bind(Size& size, int64_t value) {
    if (!size.bound()) {
      size.value = value;
      size.bound_by = arg_;
    } else if (size.value != value) {
      fail_value(std::string("'") + size.name + "' must be " + std::to_string(size.value) + " (as in '" +
                 size.bound_by + "'), got " + std::to_string(value));
    }
    return *this;
  }

  /// In host memory (pageable or pinned).
  Check& cpu() {
    if (!is_host_memory(t_.device())) fail_type("must be a CPU tensor, got device " + device_str(t_.device()));
    return *this;
  }

  Check& same_device(Device& dev) {
    const DLDevice d = t_.device();
    if (!dev.bound) {
      dev = Device{true, d, arg_};
    } else if (dev.dev.device_type != d.device_type || dev.dev.device_id != d.device_id) {
      fail_type("must be on " + device_str(dev.dev) + " (as '" + dev.bound_by + "'), got " + device_str(d));
    }
    return *this;
  }

  Check& contiguous() {
    if (!t_.IsContiguous()) fail_value("must be contiguous (row-major)");
    return *this;
  }

  /// A 2-D tensor of contiguous rows (column stride 1, row stride at least the row's width): a view of
  /// some columns of wider rows, such as one half of the ratio-2 pair ring.
  Check& contiguous_rows() {
    if (t_.ndim() != 2 || t_.stride(1) != 1 || t_.stride(0) < t_.size(1)) {
      fail_value("must be 2-D with contiguous rows (column stride 1, row stride >= its width)");
    }
    return *this;
  }

  Check& aligned(int bytes = 16) {
    if (reinterpret_cast<uintptr_t>(t_.data_ptr()) % bytes != 0) {
      fail_value("data pointer must be " + std::to_string(bytes) + "-byte aligned");
    }
    return *this;
  }

 private:
  std::string describe() const {
    std::ostringstream os;
    os << "tensor=[";
    for (int i = 0; i < t_.ndim(); ++i) os << (i ? ", " : "") << t_.size(i);
    os << "] " << dtype_str(t_.dtype()) << " " << device_str(t_.device()) << " strides=[";
    for (int i = 0; i < t_.ndim(); ++i) os << (i ? ", " : "") << t_.stride(i);
    os << "]";
    return os.str();
  }
  [[noreturn]] void fail_value(const std::string& what) const {
    TVM_FFI_THROW(DSV4JITArgumentError) << "dsv4jit." << op_ << ": argument '" << arg_ << "': " << what << "; " << describe();
    __builtin_unreachable();
  }
  [[noreturn]] void fail_type(const std::string& what) const {
    TVM_FFI_THROW(DSV4JITArgumentTypeError) << "dsv4jit." << op_ << ": argument '" << arg_ << "': " << what << "; " << describe();
    __builtin_unreachable();
  }

  const char* op_;
  const char* arg_;
  const tvm::ffi::TensorView& t_;
};

/// Scalar argument check: ValueError "dsv4jit.<op>: argument '<name>' must be <expectation>, got <actual>".
/// `expectation` is text, or a callable returning text (built only on failure: checks run per call).
template <typename Expectation, typename T>
inline void expect(bool ok, const char* op, const char* name, const Expectation& expectation, const T& actual) {
  if (ok) return;
  if constexpr (std::is_invocable_v<Expectation>) {
    TVM_FFI_THROW(DSV4JITArgumentError) << "dsv4jit." << op << ": argument '" << name << "' must be " << expectation()
                              << ", got " << actual;
  } else {
    TVM_FFI_THROW(DSV4JITArgumentError) << "dsv4jit." << op << ": argument '" << name << "' must be " << expectation
                              << ", got " << actual;
  }
}

/// A kernel's checked-mode status words (int32[words] on the call's device, OR-ed into by the
/// kernel), or nullptr when the call has none (default mode).
inline int32_t* status_words(const char* op, Device& dev, const tvm::ffi::Optional<tvm::ffi::TensorView>& status,
                             int64_t words = 1) {
  if (!status.has_value()) return nullptr;
  Check(op, "status", status.value()).shape({words}).dtype(dl::kI32).cuda(dev);
  return static_cast<int32_t*>(status.value().data_ptr());
}

}  // namespace dsv4
