"""The error a user can cause (a bad flag, a missing file, a setting this machine cannot run): `LitError`. Its own
module so that every layer can raise it, the storage layer included, which `lit_gpt.utils.run_cli` calls (utils
re-exports it: `from lit_gpt.utils import LitError` stays the usual import)."""


class LitError(Exception):
    """An error caused by the user's input or environment. CLIs print its message on one line and exit 1 (or the
    error's `exit_code`)."""
