# tessera_add_plugin(<target> <sources>...): builds a loadable Tessera plugin library.
# Plugins must be built with the same compiler and standard library as the host; the SDK
# records a toolchain fingerprint in the manifest and the host refuses a mismatch.
function(tessera_add_plugin target)
  add_library(${target} MODULE ${ARGN})
  target_link_libraries(${target} PRIVATE tessera::sdk)
  set_target_properties(${target} PROPERTIES PREFIX "libtessera-" CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
endfunction()
