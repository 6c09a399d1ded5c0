"""The one error type of data preparation: a problem the user fixes (its message says how)."""

from pretrain.errors import UserError


class DataError(UserError, ValueError):
    pass
