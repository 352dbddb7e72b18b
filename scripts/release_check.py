"""What a vLLM release changes for the wrapper: the body of ``scripts/vllm-release-check``.

Run with the release's overlay first on ``PYTHONPATH`` (the bash entry does
that); prints four sections:

(a) connector surface: public names of ``KVConnectorBase_V1`` and its
    ``Supports*`` mixins the wrapper neither forwards (with a check in
    ``tests/helpers/connector_surface.py``) nor lists in ``OWN_ANSWERS``;
(b) name-keyed sites: vLLM's decisions by connector name
    (``tests/helpers/name_keyed_scan.py``) against the audit table
    (``kvtail_connector/facade/name_keyed_table.py``): new, moved, removed;
(c) the two vLLM bugs, by behaviour on the release's real Scheduler
    (``scripts/release_bugs.py``);
(d) the scheduler suite (``pytest -m scheduler``) on the overlay, unless
    ``--skip-suite``.

Exit status 1 when (a) or (b) finds something unclassified (or cannot run),
else 0; (c) and (d) are reported, not judged.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _header(title: str) -> None:
    print(f"\n== {title}", flush=True)


def check_surface() -> int:
    """(a): prints the unclassified names; returns how many."""
    from tests.helpers import connector_surface as surface

    names = surface.public_names()
    missing = surface.unclassified()
    print(f"{len(names)} public names; {len(names) - len(missing)} forwarded or own answers")
    for n in missing:
        print(f"  UNCLASSIFIED {n.name} ({n.kind} of {n.owner}): add a forwarding check or an")
        print("    OWN_ANSWERS entry (kvtail_connector/facade/connector.py)")
    if not missing:
        print("  none unclassified")
    return len(missing)


def check_name_keyed(vllm_dir: Path, release: str) -> int:
    """(b): prints the sites against the table; returns how many need the table changed."""
    from kvtail_connector.facade import name_keyed_table as table
    from tests.helpers import name_keyed_scan as scan

    audited = release in table.RELEASES
    base = release if audited else table.RELEASES[-1]
    sites = [
        scan.TableSite(rule.key, site.path, site.line, site.text)
        for rule, site in table.rules_for(base)
    ]
    result = scan.compare(vllm_dir, sites, scan.scan(vllm_dir))
    if audited:
        print(f"vLLM {release} is in the table; {len(result.held)} of {len(sites)} sites hold")
    else:
        print(
            f"vLLM {release} is not in the table: against {base}'s sites, "
            f"{len(result.held)} of {len(sites)} hold at the same line"
        )
    for site, line in result.moved:
        print(f"  MOVED   {site.rule}: {site.path}:{site.line} -> :{line}  {site.text}")
    for site in result.removed:
        print(f"  REMOVED {site.rule}: {site.path}:{site.line}  {site.text}")
    for found in result.new:
        print(f"  NEW     {found.path}:{found.line}: {found.text}")
    if result.clean:
        print("  no new, moved or removed sites")
    findings = len(result.moved) + len(result.removed) + len(result.new)
    if not audited:
        print(f"  TABLE   add {release} to every rule's sites (name_keyed_table.RELEASES)")
        findings += 1
    return findings


def check_bugs() -> None:
    """(c)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import release_bugs

    for finding in release_bugs.run_all():
        state = {True: "PRESENT", False: "FIXED", None: "UNKNOWN"}[finding.present]
        print(f"  {state:8}{finding.bug}")
        print(f"          {finding.detail}")


def run_suite() -> int:
    """(d): the scheduler suite on this overlay; returns pytest's exit status."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "scheduler"]
    done = subprocess.run(
        [*command, "tests"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    lines = done.stdout.splitlines()
    for line in lines:
        if line.startswith(("FAILED", "ERROR")):
            print(f"  {line}")
    print(f"  {lines[-1] if lines else done.stderr.strip()[-500:]} (exit {done.returncode})")
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overlay", type=Path, required=True, help="the release's overlay dir")
    parser.add_argument("--skip-suite", action="store_true", help="skip (d), the slow part")
    args = parser.parse_args(argv)

    import vllm

    vllm_dir = Path(vllm.__file__).resolve().parent
    if not vllm_dir.is_relative_to(args.overlay.resolve()):
        print(f"error: vllm imports from {vllm_dir}, not the overlay {args.overlay}")
        return 2
    release = ".".join(vllm.__version__.split(".")[:2])
    print(f"vLLM {vllm.__version__} from {vllm_dir}")
    started = time.monotonic()

    unclassified = 0
    for title, check in (
        ("(a) connector surface", check_surface),
        ("(b) name-keyed sites", lambda: check_name_keyed(vllm_dir, release)),
    ):
        _header(title)
        try:
            unclassified += check()
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a finding
            print(f"  ERROR   could not run: {type(exc).__name__}: {exc}")
            unclassified += 1
    _header("(c) the two vLLM bugs")
    check_bugs()
    _header("(d) scheduler suite")
    suite = None if args.skip_suite else run_suite()
    if suite is None:
        print("  skipped (--skip-suite)")

    _header("summary")
    print(f"  {unclassified} unclassified in (a) and (b); ", end="")
    print("suite skipped" if suite is None else f"suite exit {suite}", end="")
    print(f"; {time.monotonic() - started:.0f}s")
    return 1 if unclassified else 0


if __name__ == "__main__":
    sys.exit(main())
