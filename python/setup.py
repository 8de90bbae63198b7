# Bundles libwsync_trainer_client.so and libwsync_engine_host.so into the package when it is built
# from a wsync checkout (`pip install ./python` after the C++ build, as tools/setup.sh does), so the
# installed package needs no environment variable to find them. $WSYNC_BUILD_DIR names another
# build directory.
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

LIBS = ("libwsync_trainer_client.so", "libwsync_engine_host.so")


class BuildPyWithClient(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        build_dir = os.environ.get("WSYNC_BUILD_DIR", os.path.join(here, "..", "build"))
        for lib in LIBS:
            src = os.path.join(build_dir, "lib", lib)
            if os.path.exists(src):
                dst_dir = os.path.join(self.build_lib, "wsync", "_lib")
                os.makedirs(dst_dir, exist_ok=True)
                shutil.copyfile(os.path.realpath(src), os.path.join(dst_dir, lib))
            else:
                print(f"wsync: {src} not found: the package will look for {lib} at run time "
                      "($WSYNC_TRAINER_CLIENT / $WSYNC_ENGINE_HOST, then the dynamic loader's path)")


setup(cmdclass={"build_py": BuildPyWithClient})
