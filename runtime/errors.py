"""One error type for everything a user can get wrong: the CLI prints it as one line."""


class DFlashError(Exception):
    """A problem with the user's input or artifact; message says what and what to do."""
