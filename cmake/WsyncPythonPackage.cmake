# The Python package's native libraries (python/pyproject.toml). `pip install ./python` configures
# this project through scikit-build-core, which sets SKBUILD, builds only wsync_trainer_client and
# wsync_engine_host, and installs the component wsync_python into the wheel: each library as one
# file, wsync/_lib/lib<name>.so, where wsync._native looks for it. The build tree's file is copied
# as it is (its RUNPATH kept: a CUDA build finds libcudart where the build did).
if(SKBUILD)
  foreach(lib wsync_trainer_client wsync_engine_host)
    install(FILES $<TARGET_FILE:${lib}> DESTINATION wsync/_lib RENAME lib${lib}.so COMPONENT wsync_python)
  endforeach()
endif()
