// The Python module entry of cbatch._C: build information only (the ops themselves are
// registered with the dispatcher in torch_bindings.cpp when this library is loaded).
// Plain pybind11, without torch/extension.h, keeps this file's compile short.
#include <pybind11/pybind11.h>

#define CBATCH_STR_(...) #__VA_ARGS__
#define CBATCH_STR(...) CBATCH_STR_(__VA_ARGS__)

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cbatch compiled kernels (ops are under torch.ops.cbatch)";
  m.def("build_info", [] {
    py::dict info;
    py::list backends;
    backends.append("cpu");
#ifdef CBATCH_WITH_CUDA
    backends.append("cuda");
    info["cuda_archs"] = py::str(CBATCH_STR(CBATCH_CUDA_ARCHS));
#else
    info["cuda_archs"] = py::none();
#endif
    info["backends"] = backends;
    info["torch_version"] = py::str(CBATCH_STR(CBATCH_TORCH_VERSION));
#ifdef _OPENMP
    info["openmp"] = true;
#else
    info["openmp"] = false;
#endif
    return info;
  });
}
