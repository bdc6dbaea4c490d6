// A shared library named like a plugin but exporting no manifest: the registry must refuse it
// with a load error instead of crashing. Not a test itself: tests/unit/test_plugin_registry.cpp
// asserts that error.
extern "C" __attribute__((visibility("default"))) int tessera_test_not_a_plugin() { return 42; }
