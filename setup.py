"""Package list for setuptools: every package under the mapped folders, prefixed with `plait.`.

pyproject.toml maps `plait` to the repository root; setuptools' own discovery cannot add the
prefix, so the list is computed here.
"""

from setuptools import find_packages, setup

MAPPED_FOLDERS = ("core", "plugins", "proto", "daemon", "tools")

packages = ["plait"]
for folder in MAPPED_FOLDERS:
    packages.append(f"plait.{folder}")
    packages.extend(f"plait.{folder}.{sub}" for sub in find_packages(folder))

setup(packages=packages)
