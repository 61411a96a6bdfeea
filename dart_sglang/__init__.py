"""DART as an SGLang speculative algorithm: `--speculative-algorithm DART --speculative-draft-model-path HEAD_DIR`.

Installing dart-spec registers the plugin (entry point group `sglang.srt.plugins`); SGLang loads it in every
process. Import-light: SGLang is imported only by `register()` and the worker/model modules; the head directory's
format (`head_format`: architecture name, `dart_config` block, `convert_sglang`) and the serving settings
(`settings`) import none.
"""

from .head_format import SGLANG_ARCHITECTURE, convert_sglang, read_sglang_dir
from .settings import DartServeSettings

__all__ = ["DartServeSettings", "SGLANG_ARCHITECTURE", "convert_sglang", "read_sglang_dir", "register"]


def register() -> None:
    from .plugin import register as _register

    _register()
