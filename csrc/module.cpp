// The Python module entry of cbatch._C and its build information.
//
// cbatch._C is a plain CPython extension module with no functions (vLLM's _C pattern): the
// ops are registered with torch's dispatcher (torch_bindings.cpp) when the library is loaded,
// and every call, error included, goes through torch's own bindings.  No pybind11 module:
// a second pybind11 in the process (a different version, or the same one built by another
// compiler) shares or splits pybind11's internals with torch's, and a toolchain whose
// pybind11 differs from torch's can crash on every C++ exception.  What the build used is an
// op too: torch.ops.cbatch.build_info() returns it as JSON.
#include <Python.h>

#include <string>

#include "ops.h"

#define CBATCH_STR_(...) #__VA_ARGS__
#define CBATCH_STR(...) CBATCH_STR_(__VA_ARGS__)
#define CBATCH_CONCAT_(a, b) a##b
#define CBATCH_CONCAT(a, b) CBATCH_CONCAT_(a, b)

namespace cbatch {
namespace {

// A JSON string literal (compiler version strings are plain ASCII, but quote them properly).
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) >= 0x20) out += ch;
  }
  return out + "\"";
}

std::string compiler() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#else
  return "unknown";
#endif
}

}  // namespace

std::string build_info() {
  std::string json = "{";
  json += "\"backends\": [\"cpu\"";
#ifdef CBATCH_WITH_CUDA
  json += ", \"cuda\"";
#endif
  json += "], \"compiler\": " + json_string(compiler());
#ifdef _GLIBCXX_RELEASE
  json += ", \"libstdcxx\": " + std::to_string(_GLIBCXX_RELEASE);
#else
  json += ", \"libstdcxx\": null";
#endif
#ifdef _GLIBCXX_USE_CXX11_ABI
  json += ", \"cxx11_abi\": " + std::string(_GLIBCXX_USE_CXX11_ABI ? "true" : "false");
#else
  json += ", \"cxx11_abi\": null";
#endif
#ifdef CBATCH_WITH_CUDA
  json += ", \"cuda_archs\": " + json_string(CBATCH_STR(CBATCH_CUDA_ARCHS));
  json += ", \"nvcc\": " + json_string(nvcc_version());
#else
  json += ", \"cuda_archs\": null, \"nvcc\": null";
#endif
  json += ", \"torch_version\": " + json_string(CBATCH_STR(CBATCH_TORCH_VERSION));
#ifdef _OPENMP
  json += ", \"openmp\": true";
#else
  json += ", \"openmp\": false";
#endif
  json += ", \"pybind11\": null";  // none: see the top of this file
  return json + "}";
}

}  // namespace cbatch

// `import cbatch._C` runs this; loading the library has already registered the ops.
PyMODINIT_FUNC CBATCH_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, CBATCH_STR(TORCH_EXTENSION_NAME),
                               "cbatch compiled kernels (the ops are under torch.ops.cbatch)",
                               0, nullptr};
  return PyModule_Create(&module);
}
