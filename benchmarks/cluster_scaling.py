"""Serving the default model through Ray Serve on this machine, against plain `specee serve`:
each deployment in turn (plain with every core; Ray with 1 replica x all cores; Ray with N
replicas x 1 core) is started, loaded by `specee bench-serve --url` (dense decoding, the requests
scenario, 1 to 16 clients), and stopped; then, for routing, the chat scenario on the N-replica
deployment with prefix-aware routing and with fewest-ongoing routing. One table at the end, then one
JSON line: per deployment, what its server decoded with (its /metrics: passes by method, draft tokens).

    python benchmarks/cluster_scaling.py [--concurrency 1,2,4,8,16] [--out bench-cluster] [--model FILE.gguf]
        [--deployments plain,ray-1,ray-n,prefix,fewest] [--replicas N] [--address RAY --port PORT]
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specee.eval.server_process import ChildServer, free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS = ("plain", "ray-1", "ray-n", "prefix", "fewest")


def start(flags: list[str], replicas: int | None, port: int | None = None) -> ChildServer:
    port = port or free_port()
    command = [sys.executable, "-m", "specee.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    server = ChildServer(command, port, cwd=ROOT)
    deadline = time.monotonic() + 300
    while replicas and len(httpx.get(server.url + "/health").json().get("replicas", [])) < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(server.output()[-3000:])
        time.sleep(0.5)
    return server


def decoded_with(server: ChildServer) -> dict:
    """What the server has decoded with so far, from its /metrics (a cluster's: the sum over its
    replicas, labelled replica="all"): target passes by the method that drafted them, draft tokens."""
    passes, drafted = {}, 0
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.labels.get("replica", "all") != "all":
                continue
            if sample.name == "specee_method_passes_total":
                passes[sample.labels["method"]] = passes.get(sample.labels["method"], 0) + int(sample.value)
            elif sample.name == "specee_draft_tokens_proposed_total":
                drafted += int(sample.value)
    return {"method_passes": passes, "drafted": drafted}


def load(server: ChildServer, out: Path, model: list[str], *options: str) -> list[dict]:
    subprocess.run([sys.executable, "-m", "specee.cli", "bench-serve", "--url", server.url, "--modes", "dense",
                    *model, "--out", str(out), *options], cwd=ROOT, check=True)
    report = json.loads(out.read_text())
    for row in report["load"]:
        row["overhead"] = report["overhead"]
    return report["load"]


def settled(server: ChildServer, replicas: int | None) -> dict:
    """decoded_with, once every replica has reported its last requests to the ingress (each reports
    every second: specee/cluster/replica.py's REPORT_S)."""
    if replicas:
        time.sleep(2.5)
    return decoded_with(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--max-tokens", default="64")
    parser.add_argument("--chat-max-tokens", default="128")
    parser.add_argument("--conversations", default="8", help="chat conversations per routing")
    parser.add_argument("--out", default="bench-cluster")
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    parser.add_argument("--deployments", default=",".join(DEPLOYMENTS),
                        help="which to run: plain, ray-1 (1 replica x all cores), ray-n (N replicas x 1 core), "
                             "prefix and fewest (ray-n's routings, chat scenario)")
    parser.add_argument("--replicas", type=int, default=os.cpu_count() or 1,
                        help="N, ray-n's replicas of one core each (default: this machine's cores)")
    parser.add_argument("--address", help="a running Ray cluster for the Ray deployments (default: a local Ray each)")
    parser.add_argument("--port", type=int,
                        help="the Ray deployments' port (a cluster keeps the HTTP port of its first application)")
    args = parser.parse_args()
    chosen = args.deployments.split(",")
    model = ["--model", args.model] if args.model else []
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    cores, n = os.cpu_count() or 1, args.replicas
    common = [*model, "--max-batch", "8", "--max-queue", "64"]
    on_ray = [*common, *(["--address", args.address] if args.address else [])]
    deployments = [d for key, d in zip(DEPLOYMENTS, [("plain", [*common, "--threads", str(cores)], None),
                   (f"ray 1x{cores}", [*on_ray, "--replicas", "1", "--threads", str(cores)], 1),
                   (f"ray {n}x1", [*on_ray, "--replicas", str(n), "--threads", "1"], n)]) if key in chosen]
    rows, decoding = [], {}
    for name, flags, replicas in deployments:
        server = start(flags, replicas, args.port if replicas else None)
        try:
            for s in load(server, out / f"{name.replace(' ', '-')}.json", model, "--concurrency", args.concurrency,
                          "--max-tokens", args.max_tokens):
                rows.append((name, "requests", s))
            decoding[name] = settled(server, replicas)
        finally:
            server.stop()
    for routing in (r for r in ("prefix", "fewest") if r in chosen):
        server = start([*on_ray, "--replicas", str(n), "--threads", "1", "--routing", routing], n, args.port)
        try:
            for s in load(server, out / f"chat-{routing}.json", model, "--scenario", "chat", "--concurrency", "4",
                          "--conversations", args.conversations, "--max-tokens", args.chat_max_tokens):
                rows.append((f"ray {n}x1 {routing}", "chat", s))
            decoding[f"ray {n}x1 {routing}"] = settled(server, n)
        finally:
            server.stop()
    print(f"{'deployment':<20} {'scenario':<9} {'clients':>7} {'tok/s':>7} {'req/s':>6} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'cached':>6}")
    for name, scenario, s in rows:
        if scenario == "requests" and s["clients"] == 1:
            o = s["overhead"]
            print(f"{name}: one request served {o['server_s']:.3f} s vs {o['in_process_s']:.3f} s in process")
    for name, scenario, s in rows:
        cached = f"{s['cached_share']:.0%}" if s.get("cached_share") is not None else "-"
        print(f"{name:<20} {scenario:<9} {s['clients']:>7} {s['tokens_per_s']:>7.1f} {s['requests_per_s']:>6.2f} "
              f"{s['ttft_p50_s']:>8.3f}s {s['ttft_p95_s']:>8.3f}s {cached:>6}")
    (out / "summary.json").write_text(json.dumps([{"deployment": n, "scenario": sc, **s} for n, sc, s in rows], indent=1))
    print(json.dumps({"spec_method": "none", "decoded_with": decoding,
                      "load": [{"deployment": n, "scenario": sc, **s} for n, sc, s in rows]}))


if __name__ == "__main__":
    main()
