// A CPU torch wheel ships c10/cuda's headers without this generated one.
// Only the compile check of the CUDA glue against such a torch sees this
// file; builds against a CUDA torch use torch's own.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
