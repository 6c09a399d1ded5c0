"""The one error type of data preparation: a problem the user fixes (its message says how)."""


class DataError(ValueError):
    pass
