// Moved to the SDK's kernel helpers (tessera/sdk/kernels/interleaved.h); this path stays so that code
// written against it still compiles. New code includes the SDK path.
#pragma once
#include "tessera/sdk/kernels/interleaved.h"
