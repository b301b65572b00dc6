"""A refusal in Forge's console: one line, as the UI shows it; its traceback only at debug level.

A refusal is raised from the pass's first model call (``patching.Refused``), and the console
says it there, once (``Refused.line``). Through the API it then travels up to the web server:
Starlette answers with Forge's handler (HTTP 500 with the message) and raises it again, and
uvicorn logs it on its ``uvicorn.error`` logger with the whole traceback, about 100 lines of
Forge's and the server's frames for a setting the user only has to change. ``QuietRefusals``, a
filter on that logger, drops that record for a refusal and hands its traceback to our own
logger at debug level (Forge's ``--loglevel DEBUG`` shows it); every other error is logged as
before. The UI's own path (Forge's main thread) prints its tracebacks with ``traceback``, not
through a logger: Forge's, not changed here.

Pure Python (logging only): tested without a host.
"""

from __future__ import annotations

import logging

from .patching import Refused

SERVER_LOGGER = "uvicorn.error"  # where uvicorn logs an exception that left the application
LOG = logging.getLogger("tokenreduce")


def _refusal_in(error: BaseException | None) -> Refused | None:
    """The refusal ``error`` is, or holds (an exception group of a middleware, a cause), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, Refused):
            return error
        inner = getattr(error, "exceptions", None)  # an ExceptionGroup
        if inner:
            found = [r for r in map(_refusal_in, inner) if r is not None]
            return found[0] if found else None
        error = error.__cause__ or error.__context__
    return None


class QuietRefusals(logging.Filter):
    """Drops the web server's record of a refusal (already said in one line), its traceback to
    our logger at debug level."""

    def filter(self, record: logging.LogRecord) -> bool:
        refused = _refusal_in(record.exc_info[1]) if record.exc_info else None
        if refused is None:
            return True
        LOG.debug("%s (the web server's record of it)", refused.line(), exc_info=record.exc_info)
        return False


def quiet_refusals() -> None:
    """Install the filter once (the WebUI runs the script again at every Reload UI)."""
    server = logging.getLogger(SERVER_LOGGER)
    if not any(isinstance(f, QuietRefusals) for f in server.filters):
        server.addFilter(QuietRefusals())
