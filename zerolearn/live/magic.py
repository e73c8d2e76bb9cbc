"""The notebook's default pool of :mod:`zerolearn.live` and the ``%%ranks`` magic on it.

:func:`start`, :func:`current` and :func:`stop` keep one :class:`~zerolearn.live.pool.Ranks`
as the current one, which ``%%ranks`` and ``%ranks`` use; an atexit hook kills every
pool's ranks when the kernel exits.
"""

from __future__ import annotations

import atexit

from zerolearn.errors import ConfigError
from zerolearn.live.pool import _POOLS, Ranks, _validate

_CURRENT: Ranks | None = None


def start(world_size: int, backend: str = "gloo", timeout_s: float = 60.0) -> Ranks:
    """Stop the current ranks, start ``world_size`` new ones and make them current.

    Raises what :class:`Ranks` raises.
    """
    global _CURRENT
    _validate(world_size, backend, timeout_s)  # bad input stops nothing
    stop()
    _CURRENT = Ranks(world_size, backend, timeout_s)
    return _CURRENT


def current() -> Ranks | None:
    """The ranks that ``%%ranks`` uses, or None."""
    return _CURRENT


def stop() -> None:
    """Stop the current ranks, if any."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
    _CURRENT = None


# Registered whenever zerolearn.live is imported (its __init__ imports this module, and
# importing zerolearn.live.pool imports the package first), so pools made with Ranks
# directly are covered too.
@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool._kill()


def _magic(line: str, cell: str | None = None) -> None:
    """``%%ranks [N]``: run the cell on the current ranks, starting N ranks first if none
    run or their number differs. ``%ranks N|status|restart|stop``: start, show, restart
    or stop the current ranks."""
    from IPython.core.error import UsageError

    word = line.strip()
    try:
        if cell is not None:
            pool = _sized(word, "%%ranks") if word else _CURRENT
            if pool is None:
                raise ConfigError("%%ranks: no ranks running; start them with %%ranks N")
        elif word == "status":
            print(_CURRENT if _CURRENT is not None else "no ranks running")
        elif word in ("restart", "stop") and _CURRENT is None:
            raise ConfigError(f"%ranks {word}: no ranks running; start them with %ranks N")
        elif word == "restart":
            _CURRENT.restart()
        elif word == "stop":
            stop()
        else:
            _sized(word, "%ranks")
    except ConfigError as e:
        raise UsageError(str(e)) from None  # IPython shows the message alone, no traceback
    if cell is not None:
        outputs = pool.run(cell)
        if any(outputs):
            print(repr(outputs))


def _sized(word: str, magic: str) -> Ranks:
    """The current ranks if there are ``word`` of them, else ``word`` fresh ones (same backend, timeout)."""
    if not word.isdigit():
        allowed = "N (a number of ranks), status, restart, stop" if magic == "%ranks" else "N (a number of ranks)"
        raise ConfigError(f"{f'{magic} {word}'.strip()}: allowed are {allowed}")
    pool = _CURRENT
    if pool is not None and pool.world_size == int(word):
        return pool
    if pool is not None:
        print(f"(stopping {pool.world_size} ranks and their variables, starting {word})")
    return start(int(word), *((pool.backend, pool.timeout_s) if pool is not None else ()))


def load_ipython_extension(ipython) -> None:
    """``%load_ext zerolearn.live``: registers ``%%ranks`` and ``%ranks``."""
    ipython.register_magic_function(_magic, magic_kind="line_cell", magic_name="ranks")
