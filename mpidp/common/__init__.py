"""Horovod's `horovod.common` package name, for the submodules scripts import from it."""
