"""pip install ./python: the package, plus the library it loads when one is
built (../build-libc/libkvcache.so, from `make MALLOC=libc lib`) so the
installed package works without KVCACHE_LIBRARY. Nothing is compiled here."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
BUILT = os.path.join(os.path.dirname(HERE), "build-libc", "libkvcache.so")


class BuildPy(build_py):
    def run(self):
        super().run()
        if os.path.exists(BUILT):
            dst = os.path.join(self.build_lib, "kvcache", "libkvcache.so")
            shutil.copy2(os.path.realpath(BUILT), dst)


setup(cmdclass={"build_py": BuildPy})
