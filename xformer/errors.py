"""Errors a user can fix: bad recipes, bad data, runs that would be overwritten.

Anything raised as an `XformerError` is the user's to fix, so the CLI prints its lines
(one per problem, each naming the file, field or line) and exits with code 2, without a
traceback. Every other exception is a bug in xformer.
"""


class XformerError(Exception):
    """A problem with the user's input; `problems` holds one self-contained line each."""

    exit_code = 2

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class RecipeError(XformerError):
    """A recipe (TOML file plus --set overrides) that does not validate."""


class DataError(XformerError):
    """A corpus, file or field that cannot be read as the recipe says."""


class RunError(XformerError):
    """A run directory or checkpoint that is missing, incomplete, or would be overwritten."""


class DivergedError(RunError):
    """Training stopped because the loss or gradients stayed non-finite (train.max_nonfinite_steps);
    the run's last checkpoint holds the weights before those steps."""

    def __init__(self, problems: str | list[str], step: int):
        super().__init__(problems)
        self.step = step
