# Bundles libwsync_trainer_client.so into the package when it is built from a wsync checkout
# (`pip install ./python` after the C++ build, as tools/setup.sh does), so the installed package
# needs no environment variable to find it. $WSYNC_BUILD_DIR names another build directory.
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

LIB = "libwsync_trainer_client.so"


class BuildPyWithClient(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        build_dir = os.environ.get("WSYNC_BUILD_DIR", os.path.join(here, "..", "build"))
        src = os.path.join(build_dir, "lib", LIB)
        if os.path.exists(src):
            dst_dir = os.path.join(self.build_lib, "wsync", "_lib")
            os.makedirs(dst_dir, exist_ok=True)
            shutil.copyfile(os.path.realpath(src), os.path.join(dst_dir, LIB))
        else:
            print(f"wsync: {src} not found: the package will look for {LIB} at run time "
                  "($WSYNC_TRAINER_CLIENT, then the dynamic loader's path)")


setup(cmdclass={"build_py": BuildPyWithClient})
