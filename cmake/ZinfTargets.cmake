# Compile settings shared by every zinf target.
add_library(zinf_build_flags INTERFACE)
target_compile_options(zinf_build_flags INTERFACE -Wall -Wextra -Wpedantic -Wshadow)
if(ZINF_WERROR)
  target_compile_options(zinf_build_flags INTERFACE -Werror)
endif()
# Open MPI's deprecated C++ bindings must never leak into C++ translation units.
target_compile_definitions(zinf_build_flags INTERFACE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
if(ZINF_CUDA_ENABLED)
  target_compile_definitions(zinf_build_flags INTERFACE ZINF_WITH_CUDA=1)
endif()

if(ZINF_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(ZINF_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT ZINF_SANITIZE STREQUAL "")
  message(FATAL_ERROR "ZINF_SANITIZE must be empty, 'address' or 'thread', not '${ZINF_SANITIZE}'")
endif()

# zinf_add_library(<module> SOURCES ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
# Builds target zinf_<module> with alias zinf::<module>; public headers in <module>/include.
function(zinf_add_library module)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(zinf_${module} ${ARG_SOURCES})
  add_library(zinf::${module} ALIAS zinf_${module})
  target_include_directories(zinf_${module} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/include
                                            PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_link_libraries(zinf_${module} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE zinf_build_flags ${ARG_PRIVATE_DEPS})
  target_compile_definitions(zinf_${module} PUBLIC OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
endfunction()
