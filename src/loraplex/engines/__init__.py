"""Engines besides the native one (loraplex.engine), behind the same interface."""
