"""Ships liboktopk.so inside the oktopk package.

Everything else about the package is in pyproject.toml. The library is built
by `make` into the repository's build/ folder; this build step copies it into
the wheel, so `make && pip install ./plugins/pytorch` (or `make
install-python`, both in one) gives an installed package that loads its own
copy. The build fails, saying what to do, rather than produce a package
without the library.
"""

import os
import shutil

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def find_library():
    """$OKTOPK_LIBRARY, else the repository's build/liboktopk.so, else a
    copy already inside the package folder (an sdist's)."""
    env = os.environ.get("OKTOPK_LIBRARY")
    candidates = [env] if env else [
        os.path.join(HERE, "..", "..", "build", "liboktopk.so"),
        os.path.join(HERE, "oktopk", "liboktopk.so"),
    ]
    for path in candidates:
        if os.path.isfile(path):
            return os.path.normpath(path)
    raise SystemExit(
        "oktopk: liboktopk.so not found (looked at "
        + ", ".join(os.path.normpath(p) for p in candidates)
        + "). Run `make` in the oktopk repository first, or `make install-python`, "
        "which builds the library and installs this package with it; or set "
        "OKTOPK_LIBRARY to a built liboktopk.so."
    )


class build_py_with_library(build_py):
    def run(self):
        super().run()
        if self.dry_run:
            return
        target = os.path.join(self.build_lib, "oktopk", "liboktopk.so")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(find_library(), target)


class BinaryDistribution(Distribution):
    """The wheel carries a native library: tag it for this platform."""

    def has_ext_modules(self):
        return True


cmdclass = {"build_py": build_py_with_library}
try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1 has it in the wheel package
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

if bdist_wheel is not None:

    class bdist_wheel_any_python(bdist_wheel):
        """The library is loaded with ctypes, never imported as an
        extension module, so one wheel fits every Python 3 on a platform:
        py3-none-<platform> (which `make wheel` turns into a manylinux
        tag)."""

        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            return ("py3", "none", super().get_tag()[2])

    cmdclass["bdist_wheel"] = bdist_wheel_any_python

setup(cmdclass=cmdclass, distclass=BinaryDistribution)
