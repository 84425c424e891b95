"""`specee serve --replicas N`: start (or join) Ray, run the application until SIGTERM or Ctrl-C,
then let every replica finish its running requests (--shutdown-grace) and stop."""
from __future__ import annotations

import logging
import signal
import sys
import threading

APP_NAME = "specee"
STOP_MARGIN_S = 15  # beyond --shutdown-grace, for Ray to stop the replicas and the proxy


def run(app, host: str, port: int, address: str | None, replicas: int | str, grace: float) -> int:
    """Serve `app` (`specee.cluster.app.application`) until SIGTERM or Ctrl-C; the exit code.
    Raises OSError for a busy port; a replica that cannot start is its error and exit code 2."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    from ..server.app import bind

    local = address is None
    if local:
        bind(host, port).close()  # a busy port fails now, not inside Ray's proxy
    stop = threading.Event()

    def request_stop(*_) -> None:
        stop.set()

    # A Ctrl-C while Ray starts stops the command once it has started, in order, not mid-start.
    signal.signal(signal.SIGINT, request_stop)
    # "local": a Ray of its own even where `ray start` left a cluster on this machine, which
    # ray.init() without an address would join.
    ray.init(address=address or "local", include_dashboard=False, logging_level=logging.WARNING,
             configure_logging=True, log_to_driver=True)
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(signum, request_stop)
    try:
        ours = not serve_running()  # then Serve stops with this command, even on a cluster we joined
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        except Exception as e:  # a replica could not start: its error, not a hang
            print(f"specee: error: the replicas did not start: {replica_error(e)}", file=sys.stderr)
            stop_serving(ours)
            return 2  # as a model that cannot load in plain `specee serve`
        where = "a local Ray" if local else f"the Ray cluster at {address}"
        http = _get_global_client().http_config  # a Serve already running keeps its own
        if (http.host, http.port) != (host, port):
            print(f"specee: warning: Ray Serve already runs on this cluster and keeps its address: "
                  f"{http.host}:{http.port}, not --host {host} --port {port}", file=sys.stderr)
        print(f"specee serving on http://{http.host}:{http.port} with {replicas} replica(s) on {where}",
              file=sys.stderr, flush=True)
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:  # should any handler but ours see the Ctrl-C: still stop in order
            pass
        print("specee: stopping: replicas finish their running requests", file=sys.stderr, flush=True)
        # Bounded: a signal sent to the whole process group (systemd's control-group kill, `timeout`)
        # also stops the local Ray's own processes, and Ray's deletion then waits forever.
        stopping = threading.Thread(target=stop_serving, args=(ours,), daemon=True)
        stopping.start()
        stopping.join(grace + STOP_MARGIN_S)
        if stopping.is_alive():
            print("specee: warning: Ray did not confirm the replicas stopped (was it stopped too?)", file=sys.stderr)
    finally:
        ray.shutdown()
    return 0


def stop_serving(ours: bool) -> None:
    """Graceful: each replica finishes its running requests within --shutdown-grace."""
    from ray import serve

    serve.delete(APP_NAME)
    if ours:
        serve.shutdown()


def serve_running() -> bool:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:
        return False


def replica_error(e: Exception) -> str:
    """Why the replicas did not start: the last line of a failed deployment's own message (the
    replica's exception, not Ray's frames), else Ray's."""
    from ray import serve

    try:
        deployments = serve.status().applications[APP_NAME].deployments.values()
        messages = [d.message for d in deployments if d.status in ("DEPLOY_FAILED", "UNHEALTHY") and d.message]
    except Exception:  # the controller is gone too: Ray's own message is all there is
        messages = []
    lines = [line.strip() for text in messages or [str(e)] for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__
