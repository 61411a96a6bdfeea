"""The one error type of the command line's own checks."""

from dart_core.errors import DartInputError


class UsageError(DartInputError):
    """Bad command-line input: `dart-spec` reports it as one line and exit status 2."""
