"""The installed plugin, as a user gets it: `pip install ./plugins/pytorch`
after `make` must give a package that carries and loads its own
liboktopk.so, with neither the repository nor OKTOPK_LIBRARY to lean on."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PLUGIN = os.path.join(ROOT, "plugins", "pytorch")
LIBRARY = os.path.join(ROOT, "build", "liboktopk.so")


def pip_install_target(target, **env):
    # --no-build-isolation: setuptools comes from this environment, so the
    # test needs no package index.
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), PLUGIN],
        env=dict(os.environ, **env), capture_output=True, text=True, timeout=300,
    )


def isolated_env(site):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OKTOPK_LIBRARY")}
    env["PYTHONPATH"] = str(site)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """One `pip install --target` of the plugin for the module's tests (each
    is several seconds of CPU); a test that changes it works on a copy."""
    if not os.path.isfile(LIBRARY):
        pytest.skip("build/liboktopk.so not built (run `make`)")
    site = tmp_path_factory.mktemp("installed") / "site"
    done = pip_install_target(site)
    assert done.returncode == 0, done.stdout + done.stderr
    return site


def test_pip_installed_package_loads_its_own_library(tmp_path, installed):
    site = installed
    assert (site / "oktopk" / "liboktopk.so").is_file(), "the wheel does not carry liboktopk.so"
    # Only the install folder on the path, run from elsewhere: the repository
    # (plugins/pytorch, build/) must be out of reach.
    probe = (
        "import sys, oktopk; "
        "assert not any('plugins/pytorch' in p for p in sys.path), sys.path; "
        "print(oktopk.__file__); print(oktopk.library_path()); print(oktopk.library_version())"
    )
    run = subprocess.run([sys.executable, "-c", probe],
                         cwd=tmp_path, env=isolated_env(site), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    module, library, version = run.stdout.split()
    assert module.startswith(str(site)), module
    assert library == str(site / "oktopk" / "liboktopk.so"), library
    assert version.count(".") == 2, version


def test_build_without_library_fails_saying_what_to_do(tmp_path):
    done = pip_install_target(tmp_path / "site", OKTOPK_LIBRARY=str(tmp_path / "missing.so"))
    assert done.returncode != 0
    assert "liboktopk.so not found" in done.stdout + done.stderr
    assert "make install-python" in done.stdout + done.stderr


def test_missing_library_error_names_the_fix(tmp_path, installed):
    # The package without its library (as a plain copy of the sources would
    # be) raises OkTopkError naming where it looked and what to run.
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    os.remove(site / "oktopk" / "liboktopk.so")
    probe = (
        "import oktopk\n"
        "try:\n    oktopk.library_version()\n"
        "except oktopk.OkTopkError as e:\n    print(e)\n"
        "else:\n    raise SystemExit('loaded a library it should not have found')\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=isolated_env(site),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "liboktopk.so not found" in run.stdout and "make install-python" in run.stdout, run.stdout
