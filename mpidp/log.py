"""The library's rank-prefixed logger: mpidp logs, it never prints."""

import logging
import socket

_LEVELS = {
    "trace": 5,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
}

logger = logging.getLogger("mpidp")
_handler = None


class _RankFilter(logging.Filter):
    def __init__(self):
        super().__init__()
        self.prefix = "[mpidp]"

    def filter(self, record):
        record.mpidp_prefix = self.prefix
        return True


_filter = _RankFilter()


def configure(rank: int, size: int, level: str) -> None:
    """Prefix every record with rank/size and host; install a stderr handler once.

    The handler is ours only if the application has not configured the "mpidp" logger itself.
    """
    global _handler
    _filter.prefix = f"[mpidp {rank}/{size} {socket.gethostname()}]"
    logger.setLevel(_LEVELS[level])
    if _handler is None and not logger.handlers:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(mpidp_prefix)s %(levelname)s: %(message)s"))
        _handler.addFilter(_filter)
        logger.addHandler(_handler)
        logger.propagate = False
