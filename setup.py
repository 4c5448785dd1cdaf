"""tokenq's package list, discovered rather than written down.

The three top-level folders install as ``tokenq.<folder>`` (the
``package-dir`` table in pyproject.toml). setuptools' ``packages.find`` in
pyproject.toml names what it finds after the folders (``producer.ops``), not
after where they install (``tokenq.producer.ops``), and has no prefix
option; so the discovery lives here, and every other setting stays in
pyproject.toml. A subpackage added under one of the folders is in the wheel
without anyone listing it (tests/project/test_wheel.py builds one and checks).
"""

from setuptools import find_packages, setup

ROOTS = ("producer", "worker", "shared")
"""The folders that install as ``tokenq.<folder>``; pyproject.toml maps each one."""


def packages() -> list[str]:
    """Every regular package under the roots, named where it installs."""
    found = find_packages(where=".", include=[f"{root}{tail}" for root in ROOTS
                                              for tail in ("", ".*")])
    return sorted(f"tokenq.{name}" for name in found)


setup(packages=packages())
