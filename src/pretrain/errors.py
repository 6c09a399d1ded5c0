"""The base of the project's own errors: a mistake in what was asked (a key, a value, a
path, a missing package) whose message names the key and the fix.

Every entry point (train.py, each ``pretrain-*`` tool) prints one of these as one line on
stderr and exits 2 (``pretrain.tools.cli_errors``); any other exception is a bug and keeps
its traceback. Each wing keeps its own error type (``ConfigError``, ``DataError``, ...) and
adds this class to its bases, so the entry points need not know them all. The bottom of the
layer contract: it imports nothing.
"""

EXIT_USAGE = 2  # as argparse and Hydra's own command-line mistakes


class UserError(Exception):
    """A mistake the user fixes; its message says which key and how."""

    def lines(self) -> list[str]:
        """The message as lines, one per mistake (a subclass listing several problems
        overrides this); whitespace, newlines included, folds to single spaces."""
        return [" ".join(str(self).split())]
