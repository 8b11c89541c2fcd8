"""Two kinds of failure, told apart everywhere they surface.

DFlashError: something the user can fix (input, artifact, environment); the CLI prints one
line and exits 2, the server answers 4xx/5xx with the message.
InternalError: a broken invariant, i.e. a bug in dflash-export; the CLI prints
"internal error (please report): ..." and the traceback and exits 3, the server answers 500
with code internal_error.
"""


class DFlashError(Exception):
    """A problem with the user's input or artifact; message says what and what to do."""


class InternalError(Exception):
    """A bug: an invariant of the code does not hold. Not a DFlashError, so nothing reports it as the user's."""
