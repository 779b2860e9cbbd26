"""The kit's wheels: what is carried to the GPU machine and whether it is complete.

The device machine has no network: every package dsforge needs that its image lacks travels as
a wheel in benchmarks/gpu/wheels/ (built by build_kit.sh, gitignored). This module checks,
without installing anything:
  - the pins of requirements.txt against setup.cfg (deepspeed and megatron-core exactly, and
    dsforge's `gpu` extra, liger-kernel, within its range: the kit installs what a user's
    `pip install 'dsforge[gpu]'` would);
  - that the folder holds exactly the expected wheels (name, version, a tag Python 3.12 on
    x86-64 Linux accepts), one of each;
  - that every requirement of every carried wheel is met by a carried wheel or by the GPU
    image's packages (IMAGE_PACKAGES), for Python 3.12 on Linux;
  - the bytes that travel: the working tree plus the wheels, against the device tool's 64 MiB;
  - (dry run with --imports) that every distribution dsforge's runtime imports is carried or
    in the image;
  - where a Python 3.12 is found here, pip's own resolver: `pip install --dry-run --no-index`
    of dsforge from the folder into a throwaway 3.12 venv whose image packages are stand-ins
    (metadata only), as run.sh's install does on the GPU machine.
A missing folder is reported as 'not built', not as a failure: CI never builds the kit.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

KIT = Path(__file__).resolve().parent
REPO = KIT.parents[1]
WHEELS = KIT / "wheels"
REQUIREMENTS = KIT / "requirements.txt"
MiB = 1024**2
TREE_LIMIT_BYTES = 64 * MiB  # the device tool's limit: working tree + carried paths

# The GPU image's Python packages as the device tool's documentation of its machine kinds
# listed them (read on a machine running the image, 2026-11-17). Only a few versions were
# listed (IMAGE_VERSIONS); for the others any version is assumed to satisfy a requirement,
# and run.sh's pip install is the final word.
IMAGE_PACKAGES = frozenset(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp
""".split())
IMAGE_VERSIONS = {"torch": "2.11.0", "numpy": "2.5.2", "triton": "3.6.0", "transformers": "5.17.0",
                  "tokenizers": "0.23.2", "safetensors": "0.8.0", "accelerate": "1.15.0"}

# The GPU machine's python3: CPython 3.12 on x86-64 Linux. build_kit.sh asks pip for wheels
# of glibc 2.28 or older, which any current distribution runs.
TARGET_PYTHON = (3, 12)
TARGET_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


@dataclass(frozen=True)
class Pin:
    name: str  # canonical (PEP 503) name
    version: str
    why: str


@dataclass
class WheelReport:
    state: str  # "not built" | "complete" | "incomplete"
    wheels: list[tuple[str, int]] = field(default_factory=list)  # (file name, bytes)
    problems: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.wheels)


def read_pins(path: Path = REQUIREMENTS) -> list[Pin]:
    """`name==version  # why` lines; anything else (besides comments) is an error."""
    pins = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text, _, why = line.partition("#")
        if not text.strip():
            continue
        name, sep, version = text.strip().partition("==")
        if not sep or not name or not version or " " in version:
            raise ValueError(f"{path}:{number}: expected 'name==version', got {line!r}")
        pins.append(Pin(canonicalize_name(name), version.strip(), why.strip()))
    return pins


GPU_EXTRA = "gpu"  # setup.cfg's extra a GPU install adds (liger-kernel)


def setup_requirements(path: Path = REPO / "setup.cfg") -> dict[str, Requirement]:
    """dsforge's install_requires by canonical name."""
    parser = configparser.ConfigParser()
    parser.read(path)
    return _requirements(parser["options"]["install_requires"])


def extra_requirements(extra: str = GPU_EXTRA, path: Path = REPO / "setup.cfg") -> dict[str, Requirement]:
    """One extra's requirements by canonical name."""
    parser = configparser.ConfigParser()
    parser.read(path)
    return _requirements(parser["options.extras_require"][extra])


def _requirements(text: str) -> dict[str, Requirement]:
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    requirements = (Requirement(line) for line in lines if line)
    return {canonicalize_name(r.name): r for r in requirements}


def dsforge_version(path: Path = REPO / "dsforge" / "__init__.py") -> str:
    for line in path.read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise ValueError(f"{path}: no __version__")


def pin_problems(pins: list[Pin], setup: dict[str, Requirement],
                 gpu_extra: dict[str, Requirement] | None = None) -> list[str]:
    """Every exact pin of setup.cfg must be carried at that version; every requirement of
    setup.cfg must be carried or in the image; every requirement of the GPU extra must be
    carried at a version it accepts (the image has none of them); a name may be pinned once."""
    problems = []
    carried = {p.name: p.version for p in pins}
    for name, requirement in (gpu_extra or {}).items():
        version = carried.get(name)
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"dsforge[{GPU_EXTRA}] needs {requirement} but the kit carries "
                            f"{name}=={version or '(nothing)'}")
    carried = {p.name: p.version for p in pins}
    if len(carried) != len(pins):
        problems.append("requirements.txt pins a package twice")
    for name, requirement in setup.items():
        exact = [s.version for s in requirement.specifier if s.operator == "=="]
        if exact and carried.get(name) != exact[0]:
            problems.append(f"setup.cfg pins {name}=={exact[0]} but the kit carries "
                            f"{name}=={carried.get(name, '(nothing)')}")
        elif not exact and name not in carried and name not in IMAGE_PACKAGES:
            problems.append(f"setup.cfg needs {requirement}, which is neither carried nor in "
                            "the GPU image")
    return problems


def expected_wheels(pins: list[Pin], version: str | None = None) -> dict[str, str]:
    """Canonical name -> version of every wheel the folder must hold (dsforge's own too)."""
    return {**{p.name: p.version for p in pins}, "dsforge": version or dsforge_version()}


def supported_tags() -> frozenset[Tag]:
    cpython = cpython_tags(TARGET_PYTHON, abis=["cp312"], platforms=list(TARGET_PLATFORMS))
    generic = compatible_tags(TARGET_PYTHON, interpreter="cp312", platforms=list(TARGET_PLATFORMS))
    return frozenset([*cpython, *generic])


def check_wheels(folder: Path, expected: dict[str, str]) -> WheelReport:
    """Does `folder` hold exactly one wheel of each expected name and version, installable
    on the GPU machine's Python?"""
    files = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not files:
        return WheelReport("not built", problems=[f"{_shown(folder)} has no wheels: run "
                                                  "bash benchmarks/gpu/build_kit.sh"])
    report = WheelReport("complete", wheels=[(f.name, f.stat().st_size) for f in files])
    found: dict[str, list[str]] = {}
    tags = supported_tags()
    for path in files:
        try:
            name, version, _, wheel_tags = parse_wheel_filename(path.name)
        except InvalidWheelFilename as exc:
            report.problems.append(f"{path.name}: not a wheel name ({exc})")
            continue
        found.setdefault(name, []).append(str(version))
        if not wheel_tags & tags:
            report.problems.append(f"{path.name}: not installable on CPython 3.12, x86-64 Linux")
    report.problems += _inventory_problems(found, expected)
    report.state = "incomplete" if report.problems else "complete"
    return report


def _inventory_problems(found: dict[str, list[str]], expected: dict[str, str]) -> list[str]:
    problems = []
    for name, versions in sorted(found.items()):
        if name not in expected:
            problems.append(f"{name} {', '.join(versions)}: not in requirements.txt (remove it)")
        elif len(versions) > 1:
            problems.append(f"{name}: {len(versions)} versions ({', '.join(versions)}); keep one")
        elif Version(versions[0]) != Version(expected[name]):
            problems.append(f"{name}: {versions[0]} in the folder, {expected[name]} expected")
    problems += [f"{name}=={version}: missing" for name, version in sorted(expected.items())
                 if name not in found]
    return problems


def wheel_requirements(path: Path) -> list[Requirement]:
    """Requires-Dist of a wheel that apply on the target without extras."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(metadata).decode())
    environment = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
                   "sys_platform": "linux", "platform_system": "Linux",
                   "platform_machine": "x86_64", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    requirements = (Requirement(line) for line in message.get_all("Requires-Dist") or [])
    return [r for r in requirements if r.marker is None or r.marker.evaluate(environment)]


def requirement_problems(folder: Path) -> list[str]:
    """Every requirement of every carried wheel, met by a carried wheel (in its specifier) or
    by the image (in its specifier where the image's version is known)."""
    carried = {}
    for path in folder.glob("*.whl"):
        try:
            name, version, _, _ = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            continue
        carried[name] = (version, path)
    problems = []
    for name, (_, path) in sorted(carried.items()):
        try:
            needs = wheel_requirements(path)
        except (OSError, zipfile.BadZipFile, StopIteration, InvalidRequirement) as exc:
            problems.append(f"{path.name}: cannot read its requirements ({exc})")
            continue
        problems += [f"{name} needs {r}: {why}" for r in needs
                     if (why := _unmet(r, carried)) is not None]
    return problems


def _unmet(requirement: Requirement, carried: dict) -> str | None:
    name = canonicalize_name(requirement.name)
    if name in carried:
        version = carried[name][0]
        return None if requirement.specifier.contains(version, prereleases=True) else \
            f"the kit carries {version}"
    if name in IMAGE_PACKAGES:
        known = IMAGE_VERSIONS.get(name)
        if known is None or requirement.specifier.contains(Version(known), prereleases=True):
            return None
        return f"the image has {known}"
    return "neither carried nor in the GPU image"


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of the working tree the device tool sends: tracked and untracked-not-ignored
    files (the ignored wheels folder travels only as a carried path)."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum(p.stat().st_size for name in listed if name and (p := repo / name).is_file())


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def folder_bytes(folder: Path) -> int:
    """Everything the carried folder holds: the wheels, the corpus, an op-build cache."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def wheel_lines(report: WheelReport, pins: list[Pin], tree: int | None,
                carried: int | None = None) -> list[str]:
    """The wheels section of the dry run, as lines; `carried`: the whole folder's bytes."""
    carried = report.bytes if carried is None else carried
    lines = [f"wheels ({_shown(WHEELS)}): {report.state}"]
    for name, size in report.wheels:
        lines.append(f"  {size / MiB:6.2f} MiB  {name}")
    if report.wheels:
        lines.append(f"  {report.bytes / MiB:6.2f} MiB  total")
    if tree is not None:
        total = tree + carried
        lines.append(f"  travels: working tree {tree / MiB:.2f} MiB + the carried folder "
                     f"{carried / MiB:.2f}"
                     f" MiB = {total / MiB:.2f} MiB of the device tool's {TREE_LIMIT_BYTES // MiB} MiB"
                     + ("" if total <= TREE_LIMIT_BYTES else "  (OVER THE LIMIT)"))
    lines += [f"  {p}" for p in report.problems]
    lines.append("  carried: " + ", ".join(f"{p.name}=={p.version}" for p in pins) + ", dsforge")
    return lines


# The image's packages whose versions are unknown stand in at a version that meets any lower
# bound; the two the kit carries in case the image's are too old stand in as old ones, so the
# resolver must take the carried wheels.
STAND_IN_VERSION = "1000.0"
OLD_STAND_INS = {"packaging": "23.2", "typing-extensions": "4.12.2"}


def find_python312() -> str | None:
    """A CPython 3.12 here ($KIT_PYTHON312, python3.12 on the PATH, or pyenv's), or None."""
    candidates = [os.environ.get("KIT_PYTHON312"), shutil.which("python3.12"),
                  *sorted(str(p) for p in (Path.home() / ".pyenv" / "versions").glob("3.12*/bin/python3.12"))]
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "--version"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.startswith("Python 3.12"):
            return candidate
    return None


def _stand_in(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("stand-in\n")
    (info / "RECORD").write_text("")


def resolve_install(folder: Path, requirements: list[str], python312: str) -> tuple[bool, str]:
    """pip's resolver on the install run.sh does, in a throwaway Python 3.12 venv with the
    image's packages as stand-ins; (ok, pip's last lines)."""
    with tempfile.TemporaryDirectory(prefix="dsforge-kit-venv-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python312, "-m", "venv", str(venv)], check=True, capture_output=True)
        site = next((venv / "lib").glob("python3.12/site-packages"))
        for name in sorted(IMAGE_PACKAGES - {"pip", "setuptools"}):
            _stand_in(site, name, OLD_STAND_INS.get(name) or IMAGE_VERSIONS.get(name, STAND_IN_VERSION))
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
        env.pop("PYTHONPATH", None)
        done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--dry-run",
                               "--no-index", "--find-links", str(folder), *requirements],
                              capture_output=True, text=True, env=env)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, "\n".join(lines[-3:])


# What a rank and the dsforge commands import: every distribution they load must be carried or
# in the image. (setuptools' vendored packages show up under their own names.)
RUNTIME_MODULES = ("dsforge.cli", "dsforge.plan", "dsforge.runtime.rank", "dsforge.runtime.assemble.engine",
                   "dsforge.runtime.loop.trainer", "dsforge.bench.report", "deepspeed", "megatron.core",
                   "megatron.core.models.gpt", "megatron.core.pipeline_parallel")
SETUPTOOLS_VENDORED = frozenset({"backports-tarfile", "jaraco-context", "jaraco-functools",
                                 "jaraco-text", "more-itertools", "autocommand", "inflect",
                                 "platformdirs", "tomli", "wheel", "zipp", "importlib-metadata"})
# Imported only where installed (inside try/except ImportError), and absent from the GPU image:
# the child hides them, as the image does, so what they pull in is not counted. Megatron-Core's
# inference context imports wandb (megatron/core/inference/contexts/dynamic_context.py);
# tensorboard's file-system layer imports boto3 and botocore for S3.
OPTIONAL_IMPORTS = ("wandb", "boto3", "botocore")
_IMPORTS = """
import functools, importlib, json, sys
from importlib.metadata import packages_distributions
hidden = set(sys.argv[1].split(","))
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in hidden:
            raise ImportError(f"{name} is hidden (not in the GPU image)")
sys.meta_path.insert(0, Hide())
from importlib.metadata import distribution
before = set(sys.modules)
for name in sys.argv[2:]:
    importlib.import_module(name)
owners = packages_distributions()
@functools.cache
def second_levels(dist):
    return {"/".join(str(f).split("/")[:2]).removesuffix(".py") for f in distribution(dist).files or []}
found = set()
for module in set(sys.modules) - before:
    parts = module.split(".")
    dists = owners.get(parts[0], [])
    if len(dists) > 1:  # a namespace (google): the distribution holding the subpackage
        dists = [d for d in dists if len(parts) > 1 and "/".join(parts[:2]) in second_levels(d)]
    found.update(dists)
print(json.dumps(sorted(found)))
"""


def imported_distributions(modules: tuple[str, ...] = RUNTIME_MODULES,
                           hidden: tuple[str, ...] = OPTIONAL_IMPORTS) -> list[str]:
    """The distributions importing `modules` loads, found by importing them in a child
    Python (with the working tree's dsforge) where the `hidden` packages cannot be found."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", _IMPORTS, ",".join(hidden), *modules],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def import_problems(distributions: list[str], pins: list[Pin]) -> list[str]:
    carried = {p.name for p in pins} | {"dsforge"}
    return [f"dsforge's runtime imports {name}, which is neither carried nor in the GPU image"
            for name in sorted({canonicalize_name(d) for d in distributions})
            if name not in carried | IMAGE_PACKAGES | SETUPTOOLS_VENDORED]
