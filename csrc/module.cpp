// The Python module stepfast._C: importing it loads this library, whose TORCH_LIBRARY_FRAGMENT blocks
// register the stepfast:: ops (sde_step.cpp, sde_logprob.cpp) with the dispatcher. No Python bindings:
// the ops are called as torch.ops.stepfast.*, which also makes them visible to torch.compile.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "stepfast C++ CPU kernels, registered as torch.ops.stepfast.*",
      -1,  // per-interpreter state: none
      nullptr,
  };
  return PyModule_Create(&module_def);
}
}
