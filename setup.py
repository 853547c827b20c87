"""Package list for setuptools: every package under the mapped folders, prefixed with `plait.`.

pyproject.toml maps `plait` to the repository root; setuptools' own discovery cannot add the
prefix, so the list is computed here.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

MAPPED_FOLDERS = (
    "core",
    "plugins",
    "proto",
    "daemon",
    "tools",
    "planner",
    "integrations",
    "training",
    "testing",
)
# Folders of data only, shipped as package data (their files: pyproject's package-data).
DATA_FOLDERS = ("configs",)

packages = ["plait"]
for folder in MAPPED_FOLDERS:
    packages.append(f"plait.{folder}")
    packages.extend(f"plait.{folder}.{sub}" for sub in find_packages(folder))
packages.extend(f"plait.{folder}" for folder in DATA_FOLDERS)


class BuildPy(build_py):
    """`plait` maps to the repository root; keep this build script out of the package."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "plait" and m[1] == "setup")]


setup(packages=packages, cmdclass={"build_py": BuildPy})
