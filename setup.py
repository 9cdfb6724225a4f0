"""Which packages ship: every package folder (one with ``__init__.py``) under the repository's top folders,
installed as ``stoker.<folder>...``. Everything else about the distribution is in pyproject.toml.

Discovered, never listed: a new sub-package ships without an edit here. A hand-kept list once left out
``stoker.consumer.exact.pool``, and every non-editable install had a trainer that could not import
(tests/house/test_packaging.py builds the wheel and imports every module from it). setuptools' own discovery
(``packages.find``) cannot add the ``stoker.`` prefix, hence this file.
"""

from pathlib import Path

from setuptools import find_packages, setup

#: The repository keeps these at its root; installed they live under the single ``stoker`` namespace (no
#: ``stoker/__init__.py``), so nothing squats a generic top-level name like ``producer``. A new top folder is
#: added here (and to the Dockerfiles' COPY lines).
TOP_FOLDERS = ("protocol", "producer", "consumer", "cli")

ROOT = Path(__file__).resolve().parent


def stoker_packages() -> list[str]:
    """``stoker.<top>`` and every package below it, for each top folder; a top folder without ``__init__.py``
    fails the build at once (it would ship as nothing)."""
    packages = []
    for top in TOP_FOLDERS:
        if not (ROOT / top / "__init__.py").is_file():
            raise SystemExit(f"setup.py: {top}/__init__.py is missing: every top folder in TOP_FOLDERS is a package")
        packages += [f"stoker.{top}", *(f"stoker.{top}.{sub}" for sub in find_packages(str(ROOT / top)))]
    return packages


setup(package_dir={f"stoker.{top}": top for top in TOP_FOLDERS}, packages=stoker_packages())
