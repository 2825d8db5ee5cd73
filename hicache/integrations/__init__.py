"""Adapters that let inference engines load hicache.

Each engine lives in its own module or package here (``sglang``, ``vllm``) and imports the
engine lazily, only there: importing :mod:`hicache` or any core module never imports an engine,
and an engine that is not installed costs nothing until its adapter is used.
"""
