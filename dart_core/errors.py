"""The error type of input this project cannot use (docs/DESIGN.md §1.1, "Errors")."""


class DartInputError(ValueError):
    """Input that fails a check: a config or its settings, a file's format or contents, a head that does not fit its
    target, a destination that would overwrite a source, an argument of a command.

    A ValueError, so library callers catch it as before. `dart-spec` reports exactly these (and OSError, the file
    system's answer about a path) as one line and exit status 2; any other exception, a plain ValueError included,
    is a bug and shows its traceback.
    """
