// The optional capabilities a plugin can declare in its manifest (SDK 2.6).
//
// A capability is an extra interface an object implements beside its kind's (the host finds
// it with dynamic_cast, so no existing vtable grows). Declaring it in the manifest
// (TESSERA_REGISTER_PLUGIN_WITH) makes it visible before any object exists: `tessera plugins`
// lists it, and `tessera config check` and stack loading refuse a stack in which a plugin's
// `needs` (or the YAML's `engine.requires`) names a capability the slot's plugin lacks. The
// conformance suites check that a plugin implements exactly what it declares.
#pragma once

namespace tessera {

// Quantizer: GroupedMatmul (tessera/sdk/quantizer.h), several weights over one input in one pass.
inline constexpr const char* kCapabilityGroupedMatmul = "grouped_matmul";
// Backend: ForwardRunnerProvider (tessera/sdk/forward.h), runs the whole forward pass itself.
inline constexpr const char* kCapabilityForwardRunner = "forward_runner";
// AttentionKernel: DeviceAttentionKernel (tessera/sdk/forward.h), computes on device pointers.
inline constexpr const char* kCapabilityDeviceAttention = "device_attention";

}  // namespace tessera
