"""The one error type users see."""


class JaxragError(Exception):
    """A user-facing error: one clear message naming the file/field and what is wrong."""
