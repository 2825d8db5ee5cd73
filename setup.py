"""Build hook for the one C extension; all other metadata is in pyproject.toml.

``hicache.memory._spancopy`` (the CPU copy engine's span copier, with streaming stores) is
optional: where it cannot be compiled, installation still succeeds and the engine copies with
numpy and torch instead (the same bytes, slower on scattered pages).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("hicache.memory._spancopy", ["hicache/memory/_spancopy.c"], optional=True),
    ]
)
