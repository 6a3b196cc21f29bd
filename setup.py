"""Packaging beyond what pyproject.toml can say statically: the Hydra configs ship inside the package.

The project keeps its configs in the top-level conf/ (Hydra groups: model/, parallel/, ...). An
installed package has no such folder beside it, so conf/ is installed as the package `launch.conf`
(launch/config.py looks for conf/ beside launch/ first, then launch/conf/). Every group folder is a
package of YAML files; listing them here, from the tree, means a new group needs no edit.
"""

from pathlib import Path

from setuptools import find_packages, setup

groups = sorted(str(d.relative_to("conf")).replace("/", ".") for d in Path("conf").rglob("*") if d.is_dir())
conf_packages = ["launch.conf", *(f"launch.conf.{g}" for g in groups)]

setup(
    packages=[*find_packages(include=["parallel", "parallel.*", "launch", "launch.*"]), *conf_packages],
    package_dir={"launch.conf": "conf"},
    package_data={"launch": ["*.sh", "slurm/*"], **{name: ["*.yaml"] for name in conf_packages}},
)
