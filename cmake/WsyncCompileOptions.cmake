# Compile options for wsync's own targets (not for generated protobuf code or third-party code).
#
# Floating point: the INT4 formats depend on IEEE float32 division and round-half-to-even, so
# no -ffast-math / reciprocal math anywhere, and no contraction of a*b+c into FMA
# (-ffp-contract=off; nvcc --fmad=false): both sides of a sync must compute the same bits.

add_library(wsync_options INTERFACE)
target_compile_options(wsync_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers
                           -ffp-contract=off -fno-fast-math>
  $<$<COMPILE_LANGUAGE:CUDA>:--fmad=false -Xcompiler=-Wall --expt-relaxed-constexpr>)
if(WSYNC_WERROR)
  target_compile_options(wsync_options INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Werror>
                                                 $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
endif()
# A unity build (CMAKE_UNITY_BUILD; tools/setup.sh makes the sanitizer builds so) compiles each .cc
# as a file #included by its batch: GCC's -Wsubobject-linkage, meant for headers
# whose classes use a type of the anonymous namespace, then fires on every .cc that does so.
if(CMAKE_UNITY_BUILD AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  target_compile_options(wsync_options INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Wno-subobject-linkage>)
endif()
target_compile_definitions(wsync_options INTERFACE
  WSYNC_WITH_CUDA=$<BOOL:${WSYNC_HAVE_CUDA}> WSYNC_WITH_NCCL=$<BOOL:${WSYNC_HAVE_NCCL}>
  WSYNC_WITH_MPI=1 WSYNC_WITH_GLOO=1)
target_include_directories(wsync_options INTERFACE ${PROJECT_SOURCE_DIR}/src)

if(WSYNC_SANITIZE)
  # Global, so that every object linked into a sanitized binary is instrumented alike.
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=address,undefined>
                      $<$<COMPILE_LANGUAGE:C,CXX>:-fno-sanitize-recover=undefined>
                      $<$<COMPILE_LANGUAGE:C,CXX>:-fno-omit-frame-pointer>)
  add_link_options(-fsanitize=address,undefined)
endif()

if(WSYNC_TSAN)
  if(WSYNC_SANITIZE)
    message(FATAL_ERROR "WSYNC_TSAN and WSYNC_SANITIZE exclude each other (one build directory each)")
  endif()
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=thread> $<$<COMPILE_LANGUAGE:C,CXX>:-fno-omit-frame-pointer>)
  add_link_options(-fsanitize=thread)
endif()
# The tests labelled tsan (sanitize), so that a TSan (ASan) build compiles only what it runs.
add_custom_target(wsync_tsan_tests)
add_custom_target(wsync_sanitize_tests)

if(WSYNC_HAVE_FUZZ)
  # Coverage instrumentation for the code the fuzz targets reach (the libFuzzer runtime itself
  # is linked into the fuzz targets only).
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=fuzzer-no-link>)
endif()

# wsync_add_test(NAME name SOURCES ... LIBS ... [LABELS ...])
# One gtest executable in build/bin, its cases discovered by ctest with the given labels; its main()
# (tests/support/test_main.cc) gives each test process a private ::testing::TempDir().
function(wsync_add_test)
  cmake_parse_arguments(T "" "NAME" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} wsync_options wsync_test_main)
  gtest_discover_tests(${T_NAME} DISCOVERY_TIMEOUT 60)
  # gtest_discover_tests flattens list-valued properties, so labels are set by a second include
  # file that runs after the discovered list (${T_NAME}_TESTS) is known.
  set(labels_file ${CMAKE_CURRENT_BINARY_DIR}/${T_NAME}_labels.cmake)
  file(WRITE ${labels_file}
       "foreach(t IN LISTS ${T_NAME}_TESTS)\n  set_tests_properties(\"\${t}\" PROPERTIES LABELS \"unit;${T_LABELS}\")\nendforeach()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${labels_file})
  if("tsan" IN_LIST T_LABELS)
    add_dependencies(wsync_tsan_tests ${T_NAME})
  endif()
  if("sanitize" IN_LIST T_LABELS)
    add_dependencies(wsync_sanitize_tests ${T_NAME})
  endif()
endfunction()
