"""The arrival model compiled to machine code with lleaves, when it is installed (`.[fast]`).

LightGBM's Booster.predict walks its trees through generic node arrays and costs a fixed ~50 us a
call; lleaves turns each tree into branches of native code (LLVM), which `kvprefetch bench
predict` measured an order of magnitude faster on the bundled model, with the same outputs
(tests/predict/test_predictors_fast.py holds it to the Booster within 1e-6).

Compiling takes seconds, so the machine code is cached, keyed by the model file's bytes, the
compiler's versions and the host CPU (the code is built for it):
`$XDG_CACHE_HOME/kvprefetch/lleaves/` (default `~/.cache/...`), outside the repository. A later
start with the same model loads it in milliseconds. Anything that goes wrong (lleaves missing,
a model it cannot compile, a cache that answers differently from the Booster) leaves the caller
on the Booster, which is always loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# How far the compiled model may drift from the Booster on the probe rows before it is refused.
MAX_ABS_DIFF = 1e-6


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvprefetch" / "lleaves"


def available() -> bool:
    try:
        import lleaves  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class CompiledModel:
    """A compiled forest: `predict(x)` answers what Booster.predict(x) answers."""

    model: Any  # lleaves.Model
    cache_file: Path
    # Seconds to compile (or to load the cached machine code), and which of the two it was.
    load_seconds: float
    from_cache: bool

    def predict(self, x: np.ndarray) -> np.ndarray:
        # One thread: a tick of 30,000 rows takes milliseconds, less than a thread pool's start.
        return self.model.predict(np.ascontiguousarray(x, dtype=np.float64), n_jobs=1)


def cache_key(model_file: Path) -> str:
    from importlib.metadata import version

    import llvmlite.binding as llvm

    try:
        features = llvm.get_host_cpu_features().flatten()
    except RuntimeError:  # LLVM cannot detect them on some hosts
        features = ""
    h = hashlib.sha256(model_file.read_bytes())
    for part in (version("lleaves"), version("llvmlite"), llvm.get_host_cpu_name(), features):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:32]


def is_cached(model_file: Path, cache_dir: Path | None = None) -> bool:
    """Whether this model's machine code is in the cache (a start would load it in milliseconds)."""
    return ((cache_dir or default_cache_dir()) / f"{cache_key(model_file)}.o").is_file()


# A partial file older than this was left by a process that stopped mid-compile (a service
# stopped while its background compile ran): dropped by the next compile.
STALE_PARTIAL_SECONDS = 3600.0


def _drop_stale_partials(cache_dir: Path) -> None:
    cutoff = time.time() - STALE_PARTIAL_SECONDS
    for partial in cache_dir.glob("*.partial"):
        with contextlib.suppress(OSError):  # another process's, gone meanwhile
            if partial.stat().st_mtime < cutoff:
                partial.unlink()


def compile_model(
    model_file: Path, probe: np.ndarray, expected: np.ndarray, cache_dir: Path | None = None
) -> CompiledModel:
    """Compile (or load from the cache) and check against the Booster's answers on `probe`.

    Raises ImportError without lleaves, ValueError when the outputs differ, and whatever lleaves
    raises for a model it cannot compile.
    """
    import lleaves

    cache_dir = cache_dir or default_cache_dir()
    cache_file = cache_dir / f"{cache_key(model_file)}.o"
    started = time.perf_counter()
    model = lleaves.Model(model_file=str(model_file))
    from_cache = cache_file.is_file()
    if from_cache:
        model.compile(cache=str(cache_file))
    else:
        cache_dir.mkdir(parents=True, exist_ok=True)
        _drop_stale_partials(cache_dir)
        # lleaves writes the object file where it is told; a unique name renamed into place means
        # a concurrent start or a crash mid-write never leaves a half file under the real name.
        partial = cache_dir / f"{cache_file.name}.{os.getpid()}.{uuid.uuid4().hex}.partial"
        try:
            model.compile(cache=str(partial))
            os.replace(partial, cache_file)
        finally:
            partial.unlink(missing_ok=True)
    compiled = CompiledModel(model, cache_file, time.perf_counter() - started, from_cache)
    diff = float(np.max(np.abs(compiled.predict(probe) - expected))) if len(probe) else 0.0
    if not diff <= MAX_ABS_DIFF:
        if from_cache:
            cache_file.unlink(missing_ok=True)  # the next start compiles afresh
        raise ValueError(f"compiled model differs from the Booster by {diff:g} on the probe rows")
    return compiled
