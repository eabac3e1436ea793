# The installed package: `cmake --install build --prefix P` puts the libraries, the public
# headers, the programs and a CMake package under P, so that a training program elsewhere does
#   find_package(zinf 0.1 CONFIG REQUIRED)      # CMAKE_PREFIX_PATH=P
#   target_link_libraries(app PRIVATE zinf::zinf)
# (docs/library.md). zinf::zinf is the engine with everything it exposes; the modules are there
# too (zinf::core, zinf::comm, ...). A pkg-config file (zinf.pc) says the same for other builds.
include(CMakePackageConfigHelpers)

if(TARGET zinf_engine)
  add_library(zinf INTERFACE)
  add_library(zinf::zinf ALIAS zinf)
  target_link_libraries(zinf INTERFACE zinf::engine)
  install(TARGETS zinf EXPORT zinfTargets)
endif()

set(ZINF_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/zinf)
install(EXPORT zinfTargets NAMESPACE zinf:: DESTINATION ${ZINF_CMAKE_DIR} COMPONENT devel)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/zinfConfig.cmake.in
                              ${CMAKE_BINARY_DIR}/zinfConfig.cmake
                              INSTALL_DESTINATION ${ZINF_CMAKE_DIR})
# 0.x: a minor version may break the API, so only the same major.minor is compatible.
write_basic_package_version_file(${CMAKE_BINARY_DIR}/zinfConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/zinfConfig.cmake ${CMAKE_BINARY_DIR}/zinfConfigVersion.cmake
        DESTINATION ${ZINF_CMAKE_DIR} COMPONENT devel)

# pkg-config: the modules' libraries, most dependent first.
get_property(zinf_modules GLOBAL PROPERTY ZINF_MODULES)
list(REVERSE zinf_modules)
set(ZINF_PC_LIBS "")
foreach(module ${zinf_modules})
  string(APPEND ZINF_PC_LIBS " -lzinf_${module}")
endforeach()
# Relocatable: the prefix is found from the .pc file's own directory (PREFIX/LIBDIR/pkgconfig).
set(ZINF_PC_PREFIX "\${pcfiledir}/..")
string(REPLACE "/" ";" zinf_libdir_parts "${CMAKE_INSTALL_LIBDIR}")
foreach(part ${zinf_libdir_parts})
  string(APPEND ZINF_PC_PREFIX "/..")
endforeach()
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(ZINF_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/zinf.pc.in ${CMAKE_BINARY_DIR}/zinf.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/zinf.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig
        COMPONENT devel)
