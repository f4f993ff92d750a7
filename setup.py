"""Installs the repository's top-level folders as one package, `wideep`: the folder `engine/` is
`wideep.engine`, `moe/` is `wideep.moe`, and so on (setuptools' package_dir maps each folder to its dotted
name; an editable install follows the same map). Nothing else of ours lands at the top of site-packages,
so a user's own `engine/` or `launch/` cannot shadow wideep's. The folders are found, not listed, so a
new one cannot be forgotten (tests/test_packaging.py builds the wheel and checks)."""
import os

from setuptools import find_packages, setup

NOT_INSTALLED = {"tests", "bench", "docs", "build", "wideep"}
ROOT = os.path.dirname(os.path.abspath(__file__))

packages, package_dir = ["wideep"], {"wideep": "wideep"}
for top in sorted(os.listdir(ROOT)):
    if top in NOT_INSTALLED or top.startswith(".") or not os.path.isfile(os.path.join(ROOT, top, "__init__.py")):
        continue
    package_dir[f"wideep.{top}"] = top
    packages += [f"wideep.{top}"] + [f"wideep.{top}.{sub}" for sub in find_packages(os.path.join(ROOT, top))]

setup(packages=packages, package_dir=package_dir)
