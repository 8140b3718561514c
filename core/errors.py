"""User-facing errors: one clear line naming the field or host and the fix (exit code 2)."""


class TrimlabError(Exception):
    """Base of every error the user can fix; the CLI prints it as one line, no traceback."""

    exit_code = 2


class SpecError(TrimlabError):
    """An experiment spec, profile or CLI option is invalid."""


class CodecError(TrimlabError):
    """A codec was asked for something it cannot do (unknown name, bad parameter, layout)."""


class WireError(TrimlabError):
    """A packet cannot be parsed: too short, wrong magic/version, inconsistent fields."""
