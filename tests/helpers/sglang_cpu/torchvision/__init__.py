"""Test-only stand-in: PyPI torchvision cannot load beside the CPU torch build, and SGLang imports it at module
level in multimodal code the DART tests never run. Any attribute is a placeholder that fails when called."""


__version__ = "0.0.0"  # transformers reads it when it finds the module


class _Missing:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, name):
        return _Missing(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision stub: {self._name} is not available in the DART CPU tests")


def __getattr__(name):
    return _Missing(name)
