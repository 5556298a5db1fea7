"""Packaging hook: every wheel (pip install ., pip wheel ., pip install <sdist>) compiles the
kernels with nvcc through kernels/build.py, the same rules as `make cubins`, and ships the
cubins inside the package. Without nvcc the build stops with a message that says how to
point it at one: there is never a wheel without cubins."""
import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_spec = importlib.util.spec_from_file_location("ep_a2a_kernel_build", Path(__file__).parent / "kernels" / "build.py")
kbuild = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kbuild)


class BuildPyWithCubins(build_py):
    def run(self):
        try:
            kbuild.build(log=lambda line: print(line, file=sys.stderr))
        except kbuild.BuildError as e:
            raise SystemExit(f"error: ep_a2a: {e}") from None
        super().run()


setup(cmdclass={"build_py": BuildPyWithCubins})
