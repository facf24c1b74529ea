"""Wheels of this checkout installed in a fresh venv outside it, for the install tests.

The sources are copied out before the build, so the build leaves nothing in the checkout and
two builds never share a build/ folder. Dependencies come from the package index (or pip's
cache), or are borrowed from this test run's venv (`make_venv(borrow_deps=True)`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.ports import listener, port_of

REPO = Path(__file__).resolve().parent.parent
# What a wheel is built from; the rest (tests, docs, .git, the venv) stays behind.
SERVER_SOURCES = (
    "pyproject.toml",
    "setup.py",
    "MANIFEST.in",
    "README.md",
    "app",
    "kvprefetch_cli",
    "bench",
    "sim",
    "training",
    "models",
    "data",
)
INSTALL_TIMEOUT_SECONDS = 600.0
READY_TIMEOUT_SECONDS = 60.0

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "dist", "*.egg-info")


def build_wheels(out: Path, *, server: bool) -> list[Path]:
    """The client's wheel, and the server's too when `server`, built into `out`."""
    src = out / "src"
    shutil.copytree(REPO / "client", src / "client", ignore=_IGNORE)
    targets = [src / "client"]
    if server:
        for name in SERVER_SOURCES:
            path = REPO / name
            if path.is_dir():
                shutil.copytree(path, src / name, ignore=_IGNORE)
            else:
                shutil.copy2(path, src / name)
        targets.append(src)
    wheels = out / "wheels"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            *map(str, targets),
            "-w",
            str(wheels),
        ],
        cwd=out,
    )
    return sorted(wheels.glob("*.whl"))


def make_venv(path: Path, wheels: Sequence[Path], *, borrow_deps: bool = False) -> Path:
    """A fresh venv at `path` holding `wheels` and their dependencies; its bin/ folder.

    `borrow_deps`: the wheels are installed without their dependencies, which the venv reads
    from this test run's own site-packages (appended to its path by a .pth file, after its own
    site-packages, so the wheels' packages win). For the server's wheel: installing LightGBM,
    pandas and the rest again was most of its test's time, and what is under test is what the
    wheel carries; `make install` resolves the same dependency list from the same metadata.
    An editable install's .pth in the borrowed folder is not run (only a venv's own are), so the
    checkout is not on the path.
    """
    run([sys.executable, "-m", "venv", str(path)], cwd=path.parent)
    bin_dir = path / "bin"
    if borrow_deps:
        site = run(
            [
                str(bin_dir / "python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            cwd=path.parent,
        ).stdout.strip()
        borrowed = sysconfig.get_paths()["purelib"]
        (Path(site) / "_borrowed_dependencies.pth").write_text(borrowed + "\n")
    # --no-compile: byte-compiling numpy, pandas and the rest up front takes longer than the
    # install itself; what runs compiles as it is imported.
    run(
        [
            str(bin_dir / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-compile",
            *(["--no-deps"] if borrow_deps else []),
            *map(str, wheels),
        ],
        cwd=path.parent,
    )
    return bin_dir


def installed(bin_dir: Path) -> set[str]:
    """The distributions in the venv, names normalised (lower case, '-' for '_')."""
    done = run([str(bin_dir / "python"), "-m", "pip", "list", "--format=json"], cwd=bin_dir)
    return {d["name"].lower().replace("_", "-") for d in json.loads(done.stdout)}


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without this checkout on the path and without the developer's KVP_*."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(
    cmd: Sequence[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = INSTALL_TIMEOUT_SECONDS,
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        list(cmd),
        cwd=cwd,
        env=env if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, (
        f"{' '.join(cmd)} exited with {done.returncode}:\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


@contextmanager
def serving(cmd: Sequence[str], *, cwd: Path, env: dict[str, str]) -> Iterator[str]:
    """Run the service command (`... serve`) on a socket the test holds (`--fd`) until its
    /readyz answers 200; yields its URL, then kills it."""
    log_path = cwd / "service.log"
    sock = listener()
    url = f"http://127.0.0.1:{port_of(sock)}"
    with sock, open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*cmd, "--fd", str(sock.fileno())],
            pass_fds=[sock.fileno()],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            assert proc.poll() is None, (
                f"the service exited with {proc.returncode}:\n{_tail(log_path)}"
            )
            try:
                if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"no /readyz 200 in time:\n{_tail(log_path)}"
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]
