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
# Builds shared library target zinf_<module> (libzinf_<module>.so) with alias zinf::<module>;
# public headers in <module>/include, installed under include/ with the export set zinfTargets
# (cmake/zinfConfig.cmake.in). Shared, so that an installed zinf carries its private dependencies
# (HDF5, liburing, xxHash, CUDA) itself and a user's program links only what the headers need.
function(zinf_add_library module)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(zinf_${module} SHARED ${ARG_SOURCES})
  add_library(zinf::${module} ALIAS zinf_${module})
  set_target_properties(zinf_${module} PROPERTIES EXPORT_NAME ${module}
                        VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
  target_include_directories(zinf_${module}
    PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_link_libraries(zinf_${module} PUBLIC ${ARG_PUBLIC_DEPS}
                        PRIVATE $<BUILD_INTERFACE:zinf_build_flags> ${ARG_PRIVATE_DEPS})
  target_compile_definitions(zinf_${module} PUBLIC OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
  target_compile_features(zinf_${module} PUBLIC cxx_std_23)  # std::expected in the headers
  install(TARGETS zinf_${module} EXPORT zinfTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime)
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          COMPONENT devel)
  set_property(GLOBAL APPEND PROPERTY ZINF_MODULES ${module})
endfunction()
