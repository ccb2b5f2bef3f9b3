"""The plugins' notices, through one logger: ``logging.getLogger("oktopk")``
(the DDP hook, the FSDP2 registration and the Horovod optimizer alike).

Two kinds, and why each level:

* :func:`notice`, WARNING: what a user must see once (an Adam-family
  optimizer keeps the dense allreduce, and what to change instead). With
  logging left unconfigured, Python's last-resort handler prints WARNING
  and above to stderr, so it is seen by default; an application that
  configures logging routes or silences it like any other library's.
* :func:`decisions`, INFO: the measured choice's decisions, which a user
  asks for with ``OKTOPK_DEBUG_AUTO=1`` (chatter otherwise). INFO is below
  the last resort's level, so asking for them also makes them visible:
  unless logging is configured (a handler on the way to the root), the
  logger gets a handler of its own that writes to stderr.
"""

import logging

logger = logging.getLogger("oktopk")


def notice(message):
    """A notice every user should see (WARNING)."""
    logger.warning(message)


def decisions():
    """The logger of the measured choice's decisions (``StepChoice.log``),
    for a rank that OKTOPK_DEBUG_AUTO=1 asked to log them: INFO, shown on
    stderr when the application has not configured logging."""
    if not logger.hasHandlers():
        handler = logging.StreamHandler()  # stderr
        handler.setFormatter(logging.Formatter("%(message)s"))  # the line as it was printed
        logger.addHandler(handler)
    if logger.level == logging.NOTSET and logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)  # asked for by the variable; a level set on this logger is the application's choice
    return logger.info
