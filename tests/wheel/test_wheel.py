"""The wheels as a user installs them (`make wheel` builds them into
build/wheels, or OKTOPK_WHEEL_DIR): each goes into a fresh virtualenv that
sees no repository, from that folder alone (pip --no-index), and runs with
the system's libzmq hidden by a mount namespace that lays an empty file
over it.

- The PyTorch plugin's wheel, in a virtualenv that already has torch (this
  interpreter's, through a .pth file): pip must find torch satisfied and
  install nothing else (with no index it could not fetch a second torch),
  and a 2-rank DDP step through the hook under torchrun must load the
  library and libzmq from the wheel.
- The Horovod plugin's wheel, in a virtualenv on the Horovod environment's
  packages: it installs with both wheels and no index, imports, and loads
  the library from the oktopk wheel.
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
WHEELS = os.environ.get("OKTOPK_WHEEL_DIR", os.path.join(ROOT, "build", "wheels"))


def system_libzmq():
    """The real files behind the system's libzmq, as the loader finds it."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    paths = {os.path.realpath(line.split("=>")[1].strip()) for line in out.splitlines() if "libzmq.so" in line and "=>" in line}
    return sorted(p for p in paths if os.path.isfile(p))


@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    """A command prefix that runs its command in a mount namespace where
    every system libzmq file is an empty file."""
    libs = system_libzmq()
    assert libs, "no system libzmq to hide (make deps installs libzmq3-dev)"
    empty = tmp_path_factory.mktemp("mask") / "empty.so"
    empty.write_bytes(b"")
    binds = " && ".join(f"mount --bind {empty} {lib}" for lib in libs)
    flags = ["-m"] if os.geteuid() == 0 else ["-r", "-m"]
    prefix = ["unshare", *flags, "--propagation", "private", "sh", "-c", f'{binds} && exec "$@"', "masked"]
    probe = subprocess.run(prefix + [sys.executable, "-c", "import ctypes; ctypes.CDLL('libzmq.so.5')"], capture_output=True, text=True)
    if probe.returncode == 0 or "file too short" not in probe.stderr:
        pytest.skip(f"cannot hide the system libzmq in a mount namespace here: {probe.stderr[-300:]}")
    return prefix, libs


def wheel(pattern):
    found = glob.glob(os.path.join(WHEELS, pattern))
    assert len(found) == 1, f"want one {pattern} in {WHEELS} (run `make wheel`), found {found}"
    return found[0]


def fresh_venv(path, site_packages):
    """A virtualenv at path whose own site-packages come first, then
    site_packages (an existing environment's: torch, Horovod, and pip
    itself). It gets no pip or setuptools of its own, which would shadow
    the environment's and leave torch's requirements unmet."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, capture_output=True, timeout=300)
    python = str(path / "bin" / "python")
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(own, "existing-environment.pth"), "w") as f:
        f.write(site_packages + "\n")
    return python


def clean_env():
    # Nothing of the repository or of this test's environment leaks in.
    drop = ("PYTHONPATH", "OKTOPK_LIBRARY", "VIRTUAL_ENV", "PYTHONHOME")
    return {k: v for k, v in os.environ.items() if k not in drop}


def pip_install(python, *args):
    # --isolated: no pip configuration or PIP_* variable adds an index or
    # another folder of wheels.
    return subprocess.run([python, "-m", "pip", "--isolated", "install", "--no-index", "--find-links", WHEELS, "--disable-pip-version-check", *args],
                          capture_output=True, text=True, env=clean_env(), timeout=300)


def installed(done):
    """The distributions a pip install reports it installed, by name."""
    assert "Successfully installed" in done.stdout, done.stdout + done.stderr
    return {d.rsplit("-", 1)[0] for d in done.stdout.split("Successfully installed", 1)[1].split()}


def test_the_wheel_repairs_in_libzmq():
    # auditwheel tagged it manylinux and grafted libzmq in beside the library.
    import zipfile

    path = wheel("oktopk-*.whl")
    assert "-py3-none-manylinux_" in os.path.basename(path), path
    names = zipfile.ZipFile(path).namelist()
    assert "oktopk/liboktopk.so" in names
    assert any(n.startswith("oktopk.libs/libzmq-") for n in names), names


def test_pytorch_wheel_in_a_fresh_venv_runs_ddp_without_system_libzmq(tmp_path, masked):
    prefix, hidden = masked
    torch_site = sysconfig.get_paths()["purelib"]  # this interpreter's torch
    python = fresh_venv(tmp_path / "venv", torch_site)
    done = pip_install(python, "oktopk")
    assert done.returncode == 0, done.stdout + done.stderr
    # Only oktopk was installed: torch was already there.
    assert installed(done) == {"oktopk"}, done.stdout
    script = tmp_path / "ddp_step.py"
    shutil.copy(os.path.join(HERE, "ddp_step.py"), script)
    # Its training steps, which import torch only: oktopk still comes from
    # the wheel alone, the source tree being nowhere on the script's path.
    shutil.copy(os.path.join(ROOT, "tests", "python", "ddp_steps.py"), tmp_path)
    port = 20000 + os.getpid() % 9000
    run = subprocess.run(prefix + [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), str(script)],
                         cwd=tmp_path, env=dict(clean_env(), OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RANK ")]
    assert run.returncode == 0 and len(lines) == 2, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    venv = str(tmp_path / "venv")
    for line in lines:
        fields = dict(f.split("=", 1) for f in line.split()[2:])
        assert fields["oktopk"].startswith(venv), line
        assert fields["library"].startswith(venv) and fields["library"].endswith("oktopk/liboktopk.so"), line
        assert fields["torch"].startswith(torch_site), line  # the environment's torch, not a second one
        assert fields["libzmq"] and all("/oktopk.libs/libzmq-" in p for p in fields["libzmq"].split(",")), line
        assert not any(p in fields["libzmq"] for p in hidden), line
        assert fields["communicator"] == "True" and fields["identical"] == "True", line


def test_pytorch_wheel_without_its_grafted_libzmq_cannot_load(tmp_path, masked):
    # The control: with the system libzmq hidden, the library built by
    # `make` (which links the system's) cannot load, so the test above
    # passes only because the wheel carries its own.
    prefix, _ = masked
    lib = os.path.join(ROOT, "build", "liboktopk.so")
    run = subprocess.run(prefix + [sys.executable, "-c", f"import ctypes; ctypes.CDLL({lib!r})"], capture_output=True, text=True)
    assert run.returncode != 0 and "libzmq" in run.stderr, run.stderr


def horovod_site():
    venv = os.environ.get("OKTOPK_HOROVOD_VENV")
    assert venv, "OKTOPK_HOROVOD_VENV names the Horovod virtualenv (make test-wheel sets it)"
    py = os.path.join(venv, "bin", "python")
    return subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_horovod_wheel_installs_and_loads_without_system_libzmq(tmp_path, masked):
    prefix, _ = masked
    site = horovod_site()
    python = fresh_venv(tmp_path / "venv", site)
    done = pip_install(python, "oktopk-horovod")
    assert done.returncode == 0, done.stdout + done.stderr
    # Both wheels and nothing else: torch and Horovod were already there.
    assert installed(done) == {"oktopk", "oktopk-horovod"}, done.stdout
    probe = (
        "import oktopk, oktopk_horovod, horovod, torch\n"
        "oktopk_horovod.Compression.oktopk(density=0.01)\n"
        "print(oktopk_horovod.__file__, oktopk.library_path(), oktopk.library_version(), horovod.__file__, torch.__file__)\n"
    )
    run = subprocess.run(prefix + [python, "-c", probe], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    plugin, library, version, hvd, torch_file = run.stdout.split()
    venv = str(tmp_path / "venv")
    assert plugin.startswith(venv) and library.startswith(venv), run.stdout
    assert hvd.startswith(site) and torch_file.startswith(site), run.stdout
    assert version.count(".") == 2, version
