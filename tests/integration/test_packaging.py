"""The package as a user installs it: a wheel built from a clean checkout (no
generated code in it) works in a fresh virtual environment."""
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def clean_checkout(dest: str) -> str:
    """The tracked files of the working tree, as a fresh clone has them."""
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(dest, name))
    assert not [f for f in os.listdir(os.path.join(dest, "dpex", "proto")) if "_pb2" in f]
    return dest


EPOCH = """
import dpex, torch
from dpex.testing.datasets import Squares
assert "{venv}" in dpex.__file__, dpex.__file__
with dpex.RemoteDataLoader(None, dataset=dpex.DatasetSpec("dpex.testing.datasets:Squares", n=10),
                           batch_size=4, processes=1, timeout=60) as loader:
    got = [b["y"].tolist() for b in loader]
want = [b["y"].tolist() for b in torch.utils.data.DataLoader(Squares(10), batch_size=4)]
assert got == want, (got, want)
print("one epoch", len(got))
"""


def test_a_wheel_from_a_clean_checkout_installs_and_runs(tmp_path):
    src = clean_checkout(str(tmp_path / "src"))
    # The build hook as pip runs it (without isolation: this venv has the build requirements).
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), src], check=True, cwd=str(tmp_path), timeout=300)
    (wheel,) = os.listdir(tmp_path / "dist")
    with zipfile.ZipFile(tmp_path / "dist" / wheel) as z:  # no two top-level names that differ only in case
        tops = {name.split("/")[0] for name in z.namelist() if not name.startswith("dpex-")}
        assert "dpex/dispatcher/page.html" in z.namelist()  # the live picture, as package data
    assert "Dpex.py" in tops and len({t.lower() for t in tops}) == len(tops), tops
    # A fresh venv; its dependencies (torch, grpcio, ...) are this venv's, through a path
    # entry (a .pth in it is not run, so the checkout's editable dpex stays out of it).
    env_dir = str(tmp_path / "venv")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = os.path.join(env_dir, "bin", "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_path("purelib") + "\n")
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps", str(tmp_path / "dist" / wheel)],
                   check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for cmd in (["dpex-dispatcher", "--help"], ["dpex-worker", "--help"], ["dpex", "--help"]):
        out = subprocess.run([os.path.join(env_dir, "bin", cmd[0]), *cmd[1:]], capture_output=True,
                             text=True, env=env, cwd=str(tmp_path), timeout=60)
        assert out.returncode == 0, out.stderr
        assert "Usage" in out.stdout
    out = subprocess.run([py, "-c", EPOCH.format(venv=env_dir)], capture_output=True, text=True, env=env,
                         cwd=str(tmp_path), timeout=180)
    assert out.returncode == 0, out.stderr
    assert "one epoch 3" in out.stdout
    out = subprocess.run([py, "-c", "from Dpex import dataloader; print(dataloader.DpexDataLoader.__name__)"],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)
    assert out.stdout.strip() == "DpexDataLoader", out.stderr
