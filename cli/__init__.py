"""pdserve.cli: the top floor. The ``pdserve`` commands (serve, demo, status, drain, bench,
plan), their flags, pre-flight checks and demos; the only package that may import
``pdserve.bench``."""
