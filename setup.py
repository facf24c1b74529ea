"""One build step beyond pyproject.toml: the wheel carries the bundled model and the scenarios.

They stay in the repository's top-level models/ and data/ (the design card's folders); a wheel
gets copies at app/_bundled/models/default and app/_bundled/data/scenarios, where
app/core/bundle.py looks when the service runs from an install rather than a checkout. An
editable install reads the checkout's folders, so nothing is copied for it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# Only what serving and replaying the shipped scenarios read (not the whole of models/ or data/).
BUNDLED = ("models/default", "data/scenarios")


class BuildPyWithBundle(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for relative in BUNDLED:
            source = ROOT / relative
            if not source.is_dir():
                raise FileNotFoundError(
                    f"{source}: the wheel must carry it (MANIFEST.in lists it for an sdist)"
                )
            target = Path(self.build_lib) / "app" / "_bundled" / relative
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target)


setup(cmdclass={"build_py": BuildPyWithBundle})
