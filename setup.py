"""Packages are found, not listed: every folder below a room installs as `quant_serve.<path>` (a new sub-package or
data folder needs no edit here; package-data in pyproject.toml says which data files ship). Everything else about
the package is in pyproject.toml."""
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
ROOMS = ("engine", "kernels", "quant", "server", "eval")   # the design card's top-level folders that install


def room_packages() -> list[str]:
    folders = [ROOT / room for room in ROOMS] + [p for room in ROOMS for p in (ROOT / room).rglob("*") if p.is_dir()]
    parts = [f.relative_to(ROOT).parts for f in folders]
    return sorted(".".join(("quant_serve", *p)) for p in parts             # no caches, no hidden or dashed folders
                  if "__pycache__" not in p and all(part.isidentifier() for part in p))


setup(packages=room_packages())
