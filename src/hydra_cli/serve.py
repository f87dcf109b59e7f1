"""``hydra-ens serve``: a saved model over HTTP on Ray Serve, with predict's records."""

from __future__ import annotations

import argparse
import signal
import threading

from .command import Command
from .options import POSITIVE, _at_least


def _cmd_serve(args: argparse.Namespace) -> int:
    from hydra_ensembles.distributed import ray_session
    from hydra_ensembles.distributed.serve import check_servable, require_serve

    serve = require_serve()
    check_servable(args.model)
    stop = threading.Event()
    with ray_session(args.address, args.replicas) as plan:
        # SIGTERM from here on (Ray has installed its own handlers) stops the server gracefully,
        # also while the application is still starting
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            _start(serve, args, plan)
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            print("stopping: requests in flight are answered first (graceful shutdown)", flush=True)
            serve.shutdown()
    print("stopped")
    return 0


def _start(serve, args: argparse.Namespace, plan) -> None:
    """Ray Serve started on ``--host``/``--port`` with the model's application, and said so."""
    from hydra_ensembles.distributed.serve import serve_application

    serve.start(http_options={"host": args.host, "port": args.port})
    app = serve_application(
        args.model,
        replicas=args.replicas,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        precision=getattr(args, "precision_asked", args.precision),
        max_length=args.max_length,
        threads=plan.threads,
    )
    serve.run(app, name="hydra", route_prefix="/")
    print(
        f"serving {args.model} at http://{args.host}:{args.port} with {args.replicas} replica(s) of "
        f"{plan.threads} thread(s): POST /predict, GET /healthz, GET /info, GET /docs; Ctrl-C stops",
        flush=True,
    )


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from .options import precision_option

    p.add_argument("model", help="a saved model folder (build's hydra/, finetune's output, a fused ensemble)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=_at_least(1), default=8000)
    p.add_argument("--replicas", type=POSITIVE, default=1, help="model replicas, one CPU each")
    p.add_argument(
        "--max-batch-size",
        type=POSITIVE,
        default=32,
        help="most texts of concurrent requests run as one batch",
    )
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=10.0,
        help="longest wait, in milliseconds, for a batch to fill before it runs",
    )
    p.add_argument(
        "--max-length",
        type=_at_least(2),
        help="tokens per text (default: the length the model was trained and calibrated at)",
    )
    p.add_argument(
        "--address",
        help="a Ray cluster to serve on (auto, or ray://HOST:PORT); default: Ray embedded on this machine",
    )
    precision_option(p)


COMMAND = Command(
    "serve",
    help="serve a saved model over HTTP (Ray Serve): POST /predict answers with predict's records "
    "(texts, or base64 image files)",
    add_arguments=_add_serve_arguments,
    run=_cmd_serve,
)
