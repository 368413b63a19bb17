"""Round trip of one MoE layer's request to a worker on loopback, torch.distributed (gloo) vs Ray, one run.

    python tools/bench_rpc.py [--kib 14] [--calls 2000]       # Ray is optional: pip install ray

Issue #19 shards experts over workers: per MoE layer the coordinator sends each worker the batch's
activations (one token at DeepSeek-V3's width: 7168 bf16 values, 14 KiB) and takes back the partial
sum of the same size. What decides the engine is that round trip, paid once per MoE layer per token
(58 layers for V3). Both contenders echo a tensor of --kib KiB between two processes on 127.0.0.1:
gloo with blocking send/recv of a CPU tensor, Ray with an actor method called through ray.get. Each
number is the median (and p90) of --calls round trips after a warm-up; they run one after the other
on the same machine, so the ratio is the number to read.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MOE_LAYERS_V3 = 58
WARMUP = 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, port: int, values: int, calls: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.zeros(values)
    times = []
    for i in range(WARMUP + calls):
        if rank == 1:  # the worker: receive the activations, send a partial sum back
            dist.recv(x, src=0)
            dist.send(x, dst=0)
            continue
        start = time.perf_counter()
        dist.send(x, dst=1)
        dist.recv(x, src=1)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    if rank == 0:
        out["times"] = times
    dist.destroy_process_group()


def gloo_round_trips(values: int, calls: int) -> list[float]:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gloo_worker, args=(_free_port(), values, calls, out), nprocs=2, join=True)
        return list(out["times"])


def ray_round_trips(values: int, calls: int) -> list[float] | None:
    try:
        import ray
    except ImportError:
        return None

    @ray.remote
    class Worker:
        def partial_sum(self, x):
            return x

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        worker = Worker.remote()
        x = torch.zeros(values).numpy()
        times = []
        for i in range(WARMUP + calls):
            start = time.perf_counter()
            ray.get(worker.partial_sum.remote(x))
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        return times
    finally:
        ray.shutdown()


def summary(times: list[float] | None) -> dict | None:
    if times is None:
        return None
    ordered = sorted(times)
    median = statistics.median(ordered)
    return {
        "median_us": round(median * 1e6, 1),
        "p90_us": round(ordered[int(0.9 * len(ordered))] * 1e6, 1),
        "ms_per_token_v3": round(median * MOE_LAYERS_V3 * 1e3, 2),  # one round trip per MoE layer
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kib", type=float, default=14.0, help="payload each way (default 14: one V3 token, bf16)")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    values = max(1, int(args.kib * 1024) // 4)  # float32 elements
    gloo = summary(gloo_round_trips(values, args.calls))
    ray = summary(ray_round_trips(values, args.calls))
    result = {"payload_bytes": values * 4, "calls": args.calls, "gloo": gloo, "ray": ray}
    if ray is not None:
        result["ray_vs_gloo_round_trip"] = round(ray["median_us"] / gloo["median_us"], 1)
    else:
        result["ray"] = "not installed: pip install ray"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
