// Headers of the per-ISA translation units (included before any `#pragma GCC target`).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "cpu/kernels.h"
