"""Will the GPU check's wheel folder travel, and install on the GPU machine?

The device tool sends the working tree (tracked files, untracked ones git does not
ignore, and ``shared/``) plus the paths named in its ``carry``: at most 64 MiB in all.
The GPU machine runs CPython 3.12 on x86-64 Linux, so every wheel must be pure Python
(``py3-none-any``) or built for ``cp312`` (or the stable ABI) on ``manylinux*_x86_64``.

    python benchmarks/wheel_folder.py .gpu_wheels [--json out.json]     # exit 1 if not
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2 ** 20
PYTHON_TAG = "cp312"
_SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis",
              ".import_linter_cache", ".gpu_wheels"}


def wheel_tag_ok(filename: str, python: str = PYTHON_TAG) -> bool:
    """Whether a wheel named ``filename`` installs on CPython ``python``, x86-64 Linux."""
    parts = filename[:-len(".whl")].split("-") if filename.endswith(".whl") else []
    if len(parts) < 5:
        return False
    pythons, abis, platforms = (set(p.split(".")) for p in parts[-3:])  # py2.py3: both
    python_ok = bool(pythons & {"py3", python}) or "abi3" in abis
    abi_ok = bool(abis & {"none", "abi3", python})
    platform_ok = "any" in platforms or any(
        p.startswith("manylinux") and p.endswith("_x86_64") for p in platforms)
    return python_ok and abi_ok and platform_ok


def _git_files(root: Path) -> list[Path] | None:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [root / name for name in out.decode().split("\0") if name]


def _walk(folder: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files += [Path(dirpath, f) for f in filenames]
    return files


def tree_files(root: Path = ROOT) -> list[Path]:
    """What travels without being carried: the files git would not ignore, and shared/."""
    files = _git_files(root)
    if files is None:  # not a git checkout: everything but caches and environments
        files = _walk(root)
    if (root / "shared").is_dir():
        files += _walk(root / "shared")
    return list(dict.fromkeys(f for f in files if f.is_file()))


def check(folder: Path, root: Path = ROOT) -> dict:
    """Sizes and tags of ``folder``'s wheels and the tree they travel with."""
    folder = folder.resolve()
    wheels = sorted(folder.glob("*.whl"))
    tree = [f for f in tree_files(root) if folder not in f.resolve().parents]
    folder_bytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    tree_bytes = sum(f.stat().st_size for f in tree)
    rows = [{"wheel": w.name, "bytes": w.stat().st_size, "tag_ok": wheel_tag_ok(w.name)}
            for w in wheels]
    total = folder_bytes + tree_bytes
    return {"folder": str(folder), "wheels": rows, "folder_bytes": folder_bytes,
            "tree_bytes": tree_bytes, "total_bytes": total, "limit_bytes": LIMIT_BYTES,
            "ok": bool(wheels) and all(r["tag_ok"] for r in rows) and total < LIMIT_BYTES}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    result = check(args.folder)
    for row in result["wheels"]:
        print(f"{row['wheel']:60s} {row['bytes'] / 2 ** 10:9.1f} KiB  "
              f"{'ok' if row['tag_ok'] else 'WRONG TAG (not cp312 / x86-64 Linux)'}")
    mib = {k: round(result[k] / 2 ** 20, 2) for k in ("folder_bytes", "tree_bytes",
                                                       "total_bytes", "limit_bytes")}
    print(f"wheels {mib['folder_bytes']} MiB + tree {mib['tree_bytes']} MiB = "
          f"{mib['total_bytes']} MiB (limit {mib['limit_bytes']} MiB): "
          f"{'ok' if result['ok'] else 'NOT OK'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
