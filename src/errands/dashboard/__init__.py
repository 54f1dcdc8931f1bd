"""The errands web dashboard: queues, jobs, the dead-letter queue, workers and the audit log.

Server-rendered (Starlette and Jinja2, every value escaped), with htmx shipped inside the
package for live refresh: no build step and no CDN. Needs the ``dashboard`` extra::

    pip install 'errands[dashboard]'
    errands dashboard shop.jobs:app            # http://127.0.0.1:8080

or mount :func:`create_app` in your own ASGI application. See docs/dashboard.md.
"""

from __future__ import annotations

from importlib.util import find_spec

from ..errors import ConfigurationError

_missing = [m for m in ("starlette", "jinja2", "itsdangerous", "multipart") if find_spec(m) is None]
if _missing:  # pragma: no cover - exercised only without the extra
    raise ConfigurationError(
        f"the dashboard needs {', '.join(_missing)}: pip install 'errands[dashboard]'"
    )

from .app import create_app  # noqa: E402
from .security import ACTIONS, Access, Identity, header_user  # noqa: E402

__all__ = ["ACTIONS", "Access", "Identity", "create_app", "header_user"]
