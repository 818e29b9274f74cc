"""The built-in reference tensor-parallel engine (``python -m tp_supervise.engine``); see docs/engine.md.

Importing the package is cheap and torch-free: torch loads only when a rank
starts serving (engine/app.py), so argument errors exit in milliseconds.
"""
