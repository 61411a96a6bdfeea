"""Test-only stand-in (see torchvision/__init__.py): every attribute is a placeholder."""

import torchvision

__getattr__ = torchvision.__getattr__
