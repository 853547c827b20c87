"""Build a wheelhouse for installing plait on a node with no network (an offline GPU node).

    python tools/wheelhouse.py --out wheelhouse [--python 3.12] [--platform manylinux_2_28_x86_64]
                               [--extra hf]… [--assume-present NAME]…

What lands in `--out`: plait's own wheel, built from this checkout, and the wheels of every
dependency plait declares (and of theirs), for the target Python version and platform — except
torch, triton and the `nvidia-*` CUDA packages, which a GPU node brings matched to its driver and
which plait must not replace. `--assume-present` leaves out more names (say, packages the node's
image is known to hold) to keep the wheelhouse small; pip on the node still checks their versions.

On the node (no index), pip keeps every installed package that satisfies plait's requirements and
takes the rest from the wheelhouse:

    python -m pip install --no-index --find-links wheelhouse plait

pip only matches a manylinux tag exactly, so `--platform manylinux_2_N_x86_64` is widened to every
older manylinux tag (2_N down to 2_5, manylinux2014/2010/1): a node with glibc 2.N runs them all.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# The GPU node's own stack: its torch is built for its CUDA, triton for its torch, and the CUDA
# libraries for its driver. A wheelhouse copy of any of them would replace the node's.
NODE_OWNED = ("torch", "triton", "nvidia-*")
# ...but NVML's bindings are pure Python, tied to no CUDA version, and what plait's GPU collector
# imports: a node without them gets them.
ALWAYS_KEPT = ("nvidia-ml-py",)
_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them (`Grpcio_Tools` == `grpcio-tools`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_left_out(name: str, patterns: Iterable[str]) -> bool:
    """Whether distribution `name` matches one of `patterns` (a trailing `*`: any suffix)."""
    name = normalized(name)
    for pattern in patterns:
        pattern = normalized(pattern)
        if name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])):
            return True
    return False


def node_owns(name: str) -> bool:
    return is_left_out(name, NODE_OWNED) and normalized(name) not in ALWAYS_KEPT


def platform_tags(platform: str) -> list[str]:
    """`manylinux_2_28_x86_64` → itself and every older manylinux tag for that architecture."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    glibc_minor, arch = int(match.group(1)), match.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc_minor, 4, -1)]
    tags += [
        f"{legacy}_{arch}" for minor, legacy in _LEGACY_MANYLINUX.items() if minor <= glibc_minor
    ]
    return tags


def wheel_requirements(wheel: Path, extras: Sequence[str]) -> list[str]:
    """The wheel's `Requires-Dist` lines that apply with `extras` (markers other than `extra ==`
    are kept for pip to evaluate for the target)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(metadata_name).decode()
    requirements = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].strip()
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", requirement)
        if extra and extra.group(1) not in extras:
            continue
        if extra:  # the marker is only `extra == "…"` for plait's own extras
            requirement = requirement.split(";", 1)[0].strip()
        requirements.append(requirement)
    return requirements


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0]


def wheel_distribution(wheel: Path) -> str:
    """`grpcio_health_checking-1.85.1-py3-none-any.whl` → `grpcio-health-checking`."""
    return normalized(wheel.name.split("-", 1)[0])


def build_plait_wheel(out: Path) -> Path:
    """plait's wheel from this checkout (no build isolation: the build backend is already here).

    setuptools stages files in `build/` and never removes one whose source is gone, so a stale
    `build/` would ship deleted modules: it is cleared first, and after."""
    staging = REPO_ROOT / "build"
    shutil.rmtree(staging, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="plait-wheel-") as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
             "--no-build-isolation", "--wheel-dir", scratch, str(REPO_ROOT)],
            check=True,
        )  # fmt: skip
        shutil.rmtree(staging, ignore_errors=True)
        (built,) = Path(scratch).glob("plait-*.whl")
        for stale in out.glob("plait-*.whl"):
            stale.unlink()
        return Path(built.replace(out / built.name))


def download_dependencies(
    requirements: Sequence[str], out: Path, *, python: str, platform: str
) -> None:
    """Wheels of `requirements` and everything they need, resolved for the target node."""
    if not requirements:
        return
    platforms = [arg for tag in platform_tags(platform) for arg in ("--platform", tag)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
         "--python-version", python, "--implementation", "cp", *platforms,
         "--dest", str(out), *requirements],
        check=True,
    )  # fmt: skip


def build(
    out: Path,
    *,
    python: str = "3.12",
    platform: str = "manylinux_2_28_x86_64",
    extras: Sequence[str] = (),
    assume_present: Sequence[str] = (),
) -> list[Path]:
    if not (REPO_ROOT / "pyproject.toml").is_file():
        raise SystemExit(f"{REPO_ROOT} is no plait checkout: build the wheelhouse from one")
    out.mkdir(parents=True, exist_ok=True)

    def left_out(name: str) -> bool:
        return node_owns(name) or is_left_out(name, assume_present)

    plait_wheel = build_plait_wheel(out)
    requirements = [
        r for r in wheel_requirements(plait_wheel, extras) if not left_out(requirement_name(r))
    ]
    download_dependencies(requirements, out, python=python, platform=platform)
    # Transitive dependencies are resolved too; drop any that the node owns or already has.
    for wheel in out.glob("*.whl"):
        if wheel != plait_wheel and left_out(wheel_distribution(wheel)):
            wheel.unlink()
    return sorted(out.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "wheelhouse")
    parser.add_argument("--python", default="3.12", help="the node's Python version (X.Y)")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64", help="the node's wheel tag")
    parser.add_argument(
        "--extra", action="append", default=[], help="plait extras to include (e.g. hf)"
    )
    parser.add_argument(
        "--assume-present",
        action="append",
        default=[],
        metavar="NAME",
        help="leave out this distribution too (a trailing * matches a prefix); repeatable",
    )
    args = parser.parse_args(argv)
    wheels = build(
        args.out,
        python=args.python,
        platform=args.platform,
        extras=args.extra,
        assume_present=args.assume_present,
    )
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.out}")
    for wheel in wheels:
        print(f"  {wheel.name}")
    print(f"on the node: python -m pip install --no-index --find-links {args.out} plait")
    return 0


if __name__ == "__main__":
    sys.exit(main())
