"""Build hook for the two C extensions; all other metadata is in pyproject.toml.

Both are optional: where one cannot be compiled, installation still succeeds and hicache does
the same work in Python.

* ``hicache.memory._spancopy``: the CPU copy engine's span copier, with streaming stores
  (without it the engine copies with numpy and torch: the same bytes, slower on scattered pages).
* ``hicache.prefix_cache._pagehash``: chained sha256 page keys, many pages per call, with
  OpenSSL's ``SHA256`` (needs OpenSSL's headers; without them the keys are hashed page by page
  with ``hashlib``: the same keys, about 3x slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("hicache.memory._spancopy", ["hicache/memory/_spancopy.c"], optional=True),
        Extension(
            "hicache.prefix_cache._pagehash", ["hicache/prefix_cache/_pagehash.c"], libraries=["crypto"], optional=True
        ),
    ]
)
