"""Operator tools run as ``python -m pdd.tools.<name>`` (no torch, no server dependencies)."""
