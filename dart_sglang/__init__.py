"""DART as an SGLang speculative algorithm: `--speculative-algorithm DART --speculative-draft-model-path HEAD_DIR`.

Installing dart-spec registers the plugin (entry point group `sglang.srt.plugins`); SGLang loads it in every
process. Import-light: SGLang is imported only by `register()` and the worker/model modules.
"""

from .settings import DartServeSettings, SGLANG_ARCHITECTURE

__all__ = ["DartServeSettings", "SGLANG_ARCHITECTURE", "register"]


def register() -> None:
    from .plugin import register as _register

    _register()
