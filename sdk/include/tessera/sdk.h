// Everything a plugin author needs: include this one header.
#pragma once

#include "tessera/sdk/abi.h"
#include "tessera/sdk/attention.h"
#include "tessera/sdk/backend.h"
#include "tessera/sdk/cache_layer.h"
#include "tessera/sdk/drafter.h"
#include "tessera/sdk/executor.h"
#include "tessera/sdk/kv_cache.h"
#include "tessera/sdk/logger.h"
#include "tessera/sdk/params.h"
#include "tessera/sdk/plugin.h"
#include "tessera/sdk/quantizer.h"
#include "tessera/sdk/router.h"
#include "tessera/sdk/sampler.h"
#include "tessera/sdk/scheduler.h"
#include "tessera/sdk/status.h"
#include "tessera/sdk/types.h"
