"""The report's two kinds of failure, each with its exit code (``cli.main``)."""


class DoesNotFit(Exception):
    """The layout cannot hold the model: exit code 2."""


class ReportError(Exception):
    """A usage or environment error with a message for the user: exit code 1."""
