# The SDK's ABI lock: sdk/abi.lock records, for each versioned part of the public headers, the
# version and a SHA-256 over the part's files (path and code, in sorted order). A header
# edit that leaves its part's version unchanged is what let a field slip into
# ScheduledSequence at ABI 1.0; this script makes that a test failure.
#
#   cmake -DSDK_DIR=<repo>/sdk -DMODE=check -P abi_lock.cmake   (ctest: sdk_abi_lock)
#   cmake -DSDK_DIR=<repo>/sdk -DMODE=write -P abi_lock.cmake   (target tessera-sdk-lock)
#
# Parts: "abi" is every header under include/ outside tessera/sdk/kernels/, versioned by
# TESSERA_SDK_ABI_MAJOR/MINOR in abi.h; "kernels" is include/tessera/sdk/kernels/, versioned by
# TESSERA_SDK_KERNELS_VERSION_MAJOR/MINOR in its version.h (absent before the kernel helpers
# existed, then skipped).
cmake_minimum_required(VERSION 3.22)
if(NOT SDK_DIR OR NOT MODE)
  message(FATAL_ERROR "abi_lock.cmake: pass -DSDK_DIR=<sdk folder> -DMODE=check|write")
endif()
get_filename_component(SDK_DIR ${SDK_DIR} ABSOLUTE)
set(include_dir ${SDK_DIR}/include)
set(lock_file ${SDK_DIR}/abi.lock)

# The version "<major>.<minor>" from two #define lines of `header`.
function(read_version header major_macro minor_macro out)
  file(STRINGS ${header} lines REGEX "^#define (${major_macro}|${minor_macro}) [0-9]+")
  set(major "")
  set(minor "")
  foreach(line ${lines})
    if(line MATCHES "^#define ${major_macro} ([0-9]+)")
      set(major ${CMAKE_MATCH_1})
    elseif(line MATCHES "^#define ${minor_macro} ([0-9]+)")
      set(minor ${CMAKE_MATCH_1})
    endif()
  endforeach()
  if(major STREQUAL "" OR minor STREQUAL "")
    message(FATAL_ERROR "${header}: no '#define ${major_macro} <n>' and '#define ${minor_macro} <n>' lines")
  endif()
  set(${out} "${major}.${minor}" PARENT_SCOPE)
endfunction()

# SHA-256 over "<path> <sha256 of its code>\n" for each file, paths relative to include/. The
# code is the file without lines that are only a // comment and without blank lines, so
# rewording documentation needs no version change, while any declaration, macro or trailing
# comment on a code line does.
function(hash_files out)
  set(files ${ARGN})
  list(SORT files)
  set(manifest "")
  foreach(rel ${files})
    file(READ ${include_dir}/${rel} code)
    # Read whole (file(STRINGS) would split lines at ';' and hide a dropped semicolon).
    string(PREPEND code "\n")
    string(REGEX REPLACE "\n[ \t]*//[^\n]*" "" code "${code}")
    set(previous "")
    while(NOT code STREQUAL previous)
      set(previous "${code}")
      string(REGEX REPLACE "\n[ \t\r]*\n" "\n" code "${code}")
    endwhile()
    string(SHA256 h "${code}")
    string(APPEND manifest "${rel} ${h}\n")
  endforeach()
  string(SHA256 digest "${manifest}")
  set(${out} ${digest} PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE all_headers RELATIVE ${include_dir} ${include_dir}/*)
set(abi_headers ${all_headers})
list(FILTER abi_headers EXCLUDE REGEX "^tessera/sdk/kernels/")
set(kernel_headers ${all_headers})
list(FILTER kernel_headers INCLUDE REGEX "^tessera/sdk/kernels/")

set(parts abi)
read_version(${include_dir}/tessera/sdk/abi.h TESSERA_SDK_ABI_MAJOR TESSERA_SDK_ABI_MINOR abi_version)
hash_files(abi_hash ${abi_headers})
set(abi_what "sdk/include/tessera/sdk/abi.h (TESSERA_SDK_ABI_MINOR, with a history line)")
if(EXISTS ${include_dir}/tessera/sdk/kernels/version.h)
  list(APPEND parts kernels)
  read_version(${include_dir}/tessera/sdk/kernels/version.h TESSERA_SDK_KERNELS_VERSION_MAJOR
               TESSERA_SDK_KERNELS_VERSION_MINOR kernels_version)
  hash_files(kernels_hash ${kernel_headers})
  set(kernels_what "sdk/include/tessera/sdk/kernels/version.h (TESSERA_SDK_KERNELS_VERSION_MINOR, with a history line)")
endif()

set(how "then run `cmake --build <build dir> --target tessera-sdk-lock` (or `cmake -DSDK_DIR=sdk -DMODE=write -P sdk/cmake/abi_lock.cmake`) to record the new hash in sdk/abi.lock")

if(MODE STREQUAL "write")
  set(text "# <part> <version> <sha256 of its headers>: written by the tessera-sdk-lock target (sdk/cmake/abi_lock.cmake).\n")
  foreach(part ${parts})
    string(APPEND text "${part} ${${part}_version} ${${part}_hash}\n")
  endforeach()
  file(WRITE ${lock_file} "${text}")
  message(STATUS "wrote ${lock_file}")
  foreach(part ${parts})
    message(STATUS "  ${part} ${${part}_version} ${${part}_hash}")
  endforeach()
  return()
elseif(NOT MODE STREQUAL "check")
  message(FATAL_ERROR "abi_lock.cmake: MODE must be check or write, got '${MODE}'")
endif()

if(NOT EXISTS ${lock_file})
  message(FATAL_ERROR "${lock_file} is missing; ${how}")
endif()
file(STRINGS ${lock_file} lock_lines REGEX "^[a-z]+ [0-9]+\\.[0-9]+ [0-9a-f]+$")
set(errors "")
foreach(part ${parts})
  set(locked_version "")
  foreach(line ${lock_lines})
    if(line MATCHES "^${part} ([0-9]+\\.[0-9]+) ([0-9a-f]+)$")
      set(locked_version ${CMAKE_MATCH_1})
      set(locked_hash ${CMAKE_MATCH_2})
    endif()
  endforeach()
  if(locked_version STREQUAL "")
    string(APPEND errors "sdk/abi.lock has no '${part}' line; ${how}.\n")
  elseif(NOT locked_hash STREQUAL ${part}_hash AND locked_version STREQUAL ${part}_version)
    string(APPEND errors
      "the public SDK headers of part '${part}' changed but its version is still ${${part}_version} "
      "(sdk/abi.lock: ${locked_hash}, headers now: ${${part}_hash}). An interface change needs a "
      "version change: bump ${${part}_what}, ${how}.\n")
  elseif(NOT locked_version STREQUAL ${part}_version)
    string(APPEND errors
      "part '${part}' is at version ${${part}_version} but sdk/abi.lock records ${locked_version}; ${how}.\n")
  endif()
endforeach()
if(errors)
  message(FATAL_ERROR "SDK ABI lock check failed:\n${errors}")
endif()
foreach(part ${parts})
  message(STATUS "sdk ${part} ${${part}_version}: headers match sdk/abi.lock")
endforeach()
