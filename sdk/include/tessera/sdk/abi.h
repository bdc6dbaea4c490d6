// ABI version of the plugin SDK and the toolchain fingerprint.
//
// History: 2.0 batched Drafter::propose with Draft (tokens + optional q rows) and
// on_drafts_settled; Sampler::verify takes a DraftView; KvCacheManager::truncate; KV dtypes
// per pool (KvLayout/AttentionShape k_dtype, v_dtype) and KvDtype::kQ8_0 (one bump for both).
// 2.1 the constraint kind (tessera/sdk/constraint.h: Constraint, CompiledConstraint,
// ConstraintMatcher; PluginKind::kConstraint appended, so existing kinds keep their values).
// 2.2 CacheKey::reproducible, CachedResponse::tier, CacheLayer::metrics and CacheMetric (the
// gateway's cache layers).
// 2.3 PluginContext::models and tessera/sdk/model_host.h (ModelHost, ModelInfo, HostModel):
// a plugin loads and runs a second model through the host (the draft-model drafter). The
// field is appended, so plugins built against 2.0-2.2 read the context unchanged.
// 2.4 CacheKey::tenant and CachedResponse::similarity (the semantic cache layer).
// 2.5 AttentionShape::sliding_window and attention_window_begin (Gemma 3's local layers);
// Backend::gelu_mul (GeGLU FFN), a virtual with a default, appended after silu_mul.
// 2.6 PluginManifest::capabilities and ::needs (appended; read only from 2.6 libraries) and
// tessera/sdk/capabilities.h: optional capabilities declared in the manifest
// (TESSERA_REGISTER_PLUGIN_WITH), listed by `tessera plugins`, checked when a stack loads.
// 2.7 RouteRequest::embedding, Router::needs_embedding and Router::metrics (RouterMetric), for
// the classifier router (virtuals with defaults appended; the struct grew at its end).
// 2.8 ModelHost::load_target_layers and TargetLayersRequest (the target's own weights through
// a subset of its layers: drafter.layer-skip), a virtual with a default appended; and
// tessera/sdk/host_model_drafter.h, the header-only drafting loop over a HostModel that
// drafter.draft-model and drafter.layer-skip share.
// 2.9 the kv_connector kind (tessera/sdk/kv_connector.h: KvConnector, KvPrefillHost,
// KvExportHandle, KvImportSink; PluginKind::kKvConnector appended), ForwardRunner::
// read_kv_layer / write_kv_layer (virtuals with defaults, appended), and four StatusCode
// values appended (kUnavailable, kDeadlineExceeded, kDataLoss, kFailedPrecondition):
// prefill/decode disaggregation.
// 2.10 sizes where structs cross the seam from plugin to host: PluginManifestHeader::
// manifest_size (the former `reserved`, same layout) and PluginManifest::param_spec_size
// (appended); the host reads appended manifest fields and the ParamSpec table by those sizes
// (manifest_has_field, manifest_param). TESSERA_PLUGIN_MANIFEST_HEADER. The layout rules per
// struct are recorded in sdk/abi.layout and checked by the test unit_test_sdk_layout.
// 2.11 replicas: KvPrefillHost::generate and ::draining, KvConnector::remote_generate
// (virtuals with defaults, appended), RemoteGenerateRequest, RemoteEvent, RemoteEventSink;
// RouteRequest::candidates (appended) and RouteCandidate.
// 2.12 layer-pipelined decode start: ForwardLayerGate and LayerGatedForward, a new optional
// capability of a ForwardRunner (tessera/sdk/forward.h; no existing vtable changed).
// 2.13 HostModel::restrict_logits (a virtual with a default, appended after forward): logits
// for a subset of the vocabulary, the reduced draft vocabulary of drafter.draft-model and
// drafter.layer-skip (`vocabulary`); HostModelDrafter maps the columns back to token ids.
//
// Plugins and the host exchange C++ objects (virtual interfaces, std::string, std::vector),
// so both must be built by the same compiler and standard library. The loader refuses a
// plugin whose ABI major differs, whose ABI minor is newer than the host's, or whose
// toolchain fingerprint differs, naming both values.
#pragma once

#include <cstdint>

#ifndef TESSERA_SDK_ABI_MAJOR  // overridable only so tests can build a mismatching plugin
#define TESSERA_SDK_ABI_MAJOR 2
#endif
#ifndef TESSERA_SDK_ABI_MINOR
#define TESSERA_SDK_ABI_MINOR 13
#endif

#define TESSERA_SDK_STRINGIFY_(x) #x
#define TESSERA_SDK_STRINGIFY(x) TESSERA_SDK_STRINGIFY_(x)

#if defined(__clang__)
#define TESSERA_SDK_COMPILER "clang-" TESSERA_SDK_STRINGIFY(__clang_major__)
#elif defined(__GNUC__)
#define TESSERA_SDK_COMPILER "gcc-" TESSERA_SDK_STRINGIFY(__GNUC__)
#else
#define TESSERA_SDK_COMPILER "unknown-compiler"
#endif

#if defined(_GLIBCXX_USE_CXX11_ABI)
#define TESSERA_SDK_STDLIB "libstdc++-cxx11abi" TESSERA_SDK_STRINGIFY(_GLIBCXX_USE_CXX11_ABI)
#elif defined(_LIBCPP_VERSION)
#define TESSERA_SDK_STDLIB "libc++-" TESSERA_SDK_STRINGIFY(_LIBCPP_ABI_VERSION)
#else
#define TESSERA_SDK_STDLIB "unknown-stdlib"
#endif

// Compiler family and major version plus standard-library ABI: the facts that decide whether
// C++ objects can cross the plugin boundary.
#define TESSERA_SDK_TOOLCHAIN TESSERA_SDK_COMPILER "/" TESSERA_SDK_STDLIB

namespace tessera {
inline constexpr uint32_t kSdkAbiMajor = TESSERA_SDK_ABI_MAJOR;
inline constexpr uint32_t kSdkAbiMinor = TESSERA_SDK_ABI_MINOR;
inline constexpr const char* kSdkToolchain = TESSERA_SDK_TOOLCHAIN;
}  // namespace tessera
