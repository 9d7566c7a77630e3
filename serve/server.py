"""`kiln serve`: load an artefact and serve it with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kiln.args import ServerArgs

log = logging.getLogger("kiln.serve")


def serve(artefact: str | Path, explicit: dict[str, Any]) -> None:
    """Serve `artefact`; `explicit` are the server arguments the user gave."""
    import uvicorn

    from kiln.runtime.engine import Engine
    from kiln.serve.app import create_app

    args = ServerArgs(**explicit)
    engine = Engine(artefact, **explicit)
    app = create_app(engine, args)
    level = (args.log_level_http or args.log_level).lower()
    # uvicorn installs SIGINT/SIGTERM handlers: in-flight requests get a few seconds, then
    # the lifespan shutdown stops the engine thread. One process, so nothing is orphaned.
    uvicorn.run(app, host=args.host, port=args.port, log_level=level, timeout_graceful_shutdown=5)
