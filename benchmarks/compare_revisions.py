"""Old against new: run benchmarks of two revisions in interleaved rounds and compare their throughputs.

A redesign keeps behaviour and speed; this is how we check the speed. The old revision is checked
out into a git worktree (``--workdir``) and imported from there through a package folder on
``PYTHONPATH`` that puts its ``producer/``, ``consumer/``, ``protocol/`` and ``cli/`` under
``stoker`` (ahead of the editable install, so producer daemons the benchmark starts run the old code
too; the old tree's JPEG crop decoder is built from its own source). Each revision runs its own copy of each
benchmark script. Rounds alternate which revision goes first. Every numeric result whose key ends in
``_per_s`` is compared as new / old: the median over rounds and the spread (min-max) are printed and
written as JSON (default benchmarks/results/compare_revisions.json)::

    python benchmarks/compare_revisions.py --old 560416d --new HEAD --rounds 3
    python benchmarks/compare_revisions.py --old HEAD~3 --bench exact_cost -- --rounds 1

Arguments after ``--`` go to every benchmark (both revisions).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ("trainer_ingest", "exact_cost", "producer_throughput")
PACKAGES = ("producer", "consumer", "protocol", "cli")


def prepare_old(revision: str, workdir: Path) -> tuple[Path, Path]:
    """A worktree of ``revision`` and a folder that imports it as ``stoker``: ``(worktree, pythonpath)``."""
    tree, package_root = workdir / "tree", workdir / "pythonpath"
    workdir.mkdir(parents=True, exist_ok=True)
    if tree.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), revision], cwd=ROOT, check=True,
                   capture_output=True)
    shutil.rmtree(package_root, ignore_errors=True)
    (package_root / "stoker").mkdir(parents=True)
    (package_root / "stoker" / "__init__.py").write_text("")  # a regular package: found ahead of the editable install
    for name in PACKAGES:
        (package_root / "stoker" / name).symlink_to(tree / name)
    if any(tree.glob("producer/**/_jpeg_crop.c")):
        build_decoder(tree)
    return tree, package_root


def build_decoder(tree: Path) -> None:
    """The old tree's crop decoder, built in place from its own source by its own setup (our build flags): the
    extension's interface changed in 6899f6e (bytes, then rows and a view), so ours cannot stand in for it."""
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0 or not any(tree.glob("producer/**/_jpeg_crop*.so")):
        raise SystemExit(f"building the old revision's crop decoder failed (a C compiler and libjpeg's headers are "
                         f"needed):\n{done.stderr[-2000:]}")


def run_one(script: Path, pythonpath: str, out: Path, extra: list[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else dict(os.environ)
    if not pythonpath:
        env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, str(script), "--out", str(out), *extra], env=env, cwd=script.parents[1],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{script} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def throughputs(result: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every numeric leaf whose key ends in ``_per_s``, keyed by its path (list items by their position)."""
    if isinstance(result, dict):
        for key, value in result.items():
            if key == "rounds":
                continue  # a benchmark's own raw rounds: its medians are what it reports
            yield from throughputs(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(result, list):
        for i, value in enumerate(result):
            yield from throughputs(value, f"{prefix}[{i}]")
    elif isinstance(result, (int, float)) and not isinstance(result, bool) and prefix.endswith("_per_s"):
        yield prefix, float(result)


def compare(runs: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for key in sorted(set(runs["old"]) & set(runs["new"])):
        old, new = runs["old"][key], runs["new"][key]
        ratios = [n / o for n, o in zip(new, old) if o > 0]
        if ratios:
            rows.append({"figure": key, "old_median": statistics.median(old), "new_median": statistics.median(new),
                         "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios), "rounds": len(ratios)})
    return rows


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="the old revision (a commit, tag or branch)")
    parser.add_argument("--new", default=None, help="the new revision (default: this working tree as it is)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--bench", default=",".join(BENCHMARKS), help=f"comma-separated (default {','.join(BENCHMARKS)})")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "stoker-compare-revisions"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compare_revisions.json"))
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    workdir = Path(args.workdir)
    tree, old_path = prepare_old(args.old, workdir / "old")
    sides = {"old": (tree / "benchmarks", str(old_path)), "new": (ROOT / "benchmarks", "")}
    if args.new is not None:  # a fixed revision: the working tree may change while this runs
        new_tree, new_path = prepare_old(args.new, workdir / "new")
        sides["new"] = (new_tree / "benchmarks", str(new_path))
    report: dict[str, Any] = {"old": args.old, "new": args.new or "working tree", "rounds": args.rounds,
                              "extra_args": extra, "benchmarks": {}}
    for bench in args.bench.split(","):
        runs: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
        for r in range(args.rounds):
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                folder, pythonpath = sides[side]
                result = run_one(folder / f"{bench}.py", pythonpath, workdir / f"{bench}-{side}-{r}.json", extra)
                for key, value in throughputs(result):
                    runs[side].setdefault(key, []).append(value)
                print(f"{bench} round {r + 1}/{args.rounds} {side}: done", flush=True)
        report["benchmarks"][bench] = compare(runs)
    print(f"\nnew / old, {args.rounds} interleaved rounds (old = {args.old}, new = {report['new']}); median and "
          "spread of per-round ratios")
    print(f"{'benchmark':<20} {'figure':<48} {'old':>10} {'new':>10} {'new/old':>8} {'spread':>13}")
    for bench, rows in report["benchmarks"].items():
        for row in rows:
            print(f"{bench:<20} {row['figure'][:48]:<48} {row['old_median']:>10.1f} {row['new_median']:>10.1f} "
                  f"{row['ratio_median']:>8.3f} {row['ratio_min']:>6.3f}-{row['ratio_max']:<6.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
