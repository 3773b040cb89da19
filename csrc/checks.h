// Input checks shared by the kernels' host code (flash-attn style: a wrong tensor gets a
// sentence, not a segfault).  TORCH_CHECK_VALUE / TORCH_CHECK_TYPE surface in Python as
// ValueError / TypeError.
#pragma once

#include <c10/util/Exception.h>

#define CBATCH_CHECK_DEVICE(x, dev)                                                      \
  TORCH_CHECK_VALUE((x).device() == (dev), #x " must be on ", (dev), ", got ", (x).device())
#define CBATCH_CHECK_CONTIGUOUS(x) \
  TORCH_CHECK_VALUE((x).is_contiguous(), #x " must be contiguous")
#define CBATCH_CHECK_DTYPE(x, dt) \
  TORCH_CHECK_TYPE((x).scalar_type() == (dt), #x " must be ", (dt), ", got ", (x).scalar_type())
#define CBATCH_CHECK_DIM(x, n) \
  TORCH_CHECK_VALUE((x).dim() == (n), #x " must have ", (n), " dims, got ", (x).dim())
