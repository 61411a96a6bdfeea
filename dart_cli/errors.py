"""The one error type of the command line's own checks."""


class UsageError(ValueError):
    """Bad command-line input: `dart-spec` reports it as one line and exit status 2."""
