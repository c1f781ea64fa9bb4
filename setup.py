from setuptools import find_packages, setup

# Versions are pinned once, in requirements.txt; a cluster brings its own torch and
# megatron-core, so the package itself does not force them.
setup(
    name="megatron-pp-ext",
    version="0.1.0",
    description="Pipeline-parallel schedules for Megatron-Core: a drop-in forward_backward_func, "
    "a validator, a cost-model simulator, timelines and a schedule selector",
    packages=find_packages(include=["megatron_pp_ext", "megatron_pp_ext.*"]),
    python_requires=">=3.12",
    entry_points={"console_scripts": ["megatron-pp-ext=megatron_pp_ext.cli:main"]},
)
